"""Exact full-dataset evaluation vs a plain jitted evaluation that drops the remainder.

Both evaluate the same trained MNIST CNN (``recipes.models``) on the same
in-memory examples, with the same batch size, and end with one transfer to the
host:

(a) ``plain``: a ``jax.jit`` step on the default device that sums the loss and
    the correct predictions of each full batch on the device; the last, ragged
    batch is dropped, so some examples are never counted.
(b) ``exact``: ``Trainer.evaluate``: one ``jax.jit`` step over the mesh of
    every local device, each batch padded to the data axis, clu metrics with
    padded examples masked out, and every example counted exactly once.

Rounds alternate which side goes first. The figure is the median per-round
ratio of throughputs, ``exact examples/s / plain examples/s``, with a target of
at least 0.95. The JSON line also reports how often the exact eval step
compiled (once: the ragged last batch is padded to the first's size).

    python -m benchmarks.bench_eval [--examples 10000] [--batch-size 128] [--rounds 15] [--cpu-devices N]

On a CPU host split into several devices, a step over two devices can run
this CNN slower than ``jit`` on one device, which uses every core itself;
``--cpu-devices 1`` isolates what the exact evaluation itself costs. The
padded last batch costs a full batch of compute: keep the eval batch small
relative to the dataset.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import flaxhooks
from recipes.models import CNN, cross_entropy_loss

TARGET_RATIO = 0.95


def make_examples(count: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "image": rng.random((count, 28, 28, 1), dtype=np.float32),
        "label": rng.integers(0, 10, count).astype(np.int32),
    }


def plain_eval(model: CNN, variables: Any, examples: dict[str, np.ndarray], batch_size: int,
               step: Any) -> tuple[float, int]:
    """Mean loss over the full batches only; returns (loss, examples counted)."""
    full = len(examples["label"]) // batch_size * batch_size
    totals = (jnp.zeros(()), jnp.zeros((), jnp.int32))
    for start in range(0, full, batch_size):
        batch = {k: v[start:start + batch_size] for k, v in examples.items()}
        totals = step(variables, totals, batch)
    loss, _ = jax.device_get(totals)
    return float(loss) / full, full


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", type=int, default=10000)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--cpu-devices", type=int, default=None)
    args = parser.parse_args()
    flaxhooks.use_cpu_devices(args.cpu_devices)

    model = CNN()
    trainer = flaxhooks.Trainer(model, optax.sgd(0.1, 0.9), cross_entropy_loss)
    train = make_examples(1024, seed=1)
    trainer.fit(flaxhooks.ArrayLoader(train, 128), epochs=1)
    variables = trainer.state.variables
    examples = make_examples(args.examples)

    @jax.jit
    def step(variables, totals, batch):
        logits = model.apply(variables, batch["image"])
        losses = optax.losses.softmax_cross_entropy_with_integer_labels(logits, batch["label"])
        correct = jnp.sum(jnp.argmax(logits, -1) == batch["label"])
        return totals[0] + losses.sum(), totals[1] + correct

    def exact() -> tuple[float, int]:
        result = trainer.evaluate(examples, batch_size=args.batch_size)
        return result.metrics["loss"], result.examples

    def plain() -> tuple[float, int]:
        return plain_eval(model, variables, examples, args.batch_size, step)

    runs = {"plain": plain, "exact": exact}
    for run in runs.values():  # compile both
        run()
    rates: dict[str, list[float]] = {"plain": [], "exact": []}
    counted: dict[str, int] = {}
    ratios = []
    devices = jax.local_device_count()
    print(f"eval: {args.examples} examples, batch {args.batch_size}, {devices} device(s), "
          f"jax {jax.__version__}")
    for round_index in range(args.rounds):
        order = ["plain", "exact"] if round_index % 2 == 0 else ["exact", "plain"]
        for name in order:
            start = time.perf_counter()
            _, counted[name] = runs[name]()
            rates[name].append(counted[name] / (time.perf_counter() - start))
        ratios.append(rates["exact"][-1] / rates["plain"][-1])
        print(f"round {round_index + 1}: plain {rates['plain'][-1]:9.0f} ex/s ({counted['plain']} counted)  "
              f"exact {rates['exact'][-1]:9.0f} ex/s ({counted['exact']} counted)  ratio {ratios[-1]:.3f}")
    ratio = statistics.median(ratios)
    compiles = trainer.evaluations.traces
    print(f"median ratio exact/plain: {ratio:.3f} (target >= {TARGET_RATIO}): "
          f"{'PASS' if ratio >= TARGET_RATIO else 'FAIL'}; exact eval step compiled {compiles}x")
    print(json.dumps({
        "benchmark": "exact_eval", "devices": devices, "examples": args.examples,
        "batch_size": args.batch_size, "rounds": args.rounds,
        "examples_per_s_plain": statistics.median(rates["plain"]),
        "examples_per_s_exact": statistics.median(rates["exact"]),
        "examples_counted_plain": counted["plain"], "examples_counted_exact": counted["exact"],
        "ratio": ratio, "ratios": ratios, "target": TARGET_RATIO, "compiles": compiles,
        "jax_version": jax.__version__,
    }))


if __name__ == "__main__":
    main()
