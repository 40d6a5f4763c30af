"""PushSum gossip over a mesh axis, the averaging step of Stochastic Gradient Push.

Every replica i holds a value x_i (a pytree: parameters) and a weight w_i (1 at the start).
A mixing round keeps half of (x_i, w_i) and pushes the other half to one out-peer, replica
i + 2^k, where k cycles through 0 .. log2(n) - 1 (the time-varying directed exponential
graph of Assran et al., ICML 2019). Mixing conserves the sums of x and of w, and the
de-biased value z_i = x_i / w_i tends to the average of the x's. With n a power of two,
log2(n) rounds of the cycle average exactly, as a butterfly all-reduce does, while each
replica sends one message per round instead of taking part in an all-reduce.

A message can be lost (a slow or failed link): then the sender keeps the half it would have
pushed, so mass is never lost, z still tends to the average, and x alone does not.
All functions run inside `mtrain.parallel.replica.replicate` and take its `ReplicaContext`.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp


def num_phases(num_replicas: int) -> int:
    """The length of the cycle of peers: log2(n) (n must be a power of two)."""
    if num_replicas < 1 or num_replicas & (num_replicas - 1):
        raise ValueError(f"PushSum's exponential graph needs a power-of-two number of "
                         f"replicas, got {num_replicas}")
    return max(int(math.log2(num_replicas)), 1)


def mix(ctx, x, w, phase, delivered=True):
    """One PushSum round: (x, w) after keeping half and receiving the half pushed by replica
    id - 2^phase. `phase` may be traced (0 .. num_phases - 1); every hop is compiled, one
    runs. Where `delivered` is False, this replica's message is lost and it keeps its mass."""
    kept, received = push(ctx, (x, w), phase, delivered)
    return jax.tree_util.tree_map(jnp.add, kept, received)


def push(ctx, mass, phase, delivered=True):
    """The two halves of a PushSum round of `mass` (a pytree, e.g. (x, w)): (what this
    replica keeps, what it receives from replica id - 2^phase). Adding them is `mix`;
    overlap SGP adds the received half some steps later."""
    if ctx.num_replicas == 1:
        return mass, jax.tree_util.tree_map(jnp.zeros_like, mass)

    def at_hop(shift, mass):
        send = jnp.where(delivered, 0.5, 0.0)
        pushed = jax.tree_util.tree_map(lambda v: v * send.astype(v.dtype), mass)
        kept = jax.tree_util.tree_map(jnp.subtract, mass, pushed)
        return kept, ctx.send_to(pushed, shift)

    hops = [functools.partial(at_hop, 2**k) for k in range(num_phases(ctx.num_replicas))]
    return jax.lax.switch(phase % len(hops), hops, mass)


def debias(x, w):
    """z = x / w: the replica's estimate of the average."""
    return jax.tree_util.tree_map(lambda v: v / w.astype(v.dtype), x)
