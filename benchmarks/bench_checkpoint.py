"""Benchmark: the cost of checkpointing while training.

What is compared
    Two Trainers train the same model (``recipes.models.CNN``, Flax's MNIST
    CNN, 824,458 parameters; with SGD momentum the saved state is about 6.6 MB),
    with the same loss, optimizer, initial state and host batches (fixed
    random float32 images ``[batch, 28, 28, 1]``, int32 labels), data-parallel
    over every local device. Both write training scalars to TensorBoard every
    50 steps:

    (a) ``lean``: nothing else.
    (b) ``checkpoint``: also ``Checkpoint(every=--every, keep=2)``, which
        saves every ``--every`` steps and once more at the end of each fit
        (and waits for that last save to be on disk).

    Both are compiled and warmed up first. Each round times (a) and (b) back
    to back over ``--steps`` steps, alternating which goes first, end to end
    until the final params are on the host and the last checkpoint is
    written; the checkpoint directory is emptied between rounds. The result is
    the median of the per-round ratios ``steps/s / lean steps/s``; target: at
    least 0.97 with the default every 50 steps. Also printed: the time the
    loop lost per save, ``(checkpoint time - lean time) / saves``, median
    over the rounds, and how long each save held the loop: orbax's
    synchronous part, until this process's shards are on the host (median
    over every timed save). Below target is reported as FAIL, but the
    script exits 0: it is a measurement.

    ``--replica-slice-bytes 0`` lets orbax split every replicated array
    between its replicas, as before 0.8 (a dispatch per slice), to compare.

How to run
    python -m benchmarks.bench_checkpoint [--steps 200] [--rounds 9] [--every 50]
        [--batch-size 128] [--cpu-devices N] [--replica-slice-bytes N]

    The last line of output is one JSON object with the results.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import jax
import optax

import flaxhooks
from benchmarks.bench_trainer import make_batches, run_trainer, start_devices
from flaxhooks.callbacks import _checkpoint
from recipes.models import CNN, cross_entropy_loss

TARGET = 0.97


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200, help="timed steps per round (default 200)")
    parser.add_argument("--rounds", type=int, default=9, help="interleaved rounds (default 9)")
    parser.add_argument("--every", type=int, default=50, help="checkpoint every this many steps (default 50)")
    parser.add_argument("--batch-size", type=int, default=128, help="global batch size (default 128)")
    parser.add_argument("--cpu-devices", type=int, default=None,
                        help="XLA CPU devices (default: one per core, unless XLA_FLAGS sets it)")
    parser.add_argument("--replica-slice-bytes", type=int, default=None,
                        help="the least bytes of a replica's slice for orbax to split a replicated array "
                             "(default: Checkpoint's own; 0: split every one, as orbax does)")
    args = parser.parse_args(argv)
    if min(args.steps, args.rounds, args.every, args.batch_size) < 1:
        parser.error("--steps, --rounds, --every and --batch-size must be positive")
    return args


def empty(directory: str) -> None:
    for name in os.listdir(directory):
        shutil.rmtree(os.path.join(directory, name))


class TimedCheckpoint(flaxhooks.Checkpoint):
    """A Checkpoint that records how long each save held the loop."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.blocked: list[float] = []

    def _start_save(self, save: Any, step: int) -> None:
        start = time.perf_counter()
        try:
            super()._start_save(save, step)
        finally:
            self.blocked.append(time.perf_counter() - start)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.replica_slice_bytes is not None:
        _checkpoint.REPLICA_SLICE_BYTES = args.replica_slice_bytes
    devices = start_devices(args.cpu_devices, args.batch_size)
    batches = make_batches(args.steps, args.batch_size)
    directory = tempfile.mkdtemp(prefix="bench-checkpoint-")
    checkpoint = TimedCheckpoint(directory, every=args.every, keep=2)
    trainers = {
        name: flaxhooks.Trainer(CNN(), optax.sgd(0.1, momentum=0.9), cross_entropy_loss, callbacks=[
            flaxhooks.TensorBoard(tempfile.mkdtemp(prefix="bench-checkpoint-tb-"), every=50),
            *([checkpoint] if name == "checkpoint" else []),
        ])
        for name in ("lean", "checkpoint")
    }
    init = trainers["lean"].init(batches[0])
    for trainer in trainers.values():  # compile and warm up
        run_trainer(trainer, init, batches, min(args.steps, 2 * args.every))
        empty(directory)
    checkpoint.blocked = []

    print(f"checkpoint: {devices} device(s), {args.steps} steps x {args.rounds} rounds, batch "
          f"{args.batch_size}, every {args.every} steps; jax {jax.__version__}")
    rates: dict[str, list[float]] = {name: [] for name in trainers}
    ratios: list[float] = []
    lost: list[float] = []  # seconds the loop lost per save, this round
    saves = args.steps // args.every + (1 if args.steps % args.every else 0)  # + the one at the end
    for round_index in range(args.rounds):
        order = list(trainers) if round_index % 2 == 0 else list(reversed(trainers))
        for name in order:
            start = time.perf_counter()
            run_trainer(trainers[name], init, batches, args.steps)  # waits for the last save too
            rates[name].append(args.steps / (time.perf_counter() - start))
            empty(directory)
        ratios.append(rates["checkpoint"][-1] / rates["lean"][-1])
        lost.append((args.steps / rates["checkpoint"][-1] - args.steps / rates["lean"][-1]) / saves)
        print(f"round {round_index + 1}/{args.rounds} ({order[0]} first): lean {rates['lean'][-1]:6.2f}/s  "
              f"checkpoint {rates['checkpoint'][-1]:6.2f}/s  ratio {ratios[-1]:.4f}")
    for trainer in trainers.values():
        trainer.bus.of(flaxhooks.TensorBoard)[0].close()
    shutil.rmtree(directory)

    result: dict[str, Any] = {
        "benchmark": "checkpoint",
        "devices": devices,
        "steps": args.steps,
        "rounds": args.rounds,
        "every": args.every,
        "batch_size": args.batch_size,
        **{f"steps_per_s_{name}": statistics.median(rates[name]) for name in trainers},
        "ratio": statistics.median(ratios),
        "seconds_lost_per_save": statistics.median(lost),
        "saves_per_round": saves,
        "seconds_blocked_per_save": statistics.median(checkpoint.blocked),
        "replica_slice_bytes": _checkpoint.REPLICA_SLICE_BYTES,
        "ratios": ratios,
        "target": TARGET,
        "jax_version": jax.__version__,
    }
    verdict = "PASS" if result["ratio"] >= TARGET else "FAIL"
    print(f"median ratio checkpoint / lean: {result['ratio']:.4f} (target >= {TARGET}): {verdict}")
    print(f"time the loop lost per save (median over rounds, {saves} saves a round): "
          f"{1000 * result['seconds_lost_per_save']:.1f} ms")
    print(f"time each save held the loop (orbax's synchronous part, median of {len(checkpoint.blocked)}): "
          f"{1000 * result['seconds_blocked_per_save']:.1f} ms")
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
