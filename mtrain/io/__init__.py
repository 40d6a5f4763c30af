"""What a run reads and writes: files, the model dir, its lock, checkpoints, metrics."""
