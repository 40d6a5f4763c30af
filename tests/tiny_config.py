"""The tiny model and run that the command-line tests train (seconds on a CPU)."""

TINY = [
    "transformer.d_model=32", "transformer.d_ff=64", "transformer.num_heads=2",
    "transformer.d_kv=16", "transformer.num_layers=1", "transformer.max_length=32",
    "vocabulary.size=256", "run.batch_size=8", "run.sequence_length=32",
    "run.eval_split='test'", "learning_rate_schedule.warmup_steps=5",
    "run.data_workers=0",  # whatever the machine's cores (the tests that need workers ask)
    "run.eval_every=-1",  # no held-out evaluation (the tests that read one ask: 0, at the end)
]
