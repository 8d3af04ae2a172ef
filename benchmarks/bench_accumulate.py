"""Benchmark: what gradient accumulation and a moving average of the weights cost per update.

What is compared
    Trainers train the recipe's MNIST CNN (``recipes.models.CNN``) with the same loss
    (``recipes.models.cross_entropy_loss``), optimizer (``optax.sgd(0.1, momentum=0.9)``),
    initial state and host batches of ``--batch-size`` fixed random images, data-parallel
    over every local device, with no callbacks:

    (a) ``lean``: one update a batch, the whole batch at once.
    (b) ``accumulate_K`` for each ``--accumulate`` K: each batch taken in K micro-batches
        inside the step (``Trainer(accumulate=K)``), one update of their mean gradient.
    (c) ``ema``: (a) with the optimizer keeping a moving average of the weights
        (``flaxhooks.with_ema(optimizer, 0.999)``).

    Each segment is a whole fit of ``--steps`` updates from the same state, timed end to end
    (wall clock, with the process's CPU time over it: the cores busy); everything is compiled
    before timing. Each round times every segment once, rotating which goes first; the
    results are medians over rounds of each segment's updates per second and of its per-round
    ratio to ``lean`` (below 1: slower). Beside them, XLA's memory analysis of each compiled
    step (``StepRunner.step_memory``): the bytes of temporaries (activations, gradients,
    scratch) on each device, and of the arguments (the state and the batch), which the
    average grows by the parameters' size. On CPU the micro-batches are written out (what is
    timed); the layout GPU and TPU get, a loop holding one micro-batch's activations at a
    time, is compiled beside it for its memory (``memory_looped``), not timed: XLA:CPU runs
    a convolution inside a loop an order of magnitude slower (jax-ml/jax#12868).

How to run
    python -m benchmarks.bench_accumulate [--steps 30] [--rounds 5] [--batch-size 128]
        [--accumulate 2 4] [--cpu-devices N]

    The last line of output is one JSON object with the results.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable, Sequence
from typing import Any

import jax
import optax

import flaxhooks
from benchmarks.bench_trainer import make_batches, start_devices
from benchmarks.rounds import alternate
from flaxhooks.step import StepRunner
from recipes.models import CNN, cross_entropy_loss

EMA_DECAY = 0.999


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30, help="updates per timed fit")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=128, help="global batch size of each update")
    parser.add_argument("--accumulate", type=int, nargs="+", default=[2, 4], help="micro-batches per update")
    parser.add_argument("--cpu-devices", type=int, default=None)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    devices = start_devices(args.cpu_devices, args.batch_size)
    batches = make_batches(args.steps, args.batch_size)
    sgd = optax.sgd(0.1, momentum=0.9)
    trainers = {"lean": flaxhooks.Trainer(CNN(), sgd, cross_entropy_loss)}
    for k in args.accumulate:
        trainers[f"accumulate_{k}"] = flaxhooks.Trainer(CNN(), sgd, cross_entropy_loss, accumulate=k)
    trainers["ema"] = flaxhooks.Trainer(CNN(), flaxhooks.with_ema(sgd, EMA_DECAY), cross_entropy_loss)
    initial = {name: t.init(batches[0]) for name, t in trainers.items()}  # one seed: the same weights
    runs: dict[str, Callable[[], Any]] = {
        name: lambda t=trainer, s=initial[name]: jax.block_until_ready(
            t.fit(batches, steps=args.steps, state=s).params)
        for name, trainer in trainers.items()}
    for run in runs.values():  # compile everything first
        run()
    names = list(runs)
    print(f"{devices} device(s), batch {args.batch_size}, {args.steps} updates x {args.rounds} rounds; each "
          "segment a whole fit from the same state, the order rotated per round")
    rates, busy = alternate(runs, args.rounds, args.steps, "updates/s")
    memory = {name: t.runner.step_memory() for name, t in trainers.items()}
    # The layout GPU and TPU get (a loop over the micro-batches), compiled here for its memory alone:
    # XLA:CPU runs a convolution inside a loop an order of magnitude slower (jax-ml/jax#12868).
    looped = {}
    loops_on = StepRunner.LOOP_MICRO_BATCHES_ON
    StepRunner.LOOP_MICRO_BATCHES_ON = loops_on | {jax.devices()[0].platform}
    try:
        for k in args.accumulate:
            trainer = flaxhooks.Trainer(CNN(), sgd, cross_entropy_loss, accumulate=k)
            trainer.fit(batches, steps=1, state=initial["lean"])
            looped[f"accumulate_{k}"] = trainer.runner.step_memory()
    finally:
        StepRunner.LOOP_MICRO_BATCHES_ON = loops_on
    result: dict[str, Any] = {
        "benchmark": "accumulate", "devices": devices, "batch_size": args.batch_size, "steps": args.steps,
        "rounds": args.rounds, "ema_decay": EMA_DECAY,
        **{f"updates_per_s_{n}": statistics.median(r) for n, r in rates.items()},
        **{f"cores_busy_{n}": statistics.median(b) for n, b in busy.items()},
        **{f"{n}_over_lean": statistics.median(a / b for a, b in zip(rates[n], rates["lean"], strict=True))
           for n in names if n != "lean"},
        "memory": memory, "memory_looped": looped,
        "compiles": {n: dict(t.runner.traces) for n, t in trainers.items()},
        "jax_version": jax.__version__,
    }
    for name in names:
        held = memory[name] or {}
        print(f"{name:>14}: {result[f'updates_per_s_{name}']:7.1f} updates/s, "
              f"{result[f'cores_busy_{name}']:.2f} cores busy (median); per device: temporaries "
              f"{held.get('temporaries', 0) / 2**20:.1f} MiB, "
              f"arguments {held.get('arguments', 0) / 2**20:.1f} MiB")
    for name, held in looped.items():
        print(f"{name:>14} in a loop (GPU and TPU's layout; compiled, not timed): temporaries "
              f"{(held or {}).get('temporaries', 0) / 2**20:.1f} MiB per device")
    for name in names[1:]:
        print(f"median ratio {name} / lean: {result[f'{name}_over_lean']:.3f}")
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
