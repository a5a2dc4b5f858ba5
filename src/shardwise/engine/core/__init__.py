"""The mechanism, layer by layer: one parameter -> one unit -> the schedule -> hooks -> context.

events.py         the one Event schema and Span timing
layout.py         which dim a parameter shards on (the balanced-shards rule; the planner too)
dtensor.py        DTensor faces: a shard's DTensor, a TP parameter's local piece, dp_mesh_dims
policies.py       the knobs as values, argument checks, and the mesh a unit runs on (MeshInfo)
sharded_param.py  one parameter, whole: shard, unsharded storage, gradients, extension hooks
unit.py           one unit, whole: gather and reduce halves, buckets, buffer pool, hpZ, streams
schedule.py       when each unit gathers, reshards, reduces (deciding; no tensors)
context.py        one model's context: schedule, sinks, pool, first-forward checks, containers
hooks.py          module and autograd hooks that tell the schedule where the step is
"""
