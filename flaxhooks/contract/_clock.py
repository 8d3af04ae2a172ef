"""Where the time goes: the loop's host clock, read only when a callback is due."""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

_log = logging.getLogger("flaxhooks")
_T = TypeVar("_T")

#: Peak dense bf16 FLOP/s of one device (vendors' data sheets, no sparsity), by the
#: longest start of its ``jax.Device.device_kind``. Add another device with
#: ``flaxhooks.PEAK_FLOPS["NVIDIA L4"] = 121e12``; with none, MFU is not shown.
PEAK_FLOPS: dict[str, float] = {
    "NVIDIA H100": 989e12,  # SXM (device kind "NVIDIA H100 80GB HBM3")
    "NVIDIA H100 PCIe": 756e12,
    "NVIDIA H100 NVL": 835e12,
    "NVIDIA H200": 989e12,
    "NVIDIA H200 NVL": 835e12,
    "NVIDIA GH200": 989e12,
    "NVIDIA A100": 312e12,
    "NVIDIA B200": 2250e12,
    "TPU v4": 275e12,
    "TPU v5 lite": 197e12,  # v5e
    "TPU v5": 459e12,  # v5p
    "TPU v6 lite": 918e12,  # v6e (Trillium)
}

#: The data-wait share of an interval from which :attr:`Interval.input_bound` may hold.
INPUT_BOUND = 0.1


def _peak(device_kind: str) -> float | None:
    """The peak FLOP/s of one device of ``device_kind`` in :data:`PEAK_FLOPS`, or None.

    Examples:
        >>> _peak("NVIDIA H100 80GB HBM3"), _peak("TPU v5 lite"), _peak("cpu")
        (989000000000000.0, 197000000000000.0, None)
    """
    starts = [kind for kind in PEAK_FLOPS if device_kind.startswith(kind)]
    return PEAK_FLOPS[max(starts, key=len)] if starts else None


@dataclasses.dataclass(frozen=True)
class Reading:
    """The loop's running host timings at one moment of a fit (see :meth:`FitClock.read`).

    Attributes:
        time: ``time.perf_counter()`` then.
        step: the optimizer steps completed (``loop.step``).
        data_wait: seconds blocked fetching the next batch, since the fit started.
        device_wait: seconds blocked waiting for a step in flight, since the fit started.
        evaluating: seconds spent in ``loop.evaluate``, since the fit started.
    """

    time: float
    step: int
    data_wait: float = 0.0
    device_wait: float = 0.0
    evaluating: float = 0.0


@dataclasses.dataclass(frozen=True)
class Interval:
    """Where the time of the training steps between two readings went.

    Attributes:
        seconds: the wall time between them, evaluations left out.
        steps: the steps taken.
        examples_per_sec: global examples (every process's) per second.
        data_wait: the share (0 to 1) of ``seconds`` the loop was blocked
            fetching its next batch.
        device_wait: the share it was blocked waiting for the devices (a step
            in flight): the time the host had nothing else to do.
        flops_per_sec: the FLOP rate of the whole mesh, the lean step's FLOPs
            (XLA's count) times the steps, over ``seconds``; None when not known.
        mfu: ``flops_per_sec`` over the peak of the mesh's devices (see
            :data:`PEAK_FLOPS`); None when either is not known.
    """

    seconds: float
    steps: int
    examples_per_sec: float
    data_wait: float
    device_wait: float
    flops_per_sec: float | None = None
    mfu: float | None = None

    @property
    def input_bound(self) -> bool:
        """Whether the data held training back: the loop waited for its next
        batch at least :data:`INPUT_BOUND` of the time, and longer than for
        anything else: than for the devices (a wait for data while they
        are busy with the steps in flight costs nothing) and than its own
        work (dispatching steps, callbacks)."""
        rest = 1.0 - self.data_wait - self.device_wait
        return self.data_wait >= INPUT_BOUND and self.data_wait > max(self.device_wait, rest)


def _interval(earlier: Reading, later: Reading, examples_per_step: int, flops_per_step: float | None,
            peak: float | None) -> Interval | None:
    """What the steps between two readings took (None: no step or no time),
    given the global batch size, and the whole mesh's FLOPs per step and peak FLOP/s if known.

    Examples:
        >>> w = _interval(Reading(10.0, 100), Reading(20.0, 300, data_wait=5.0, device_wait=1.0,
        ...             evaluating=2.0), examples_per_step=64, flops_per_step=1e12, peak=1e14)
        >>> w.seconds, w.examples_per_sec, w.data_wait, w.flops_per_sec, w.mfu, w.input_bound
        (8.0, 1600.0, 0.625, 25000000000000.0, 0.25, True)
    """
    steps = later.step - earlier.step
    seconds = (later.time - earlier.time) - (later.evaluating - earlier.evaluating)
    if steps <= 0 or seconds <= 0:
        return None
    flops = None if flops_per_step is None else flops_per_step * steps / seconds
    return Interval(
        seconds=seconds, steps=steps, examples_per_sec=examples_per_step * steps / seconds,
        data_wait=min(max((later.data_wait - earlier.data_wait) / seconds, 0.0), 1.0),
        device_wait=min(max((later.device_wait - earlier.device_wait) / seconds, 0.0), 1.0),
        flops_per_sec=flops, mfu=None if flops is None or not peak else flops / peak)


class FitClock:
    """The host clock of one fit (``loop.clock``): the loop's waits for batches
    and devices, and its evaluations, timed with ``time.perf_counter`` (no host
    sync). A callback takes a :meth:`read` when due and turns two into a
    :class:`Interval` with :meth:`interval`; the loop keeps it, callbacks only read it.

    Args:
        steps: the steps completed now (``lambda: loop.step``).
        examples_per_step: the global batch size (every process's examples).
        devices: the number of devices of the mesh.
        flops: the FLOPs of one lean step on each device (None: not known), called once when needed.
        clock: the time source (seconds), for tests.

    Examples:
        >>> import flaxhooks
        >>> class Speed(flaxhooks.Callback):
        ...     def on_fit_start(self, loop):
        ...         self.start = loop.clock.read()
        ...     def on_fit_end(self, loop):
        ...         self.interval = loop.clock.interval(self.start)
    """

    def __init__(self, steps: Callable[[], int], examples_per_step: int, devices: int, device_kind: str,
                 flops: Callable[[], float | None] = lambda: None,
                 clock: Callable[[], float] = time.perf_counter):
        self.examples_per_step = examples_per_step
        self.devices = devices
        self.device_kind = device_kind
        self._steps = steps
        self._flops = flops
        self._clock = clock
        self._data_wait = self._device_wait = self._evaluating = 0.0
        self._evaluation: float | None = None  # when the evaluation under way started
        self.started = self.read()
        #: The reading once the first step (which waits for compiling) was dispatched.
        self.warm: Reading | None = None

    @classmethod
    def of(cls, loop: Any, flops: Callable[[], float | None], mesh: Any) -> FitClock:
        """The clock of ``loop``, training over ``mesh``."""
        spec = loop.spec
        examples = 0 if spec is None else spec.batch_size * spec.processes
        return cls(lambda: loop.step, examples, mesh.size, mesh.devices.flat[0].device_kind, flops)

    def read(self) -> Reading:
        """The running timings now (a clock read, nothing from the devices)."""
        now = self._clock()
        evaluating = self._evaluating + (0.0 if self._evaluation is None else now - self._evaluation)
        return Reading(now, self._steps(), self._data_wait, self._device_wait, evaluating)

    @functools.cached_property
    def flops_per_step(self) -> float | None:
        """The FLOPs of one lean step over the whole mesh (XLA's count), or None where not counted."""
        try:
            per_device = self._flops()
        except Exception as error:  # a figure is not worth failing a fit for
            _log.debug("the step's FLOPs are not known: %s", error)
            return None
        return None if per_device is None else per_device * self.devices

    @property
    def peak_flops(self) -> float | None:
        """The peak FLOP/s of the whole mesh (:data:`PEAK_FLOPS`), or None."""
        peak = _peak(self.device_kind)
        return None if peak is None else peak * self.devices

    def interval(self, earlier: Reading, later: Reading | None = None) -> Interval | None:
        """The figures of the steps between ``earlier`` and ``later`` (default:
        now), or None: no step between them.

        The fit's first step waits for XLA to compile it: an interval from
        before it starts once the loop went on to fetch the next batch, and
        is None until then."""
        later = later or self.read()
        if earlier.step == self.started.step:
            if self.warm is None or later.time < self.warm.time:
                return None
            earlier = self.warm
        if later.step <= earlier.step:
            return None
        return _interval(earlier, later, self.examples_per_step, self.flops_per_step, self.peak_flops)

    # -- what the loop times (Fit) ---------------------------------------------

    def batches(self, batches: Iterable[_T]) -> Iterator[_T]:
        """``batches``, timing each wait for the next one."""
        iterator = iter(batches)
        while True:
            start = self._clock()
            if self.warm is None and self._steps() > self.started.step:
                self.warm = Reading(start, self._steps(), self._data_wait, self._device_wait,
                                    self._evaluating)
            try:
                batch = next(iterator)
            except StopIteration:
                return
            finally:
                self._data_wait += self._clock() - start
            yield batch

    def device_waits(self, wait: Callable[..., None]) -> Callable[..., None]:
        """``wait`` (for a step in flight), timed."""

        def timed(*args: Any) -> None:
            start = self._clock()
            try:
                wait(*args)
            finally:
                self._device_wait += self._clock() - start

        return timed

    def evaluations(self, evaluate: Callable[..., _T] | None) -> Callable[..., _T] | None:
        """``evaluate``, timed: intervals leave evaluations out."""
        if evaluate is None:
            return None

        def timed(*args: Any, **kwargs: Any) -> _T:
            if self._evaluation is not None:  # one inside another (a handler of its events): timed already
                return evaluate(*args, **kwargs)
            self._evaluation = self._clock()
            try:
                return evaluate(*args, **kwargs)
            finally:
                self._evaluating += self._clock() - self._evaluation
                self._evaluation = None

        return timed
