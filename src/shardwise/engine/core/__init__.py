"""The mechanism, layer by layer: one parameter -> one unit -> the schedule -> hooks -> context.

sharded_param.py  one parameter: padded shard and its face; param_*.py: its unsharded storage,
                  gradients, subclass shards, materialization
dtensor.py        the DTensor face of a shard; tp.py: a TP DTensor parameter's local piece
mesh.py           the unit's shard / replicate groups and their transport
policies.py       the knobs as values; checks.py: argument checks (ValueError before any collective)
bucket.py         a unit's flat layout per communication dtype; buffers.py: the buffer pool
pack.py, reduce.py  gradients into the reduce buffer; the reduction and its finish
unit.py           one unit: unshard / wait / reshard / reduce (acting); unit_gather.py and
                  unit_reduce.py: its gather and reduce halves
schedule.py       when each unit gathers, reshards, reduces (deciding; no tensors)
hooks.py          module and autograd hooks that tell the schedule where the step is
context.py        one model's context: schedule, sinks, pool; first-forward checks
containers.py     containers of units: each member once per holder call (local check)
freeze_check.py   SHARDWISE_DEBUG: every rank trains the same parameters
events.py, traverse.py, inspect.py  the event schema; tensors in nested outputs; looking inside
"""
