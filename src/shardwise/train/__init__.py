"""`shardwise train`: config, model, data and the training loop."""
