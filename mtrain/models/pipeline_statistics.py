"""How the statistics a pipeline's chunks return (`pipeline.run`: the experts' losses and
load, per layer) add up over the microbatches flowing through the stages, and over the
data shards of a stage, into the whole batch's: accumulators an iteration adds to (none in
the bubble), finished into sums, maxima, means, or means weighted by the counts they are
means over (a mean over a microbatch's tokens times its tokens adds up to the batch's)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Reductions:
    """How each statistic a chunk returns adds up over the microbatches: by default their
    mean; `sums` by name are added, `maxima` the most of any, and `weighted` ((statistic,
    count) pairs, the count a sum beside it) the mean weighted by the count: a mean over
    the count's items of each microbatch becomes the batch's."""

    sums: tuple[str, ...] = ()
    maxima: tuple[str, ...] = ()
    weighted: tuple[tuple[str, str], ...] = ()

    def kind(self, name: str) -> str:
        return ("sum" if name in self.sums else "max" if name in self.maxima
                else "weighted" if name in dict(self.weighted) else "mean")

    def count(self, path: tuple) -> tuple:
        """The path of the count that weighs the statistic at `path`."""
        return (*path[:-1], dict(self.weighted)[path[-1]])


def zeros(stats_shape, r_count: int, reductions: Reductions):
    """Accumulators [R, k, ...] of each statistic (stats_shape's leaves are [k, ...])."""
    def zero(path, leaf):
        fill = -jnp.inf if reductions.kind(path[-1].key) == "max" else 0.0
        return jnp.full((r_count, *leaf.shape), fill, jnp.float32)
    return jax.tree_util.tree_map_with_path(zero, stats_shape)


def _keys(tree) -> dict:
    """A tree of statistics as {path of keys: leaf}."""
    return {tuple(k.key for k in path): leaf
            for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def add(totals, stats, r, valid, reductions: Reductions):
    """This iteration's statistics into run r's accumulators (none in the bubble, where
    `valid` is False); a weighted one times its count."""
    new = {k: v.astype(jnp.float32) for k, v in _keys(stats).items()}

    def one(path, total):
        key = tuple(k.key for k in path)
        here, value = jax.lax.dynamic_index_in_dim(total, r, 0, False), new[key]
        kind = reductions.kind(key[-1])
        if kind == "max":
            value = jnp.where(valid, jnp.maximum(here, value), here)
        else:
            if kind == "weighted":
                value = value * new[reductions.count(key)]
            value = here + jnp.where(valid, value, 0.0)
        return jax.lax.dynamic_update_index_in_dim(total, value, r, 0)
    return jax.tree_util.tree_map_with_path(one, totals)


def finish(totals, stats_shape, m_count, reductions: Reductions):
    """Accumulators [R, k, ...] -> each run's statistics (a mean over its `m_count`
    microbatches, each of which every run sees once; a weighted one over their summed
    count, 0 where that is 0), in their own dtypes."""
    summed = _keys(totals)

    def one(path, total, like):
        key = tuple(k.key for k in path)
        kind = reductions.kind(key[-1])
        if kind == "mean":
            total = total / m_count
        elif kind == "weighted":
            count = summed[reductions.count(key)]
            total = jnp.where(count > 0, total / jnp.where(count > 0, count, 1.0), 0.0)
        return total.astype(like.dtype)
    return jax.tree_util.tree_map_with_path(one, totals, stats_shape)


def over_shards(totals, axis: str, reductions: Reductions):
    """Accumulators of the data shards of manual mesh `axis` added up (the most of any
    for a maximum: a metric, without gradient)."""
    return jax.tree_util.tree_map_with_path(
        lambda path, v: jax.lax.pmax(jax.lax.stop_gradient(v), axis)
        if reductions.kind(path[-1].key) == "max" else jax.lax.psum(v, axis), totals)
