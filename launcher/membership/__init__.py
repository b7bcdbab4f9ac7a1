"""Which hosts each attempt runs on: the fixed and elastic membership policies, host
discovery, the elastic job's survey of its hosts and the resize monitor."""
