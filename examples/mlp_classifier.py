"""The replica API on something that is not a Transformer: an MLP classifier trained
data-parallel with `mtrain.parallel.replica`, one step function written for one replica.

The data are 10 Gaussian clusters in 16 dimensions (a fixed seed; 4096 training and 1024
test points). Each replica gets its slice of every batch, computes its gradient, and the
replicas average them with `ctx.all_mean`: exactly the full-batch gradient, so the result
does not depend on the number of replicas. Run it on 8 simulated CPU devices with

    python examples/mlp_classifier.py --cpu_devices 8
"""

from __future__ import annotations

import argparse

CLASSES, DIM, HIDDEN = 10, 16, 64


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cpu_devices", type=int, default=0)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch_size", type=int, default=256)
    p.add_argument("--mesh_shape", default="", help="default: batch over every device")
    return p.parse_args(argv)


def dataset(seed=0):
    import numpy as np

    rng = np.random.default_rng(seed)
    centres = rng.normal(0, 1.0, (CLASSES, DIM))

    def sample(n):
        labels = rng.integers(0, CLASSES, n)
        return (centres[labels] + rng.normal(0, 0.45, (n, DIM))).astype(np.float32), labels

    return sample(4096), sample(1024)


def init(key):
    import jax

    k1, k2 = jax.random.split(key)
    return {"w1": jax.random.normal(k1, (DIM, HIDDEN)) * DIM**-0.5,
            "b1": jax.numpy.zeros(HIDDEN),
            "w2": jax.random.normal(k2, (HIDDEN, CLASSES)) * HIDDEN**-0.5,
            "b2": jax.numpy.zeros(CLASSES)}


def logits(params, x):
    import jax

    h = jax.nn.relu(x @ params["w1"] + params["b1"])
    return h @ params["w2"] + params["b2"]


def loss_fn(params, batch):
    import optax

    x, y = batch
    return optax.softmax_cross_entropy_with_integer_labels(logits(params, x), y).mean()


def train_step(ctx, params, batch, learning_rate=0.5):
    """One replica's step: its gradient, averaged over the replicas; the update."""
    import jax

    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    grads, loss = ctx.all_mean((grads, loss))
    params = jax.tree_util.tree_map(lambda p, g: p - learning_rate * g, params, grads)
    return params, loss


def main(args) -> dict:
    import jax
    import numpy as np

    from mtrain.parallel.layout import Layout
    from mtrain.parallel.replica import replicate

    layout = Layout(args.mesh_shape or f"batch:{jax.device_count()}")
    mesh = layout.make_mesh(jax.devices()[: layout.size])
    step = replicate(train_step, mesh, "batch", split_inputs=(False, True))
    (x, y), (test_x, test_y) = dataset()
    params = init(jax.random.key(0))
    rng = np.random.default_rng(1)
    for i in range(args.steps):
        rows = rng.integers(0, len(x), args.batch_size)
        params, loss = step(params, (x[rows], y[rows]))
        # One step in flight at a time: simulated CPU devices can deadlock in XLA's
        # collectives when many multi-device programs are queued at once.
        loss.block_until_ready()
    accuracy = float((np.argmax(logits(params, test_x), -1) == test_y).mean())
    print(f"{mesh.shape['batch']} replicas, {args.steps} steps: loss {float(loss):.4f}, "
          f"test accuracy {accuracy:.3f}")
    return {"loss": float(loss), "accuracy": accuracy, "params": params}


if __name__ == "__main__":
    ARGS = parse_args()
    if ARGS.cpu_devices:
        from mtrain.parallel.cpu_devices import simulate_cpu_devices

        simulate_cpu_devices(ARGS.cpu_devices)
    main(ARGS)
