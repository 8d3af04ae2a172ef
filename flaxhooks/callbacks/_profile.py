"""Profile: a ``jax.profiler`` trace of a few chosen steps."""

from __future__ import annotations

import logging
import os
from typing import Any

import jax

from flaxhooks.contract import Callback, Loop
from flaxhooks.writers import check_writable

_log = logging.getLogger("flaxhooks")


class Profile(Callback):
    """Traces a few chosen steps with ``jax.profiler`` for TensorBoard's Profile tab.

    See docs/guides/what-you-see.md for how to view it.

    Args:
        logdir: the run directory; None: the fit's TensorBoard writer's.
        steps: ``(start, stop)``, both included, numbered as ``loop.step``; or a
            number of steps traced in each fit after ``warmup``.
        warmup: with a number of ``steps``, the steps each fit runs first (default 9).
        options: a ``jax.profiler.ProfileOptions`` for the trace.

    Attributes:
        trace_dirs: the directories of the traces written so far, oldest first.

    Raises:
        ValueError: steps that are not positive, a ``stop`` before its ``start``,
            or (at ``fit_start``) ``logdir=None`` where no writer writes TensorBoard files.
        LogdirError: ``logdir`` cannot be written.

    Examples:
        >>> import os, tempfile, numpy as np, optax, flax.linen as nn, flaxhooks
        >>> profile = flaxhooks.Profile(tempfile.mkdtemp(), steps=(3, 4))
        >>> trainer = flaxhooks.Trainer(
        ...     nn.Dense(3), optax.sgd(0.1), lambda logits, batch: (logits ** 2).mean(),
        ...     callbacks=[profile])
        >>> data = [{"image": np.ones((len(trainer.devices), 5), np.float32)}] * 6
        >>> state = trainer.fit(data, epochs=1)
        >>> [trace] = profile.trace_dirs  # <logdir>/plugins/profile/<timestamp>
        >>> any(name.endswith(".xplane.pb") for name in os.listdir(trace))
        True
    """

    process_zero_only = True
    # Before other handlers: the chosen steps' step_start handlers are traced.
    order = -100
    #: The warm-up of ``steps=<number>`` when ``warmup`` is left out.
    DEFAULT_WARMUP = 9

    def __init__(self, logdir: str | os.PathLike[str] | None = None, steps: int | tuple[int, int] = 3, *,
                 warmup: int | None = None, options: jax.profiler.ProfileOptions | None = None):
        self.steps = _checked_steps(steps)
        if warmup is not None and isinstance(self.steps, tuple):
            raise ValueError(f"warmup applies to a number of steps only; steps={self.steps} already "
                             "names the steps")
        self.warmup = self.DEFAULT_WARMUP if warmup is None else warmup
        if isinstance(self.warmup, bool) or not isinstance(self.warmup, int) or self.warmup < 0:
            raise ValueError(f"warmup must be a number of steps, 0 or more, got {warmup!r}")
        self.logdir = None if logdir is None else os.fspath(logdir)
        if self.logdir is not None:
            check_writable(self.logdir, "profiler traces")
        self._logdir: str | None = self.logdir  # the fit's: given, or the TensorBoard writer's
        self.options = options
        self.trace_dirs: list[str] = []
        self._span: tuple[int, int] | None = None  # this fit's steps, while still to come
        self._tracing = False
        self._annotation: jax.profiler.StepTraceAnnotation | None = None
        self._before: set[str] = set()
        self._warned_behind = False

    def __repr__(self) -> str:
        return f"Profile({self.logdir!r}, steps={self.steps!r})"

    def on_fit_start(self, loop: Loop) -> None:
        self._logdir = self.logdir or loop.writers.logdir
        if self._logdir is None:
            raise ValueError(
                "Profile(logdir=None) writes into the TensorBoard directory of the fit, but no writer of "
                "this Trainer writes one: add a TensorBoard callback, or give Profile a logdir")
        if isinstance(self.steps, int):
            first = loop.step + self.warmup + 1
            self._span = (first, first + self.steps - 1)
            return
        start, stop = self.steps
        self._span = self.steps
        if start <= loop.step:
            self._span = None
            if not self._warned_behind and not self.trace_dirs:
                self._warned_behind = True
                _log.warning("Profile: steps %d to %d are behind this fit, which starts after step %d (a "
                             "resumed run?): nothing is traced. Choose later steps, or a number of steps "
                             "(Profile(steps=3)) to trace after each fit's warm-up", start, stop, loop.step)

    def dispatch_ends_at(self, step: int) -> bool:
        """The trace starts after ``step`` or ends with it: a dispatch of several steps ends there."""
        return self._span is not None and step in (self._span[0] - 1, self._span[1])

    def on_step_start(self, loop: Loop) -> None:
        step = loop.step + 1
        if self._span is None or step < self._span[0]:
            return
        if not self._tracing and not self._start(loop, step):
            return
        self._annotation = jax.profiler.StepTraceAnnotation("train", step_num=step)
        self._annotation.__enter__()

    def on_step_end(self, loop: Loop) -> None:
        if self._tracing:
            # After every step_end handler: the step's handlers are in the trace.
            loop.after(self, self._step_done)

    def _step_done(self, loop: Loop) -> None:
        self._end_annotation()
        assert self._span is not None
        if loop.step >= self._span[1]:
            # The one wait: the last chosen step's device work belongs in the trace.
            jax.block_until_ready(loop.metrics)
            self._stop(loop)

    def on_fit_end(self, loop: Loop) -> None:
        span = self._span
        if self._tracing:
            self._end_annotation()
            # A failed step may never finish: wait only on a clean end.
            if loop.exception is None and loop.metrics is not None:
                jax.block_until_ready(loop.metrics)
            self._stop(loop)
        elif span is not None and loop.exception is None and loop.step < span[0]:
            _log.info("Profile: training ended at step %d, before step %d: nothing was traced",
                      loop.step, span[0])
        self._span = None

    def _start(self, loop: Loop, step: int) -> bool:
        """Starts the trace at ``step``; False (with a warning) if it cannot."""
        assert self._logdir is not None and self._span is not None
        self._before = set(_listdir(_profile_root(self._logdir)))
        try:
            jax.profiler.start_trace(self._logdir, profiler_options=self.options)
        except RuntimeError as error:
            span, self._span = self._span, None
            cause = ("another jax.profiler trace is already running in this process (jax.profiler."
                     "start_trace or jax.profiler.trace elsewhere, or another Profile); only one can run at "
                     "a time"
                     if "already" in str(error) else f"jax.profiler.start_trace failed: {error}")
            _log.warning("Profile: steps %d to %d are not traced: %s", step, span[1], cause)
            return False
        self._tracing = True
        return True

    def _stop(self, loop: Loop) -> None:
        assert self._logdir is not None
        span, self._span = self._span, None
        first = span[0] if span else None
        self._tracing = False  # even if stopping fails: this trace is over
        jax.profiler.stop_trace()
        root = _profile_root(self._logdir)
        written = sorted(set(_listdir(root)) - self._before) or sorted(_listdir(root))[-1:]
        where = os.path.join(root, written[-1]) if written else root
        self.trace_dirs.append(where)
        ended = "" if span is None or loop.step >= span[1] else f" (training ended before step {span[1]})"
        _log.info("Profile: traced steps %s to %d%s into %s. View it in TensorBoard's Profile tab: "
                  "pip install tensorboard-plugin-profile, then tensorboard --logdir %s",
                  first, loop.step, ended, where, self._logdir)

    def _end_annotation(self) -> None:
        annotation, self._annotation = self._annotation, None
        if annotation is not None:
            annotation.__exit__(None, None, None)


def _checked_steps(steps: Any) -> int | tuple[int, int]:
    """``steps`` as given, once checked."""
    def is_int(value: Any) -> bool:
        return isinstance(value, int) and not isinstance(value, bool)

    if is_int(steps):
        if steps < 1:
            raise ValueError(f"steps must be a positive number of steps, got {steps}")
        return int(steps)
    if not (isinstance(steps, (tuple, list)) and len(steps) == 2 and all(map(is_int, steps))):
        raise ValueError(f"steps must be (start, stop) or a number of steps, got {steps!r}")
    start, stop = (int(s) for s in steps)
    if start < 1:
        raise ValueError(f"steps=({start}, {stop}): steps are numbered from 1 (the first step)")
    if stop < start:
        raise ValueError(f"steps=({start}, {stop}): stop comes before start")
    return start, stop


def _profile_root(logdir: str) -> str:
    """Where ``jax.profiler`` puts a logdir's traces, one directory each."""
    return os.path.join(logdir, "plugins", "profile")


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except FileNotFoundError:
        return []
