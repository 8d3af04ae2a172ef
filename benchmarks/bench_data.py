"""Benchmark: the recipe's training on grain vs on ``ArrayLoader``, and how
long the loop waits for its data.

What is compared
    Two Trainers train the recipe's model (``recipes.models.CNN``, Flax's
    MNIST CNN) with the same loss, optimizer (``optax.sgd(0.1,
    momentum=0.9)``) and initial state, data-parallel over every local
    device, one epoch each time, on the same MNIST-shaped examples (fixed
    random float32 images ``[28, 28, 1]``, int32 labels, ``--examples`` of
    them) batched ``--batch-size`` at a time:

    (a) ``array``: ``flaxhooks.ArrayLoader(arrays, batch_size, seed=0)``,
        as ``python -m recipes.mnist`` trains by default.
    (b) ``grain``: the recipe's ``--loader grain``, a grain ``MapDataset``:
        the examples' indices shuffled and batched, each batch gathered from
        the arrays (``MapDataset.range(n).seed(0).shuffle().batch(batch_size)
        .map(Gather(arrays))``), iterated with grain's default read options
        (its own threads).

    Both go through the same input pipeline (``DevicePrefetch()``, its
    thread reading ahead). Everything is compiled before anything is timed.
    Each round times (a) and (b) back to back, one epoch each from the same
    state, alternating which goes first, end to end until the final params
    are on the host. The results are the medians of the per-round ratios
    ``grain steps/s / array steps/s`` (target: at least 0.98) and of each
    loader's data wait: the share of the epoch's wall time the loop was
    blocked waiting for its next batch, read from the loop's clock
    (``loop.clock``, host timers only; target: below 1%). A figure off its
    target is reported as FAIL, but the script exits 0: it is a measurement.

How to run
    python -m benchmarks.bench_data [--examples 16384] [--rounds 11] [--batch-size 128] [--cpu-devices N]

    The last line of output is one JSON object with the results.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
import optax

import flaxhooks
from benchmarks.bench_trainer import start_devices
from recipes import mnist
from recipes.models import CNN, cross_entropy_loss

RATIO_TARGET = 0.98
DATA_WAIT_TARGET = 0.01


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", type=int, default=16384, help="examples per epoch (default 16384)")
    parser.add_argument("--rounds", type=int, default=11, help="interleaved rounds (default 11)")
    parser.add_argument("--batch-size", type=int, default=128, help="global batch size (default 128)")
    parser.add_argument("--cpu-devices", type=int, default=None,
                        help="XLA CPU devices (default: one per core, unless XLA_FLAGS sets it)")
    args = parser.parse_args(argv)
    if args.examples < args.batch_size or args.rounds < 1 or args.batch_size < 1:
        parser.error("--rounds and --batch-size must be positive, --examples at least one batch")
    return args


class DataWait(flaxhooks.Callback):
    """The share of each fit's time the loop waited for its data."""

    def __init__(self) -> None:
        self.shares: list[float] = []
        self._start: Any = None

    def on_fit_start(self, loop: flaxhooks.Loop) -> None:
        self._start = loop.clock.read()

    def on_fit_end(self, loop: flaxhooks.Loop) -> None:
        interval = loop.clock.interval(self._start)
        if interval is not None:
            self.shares.append(interval.data_wait)


def loaders(examples: int, batch_size: int) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    arrays = {"image": rng.random((examples, 28, 28, 1), dtype=np.float32),
              "label": rng.integers(0, 10, examples).astype(np.int32)}
    return {name: mnist.train_loader(mnist.Config(loader=name), arrays, batch_size)
            for name in ("array", "grain")}


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    devices = start_devices(args.cpu_devices, args.batch_size)
    data = loaders(args.examples, args.batch_size)
    waits = {name: DataWait() for name in data}
    trainers = {name: flaxhooks.Trainer(CNN(), optax.sgd(0.1, momentum=0.9), cross_entropy_loss,
                                        callbacks=[waits[name]]) for name in data}
    init = trainers["array"].init(next(iter(data["array"](0))))
    for name, trainer in trainers.items():  # compiles the step
        trainer.fit(data[name], steps=int(init.step) + 3, state=init)
        waits[name].shares.clear()

    steps = len(data["array"])
    print(f"data: {devices} device(s) ({jax.devices()[0].platform}), {steps} steps an epoch x "
          f"{args.rounds} rounds, batch {args.batch_size}; jax {jax.__version__}")
    rates: dict[str, list[float]] = {name: [] for name in data}
    cpu: dict[str, list[float]] = {name: [] for name in data}
    ratios: list[float] = []
    for round_index in range(args.rounds):
        order = list(data) if round_index % 2 == 0 else list(data)[::-1]
        for name in order:
            start, cpu_start = time.perf_counter(), time.process_time()
            state = trainers[name].fit(data[name], epochs=1, state=init)
            jax.block_until_ready(state.params)
            jax.device_get(jax.tree.leaves(state.params)[0])
            rates[name].append(steps / (time.perf_counter() - start))
            cpu[name].append((time.process_time() - cpu_start) / steps)
        ratios.append(rates["grain"][-1] / rates["array"][-1])
        print(f"round {round_index + 1}/{args.rounds} ({order[0]} first): "
              + "  ".join(f"{n} {rates[n][-1]:6.2f} steps/s, data wait {waits[n].shares[-1]:.2%}"
                          for n in data)
              + f"  ratio {ratios[-1]:.4f}")

    result: dict[str, Any] = {
        "benchmark": "data",
        "devices": devices,
        "platform": jax.devices()[0].platform,
        "examples": args.examples,
        "rounds": args.rounds,
        "batch_size": args.batch_size,
        **{f"steps_per_s_{name}": statistics.median(rates[name]) for name in data},
        "ratio_grain": statistics.median(ratios),
        # Every thread's CPU time per step (XLA's, the loop's, the input thread's, grain's): on a
        # host whose cores all compute, what the loader costs comes out of the steps.
        **{f"cpu_ms_per_step_{name}": 1000 * statistics.median(cpu[name]) for name in data},
        "ratios_grain": ratios,
        **{f"data_wait_{name}": statistics.median(waits[name].shares) for name in data},
        "targets": {"ratio_grain": RATIO_TARGET, "data_wait": DATA_WAIT_TARGET},
        "compiles": {name: dict(trainer.runner.traces) for name, trainer in trainers.items()},
        "jax_version": jax.__version__,
    }
    verdict = "PASS" if result["ratio_grain"] >= RATIO_TARGET else "FAIL"
    print(f"median ratio grain / array: {result['ratio_grain']:.4f} (target >= {RATIO_TARGET}): {verdict}; "
          f"CPU time per step (every thread): array {result['cpu_ms_per_step_array']:.1f} ms, "
          f"grain {result['cpu_ms_per_step_grain']:.1f} ms")
    for name in data:
        share = result[f"data_wait_{name}"]
        verdict = "PASS" if share < DATA_WAIT_TARGET else "FAIL"
        print(f"median data wait, {name}: {share:.2%} of the step time (target < {DATA_WAIT_TARGET:.0%}): "
              f"{verdict}")
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
