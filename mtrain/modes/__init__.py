"""What each --mode does with a built experiment: train, eval, infer, score, plan."""
