"""Side-by-side benchmarks: shardwise vs PyTorch FSDP2, DDP and the no-communication bound."""
