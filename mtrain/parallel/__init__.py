"""Devices, meshes and layouts: the layout language, processes, replicas and gossip.

Imports nothing (cpu_devices must be importable before jax)."""
