"""Trains ``helpers.resume_trainer`` in a process of its own, resuming from
its checkpoints, for the fault tests in ``test_checkpoint.py``.

Usage: ``python -m tests.callbacks.checkpoint_worker WORKDIR [options]``. Prints
``step N`` after each step (flushed), ``DONE N`` at the end, and on a signal
``INTERRUPTED N``, exiting with 128 + the signal number as a shell does.
"""

from __future__ import annotations

import argparse
import resource
import signal
import sys
import time

import jax
import numpy as np

import flaxhooks
from tests.helpers import resume_data, resume_trainer


class Announce(flaxhooks.Callback):
    """Prints each step; optionally slows the loop, or limits file sizes after a step."""

    def __init__(self, seconds: float, limit_after: int | None, limit_bytes: int):
        self.seconds, self.limit_after, self.limit_bytes = seconds, limit_after, limit_bytes

    def on_step_end(self, loop):
        print(f"step {loop.step}", flush=True)
        time.sleep(self.seconds)
        if loop.step == self.limit_after:
            # Earlier saves complete first.
            next(cb for cb in loop.callbacks if isinstance(cb, flaxhooks.Checkpoint)).wait()
            # A disk that fills up: writes past this size fail with EFBIG.
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (self.limit_bytes, resource.RLIM_INFINITY))


def stall_finalize_at(step: int) -> None:
    """Stops a save of ``step`` after its files are written, before orbax
    renames its temporary directory into place, so the test can kill it there."""
    from orbax.checkpoint._src.path import atomicity

    finalize = atomicity.AtomicRenameTemporaryPath.finalize

    def stalled(self, *args, **kwargs):
        if str(self.get_final()).rstrip("/").endswith(f"/{step}"):
            print(f"STALLED {step}", flush=True)
            time.sleep(600)
        return finalize(self, *args, **kwargs)

    atomicity.AtomicRenameTemporaryPath.finalize = stalled


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("workdir")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--seconds-per-step", type=float, default=0.0)
    parser.add_argument("--stall-save", type=int)
    parser.add_argument("--limit-after", type=int)
    parser.add_argument("--limit-bytes", type=int, default=4096)
    args = parser.parse_args()
    flaxhooks.use_cpu_devices(2)  # before JAX starts its backends
    if args.stall_save is not None:
        stall_finalize_at(args.stall_save)
    announce = Announce(args.seconds_per_step, args.limit_after, args.limit_bytes)
    trainer = resume_trainer(args.workdir, [announce])
    try:
        state = trainer.fit(resume_data(), epochs=args.epochs, resume=True)
    except flaxhooks.TrainingInterrupted as interrupted:
        print(f"INTERRUPTED {interrupted.step}", flush=True)
        return 128 + interrupted.signal
    np.savez(f"{args.workdir}/params.npz", *[np.asarray(x) for x in jax.tree.leaves(state.params)])
    print(f"DONE {int(state.step)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
