"""The public engine API: `fully_shard` / `shard_model`, FSDP2's module facade and state.

fully_shard.py    fully_shard, shard_model: wrap policies, argument checks, building the units
sharded_module.py the class a sharded module becomes (ShardedModule, FSDP2's FSDPModule methods)
state.py          `fully_shard.state(module)`, FSDP2's param-group views, state-dict hooks
"""
