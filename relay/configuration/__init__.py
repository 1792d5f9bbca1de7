"""
Configuration: the YAML file parsed into frozen settings with one-line
errors (config.md), the start-up checks and the C{components:} swaps.
"""
