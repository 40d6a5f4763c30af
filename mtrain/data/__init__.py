"""Input pipeline: text sources (sources.py), packing (packing.py), batches (pipeline.py)."""
