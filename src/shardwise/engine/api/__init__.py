"""The public engine API: `fully_shard` / `shard_model`, FSDP2's module facade and state.

fully_shard.py    fully_shard, shard_model: check (fully_shard_checks.py), then build_unit.py
build_unit.py     collect parameters, re-home tied ones, shard, build the unit, install hooks
sharded_module.py the class a sharded module becomes (ShardedModule), own_unit
wrap.py           which modules become units and which parameters each owns (the planner too)
module_api.py     FSDP2's FSDPModule methods, no_sync; module_comm_api.py: its comm methods
state.py          `fully_shard.state(module)`; sd_hooks.py: state-dict hooks
misuse.py         the optimizer-built-before-sharding check (the one process-wide hook)
"""
