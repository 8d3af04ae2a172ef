"""Benchmark: the cost of TensorBoard logging on short steps, every step and every 50.

What is compared
    Three Trainers train the same small MLP (64 inputs, 256 hidden, 10
    classes; about a millisecond a step on a 2-core CPU, where any per-step
    host work shows) with the same loss (cross-entropy plus accuracy),
    optimizer (``optax.sgd(0.1, momentum=0.9)``), initial state and host
    batches, data-parallel over every local device:

    (a) ``lean``: no callbacks.
    (b) ``every_1``: ``TensorBoard(every=1)``: the training scalars (loss,
        accuracy, steps/s) of every step.
    (c) ``every_50``: ``TensorBoard(every=50)``.

    Each fit writes its scalars and closes its event file before it returns,
    so what is timed includes getting every value onto disk. All three are
    compiled and warmed up first. Each round times (a), (b) and (c) over
    ``--steps`` steps, rotating which goes first; the result is the median of
    the per-round ratios ``steps/s / lean steps/s``. Targets: at least 0.85
    every step and 0.98 every 50 steps. Below target is reported as FAIL, but
    the script exits 0: it is a measurement.

    On a CPU the XLA devices run on the same cores as the Python threads, so
    every microsecond the writer thread spends (reading a batch of steps in
    one transfer, building and checksumming the events: about 40 us of CPU
    a step) is taken from the devices; on a GPU or TPU host it runs beside them.

How to run
    python -m benchmarks.bench_tensorboard [--steps 500] [--rounds 9]
        [--batch-size 128] [--cpu-devices N]

    The last line of output is one JSON object with the results.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import numpy as np
import optax

import flaxhooks
from benchmarks.bench_trainer import run_trainer, start_devices
from recipes.models import cross_entropy_loss

TARGETS = {"every_1": 0.85, "every_50": 0.98}
FEATURES = 64


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        return nn.Dense(10)(nn.relu(nn.Dense(256)(x)))


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=500, help="timed steps per round (default 500)")
    parser.add_argument("--rounds", type=int, default=9, help="interleaved rounds (default 9)")
    parser.add_argument("--batch-size", type=int, default=128, help="global batch size (default 128)")
    parser.add_argument("--cpu-devices", type=int, default=None,
                        help="XLA CPU devices (default: one per core, unless XLA_FLAGS sets it)")
    args = parser.parse_args(argv)
    if min(args.steps, args.rounds, args.batch_size) < 1:
        parser.error("--steps, --rounds and --batch-size must be positive")
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    devices = start_devices(args.cpu_devices, args.batch_size)
    rng = np.random.default_rng(0)
    batches = [
        {"image": rng.normal(size=(args.batch_size, FEATURES)).astype(np.float32),
         "label": rng.integers(0, 10, args.batch_size).astype(np.int32)}
        for _ in range(args.steps)
    ]
    logdirs = {name: tempfile.mkdtemp(prefix=f"bench-tensorboard-{name}-") for name in TARGETS}
    trainers = {
        "lean": flaxhooks.Trainer(MLP(), optax.sgd(0.1, momentum=0.9), cross_entropy_loss),
        **{
            name: flaxhooks.Trainer(MLP(), optax.sgd(0.1, momentum=0.9), cross_entropy_loss, callbacks=[
                flaxhooks.TensorBoard(logdirs[name], every=int(name.split("_")[1]))])
            for name in TARGETS
        },
    }
    init = trainers["lean"].init(batches[0])
    for trainer in trainers.values():  # compile and warm up
        run_trainer(trainer, init, batches, min(args.steps, 100))

    print(f"tensorboard: {devices} device(s), {args.steps} steps x {args.rounds} rounds, batch "
          f"{args.batch_size}; jax {jax.__version__}")
    names = list(trainers)
    rates: dict[str, list[float]] = {name: [] for name in names}
    ratios: dict[str, list[float]] = {name: [] for name in TARGETS}
    for round_index in range(args.rounds):
        order = names[round_index % 3:] + names[:round_index % 3]
        for name in order:
            start = time.perf_counter()
            run_trainer(trainers[name], init, batches, args.steps)
            rates[name].append(args.steps / (time.perf_counter() - start))
        for name in TARGETS:
            ratios[name].append(rates[name][-1] / rates["lean"][-1])
        print(f"round {round_index + 1}/{args.rounds} ({order[0]} first): "
              + "  ".join(f"{name} {rates[name][-1]:7.1f}/s" for name in names)
              + "  ratios " + " ".join(f"{ratios[name][-1]:.3f}" for name in TARGETS))
    for logdir in logdirs.values():
        shutil.rmtree(logdir)

    result: dict[str, Any] = {
        "benchmark": "tensorboard",
        "devices": devices,
        "steps": args.steps,
        "rounds": args.rounds,
        "batch_size": args.batch_size,
        **{f"steps_per_s_{name}": statistics.median(rates[name]) for name in names},
        **{f"ratio_{name}": statistics.median(ratios[name]) for name in TARGETS},
        **{f"ratios_{name}": ratios[name] for name in TARGETS},
        "targets": TARGETS,
        "jax_version": jax.__version__,
    }
    for name, target in TARGETS.items():
        verdict = "PASS" if result[f"ratio_{name}"] >= target else "FAIL"
        print(f"median ratio {name} / lean: {result[f'ratio_{name}']:.4f} (target >= {target}): {verdict}")
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
