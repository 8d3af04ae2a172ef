"""Benchmark: the cost of per-layer activation, activation-gradient and parameter statistics.

What is compared
    Three Trainers train the same model (``recipes.models.CNN``, Flax's MNIST
    CNN, which sows its post-ReLU activations), with the same loss, optimizer
    (``optax.sgd(0.1, momentum=0.9)``), initial state and host batches (fixed
    random float32 images ``[batch, 28, 28, 1]``, int32 labels), data-parallel
    over every local device. Each has a ``TensorBoard`` callback writing the
    training scalars every 50 steps to its own temporary directory:

    (a) ``lean``: nothing else, so only the lean step runs.
    (b) ``every_10``: ``ActivationStats`` (sown values and every module's
        output, captured), ``ActivationGradStats`` (every module's output,
        perturbed) and ``ParamStats``, with their default statistics, all
        every 10 steps, written through the TensorBoard writer. The
        instrumented step runs once per 10 steps.
    (c) ``every_step``: the same callbacks due at every step.

    ``--stats all`` gives the two activation callbacks every statistic of
    every value (``stats="all"``) instead of the defaults; ``--histograms``
    adds histograms to (b) and (c); ``--no-param-stats`` leaves
    ``ParamStats`` out. All three are compiled (both steps warmed up) before
    anything is timed. Each round times (a), (b) and (c) back to back over
    ``--steps`` steps, rotating which goes first to cancel drift, end to end
    until the final params are on the host. The results are the medians of
    the per-round ratios ``steps/s / lean steps/s``; targets: at least 0.98
    for (b) and 0.90 for (c). A ratio below its target is reported as FAIL,
    but the script exits 0: it is a measurement. The JSON line also gives
    the compile counts of each step, and a second estimate of the cost: the
    median ratio of CPU time per step (every thread of the process, lean /
    instrumented), which other processes on a shared host disturb too, but
    differently from the wall clock.

    Per-round timings on a small shared CPU host vary by several percent:
    read the medians of many rounds.

How to run
    python -m benchmarks.bench_activations [--steps 200] [--rounds 9]
        [--batch-size 128] [--cpu-devices N] [--histograms] [--stats all]
        [--no-param-stats]

    The last line of output is one JSON object with the results.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import jax
import optax

import flaxhooks
from benchmarks.bench_trainer import make_batches, run_trainer, start_devices
from recipes.models import CNN, cross_entropy_loss

TARGETS = {"every_10": 0.98, "every_step": 0.90}
TENSORBOARD_EVERY = 50


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200, help="timed steps per round (default 200)")
    parser.add_argument("--rounds", type=int, default=9, help="interleaved rounds (default 9)")
    parser.add_argument("--batch-size", type=int, default=128, help="global batch size (default 128)")
    parser.add_argument("--cpu-devices", type=int, default=None,
                        help="XLA CPU devices (default: one per core, unless XLA_FLAGS sets it)")
    parser.add_argument("--histograms", action="store_true", help="also write histograms")
    parser.add_argument("--stats", choices=("default", "all"), default="default",
                        help="the activation callbacks' statistics: the defaults, or every one (stats='all')")
    parser.add_argument("--no-param-stats", action="store_true", help="leave ParamStats out")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.rounds < 1 or args.batch_size < 1:
        parser.error("--steps, --rounds and --batch-size must be positive")
    return args


def make_trainer(every: int | None, args: argparse.Namespace) -> flaxhooks.Trainer:
    callbacks: list[flaxhooks.Callback] = [
        flaxhooks.TensorBoard(tempfile.mkdtemp(prefix="bench-act-"), every=TENSORBOARD_EVERY)
    ]
    if every is not None:
        stats = None if args.stats == "default" else "all"
        callbacks += [
            flaxhooks.ActivationStats(every=every, histograms=args.histograms, stats=stats),
            flaxhooks.ActivationGradStats(every=every, histograms=args.histograms, stats=stats),
        ]
        if not args.no_param_stats:
            callbacks.append(flaxhooks.ParamStats(every=every))
    return flaxhooks.Trainer(CNN(), optax.sgd(0.1, momentum=0.9), cross_entropy_loss, callbacks=callbacks)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    devices = start_devices(args.cpu_devices, args.batch_size)
    batches = make_batches(args.steps, args.batch_size)
    trainers = {
        "lean": make_trainer(None, args),
        "every_10": make_trainer(10, args),
        "every_step": make_trainer(1, args),
    }
    init = trainers["lean"].init(batches[0])
    # Warm up: 30 steps compile both steps of every_10 (and the writers).
    for trainer in trainers.values():
        run_trainer(trainer, init, batches * (30 // len(batches) + 1), 30)

    print(
        f"activation_stats: {devices} device(s), {args.steps} steps x {args.rounds} rounds, "
        f"batch {args.batch_size}, stats {args.stats}, histograms {args.histograms}, "
        f"param stats {not args.no_param_stats}; jax {jax.__version__}"
    )
    names = list(trainers)
    rates: dict[str, list[float]] = {name: [] for name in names}
    ratios: dict[str, list[float]] = {name: [] for name in TARGETS}
    # CPU time (every thread of this process) per step: a second estimate, which
    # other processes on a shared host disturb differently from the wall clock.
    cpu_ratios: dict[str, list[float]] = {name: [] for name in TARGETS}
    for round_index in range(args.rounds):
        order = names[round_index % 3:] + names[:round_index % 3]
        round_rates, round_cpu = {}, {}
        for name in order:
            trainer = trainers[name]
            start, cpu_start = time.perf_counter(), time.process_time()
            run_trainer(trainer, init, batches, args.steps)
            round_rates[name] = args.steps / (time.perf_counter() - start)
            round_cpu[name] = time.process_time() - cpu_start
        for name in names:
            rates[name].append(round_rates[name])
        for name in TARGETS:
            ratios[name].append(round_rates[name] / round_rates["lean"])
            cpu_ratios[name].append(round_cpu["lean"] / round_cpu[name])
        print(f"round {round_index + 1}/{args.rounds} ({order[0]} first): "
              + "  ".join(f"{n} {round_rates[n]:6.2f}/s" for n in names)
              + "  ratios " + " ".join(f"{ratios[n][-1]:.4f}" for n in TARGETS)
              + "  cpu-time ratios " + " ".join(f"{cpu_ratios[n][-1]:.4f}" for n in TARGETS))
    for trainer in trainers.values():
        for callback in trainer.callbacks:
            if isinstance(callback, flaxhooks.TensorBoard):
                callback.close()

    result: dict[str, Any] = {
        "benchmark": "activation_stats",
        "devices": devices,
        "steps": args.steps,
        "rounds": args.rounds,
        "batch_size": args.batch_size,
        "histograms": args.histograms,
        "stats": args.stats,
        "param_stats": not args.no_param_stats,
        **{f"steps_per_s_{name}": statistics.median(rates[name]) for name in names},
        **{f"ratio_{name}": statistics.median(ratios[name]) for name in TARGETS},
        **{f"ratios_{name}": ratios[name] for name in TARGETS},
        **{f"cpu_ratio_{name}": statistics.median(cpu_ratios[name]) for name in TARGETS},
        "targets": TARGETS,
        "compiles": {name: dict(trainer.runner.traces) for name, trainer in trainers.items()},
        "jax_version": jax.__version__,
    }
    for name, target in TARGETS.items():
        verdict = "PASS" if result[f"ratio_{name}"] >= target else "FAIL"
        print(f"median ratio {name} / lean: {result[f'ratio_{name}']:.4f} (target >= {target}): {verdict}; "
              f"CPU time per step, lean / {name}: {result[f'cpu_ratio_{name}']:.4f}")
    print(f"compilations: {result['compiles']}")
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
