"""The vocabulary every part of the launcher shares: the launch interface (an attempt, its
outcome, the launcher and membership-policy protocols), the typed options, the rank
plan, host names, the agents' wire protocol and the words of its messages. It imports
nothing else of the launcher, so every other part may import it."""
