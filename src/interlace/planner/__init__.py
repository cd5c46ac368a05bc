"""The planner: price hybrid-parallel plans on a hardware description and rank them.

`hardware` (device and link presets) and `calibrate` (this machine, measured); `profile` (a
model's per-shard work and what each pipeline stage holds); `step` (one step's terms, each
parallel dimension priced in its own module: `cost_work`, `cost_tensor`, `cost3d`,
`cost_context`, `cost_moe`, `cost_pipeline`, `cost_data`, `cost_optimizer`, on `collective_cost`
and `bytes`); `cost` (time per runtime op and memory per device of one plan), `simulate` (the
step as a timeline), `search` (enumerate, validate, prune by memory, rank), `context_choice`
(why a plan splits its sequences), `auto` (`--plan auto`), `cli` (the `interlace plan` options
that drive them).
"""
