"""The loop context every handler receives: facts it reads, requests it makes."""

from __future__ import annotations

import collections
import dataclasses
import operator
import types
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Generic, NoReturn, TypeVar, overload

import jax

from flaxhooks.contract._clock import FitClock
from flaxhooks.contract._errors import MidDispatchError
from flaxhooks.contract._events import Event, LossRead
from flaxhooks.contract._findings import Finding
from flaxhooks.data import BatchSpec, DataPosition
from flaxhooks.eval import EvalResult, EvalStart
from flaxhooks.placement import host_scalars
from flaxhooks.step import Model, TrainState
from flaxhooks.writers import Writers

_T = TypeVar("_T")

#: The events a callback may emit itself, and the payload each takes.
EMITTABLE: dict[Event, type] = {
    Event.LOSS_READ: LossRead, Event.EVAL_START: EvalStart, Event.EVAL_END: EvalResult,
    Event.FINDING: Finding}


@dataclasses.dataclass(eq=False)
class LoopRecord:
    """What the loop knows, written only by the code that runs the loop; handlers read :class:`Loop`."""

    state: TrainState | None = None
    step: int = 0
    epoch: int = 0
    epoch_step: int = 0
    epoch_done: bool = False
    dispatch_end: int = 0
    data_position: DataPosition | None = None
    max_steps: int | None = None
    max_epochs: int | None = None
    steps_per_epoch: int | None = None
    resumed_from: int | None = None
    batch: Any = None
    metrics: Any = None
    settled_step: int | None = None
    settled_metrics: Any = None
    totals: Any = None
    event: str = ""
    payload: Any = None
    stop_reason: str | None = None
    diverged: int | None = None
    diverged_details: str | None = None
    interrupted: int | None = None
    exception: BaseException | None = None
    published: dict[str, Any] = dataclasses.field(default_factory=dict)
    callbacks: tuple[Any, ...] = ()
    model: Model | None = None
    spec: BatchSpec | None = None
    writers: Writers = dataclasses.field(default_factory=Writers)
    clock: FitClock | None = None
    #: The handler running now, and what the event's handlers asked to run after all of them.
    handling: Any = None
    after: list[tuple[Any, Callable[[Loop], Any]]] = dataclasses.field(default_factory=list)
    requests: collections.deque[Request] = dataclasses.field(
        default_factory=lambda: collections.deque(maxlen=1024))


@dataclasses.dataclass(frozen=True)
class Request:
    """One request a handler made of the loop, as the loop recorded it."""

    kind: str  # "stop", "evaluate", "emit", "mark_diverged" or "replace_state"
    step: int
    event: str  # the event being handled
    by: Any  # the callback that made it (None: the loop's own code)
    detail: str = ""  # the reason, the event emitted, the evaluation's name


class _Fact(property, Generic[_T]):
    """A read-only fact of the loop's record, typed for mypy."""

    def __init__(self, name: str, doc: str) -> None:
        super().__init__(operator.attrgetter(f"_record.{name}"), doc=doc)

    if TYPE_CHECKING:
        @overload
        def __get__(self, loop: None, owner: type | None = None) -> _Fact[_T]: ...
        @overload
        def __get__(self, loop: Loop, owner: type | None = None) -> _T: ...
        def __get__(self, loop: Loop | None, owner: type | None = None) -> _Fact[_T] | _T: ...
        def __set__(self, loop: Loop, value: NoReturn) -> None: ...  # read-only: a callback asks instead


class Loop:
    """What every handler receives: read-only facts about training, and requests it may make.

    Device values (``state``, ``metrics``, ``batch``) stay on the devices: read them only when due.

    Examples:
        >>> import flaxhooks
        >>> loop = flaxhooks.Loop(state=None, step=3)
        >>> loop.step, loop.should_stop
        (3, False)
        >>> loop.stop("enough"); loop.stop_reason
        'enough'
    """

    step = _Fact[int]("step", "Optimizer steps completed, counting a resumed state's.")
    dispatch_end = _Fact[int]("dispatch_end", "The last step of the dispatch that holds the latest step "
                              "(``Trainer(steps_per_dispatch=)``): :attr:`state` is kept where ``loop.step`` "
                              "is ``loop.dispatch_end``.")
    epoch = _Fact[int]("epoch", "The current epoch, from 0 (people read ``loop.epoch + 1``).")
    epoch_step = _Fact[int]("epoch_step", "Batches taken so far in the current epoch.")
    epoch_done = _Fact[bool](
        "epoch_done", "Whether the current epoch's data ran out (set before ``epoch_end``).")
    data_position = _Fact[DataPosition | None](
        "data_position", "Where this process's data stands after the latest step's batch (a "
        ":class:`~flaxhooks.data.DataPosition`), as a checkpoint saves it.")
    max_steps = _Fact[int | None]("max_steps", "The step at which training ends, if bounded by steps.")
    max_epochs = _Fact[int | None]("max_epochs", "The number of epochs, if bounded by epochs.")
    steps_per_epoch = _Fact[int | None](
        "steps_per_epoch", "Batches per epoch when the data has a length, else None.")
    resumed_from = _Fact[int | None]("resumed_from", "On ``fit(resume=True)``, the checkpoint's step (0: "
                                     "none); else None. Writers drop what they logged after it.")
    batch = _Fact[Any]("batch", "The device batch of the current step (``step_start`` / ``step_end``).")
    metrics = _Fact[Any](
        "metrics", "The latest step's metrics, device arrays: reading them waits for the step.")
    settled_step = _Fact[int | None]("settled_step", "The newest step known to have finished on the devices.")
    settled_metrics = _Fact[Any]("settled_metrics", "That step's metrics: reading them does not wait.")
    totals = _Fact[Any]("totals", "Running totals of every step's metrics since ``fit`` started, on the "
                        "devices (``window_means(window_sums(earlier, later))``).")
    event = _Fact[str]("event", "The event being emitted.")
    payload = _Fact[Any]("payload", "That event's data: an ``EvalStart`` or ``EvalResult``, a ``Finding``, "
                         "the error for ``exception``; else None.")
    stop_reason = _Fact[str | None]("stop_reason", "Why training was asked to stop, or None.")
    diverged = _Fact[int | None]("diverged", "The first step whose loss (or a watched value) went "
                                 "non-finite, once a guard stopped training for it; ``fit`` then raises "
                                 "``NonFiniteError``.")
    interrupted = _Fact[int | None]("interrupted", "The signal (SIGINT, SIGTERM) that asked training to "
                                    "stop, or None.")
    exception = _Fact[BaseException | None]("exception", "The error that is ending training, if any.")
    callbacks = _Fact[tuple[Any, ...]](
        "callbacks", "The registered callbacks, in the order their handlers run.")
    model = _Fact[Model | None]("model", "The model adapter (:class:`flaxhooks.step.Model`).")
    spec = _Fact[BatchSpec | None]("spec", "The keys, shapes and dtypes of the training batches.")
    writers = _Fact[Writers]("writers", "The fit's writers (:class:`flaxhooks.writers.Writers`); empty "
                             "without any.")
    clock = _Fact[FitClock | None]("clock", "The fit's host clock (:class:`~flaxhooks.contract.FitClock`); "
                                   "None outside fit.")

    # Set once in __init__, through object.__setattr__.
    _record: LoopRecord
    _bus: Any
    _evaluate: Callable[..., EvalResult] | None
    _replay: Callable[[Any, Any], tuple[Any, ...]] | None
    _published: Mapping[str, Any]
    _host_metrics: tuple[int, dict[str, float]] | None

    def __init__(
        self, state: TrainState | None = None, *, bus: Any = None,
        evaluate: Callable[..., EvalResult] | None = None,
        replay: Callable[[Any, Any], tuple[Any, ...]] | None = None,
        record: LoopRecord | None = None, **facts: Any,
    ):
        record = record or LoopRecord(state=state, **facts)
        object.__setattr__(self, "_record", record)
        object.__setattr__(self, "_bus", bus)
        object.__setattr__(self, "_evaluate", evaluate)
        object.__setattr__(self, "_replay", replay)
        object.__setattr__(self, "_published", types.MappingProxyType(record.published))
        object.__setattr__(self, "_host_metrics", None)

    def __setattr__(self, name: str, value: Any) -> None:
        if name.startswith("_"):
            object.__setattr__(self, name, value)
            return
        raise AttributeError(
            f"loop.{name} cannot be set: a callback reads the loop's facts and asks for changes with "
            "loop.stop(), loop.evaluate(), loop.emit(), loop.after(), loop.publish(), loop.mark_diverged() "
            "or loop.replace_state(); keep your own values on the callback")

    def __repr__(self) -> str:
        return f"Loop(step={self.step}, epoch={self.epoch}, event={self.event!r})"

    @property
    def state(self) -> TrainState:
        """The train state after the latest step (its buffers are donated to the next step: copy what
        you keep; ask for another with :meth:`replace_state`).

        Raises:
            MidDispatchError: the latest step is inside a dispatch of several steps, whose state only its
                last step has.
        """
        self._kept("loop.state")
        return self._record.state  # type: ignore[return-value]

    def _kept(self, what: str) -> None:
        """Raises :class:`MidDispatchError` for ``what`` at a step inside a dispatch of several steps."""
        record = self._record
        if record.step >= record.dispatch_end:
            return
        by = f"{type(record.handling).__name__}: " if record.handling is not None else ""
        raise MidDispatchError(
            f"{by}{what} at step {record.step}, inside a dispatch of several steps (Trainer("
            f"steps_per_dispatch=...)) that keeps only the state after its last step, {record.dispatch_end}: "
            f"define dispatch_ends_at(step) on the callback, True for step {record.step}, so a dispatch ends "
            "there")

    # Facts derived from the others.

    @property
    def should_stop(self) -> bool:
        """Whether something asked training to stop."""
        return self._record.stop_reason is not None

    @property
    def position(self) -> tuple[int, int]:
        """``(epoch, batches into it)`` at which training would go on from here."""
        record = self._record
        return (record.epoch + 1, 0) if record.epoch_done else (record.epoch, record.epoch_step)

    @property
    def published(self) -> Mapping[str, Any]:
        """Results callbacks published for each other (:meth:`publish`), by topic; read-only."""
        return self._published

    @property
    def requests(self) -> tuple[Request, ...]:
        """The requests made during this fit (the latest 1,024), oldest first."""
        return tuple(self._record.requests)

    def host_metrics(self) -> dict[str, float]:
        """The latest step's metrics as Python floats (waits; callbacks of one step share the transfer)."""
        record = self._record
        if record.metrics is None:
            return {}
        if self._host_metrics is None or self._host_metrics[0] != record.step:
            self._host_metrics = (record.step, host_scalars(record.metrics))
        return dict(self._host_metrics[1])

    # Requests.

    def stop(self, reason: str = "stopped by a callback") -> None:
        """Asks the loop to stop after the current event (end hooks still run); the first reason is kept."""
        if not isinstance(reason, str) or not reason:
            raise ValueError(f"loop.stop needs the reason as a non-empty string, got {reason!r}")
        self._note("stop", reason)
        if self._record.stop_reason is None:
            self._record.stop_reason = reason

    def evaluate(self, data: Any, **options: Any) -> EvalResult | None:
        """Evaluates the current state on ``data``, taking and returning what ``Trainer.evaluate`` does."""
        if self._evaluate is None:
            raise RuntimeError("loop.evaluate works during fit, where the loop has a state to evaluate")
        self._kept("loop.evaluate")
        self._note("evaluate", str(options.get("name", "eval")))
        return self._evaluate(data, **options)

    def emit(self, event: Event | str, payload: Any = None) -> None:
        """Emits ``loss_read``, ``eval_start``, ``eval_end`` or ``finding`` with its payload."""
        emitted = next((e for e in EMITTABLE if event in (e, e.value)), None)
        if emitted is None:
            allowed = ", ".join(repr(e.value) for e in EMITTABLE)
            raise ValueError(f"a callback may emit only {allowed}; the loop emits the others")
        if not isinstance(payload, EMITTABLE[emitted]):
            expected = EMITTABLE[emitted].__name__
            raise TypeError(f"{emitted.value} takes a {expected}, got {type(payload).__name__}")
        if self._bus is None:
            raise RuntimeError("this Loop is not attached to a Trainer's callbacks: nobody to emit to")
        if emitted is not Event.LOSS_READ:  # a reading is a fact passed on: it would flood the log
            self._note("emit", emitted.value)
        self._bus.emit(emitted, self, payload)

    def after(self, callback: Any, then: Callable[[Loop], Any]) -> None:
        """Runs ``then(loop)`` once every handler of the current event has run (not if one fails)."""
        if not callable(then):
            raise TypeError(f"loop.after needs a callable, got {then!r}")
        self._record.after.append((callback, then))

    def publish(self, topic: str, value: Any) -> None:
        """Makes a result visible to every other callback as ``loop.published[topic]``."""
        if not isinstance(topic, str) or not topic:
            raise ValueError(f"a published topic is a non-empty string, got {topic!r}")
        self._record.published[topic] = value

    def mark_diverged(self, step: int, reason: str, *, details: str | None = None) -> None:
        """Says training diverged at ``step`` and stops it; ``fit`` raises ``NonFiniteError``.

        Args:
            reason: why training stops, in a few words (the progress summary says it).
            details: the full account ``NonFiniteError`` carries (default: ``reason``).
        """
        record = self._record
        if not isinstance(step, int) or not 0 < step <= record.step:
            raise ValueError(f"a diverged step is one of the steps taken (1 to {record.step}), got {step!r}")
        self._note("mark_diverged", f"step {step}: {reason}")
        if record.diverged is None:
            record.diverged, record.diverged_details = step, details or reason
        self.stop(reason)

    def replace_state(self, state: TrainState) -> None:
        """Hands the next step ``state``, which must match the current one leaf for leaf (and sharding)."""
        record = self._record
        self._kept("loop.replace_state")
        if record.state is not None:
            _check_like(state, record.state)
        self._note("replace_state")
        record.state = state

    def replay(self, batch: Any, contributors: Any) -> tuple[Any, ...]:
        """Runs the step from ``loop.state`` on ``batch`` with ``contributors`` due; returns their results."""
        if self._replay is None:
            raise RuntimeError("loop.replay works during fit")
        self._kept("loop.replay")
        return self._replay(batch, contributors)

    def _note(self, kind: str, detail: str = "") -> None:
        record = self._record
        record.requests.append(Request(kind, record.step, record.event, record.handling, detail))


def record_of(loop: Loop) -> LoopRecord:
    """The record behind ``loop``: for the code that runs the loop, never a callback."""
    return loop._record


def _check_like(new: Any, current: Any) -> None:
    new_leaves, new_tree = jax.tree.flatten(new)
    leaves, tree = jax.tree.flatten(current)
    # jax.tree_util.PyTreeDef aliases a class of jaxlib's compiled extension, which ships no stub.
    if new_tree != tree:  # type: ignore[operator]
        raise ValueError(f"loop.replace_state needs the current state's structure: got {new_tree}, "
                         f"expected {tree}")
    paths = [jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_flatten_with_path(current)[0]]
    for path, a, b in zip(paths, new_leaves, leaves, strict=True):
        if (a.shape, a.dtype) != (b.shape, b.dtype):
            raise ValueError(f"loop.replace_state: state{path} is {a.dtype}{list(a.shape)}, "
                             f"the current one {b.dtype}{list(b.shape)}")
        if getattr(a, "sharding", None) != getattr(b, "sharding", None):
            raise ValueError(f"loop.replace_state: state{path} is placed as {getattr(a, 'sharding', None)}, "
                             f"the current one as {b.sharding}: put it in place first (jax.device_put)")
