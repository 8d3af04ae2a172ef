"""The stop protocol: every process of a run stops at one agreed step.

docs/architecture.md ("The stop protocol") walks through it.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax

from flaxhooks.contract import Loop, PeerLost, PeerTimeout, ProcessError, record_of
from flaxhooks.processes._peers import (
    END_GRACE_SECONDS,
    HEARTBEAT_SECONDS,
    Peers,
    abandoned,
    cause_within,
    describe,
    exit_without_shutdown_barrier,
    gone_error,
    mark_abandoned,
    warn_of_a_small_cpu_pool,
)

_log = logging.getLogger("flaxhooks")

#: The agreement of the fit under way on several processes, if any.
_watching: list[AgreedStops] = []


def wait_ready(tree: Any) -> None:
    """Waits until every array in ``tree`` is computed; on several processes a lost peer ends the wait.

    Raises:
        ProcessError: a peer was lost or left the run while this one waited.
    """
    if not _watching:
        jax.block_until_ready(tree)
        return
    stops = _watching[-1]
    for leaf in jax.tree.leaves(tree):
        if isinstance(leaf, jax.Array):
            stops.wait_until_ready(leaf)


def peer_gone(step: int | None = None) -> ProcessError | None:
    """The error naming a peer found lost or gone at ``step`` (default: the last dispatched), or None.

    For waits outside the train step that depend on the other processes (a checkpoint's save).
    """
    if not _watching or _watching[-1].gone is None:
        return None
    return _watching[-1]._gone_error(step)


@dataclasses.dataclass
class _Round:
    """One round of agreement."""

    number: int
    answered: bool = False  # this process posted where it stands
    target: int | None = None  # the step every process stops at
    requested: dict[str, Any] | None = None  # what this process asked for, if it asked
    data_ended: bool = False  # some process asked because its data ran out


class LocalStops:
    """One process: a stop takes effect where it is asked for, errors are raised at once."""

    several = False
    signals: tuple[int, ...] = (signal.SIGINT, signal.SIGTERM)  # handled during the fit

    def start(self, record: Mapping[str, Any], failure: BaseException | None) -> None:
        """Before training: raises ``failure`` (preparing the fit failed), if any."""
        if failure is not None:
            raise failure

    def at_boundary(self, loop: Loop, pulled: bool = False) -> bool:
        """Whether the loop stops at this step boundary."""
        return loop.should_stop

    def may_dispatch(self, loop: Loop) -> bool:
        """Whether the next step may be dispatched."""
        return self.dispatch_through(loop, loop.step + 1) > loop.step

    def dispatch_through(self, loop: Loop, last: int) -> int:
        """The last of the steps after ``loop.step`` up to ``last`` that may be dispatched now
        (``loop.step``: none, stop instead)."""
        return last

    def wait_ready(self, loop: Loop, value: jax.Array) -> None:
        """Waits until ``value`` is computed."""
        value.block_until_ready()

    def data_ended(self, loop: Loop) -> bool:
        """This process's data ran out; True: the epoch ends here."""
        return True

    def defer(self, loop: Loop, error: Exception) -> None:
        """An error in the loop: raised at once."""
        raise error

    def batches(self, loop: Loop, batches: Iterator[Any], zeros: Callable[[], Any]) -> Iterator[Any]:
        """The epoch's device batches, as they are."""
        return batches

    def finish(self, loop: Loop) -> None:
        """The loop ended at its last epoch or step."""

    def failed(self, loop: Loop, error: BaseException) -> BaseException:
        """The error the fit raises for ``error``."""
        return error

    def close(self, loop: Loop, error: BaseException | None) -> None:
        """After the end hooks, with the fit's error if any."""

    def interrupted(self, loop: Loop) -> int | None:
        """The signal that stopped training, if one did."""
        return loop.interrupted


class AgreedStops(LocalStops):
    """Several processes: stops and faults agreed through :class:`Peers`."""

    several = True

    def __init__(self, peers: Peers):
        self.peers = peers
        self.fault: BaseException | None = None  # raised on every process at the agreed step
        # Known equal lengths: epochs end at the same step without a round.
        self._known_lengths = True
        self._round = _Round(0)
        self._dispatched = 0  # the last step this process dispatched
        self._lock = threading.Lock()
        self._advanced = threading.Event()  # a round ended, or the fit did
        self._closed = False
        self._decided = False
        self._signal: int | None = None  # the signal every process agreed on
        self._watcher: threading.Thread | None = None
        #: What the watcher found: processes that left the run, and lost ones.
        self.gone: tuple[dict[int, dict[str, Any]], list[int]] | None = None
        self._leaving: float | None = None  # when this process gave up on the others
        self._preemption = False  # JAX's preemption service runs: it holds SIGTERM
        self._asked = 0  # the last step JAX's preemption sync point was asked about
        self._sync_offset = 0  # step + offset: the id JAX's sync point is asked with
        self._preempted = False  # it answered yes

    # -- start and end -------------------------------------------------------

    def start(self, record: Mapping[str, Any], failure: BaseException | None) -> None:
        """Checks that every process starts the same fit; starts the watcher.

        Raises:
            BatchError: the processes feed batches of different keys, shapes or dtypes or data lengths,
                or one cannot train on its data.
            ProcessError: a process failed before training, or they start
                from different places.
        """
        from flaxhooks.data import BatchError

        mine = dict(record)
        if failure is not None:
            mine.update(error=describe(failure), batch_error=isinstance(failure, BatchError))
        self.peers.post("start", mine)
        try:
            everyone = self.peers.gather("start", "the start of fit")
            for process in range(self.peers.count):  # one that gave up waiting for this one
                self.peers.check(process, "the start of fit")
        except ProcessError as error:
            self.failed_at(record["start"][0] if "start" in record else 0, error)
            raise
        failed = [(i, r) for i, r in enumerate(everyone) if r.get("error")]
        if failed:
            each = "; ".join(f"process {i}: {r['error']}" for i, r in failed)
            if all(r["batch_error"] for _, r in failed):
                raise BatchError(f"a process cannot train on its data ({each})") from failure
            raise ProcessError(f"fit failed before training ({each})", [i for i, _ in failed]) from failure
        for field, problem, hint in _AGREED_AT_START:
            values = [r[field] for r in everyone]
            if len(set(map(json.dumps, values))) > 1:
                each = "; ".join(f"process {i}: {v}" for i, v in enumerate(values))
                error_type = BatchError if field in ("batches", "length") else ProcessError
                raise error_type(f"the processes {problem} ({each}): {hint}")
        if len({r.get("first") for r in everyone}) == 1 and jax.process_index() == 0:
            _log.warning(
                "every process took the same first batch (fingerprint %s): each process feeds its own share "
                "of the global batch, so shard the data by process (grain: ds[jax.process_index()::"
                "jax.process_count()] or ShardByJaxProcess; ArrayLoader shards itself)", everyone[0]["first"])
        self._known_lengths = all(r["length"] is not None for r in everyone)
        self._dispatched = record["start"][0]
        # JAX's ids must grow across fits; a notice before this fit's first
        # ask placed the sync point at the next id, so this ask answers it.
        self._sync_offset = _last_sync_point_id[0] + 1 - self._dispatched
        self._preemption, self._preempted = self._ask_sync_point(self._dispatched)
        if self._preemption:
            self.signals = (signal.SIGINT,)
        self._watcher = threading.Thread(target=self._watch, name="flaxhooks-peers", daemon=True)
        self._watcher.start()
        _watching.append(self)

    def close(self, loop: Loop, error: BaseException | None) -> None:
        """After the end hooks: a fit that fails on one process fails on all.

        Raises:
            ProcessError: this fit ended without error here but failed elsewhere.
        """
        try:
            if abandoned:
                return  # some peer cannot answer
            self.peers.post("end", {"step": loop.step, "error": None if error is None else describe(error)})
            everyone = self.peers.gather("end", "the end of fit")
        finally:
            self._stop_watching()
        failed = [(i, r["error"]) for i, r in enumerate(everyone) if r["error"]]
        if error is None and failed:
            raise ProcessError(
                "fit failed on " + "; ".join(f"process {i}: {e}" for i, e in failed),
                [i for i, _ in failed], loop.step)

    # -- the main thread's checks --------------------------------------------

    def at_boundary(self, loop: Loop, pulled: bool = False) -> bool:
        """Whether the loop stops here; ``pulled``: the next batch is in hand.

        Raises:
            ProcessError: the agreed outcome is a failure.
        """
        if self.gone is not None:
            raise self._gone_error(loop.step)
        if self._decided:
            return True
        if self._preemption and loop.step > self._asked:
            self._preempted = self._ask_sync_point(loop.step)[1]
        if self._preempted and loop.interrupted is None:
            self._preempt(loop)
        current = self._round
        if current.requested is None and (self.fault is not None or loop.should_stop):
            self._request(self._word(loop))
        if not current.answered:
            return False
        if loop.step < self._settle(current):
            return False
        if current.data_ended and current.requested is None and not pulled:
            return False  # first see whether this process's data ran out too
        return self._conclude(loop, current)

    def dispatch_through(self, loop: Loop, last: int) -> int:
        """Called right before steps are dispatched: no further than an agreed stop's step."""
        step = loop.step + 1
        while True:
            with self._lock:
                current = self._round
                if not current.answered or (current.target is not None and step <= current.target):
                    # Answers post the last step dispatched: no process dispatches past the agreed one.
                    self._dispatched = last if current.target is None else min(last, current.target)
                    return self._dispatched
            # The watcher has just answered for this process: settle first.
            if step > self._settle(current) and self._conclude(loop, current):
                return loop.step

    def wait_ready(self, loop: Loop, value: jax.Array) -> None:
        """Waits until ``value`` is computed; a lost peer ends the wait."""
        self.wait_until_ready(value, loop.step)

    def wait_until_ready(self, value: jax.Array, step: int | None = None) -> None:
        """Polls until ``value`` is computed; a lost or gone peer raises its error at ``step``."""
        pause = 1e-4
        # jax.Array.is_ready is public (documented, on every jax.Array) but missing from jax's basearray.pyi.
        while not value.is_ready():  # type: ignore[attr-defined]
            if self.gone is not None:
                raise self._gone_error(step)
            time.sleep(pause)
            pause = min(pause * 2, 2e-3)

    def _gone_error(self, step: int | None = None) -> ProcessError:
        """The error naming the peers found gone, at ``step`` (default: the last dispatched)."""
        assert self.gone is not None
        step = self._dispatched if step is None else step
        error = gone_error(*self.gone, f"at step {step}", step)
        assert error is not None
        return error

    def _peer_error(self, step: int, error: BaseException) -> ProcessError | None:
        """The error naming a lost or gone peer behind ``error``, or None.

        XLA's message does not name the lost process: a runtime error while a
        peer's heartbeat is stale is that peer's loss.
        """
        if self.gone is not None:
            return self._gone_error(step)
        found = cause_within(error, (PeerLost, PeerTimeout))
        if found is not None:  # a copy: raised from ``error``, which holds it
            return found if found is error else type(found)(str(found), found.processes, found.step)
        runtime = cause_within(error, (jax.errors.JaxRuntimeError,))
        if runtime is None:
            return None
        lost = self.peers.lost_now()
        if not lost:
            return None
        which = ", ".join(map(str, lost))
        return PeerLost(
            f"process{'es' if len(lost) > 1 else ''} {which} was lost at step {step} (killed, crashed, or "
            f"its host went down), so training cannot go on. The collective that noticed failed with "
            f"{describe(runtime)}", lost, step)

    def defer(self, loop: Loop, error: Exception) -> None:
        """An error in the loop: kept, to be raised on every process (as a
        :class:`ProcessError` naming this one) at the step they agree to stop at.

        Raises:
            ProcessError: a peer is lost or left the run (or a runtime error
                that its loss explains): no step can be agreed with it, so
                its error is raised at once.
        """
        reported = self._peer_error(loop.step, error)
        if reported is error:
            raise error
        if reported is not None:
            raise reported from error
        if self.fault is None:
            self.fault = error
            _log.error("process %d failed at step %d (%s): every process stops at the step they agree on",
                       self.peers.index, loop.step, error, exc_info=error)
        else:
            _log.error("process %d failed again at step %d: %s", self.peers.index, loop.step, error)

    def batches(self, loop: Loop, batches: Iterator[Any], zeros: Callable[[], Any]) -> Iterator[Any]:
        """The epoch's device batches; data that fails or runs out early is replaced by ``zeros()``."""
        while True:
            try:
                batch = next(batches)
            except StopIteration:
                if self.data_ended(loop):
                    return
                break
            except Exception as error:
                self.defer(loop, error)
                break
            yield batch
        yield from itertools.repeat(zeros())

    def data_ended(self, loop: Loop) -> bool:
        """This process's data ran out; True: the epoch ended here on every process.

        False: another process went on, so this one goes on (with zeros) to
        the agreed step, where training fails everywhere.
        """
        current = self._round
        if self._known_lengths and current.requested is None and not current.answered:
            return True  # the same length everywhere: every process's epoch ends here
        if current.requested is None:
            self._request(self._word(loop, ran_out=True))
        if loop.step < self._settle(current):
            self.fault = self.fault or RuntimeError(
                f"its data ran out at step {loop.step}, before the other processes'")
            return False
        return not self._conclude(loop, current, ran_out=True)

    def finish(self, loop: Loop) -> None:
        """The loop ended at its last epoch or step: agree with the others.

        Raises:
            ProcessError: the agreed outcome is a failure.
        """
        if self.at_boundary(loop):  # a request of this process's, or one under way
            return
        current = self._round
        self._answer(current, {"kind": "end"})
        self._settle(current)
        self._conclude(loop, current)

    def failed(self, loop: Loop, error: BaseException) -> BaseException:
        """An error the loop cannot carry to an agreed step: names a lost peer, or leaves the run."""
        agreed = isinstance(error, ProcessError) and not isinstance(error, (PeerLost, PeerTimeout))
        if agreed and self.gone is None:
            return error  # raised by every process at the agreed step
        error = self._peer_error(loop.step, error) or error
        self.failed_at(loop.step, error)
        return error

    def failed_at(self, step: int, error: BaseException) -> None:
        """This process leaves the run: tells the others, and at exit skips JAX's shutdown barrier."""
        self._leaving = time.monotonic()
        _log.error("process %d leaves the run at step %d: %s", self.peers.index, step, describe(error))
        try:
            self.peers.leave(step, error)
        except Exception:  # noqa: BLE001 - the coordination service may be gone too
            _log.debug("could not tell the other processes", exc_info=True)
        mark_abandoned(describe(error))

    def _ask_sync_point(self, step: int) -> tuple[bool, bool]:
        self._asked = step
        _last_sync_point_id[0] = step + self._sync_offset
        return _ask_preemption_sync_point(_last_sync_point_id[0])

    def _preempt(self, loop: Loop) -> None:
        """Every process reached JAX's preemption sync point: a SIGTERM reached some process."""
        agreed = "the step JAX's preemption sync point agreed on"
        if loop.dispatch_end > loop.step:  # several steps a dispatch: at its end
            agreed = f"the end of the dispatch holding step {loop.step}, {agreed}"
        _log.warning("a preemption notice (SIGTERM) reached the run: every process stops at step %d, %s",
                     loop.dispatch_end if loop.dispatch_end > loop.step else loop.step, agreed)
        record_of(loop).interrupted = signal.SIGTERM
        loop.stop("interrupted by SIGTERM (JAX's preemption sync point)")

    # -- rounds --------------------------------------------------------------

    def interrupted(self, loop: Loop) -> int | None:
        """The signal every process agreed stopped training."""
        return self._signal if self._decided else loop.interrupted

    def _word(self, loop: Loop, ran_out: bool = False) -> dict[str, Any]:
        """What this process has to say about stopping, as of now."""
        if self.fault is not None:
            return {"kind": "error", "error": describe(self.fault)}
        if loop.interrupted is not None:
            return {"kind": "signal", "reason": loop.stop_reason, "signal": loop.interrupted}
        if loop.should_stop:
            return {"kind": "stop", "reason": loop.stop_reason}
        return {"kind": "data_end" if ran_out else "go_on"}

    def _request(self, request: dict[str, Any]) -> None:
        current = self._round
        current.requested = request
        self._answer(current, request)
        self.peers.ring(f"round-{current.number}/trigger")  # wakes every watcher

    def _answer(self, current: _Round, record: Mapping[str, Any]) -> None:
        """Posts the last step this process dispatched, unless it answered ``current`` (or it ended)."""
        with self._lock:  # the main thread's answer and the watcher's: only one is posted
            if self._round is current and not current.answered:
                current.answered = True
                self.peers.post(f"round-{current.number}/answer", {**record, "step": self._dispatched})

    def _settle(self, current: _Round) -> int:
        """The round's target step, once every process answered."""
        if current.target is None:
            answers = self.peers.gather(f"round-{current.number}/answer", "an agreed stop")
            current.target = max(a["step"] for a in answers)
            current.data_ended = any(a["kind"] == "data_end" for a in answers)
        return current.target

    def _conclude(self, loop: Loop, current: _Round, ran_out: bool = False) -> bool:
        """At the target: posts this process's final word, applies everyone's; whether training stops.

        Raises:
            ProcessError: the outcome is a failure.
        """
        # An error or a signal may have come since it answered.
        word = self._word(loop, ran_out=ran_out)
        self.peers.post(f"round-{current.number}/final", {**word, "step": loop.step})
        finals = self.peers.gather(
            f"round-{current.number}/final", f"the agreed stop at step {current.target}")
        if {f["kind"] for f in finals} == {"data_end"} and len({f["step"] for f in finals}) == 1:
            with self._lock:
                self._round = _Round(current.number + 1)
            self._advanced.set()
            return False  # every process's epoch ended at this step
        self._decided = True
        error = _agreed_failure(finals, loop.step, current.data_ended)
        if error is not None:
            if self.fault is not None:
                raise error from self.fault
            raise error
        by_reason: dict[str, list[int]] = {}
        for i, f in enumerate(finals):
            if f["kind"] in ("stop", "signal"):
                by_reason.setdefault(f["reason"], []).append(i)
        reasons = [
            f"{'every process' if len(who) == len(finals) else 'process ' + ', '.join(map(str, who))}: {why}"
            for why, who in by_reason.items()
        ]
        signals = [f["signal"] for f in finals if f["kind"] == "signal"]
        self._signal = signals[0] if signals else None
        if self._signal is not None and loop.interrupted is None:
            _log.warning(
                "%s on another process: every process stops at step %d",
                signal.Signals(self._signal).name, loop.step)
        record = record_of(loop)
        record.interrupted = self._signal
        if reasons:
            record.stop_reason = None  # the same words on every process
            loop.stop("; ".join(reasons))
        return True

    # -- the watcher thread --------------------------------------------------

    def _stop_watching(self) -> None:
        """Ends the watcher: one blocked in the key-value store at exit aborts the process."""
        self._closed = True
        self._advanced.set()
        if self in _watching:
            _watching.remove(self)
        if self._watcher is None:
            return
        # Every process is past its loop: waking the watchers is harmless.
        self.peers.ring(f"round-{self._round.number}/trigger", "end")
        self._watcher.join(timeout=2 * HEARTBEAT_SECONDS)
        self._watcher = None

    def _watch(self) -> None:
        beats = itertools.count()
        while not self._closed:
            current = self._round
            try:
                if self._leaving is not None:
                    self._outlive()
                    return
                self.peers.beat(next(beats))
                left, lost = self.peers.gone()
                if left or lost:
                    self.gone = (left, lost)
                    self._outlive()
                    return
                if current.answered:
                    self._advanced.wait(HEARTBEAT_SECONDS)
                    self._advanced.clear()
                    continue
                if not self.peers.rung(f"round-{current.number}/trigger", HEARTBEAT_SECONDS):
                    continue
            except jax.errors.JaxRuntimeError as error:
                _log.debug("the watcher lost the coordination service: %s", error)
                return
            if self._closed:
                return
            self._answer(current, {"kind": "go_on"})

    def _outlive(self) -> None:
        """A peer is gone or this process left: if ``fit`` has not ended soon after, exit."""
        deadline = (self._leaving or time.monotonic()) + END_GRACE_SECONDS
        while not self._closed and time.monotonic() < deadline:
            time.sleep(0.05)
        if self._closed:
            return
        if self.gone is not None:  # what the main thread would have raised
            error = self._gone_error()
            why = f"{type(error).__name__}: {error}"
        else:
            why = "it left the other processes"
        message = (
            f"flaxhooks: {why}. Process {self.peers.index} is stuck in a collective with a process that "
            f"will never take part, {END_GRACE_SECONDS:g} s later: exiting with status 1"
        )
        print(message, file=sys.stderr, flush=True)
        mark_abandoned(message)
        exit_without_shutdown_barrier()


#: What every process must agree on at the start of a fit: (record field,
#: what differs, what to do about it).
_AGREED_AT_START = (
    ("batches", "feed different batches",
     "every process must feed batches of the same keys, shapes and dtypes"),
    ("length", "have different numbers of batches per epoch",
     "every process must take the same number of steps per epoch"),
    ("start", "start at different steps or data positions",
     "every process must continue from the same state"),
    ("resumed", "resumed from different checkpoints",
     "every process must read the same checkpoint directory (a shared file system)"),
)


def _agreed_failure(
    finals: Sequence[Mapping[str, Any]], step: int, data_round: bool
) -> ProcessError | None:
    """The failure every process raises, from every process's final word, or None."""
    errors = [(i, f["error"]) for i, f in enumerate(finals) if f["kind"] == "error"]
    ran_out = [i for i, f in enumerate(finals) if f["kind"] == "data_end"]
    # In a data round the others tried their next batch: one going on had more data.
    if not errors and data_round and ran_out and any(f["kind"] == "go_on" for f in finals):
        errors = [(i, "its data ran out before the other processes'") for i in ran_out]
    if not errors and len({f["step"] for f in finals}) > 1:
        errors = [(i, f"it ended at step {f['step']}") for i, f in enumerate(finals)]
    if not errors:
        return None
    each = "; ".join(f"process {i}: {e}" for i, e in errors)
    return ProcessError(
        f"training failed on {each} (every process stopped at step {step})", [i for i, _ in errors], step)


#: The last id this process asked JAX's preemption sync point about. Every
#: process asks the same ids: fits start and stop at agreed steps.
_last_sync_point_id = [0]


def _ask_preemption_sync_point(step_id: int) -> tuple[bool, bool]:
    """Whether JAX's preemption service runs, and whether every process reached its sync point."""
    from jax.experimental import multihost_utils

    try:
        return True, multihost_utils.reached_preemption_sync_point(step_id)
    except RuntimeError:  # the service is off: flaxhooks handles SIGTERM itself
        return False, False


def stops_for(timeout: float) -> LocalStops:
    """The agreement a fit needs: local with one process, agreed with several."""
    if jax.process_count() == 1:
        return LocalStops()
    warn_of_a_small_cpu_pool()
    return AgreedStops(Peers(timeout))
