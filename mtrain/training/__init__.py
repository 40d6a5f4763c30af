"""Training: the sharded state and its steps, optimizer, losses, SGP, the loop and its hooks."""
