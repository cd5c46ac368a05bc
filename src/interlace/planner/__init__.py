"""The planner: price hybrid-parallel plans on a hardware description and rank them.

`hardware` (device and link presets), `cost` (time per runtime op and memory per device of one
plan), `search` (enumerate, validate, prune by memory, rank), `cli` (the `interlace plan`
options that drive them).
"""
