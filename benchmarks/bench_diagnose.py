"""Benchmark: what ``Diagnose`` costs, sampling every step and every 16 steps.

What is compared
    Three Trainers train the same model (``recipes.models.CNN``, Flax's MNIST
    CNN), with the same loss, optimizer (``optax.sgd(0.1, momentum=0.9)``),
    initial state and host batches (fixed random float32 images
    ``[batch, 28, 28, 1]``, int32 labels), data-parallel over every local
    device. Each has a ``TensorBoard`` callback writing the training scalars
    every 50 steps to its own temporary directory, and the non-finite guard
    every Trainer has:

    (a) ``lean``: nothing else.
    (b) ``every_16``: ``Diagnose(every=16)`` (its default window of 200 steps;
        heatmaps on, the table off).
    (c) ``every_step``: ``Diagnose(every=1)``.
    (d) ``every_16_stats_10``: (b) and ``ActivationStats(every=10)``.

    With ``--steps-per-dispatch k`` every Trainer runs ``k`` steps a dispatch;
    with ``auto``, (d) chooses its count during the warm-up and every other
    Trainer then runs at that count (the lean one at the same ``k``).

    With ``--model transformer`` the model is the addition recipe's
    Transformer at its default size (``recipes.transformer.Transformer``:
    width 128, 2 blocks of 4 heads, 16 tokens, sequences of 12), trained with
    ``optax.adamw(2e-3)`` on the recipe's sums, data-parallel; Diagnose then
    also computes its Transformer findings (attention logits and entropy per
    head through ``record_attention``, the output's ``log Z``). Targets: 0.98
    and 0.90.

    Everything is compiled before anything is timed. Each round times (a),
    (b) and (c) back to back over ``--steps`` steps, rotating which goes
    first, end to end until the final params are on the host: each fit judges
    one window (read, findings, heatmaps). The results are the medians of the
    per-round ratios ``steps/s / lean steps/s``; targets: at least 0.98 for
    (b) and 0.91 for (c) (Cockpit's cheapest instruments cost 1.6 times the
    step). A ratio below its target is reported as FAIL, but the script
    exits 0: it is a measurement. The JSON line also gives each Trainer's
    compile counts and the median ratio of CPU time per step.

How to run
    python -m benchmarks.bench_diagnose [--model cnn|transformer] [--steps 200] [--rounds 9]
        [--batch-size 128] [--steps-per-dispatch 1|K|auto] [--cpu-devices N]

    The last line of output is one JSON object with the results.
"""

from __future__ import annotations

import argparse
import functools
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

TARGETS = {"every_16": 0.98, "every_step": 0.91, "every_16_stats_10": 0.98}
#: The targets with the Transformer (its attention and log Z sums on top).
TRANSFORMER_TARGETS = {"every_16": 0.98, "every_step": 0.90, "every_16_stats_10": 0.98}
CONFIGS = (("lean", None, False), ("every_16", 16, False), ("every_step", 1, False),
           ("every_16_stats_10", 16, True))
TENSORBOARD_EVERY = 50


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=("cnn", "transformer"), default="cnn",
                        help="the recipe CNN on MNIST-shaped batches, or the addition recipe's Transformer")
    parser.add_argument("--steps", type=int, default=200, help="timed steps per round (default 200)")
    parser.add_argument("--rounds", type=int, default=9, help="interleaved rounds (default 9)")
    parser.add_argument("--batch-size", type=int, default=128, help="global batch size (default 128)")
    parser.add_argument("--steps-per-dispatch", default="1",
                        help="Trainer(steps_per_dispatch=): a number, or auto (default 1)")
    parser.add_argument("--cpu-devices", type=int, default=None,
                        help="XLA CPU devices (default: one per core, unless XLA_FLAGS sets it)")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.rounds < 1 or args.batch_size < 1:
        parser.error("--steps, --rounds and --batch-size must be positive")
    if args.steps_per_dispatch != "auto":
        args.steps_per_dispatch = int(args.steps_per_dispatch)
    return args


def make_trainer(every: int | None, model: str = "cnn", stats: bool = False,
                 steps_per_dispatch: int | str = 1) -> flaxhooks.Trainer:
    callbacks: list[flaxhooks.Callback] = [
        flaxhooks.TensorBoard(tempfile.mkdtemp(prefix="bench-diagnose-"), every=TENSORBOARD_EVERY)
    ]
    if every is not None:
        callbacks.append(flaxhooks.Diagnose(every=every, table=False))
    if stats:
        callbacks.append(flaxhooks.ActivationStats(every=10))
    options: dict[str, Any] = {"callbacks": callbacks, "steps_per_dispatch": steps_per_dispatch}
    if model == "transformer":
        from recipes import addition_data
        from recipes.transformer import AXIS_RULES, Transformer, batch_loss

        transformer = Transformer(vocab_size=16, length=addition_data.sequence_length(3) - 1)
        loss = functools.partial(batch_loss, pad=addition_data.PAD)
        # Data-parallel: the batch over the devices, every parameter and other activation axis whole.
        rules = [(name, "data" if name == "batch" else None) for name, _ in AXIS_RULES]
        model = flaxhooks.as_model(transformer, input_keys=("tokens",))
        return flaxhooks.Trainer(model, optax.adamw(2e-3), loss, label_key=None, axis_rules=rules, **options)
    return flaxhooks.Trainer(CNN(), optax.sgd(0.1, momentum=0.9), cross_entropy_loss, **options)


def make_sum_batches(count: int, batch_size: int) -> list[dict[str, Any]]:
    """``count`` host batches of the addition recipe's 3-digit sums."""
    from recipes import addition_data

    train = addition_data.make_sums(3, count * batch_size, 10, 0).train()
    return [{key: values[i * batch_size:(i + 1) * batch_size] for key, values in train.items()}
            for i in range(count)]


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    devices = start_devices(args.cpu_devices, args.batch_size)
    targets = TRANSFORMER_TARGETS if args.model == "transformer" else TARGETS
    batches = (make_sum_batches if args.model == "transformer" else make_batches)(args.steps, args.batch_size)
    k = args.steps_per_dispatch
    init = make_trainer(None, args.model).init(batches[0])
    if k == "auto":  # (d) chooses; the others run at its count
        chooser = make_trainer(16, args.model, True, "auto")
        run_trainer(chooser, init, batches * (400 // len(batches) + 1), 400)
        k = chooser.chosen_steps_per_dispatch or 1
    trainers = {name: make_trainer(every, args.model, stats, k) for name, every, stats in CONFIGS}
    for trainer in trainers.values():  # compiles every step and the windows' sum
        run_trainer(trainer, init, batches * (40 // len(batches) + 1), 40)

    print(f"diagnose ({args.model}): {devices} device(s) ({jax.devices()[0].platform}), {args.steps} steps x "
          f"{args.rounds} rounds, batch {args.batch_size}, {k} step(s) a dispatch "
          f"({args.steps_per_dispatch!r} asked); jax {jax.__version__}")
    names = list(trainers)
    rates: dict[str, list[float]] = {name: [] for name in names}
    ratios: dict[str, list[float]] = {name: [] for name in targets}
    cpu_ratios: dict[str, list[float]] = {name: [] for name in targets}
    for round_index in range(args.rounds):
        order = names[round_index % len(names):] + names[:round_index % len(names)]
        round_rates, round_cpu = {}, {}
        for name in order:
            start, cpu_start = time.perf_counter(), time.process_time()
            run_trainer(trainers[name], init, batches, args.steps)
            round_rates[name] = args.steps / (time.perf_counter() - start)
            round_cpu[name] = time.process_time() - cpu_start
        for name in names:
            rates[name].append(round_rates[name])
        for name in targets:
            ratios[name].append(round_rates[name] / round_rates["lean"])
            cpu_ratios[name].append(round_cpu["lean"] / round_cpu[name])
        print(f"round {round_index + 1}/{args.rounds} ({order[0]} first): "
              + "  ".join(f"{n} {round_rates[n]:6.2f}/s" for n in names)
              + "  ratios " + " ".join(f"{ratios[n][-1]:.4f}" for n in targets))
    for trainer in trainers.values():
        for callback in trainer.callbacks:
            if isinstance(callback, flaxhooks.TensorBoard):
                callback.close()

    result: dict[str, Any] = {
        "benchmark": "diagnose",
        "model": args.model,
        "devices": devices,
        "platform": jax.devices()[0].platform,
        "steps": args.steps,
        "rounds": args.rounds,
        "batch_size": args.batch_size,
        "steps_per_dispatch": k,
        "steps_per_dispatch_asked": args.steps_per_dispatch,
        **{f"steps_per_s_{name}": statistics.median(rates[name]) for name in names},
        **{f"ratio_{name}": statistics.median(ratios[name]) for name in targets},
        **{f"ratios_{name}": ratios[name] for name in targets},
        **{f"cpu_ratio_{name}": statistics.median(cpu_ratios[name]) for name in targets},
        "targets": targets,
        "compiles": {name: dict(trainer.runner.traces) for name, trainer in trainers.items()},
        "findings": {name: [f.kind for f in cb.findings] for name, trainer in trainers.items()
                     for cb in trainer.callbacks if isinstance(cb, flaxhooks.Diagnose)},
        "jax_version": jax.__version__,
    }
    for name, target in targets.items():
        verdict = "PASS" if result[f"ratio_{name}"] >= target else "FAIL"
        print(f"median ratio {name} / lean: {result[f'ratio_{name}']:.4f} (target >= {target}): {verdict}; "
              f"CPU time per step, lean / {name}: {result[f'cpu_ratio_{name}']:.4f}")
    print(f"compilations: {result['compiles']}")
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
