"""The processes of one run, as peers talking through JAX's key-value store, with heartbeats.

docs/architecture.md ("The stop protocol") says how they are used.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import json
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import jax

from flaxhooks.contract import PeerLost, PeerTimeout, ProcessError
from flaxhooks.placement import cpu_pool_size, cpu_threads_needed

_log = logging.getLogger("flaxhooks")
_Error = TypeVar("_Error", bound=BaseException)

#: Seconds between a watcher's heartbeats.
HEARTBEAT_SECONDS = 0.5
#: A peer whose heartbeat (from a thread of its own) has not moved for this long is lost.
LOST_AFTER_SECONDS = 4.0
#: How often a process that waits for another says so.
WAIT_NOTE_SECONDS = 5.0
#: After a peer is lost or abandoned, how long ``fit`` may take to end before the
#: process exits (it may be stuck in a collective gloo never fails).
END_GRACE_SECONDS = 4.0

_fits = itertools.count()


def describe(error: BaseException) -> str:
    """``error`` in one line, with its type, as the other processes are told it."""
    return f"{type(error).__name__}: {error}"


def distributed_client() -> Any:
    """JAX's distributed client, reached as orbax reaches it (JAX has no public accessor)."""
    from orbax.checkpoint import multihost

    if not multihost.is_jax_distributed_client_initialized():
        raise RuntimeError(
            "several JAX processes but no distributed client: call jax.distributed.initialize first")
    return multihost.get_jax_distributed_client()


def posted(client: Any, key: str) -> str | None:
    """The value posted under ``key``, or None if there is none yet (never waits)."""
    return next((value for found, value in client.key_value_dir_get(key.rsplit("/", 1)[0] + "/")
                 if found == key), None)


def wait_posted(client: Any, key: str, timeout: float) -> str | None:
    """The value posted under ``key``, waiting up to ``timeout`` seconds; None if none came.

    Raises:
        jax.errors.JaxRuntimeError: the coordination service cannot be reached.
    """
    try:
        return client.blocking_key_value_get(key, max(1, int(1000 * timeout)))
    except jax.errors.JaxRuntimeError:
        # A deadline passed, or the service is gone: a read that does not wait raises only if gone.
        return posted(client, key)


def from_process_zero(name: str, choose: Callable[[], str], timeout: float, what: str) -> str:
    """Process 0's ``choose()`` on every process, the others waiting up to ``timeout`` seconds.

    Raises:
        ProcessError: process 0 gave none in time, or cannot be reached.
    """
    client = distributed_client()
    key = f"flaxhooks/{name}"
    chosen: str | None
    if jax.process_index() == 0:
        chosen = choose()
        client.key_value_set(key, chosen)
        return chosen
    try:
        chosen = wait_posted(client, key, timeout)
    except jax.errors.JaxRuntimeError as error:
        raise ProcessError(f"process {jax.process_index()} cannot reach JAX's coordination service (it runs "
                           f"in process 0) to learn {what}: {error}", [0]) from error
    if chosen is None:
        raise ProcessError(
            f"process {jax.process_index()} waited {timeout:g} s for process 0 to choose {what}", [0])
    return chosen


#: Why this process left its peers, if it did: it then exits without JAX's shutdown barrier.
abandoned: list[str] = []


def exit_without_shutdown_barrier() -> None:
    """At exit, once this process left its peers: ends it at once, without JAX's shutdown barrier."""
    if not abandoned:
        return
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # nothing left to report to
            stream.flush()
    logging.shutdown()
    # jax.distributed.shutdown() would wait at a barrier a lost peer never reaches, then abort.
    os._exit(1)


def mark_abandoned(reason: str) -> None:
    """This process left its peers (for ``reason``): it exits without JAX's shutdown barrier."""
    if not abandoned:
        # Registered after JAX's own shutdown hook, so it runs before it.
        atexit.register(exit_without_shutdown_barrier)
    abandoned.append(reason)


class Peers:
    """This run's processes, reached through JAX's key-value store (JSON under ``<key>/<process>``).

    Args:
        timeout: the longest a process waits for another, in seconds.
    """

    def __init__(self, timeout: float):
        self.client = distributed_client()
        self.index = jax.process_index()
        self.count = jax.process_count()
        self.timeout = timeout
        self.prefix = f"flaxhooks/fit-{next(_fits)}"  # every process calls fit in the same order
        self._seen: dict[int, tuple[str, float]] = {}  # process -> (heartbeat, when it last moved)
        self._lock = threading.Lock()

    def key(self, name: str, process: int | None = None) -> str:
        """Where ``process`` (default: this one) posts its value under ``name``."""
        return f"{self.prefix}/{name}/{self.index if process is None else process}"

    def post(self, name: str, value: Mapping[str, Any]) -> None:
        self.client.key_value_set(self.key(name), json.dumps(value), allow_overwrite=True)

    def gather(self, name: str, what: str) -> list[dict[str, Any]]:
        """Every process's value under ``name``, in process order, waiting up to ``timeout`` in all.

        Raises:
            PeerTimeout: a process did not post in time.
            PeerLost: a process stopped answering while this one waited.
            ProcessError: a process left the run.
        """
        start = time.monotonic()
        noted = start
        values = []
        for process in range(self.count):
            while True:
                waited = time.monotonic() - start
                if waited >= self.timeout:
                    raise PeerTimeout(
                        f"process {self.index} waited {waited:.0f} s for process {process} to reach "
                        f"{what}, and it has not (peer_timeout={self.timeout:g} s: raise it for slower "
                        "processes)", [process])
                try:
                    raw = wait_posted(self.client, self.key(name, process), min(1.0, self.timeout - waited))
                except jax.errors.JaxRuntimeError as error:
                    raise PeerLost(
                        f"process {self.index} cannot reach JAX's coordination service (it runs in "
                        f"process 0) while waiting for {what}: {error}", [0],
                    ) from error
                if raw is not None:
                    values.append(json.loads(raw))
                    break
                self.check(process, what)
                now = time.monotonic()
                if now - noted >= WAIT_NOTE_SECONDS:
                    noted = now
                    _log.warning(
                        "process %d is waiting for process %d to reach %s (%.0f s so far, peer_timeout=%g s)",
                        self.index, process, what, now - start, self.timeout)
        return values

    def check(self, process: int, what: str) -> None:
        """Raises if a process left the run or stopped answering."""
        where = f"while process {self.index} waited for process {process} to reach {what}"
        error = gone_error(*self.gone(), where)
        if error is not None:
            raise error

    def ring(self, name: str, value: str = "1") -> None:
        """Posts ``name`` for every watcher to wake on (the first post stands; a refused one is dropped)."""
        with contextlib.suppress(jax.errors.JaxRuntimeError):
            self.client.key_value_set(f"{self.prefix}/{name}", value)

    def rung(self, name: str, timeout: float) -> bool:
        """Whether ``name`` was rung within ``timeout`` seconds (raises JaxRuntimeError if unreachable)."""
        return wait_posted(self.client, f"{self.prefix}/{name}", timeout) is not None

    def beat(self, count: int) -> None:
        self.client.key_value_set(self.key("alive"), str(count), allow_overwrite=True)

    def leave(self, step: int, error: BaseException) -> None:
        """Tells the others, in place of a heartbeat, that this process leaves the run."""
        record = json.dumps({"left": step, "error": describe(error)})
        self.client.key_value_set(self.key("alive"), record, allow_overwrite=True)

    def _heartbeats(self) -> dict[int, str]:
        """Every process's latest heartbeat, in one read."""
        try:
            entries = self.client.key_value_dir_get(f"{self.prefix}/alive/")
        except jax.errors.JaxRuntimeError:
            return {}
        return {int(key.rsplit("/", 1)[1]): value for key, value in entries}

    def gone(self) -> tuple[dict[int, dict[str, Any]], list[int]]:
        """The processes that left the run (with what they said), and the lost ones.

        Lost: a heartbeat that has not moved for :data:`LOST_AFTER_SECONDS` over the calls so far.
        """
        now = time.monotonic()
        left, lost = {}, []
        with self._lock:
            for process, beat in self._heartbeats().items():
                if process == self.index:
                    continue
                if beat.startswith("{"):
                    left[process] = json.loads(beat)
                    continue
                seen = self._seen.get(process)
                if seen is None or seen[0] != beat:
                    self._seen[process] = (beat, now)
                elif now - seen[1] >= LOST_AFTER_SECONDS:
                    lost.append(process)
        return left, lost

    def lost_now(self, settle: float = 3 * HEARTBEAT_SECONDS) -> list[int]:
        """The processes whose heartbeat does not move over ``settle`` seconds."""
        before = self._heartbeats()
        time.sleep(settle)
        after = self._heartbeats()
        return [p for p, beat in before.items() if p != self.index and after.get(p) == beat]


def gone_error(left: Mapping[int, Mapping[str, Any]], lost: Sequence[int], where: str,
               step: int | None = None) -> ProcessError | None:
    """The error that names the processes that left the run or were lost, or None."""
    if left:
        each = "; ".join(
            f"process {p} left the run at step {r['left']} ({r['error']})" for p, r in left.items())
        return ProcessError(f"{each}, {where}", list(left), step)
    if lost:
        return PeerLost(
            f"process{'es' if len(lost) > 1 else ''} {', '.join(map(str, lost))} was lost {where}: no "
            f"heartbeat for {LOST_AFTER_SECONDS:g} s (killed, crashed, or its host went down), so "
            "training cannot go on", list(lost), step)
    return None


def cause_within(error: BaseException | None, kinds: tuple[type[_Error], ...]) -> _Error | None:
    """The first exception of ``kinds`` in ``error``'s chain of causes, or None."""
    for _ in range(6):  # a bounded walk: chains may loop
        if error is None or isinstance(error, kinds):
            return error
        error = error.__cause__ or error.__context__
    return None


_warned_of_pool: list[bool] = []


def warn_of_a_small_cpu_pool() -> None:
    """Warns once if this process's XLA:CPU thread pool is too small for collectives across processes."""
    devices = jax.local_devices()
    if _warned_of_pool or devices[0].platform != "cpu" or len(devices) == 1:
        return
    pool, needed = cpu_pool_size(len(devices)), cpu_threads_needed(len(devices))
    if pool < needed:
        _warned_of_pool.append(True)
        _log.warning(
            "XLA's CPU client runs this process's %d devices on a pool of %d threads, too few for "
            "collectives across processes: a step can deadlock. Set PJRT_NPROC=%d in the environment before "
            "JAX starts (flaxhooks.use_cpu_devices(..., across_processes=True) does it)",
            len(devices), pool, needed)
