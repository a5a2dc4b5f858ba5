"""PyTorch's FSDP2 test scenarios (test/distributed/_composable/fsdp/), ported to shardwise.

Each upstream file `test_fully_shard_X.py` has a worker module here (`X_workers.py`, the
scenarios as module-level functions) and a test file (`test_X.py`, which lists the cases and
the scenarios left out, with the reason). All cases of one world size run in one set of
processes (see `harness.py`), so the whole folder pays process start-up about once per world
size.
"""
