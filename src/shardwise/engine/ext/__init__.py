"""Extensions around the core: model-level operations built on units.

materialize.py      meta-device init: each rank allocates and initializes its shards
grad_norm.py        clip_grad_norm_: the global norm, the same on every rank
mixed_precision.py  ShardedGradScaler, precision_plan
"""
