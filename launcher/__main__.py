"""``python -m popdist_lite_launcher`` is ``poprun-lite``."""

from .cli import main

if __name__ == "__main__":
    main()
