"""Checkpoints with orbax: atomic, the last K kept, checksummed, with every callback's state."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import json
import logging
import os
import threading
import time
import warnings
import zlib
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from flaxhooks.callbacks._data_positions import (
    DATA_ITEM,
    gather_positions,
    loader_states_args,
    post_position,
    read_positions,
    split_positions,
)
from flaxhooks.core import (
    WAIT_NOTE_SECONDS,
    Callback,
    Every,
    Loop,
    PeerLost,
    ProcessError,
    as_every,
    distributed_client,
    peer_gone,
)
from flaxhooks.data import DataPosition, device0_copy
from flaxhooks.writers import check_writable

if TYPE_CHECKING:
    from flaxhooks.core import FitPlan
    from flaxhooks.step import TrainState

_log = logging.getLogger("flaxhooks")

#: Bumped when the layout of what is saved changes. A state whole on process
#: 0 is saved in format 1: each leaf whole, with one CRC32.
FORMAT = 1
#: A state split across processes is saved in format 2: every process writes
#: its parts of each leaf, and each part has its own CRC32 (``"parts"``:
#: ``{"index": [[start, stop], ...], "crc32": ...}``, together covering the
#: leaf once).
FORMAT_PARTS = 2

#: Numbers each fit's saves on several processes; every process runs the
#: same callbacks' ``fit_start`` in the same order, so the numbers agree.
_exchanges = itertools.count()


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written, read, or used for this model."""


class CheckpointConflictError(CheckpointError):
    """A fresh run's checkpoint directory holds another run's later checkpoints.

    Attributes:
        directory: the checkpoint directory.
        steps: the steps of the other run's checkpoints after this run's start.
        start: the step this run starts from.
    """

    def __init__(self, directory: str, steps: Sequence[int], start: int):
        self.directory, self.steps, self.start = directory, list(steps), start
        super().__init__(
            f"{directory!r} holds checkpoints of another run (steps {self.steps}) beyond this run's start at "
            f"step {start}: pass resume=True to go on from them, or use another directory"
        )


class CheckpointMismatchError(CheckpointError):
    """A checkpoint holds a train state of another shape than this model and
    optimizer make: the model or the optimizer changed since it was saved.

    Attributes:
        path: the checkpoint read.
        difference: what differs, e.g. ``.params['Dense_0']['kernel'] is
            float32[32, 10] there and float32[64, 10] here``.
    """

    def __init__(self, path: str, difference: str):
        self.path, self.difference = path, difference
        super().__init__(
            f"the checkpoint {path!r} does not fit this model and optimizer: {difference}. The model or "
            "the optimizer changed since it was saved: train this one in another directory, or resume "
            "with the ones that saved it"
        )


class CheckpointWarning(UserWarning):
    """A checkpoint was skipped: unreadable on restore, or a non-finite state on save."""


def state_leaves(state: Any) -> list[tuple[str, Any]]:
    """The leaves of a train state by key path, e.g. ``.params['Dense_0']['kernel']``.

    Only pytree leaves: the static optimizer (``tx``) is not saved, and
    per-step collections never live in the state.
    """
    flat, _ = jax.tree_util.tree_flatten_with_path(state)
    return [(jax.tree_util.keystr(path), leaf) for path, leaf in flat]


def callback_keys(callbacks: Sequence[Callback]) -> dict[str, Callback]:
    """A stable name per callback: its class name, with ``#i`` for the i-th repeat."""
    keys: dict[str, Callback] = {}
    seen: dict[str, int] = {}
    for callback in callbacks:
        name = type(callback).__name__
        count = seen.get(name, 0)
        seen[name] = count + 1
        keys[name if count == 0 else f"{name}#{count}"] = callback
    return keys


def _shown(path: str) -> str:
    """``path`` as a person typed it: relative to the working directory when inside it."""
    relative = os.path.relpath(path)
    return path if relative.startswith("..") else relative


def _checksum(array: np.ndarray) -> int:
    return zlib.crc32(np.ascontiguousarray(array).reshape(-1).view(np.uint8).data)


@dataclasses.dataclass(frozen=True)
class Restored:
    """A checkpoint read back and verified, not yet tied to a model.

    Attributes:
        step: the optimizer steps the saved state had taken.
        position: ``(epoch, batches into it)`` where training goes on.
        leaves: the state's arrays by key path (see :func:`state_leaves`).
        callbacks: each callback's saved state, by :func:`callback_keys` name.
        path: the checkpoint's directory.
        stop_reason: why the saved run had decided to stop, if it had.
        data: every process's data position at the save, loader states
            included, in process order (None: a checkpoint of 0.7 or older).
    """

    step: int
    position: tuple[int, int]
    leaves: Mapping[str, np.ndarray]
    callbacks: Mapping[str, Any]
    path: str
    stop_reason: str | None = None
    data: tuple[DataPosition, ...] | None = None

    def train_state(self, like: TrainState) -> TrainState:
        """The saved arrays in the structure of ``like`` (abstract or concrete).

        Raises:
            CheckpointError: the model or optimizer state has other leaves,
                shapes or dtypes than the saved one.
        """
        flat, treedef = jax.tree_util.tree_flatten_with_path(like)
        paths = [jax.tree_util.keystr(path) for path, _ in flat]
        missing = [p for p in paths if p not in self.leaves]
        unexpected = sorted(set(self.leaves) - set(paths))
        if missing or unexpected:
            raise CheckpointMismatchError(self.path, _leaf_difference(missing, unexpected))
        for path, (_, leaf) in zip(paths, flat, strict=True):
            saved = self.leaves[path]
            if saved.shape != jnp.shape(leaf) or saved.dtype != jnp.result_type(leaf):
                raise CheckpointMismatchError(self.path, (
                    f"{path} is {saved.dtype}{list(saved.shape)} there and "
                    f"{jnp.result_type(leaf)}{list(jnp.shape(leaf))} here"))
        return jax.tree_util.tree_unflatten(treedef, [self.leaves[p] for p in paths])

    def load_callbacks(self, callbacks: Sequence[Callback]) -> None:
        """Gives each callback its saved state (``load_state_dict``)."""
        keyed = callback_keys(callbacks)
        for key, state in self.callbacks.items():
            callback = keyed.get(key)
            if callback is None:
                _log.warning("the checkpoint holds state for %s, which this Trainer lacks: ignored", key)
                continue
            try:
                callback.load_state_dict(state)
            except Exception as error:
                raise CheckpointError(
                    f"{callback!r} cannot load its state from {self.path!r}: {type(error).__name__}: {error}"
                ) from error


def _whole_on_process_0(leaf: Any) -> bool:
    """Whether process 0's devices hold every part of ``leaf`` (replicated, or
    split only over devices that process 0 has a copy on)."""
    sharding = getattr(leaf, "sharding", None)
    if sharding is None or sharding.is_fully_replicated or sharding.is_fully_addressable:
        return True
    where = sharding.devices_indices_map(tuple(leaf.shape))

    def part(index: tuple[slice, ...]) -> tuple[Any, ...]:
        return tuple((s.start, s.stop) for s in index)

    return {part(i) for i in where.values()} <= {part(i) for d, i in where.items() if d.process_index == 0}


@dataclasses.dataclass(frozen=True)
class _Parts:
    """A leaf split over devices, as copies of the parts this process holds."""

    shape: tuple[int, ...]
    dtype: Any
    parts: tuple[tuple[tuple[slice, ...], jax.Array], ...]

    def host(self) -> np.ndarray:
        whole = np.empty(self.shape, self.dtype)
        for index, data in self.parts:
            whole[index] = np.asarray(data)
        return whole


def _snapshot(x: jax.Array) -> Any:
    """A copy of a state leaf that process 0 alone can take and read, with no
    collective: a replicated leaf's local copy, else the parts its devices hold."""
    if x.is_fully_replicated:
        return jnp.copy(device0_copy(x))
    if jax.process_count() == 1:
        return jnp.copy(x)
    seen: dict[Any, tuple[slice, ...]] = {}
    for shard in x.addressable_shards:
        seen.setdefault(tuple((s.start, s.stop) for s in shard.index), shard)
    return _Parts(tuple(x.shape), x.dtype, tuple((s.index, jnp.copy(s.data)) for s in seen.values()))


def _global_snapshot(x: jax.Array) -> jax.Array:
    """A copy of a state leaf that every process takes of its own devices, with
    no collective: a replicated leaf's local copy, else the same global array
    made of copies of this process's shards (every process must take its own)."""
    if x.is_fully_replicated:
        return jnp.copy(device0_copy(x))
    copies = [jnp.copy(shard.data) for shard in x.addressable_shards]
    return jax.make_array_from_single_device_arrays(x.shape, x.sharding, copies)


def _bounds(index: tuple[slice, ...], shape: tuple[int, ...]) -> list[list[int]]:
    """A shard's index as ``[[start, stop], ...]``, one pair per dimension."""
    return [list(s.indices(n)[:2]) for s, n in zip(index, shape, strict=True)]


def _host(x: Any) -> np.ndarray:
    return x.host() if isinstance(x, _Parts) else np.asarray(jax.device_get(x))


def _verified(array: np.ndarray, info: Mapping[str, Any], format: int) -> bool:
    """Whether ``array`` has the CRC32 saved with it: whole (format 1), or of
    each part, the parts covering it once (format 2)."""
    if format == FORMAT:
        return _checksum(array) == info["crc32"]
    covered = 0
    for part in info["parts"]:
        index = tuple(slice(start, stop) for start, stop in part["index"])
        covered += int(np.prod([stop - start for start, stop in part["index"]]))
        if len(index) != array.ndim or _checksum(array[index]) != part["crc32"]:
            return False
    return covered == array.size


def _leaf_difference(missing: Sequence[str], unexpected: Sequence[str]) -> str:
    """What a checkpoint lacks and holds beyond a train state, a few of each."""
    def few(paths: Sequence[str]) -> str:
        more = f" and {len(paths) - 3} more" if len(paths) > 3 else ""
        return ", ".join(paths[:3]) + more

    parts = ([f"this train state has {few(missing)}, which it lacks"] if missing else []) + (
        [f"it holds {few(unexpected)}, which this train state lacks"] if unexpected else [])
    return "; ".join(parts)


def _this_process_only() -> Any:
    """orbax options under which this process reads or writes alone: no
    orbax barrier, which would wait for (and time out on) slower processes."""
    import orbax.checkpoint as ocp

    index = jax.process_index()
    return ocp.options.MultiprocessingOptions(primary_host=index, active_processes={index})


def _every_process(prefix: str) -> Any:
    """orbax options under which every process writes its part and process 0
    commits. Naming the processes makes each orbax barrier a wait in JAX's
    key-value store with a timeout (``get_barrier_sync_fn``), never
    ``sync_global_devices``, a compiled collective that a background thread
    could interleave with the train step's (a deadlock)."""
    import orbax.checkpoint as ocp

    return ocp.options.MultiprocessingOptions(
        primary_host=0, active_processes=set(range(jax.process_count())), barrier_sync_key_prefix=prefix,
    )


def _writer(directory: str, keep: int, every_process: str | None = None) -> Any:
    """orbax's manager of ``directory``: process 0 alone writes, or with
    ``every_process`` (a barrier prefix the processes agree on) every process
    writes its part."""
    import orbax.checkpoint as ocp

    options = ocp.CheckpointManagerOptions(
        # The step's temporary directories are made by process 0 between two
        # of orbax's key-value barriers (``atomicity.create_all``), never
        # "asynchronously": then the other processes would wait for a signal
        # keyed by orbax's per-process count of saves
        # (``awaitable_signals_contract_<n>``), and that count differs between
        # processes once process 0 saved alone (format 1, an earlier fit): a
        # process could read a stale signal and write its part before the
        # directory exists, or into one process 0 then replaces. orbax 0.12.8
        # already turns this off without async checkpointing; said here so
        # that it stays off.
        async_options=ocp.options.AsyncOptions(create_directories_asynchronously=False),
        max_to_keep=keep,
        create=False,  # made (and checked) by Checkpoint itself
        # A save killed halfway leaves a temporary directory that was never
        # renamed into place; it is removed when the next writer opens.
        cleanup_tmp_directories=True,
        enable_async_checkpointing=False,  # saves already run on their own thread
        multiprocessing_options=(
            _this_process_only() if every_process is None else _every_process(every_process)),
    )
    return ocp.CheckpointManager(directory, options=options)


class _Background:
    """``fn(*args)`` running on a daemon thread of its own.

    A thread pool's threads are joined before the interpreter exits, so one
    stuck reading a state that can never be computed (a lost process) would
    keep the process alive. A daemon thread must instead be joined once done:
    one still unwinding orbax's native state when the interpreter exits
    aborts the process.
    """

    def __init__(self, fn: Any, *args: Any):
        self._future: concurrent.futures.Future[None] = concurrent.futures.Future()

        def run() -> None:
            try:
                self._future.set_result(fn(*args))
            except BaseException as error:
                self._future.set_exception(error)

        self._thread = threading.Thread(target=run, name="flaxhooks-checkpoint", daemon=True)
        self._thread.start()

    def done(self) -> bool:
        return self._future.done()

    def result(self, timeout: float | None = None) -> bool:
        """Waits up to ``timeout``; False if still running, else its result (or error)."""
        try:
            self._future.exception(timeout)
        except concurrent.futures.TimeoutError:
            return False
        self._thread.join()
        self._future.result()
        return True


class Checkpoint(Callback):
    """Saves the train state and every callback's state with orbax, and restores
    the latest good checkpoint for ``Trainer.fit(..., resume=True)`` (it is the
    fit's :class:`~flaxhooks.core.Restorer`).

    Saves are atomic, checksummed, never of a non-finite state, and written on a
    background thread; on several processes the directory must be shared. The
    README ("Checkpoints, resuming, and interruption", "Several hosts") has the
    details.

    Args:
        directory: where checkpoints go (one subdirectory per step); checked
            for writing at once.
        every: save every this many steps (or an ``Every``); None: only at
            epoch ends and at the end.
        at_epoch_end: save when an epoch's data runs out.
        keep: how many of the latest checkpoints to keep.

    Example:
        >>> import tempfile, flaxhooks
        >>> checkpoint = flaxhooks.Checkpoint(tempfile.mkdtemp(), every=500, keep=3)
        >>> checkpoint.saved_steps()
        []
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        every: Every | int | None = None,
        at_epoch_end: bool = True,
        keep: int = 3,
    ):
        if keep < 1:
            raise ValueError(f"keep must be at least 1, got {keep}")
        self.directory = os.path.abspath(os.fspath(directory))
        check_writable(self.directory, "checkpoints", CheckpointError)
        self.every = None if every is None else as_every(every)
        self.at_epoch_end = at_epoch_end
        self.keep = keep
        #: Steps whose state was not saved because it was not finite.
        self.skipped_steps: list[int] = []
        self._writer: Any = None
        self._across = False  # the fit's state is split across processes: every process writes
        self._exchange = ""  # where this fit's processes agree on each save (JAX's key-value store)
        self._saving: _Background | None = None
        # The step of the save in progress, and whose part it waits for (as
        # its thread last said): for a main thread that waits for it.
        self._saving_step: int | None = None
        self._waiting_for = "the other processes' parts"
        self._due = False
        self._saved_step: int | None = None
        self._boundary: int | None = None  # the last step whose events all ran

    def __repr__(self) -> str:
        return f"Checkpoint({self.directory!r}, every={self.every!r}, keep={self.keep})"

    # -- reading -------------------------------------------------------------

    def saved_steps(self) -> list[int]:
        """The steps of the complete checkpoints on disk, oldest first.

        A save still in progress, or killed halfway, is in a temporary
        directory that does not count until renamed to its step.
        """
        try:
            names = os.listdir(self.directory)
        except FileNotFoundError:
            return []
        except OSError as error:
            raise CheckpointError(f"cannot list the checkpoints in {self.directory!r}: {error}") from error
        directory = self.directory
        return sorted(int(name) for name in names if name.isdigit() and os.path.isdir(f"{directory}/{name}"))

    def restore_latest(self) -> Restored | None:
        """Reads the newest checkpoint that reads back and verifies.

        Returns:
            None when there is no checkpoint at all.

        Raises:
            CheckpointError: there are checkpoints, but none can be read.
        """
        steps = self.saved_steps()
        if not steps:
            return None
        failures = []
        for step in reversed(steps):
            try:
                return self._read(step)
            except (TimeoutError, jax.errors.JaxRuntimeError):
                raise  # waiting or the runtime failed: the checkpoint itself may be fine
            except (CheckpointError, ValueError, OSError, KeyError, IndexError, TypeError) as error:
                # Corrupted, truncated, or not ours. (Anything else is a fault
                # of the reader, never a reason to set a checkpoint aside.)
                failures.append(f"step {step}: {type(error).__name__}: {error}")
                warnings.warn(
                    f"the checkpoint at step {step} in {self.directory!r} cannot be restored "
                    f"({type(error).__name__}: {error}); trying the one before it",
                    CheckpointWarning, stacklevel=2,
                )
        raise CheckpointError(
            f"no checkpoint in {self.directory!r} can be restored:\n  " + "\n  ".join(failures)
        )

    def _read(self, step: int) -> Restored:
        import orbax.checkpoint as ocp

        path = os.path.join(self.directory, str(step))
        # Every process reads on its own: a slower process (one that starts
        # late) never makes another's read time out. Each leaf is read whole,
        # as host numpy, whoever wrote its parts (format 2): onto any mesh.
        alone = _this_process_only()
        handler = ocp.CompositeCheckpointHandler(
            state=ocp.PyTreeCheckpointHandler(multiprocessing_options=alone),
            meta=ocp.JsonCheckpointHandler(multiprocessing_options=alone),
        )
        with ocp.Checkpointer(handler, multiprocessing_options=alone) as checkpointer:
            meta = checkpointer.restore(path, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta
            if meta.get("format") not in (FORMAT, FORMAT_PARTS) or meta.get("step") != step:
                raise CheckpointError(
                    f"{path!r} is not a flaxhooks checkpoint of format {FORMAT} or {FORMAT_PARTS} for "
                    f"step {step}"
                )
            as_numpy = {str(i): ocp.RestoreArgs(restore_type=np.ndarray)
                        for i, info in enumerate(meta["leaves"]) if np.prod(info["shape"])}
            arrays = checkpointer.restore(path, args=ocp.args.Composite(
                state=ocp.args.PyTreeRestore(restore_args=as_numpy))).state if as_numpy else {}
        leaves = {}
        for index, info in enumerate(meta["leaves"]):
            shape, dtype = tuple(info["shape"]), jnp.dtype(info["dtype"])
            array = np.asarray(arrays[str(index)]) if np.prod(shape) else np.zeros(shape, dtype)
            if array.shape != shape or array.dtype != dtype or not _verified(array, info, meta["format"]):
                raise CheckpointError(
                    f"{info['path']} does not match the shape, dtype and checksum saved with it"
                )
            leaves[info["path"]] = array
        return Restored(step, (meta["epoch"], meta["epoch_step"]), leaves, meta["callbacks"], path,
                        meta["stop_reason"], read_positions(path, meta.get("data")))

    # -- writing -------------------------------------------------------------

    def check_fit(self, plan: FitPlan) -> None:
        """Refuses a directory that cannot be written, or that holds another
        run's checkpoints beyond this run's start (on every process: none goes
        on alone); checkpoints a resume found unreadable are not another run's."""
        if jax.process_index() == 0:
            check_writable(self.directory, "checkpoints", CheckpointError)
        later = [s for s in self.saved_steps() if s > plan.step]
        if later and plan.resumed_from != plan.step:
            raise CheckpointConflictError(self.directory, later, plan.step)

    def on_fit_start(self, loop: Loop) -> None:
        self._due = False
        # A state that process 0 does not hold whole: every process writes its part.
        self._across = jax.process_count() > 1 and not all(
            _whole_on_process_0(leaf) for _, leaf in state_leaves(loop.state))
        self._exchange = f"flaxhooks/checkpoint-{next(_exchanges)}"
        self._boundary = loop.step
        self._set_aside_unreadable(loop.step)
        self._saved_step = loop.step if loop.step in self.saved_steps() else None
        self._writer = None  # opened afresh: its list of steps may be stale

    def _set_aside_unreadable(self, step: int) -> None:
        """Checkpoints after a resumed run's start are ones the resume could not
        read (:meth:`check_fit` refused any other): set aside as ``unreadable-<step>``."""
        if jax.process_index() != 0:
            return
        for unreadable in [s for s in self.saved_steps() if s > step]:
            aside = os.path.join(self.directory, f"unreadable-{unreadable}-{time.time_ns()}")
            os.replace(os.path.join(self.directory, str(unreadable)), aside)
            _log.warning("set the unreadable checkpoint at step %d aside as %s", unreadable, aside)

    def on_step_start(self, loop: Loop) -> None:
        self._raise_failed_save()

    # Saves happen once every handler of the event has run (loop.after), so
    # the saved callbacks' state matches the saved parameters, whatever the
    # callbacks' order.

    def on_step_end(self, loop: Loop) -> None:
        due = self.every is not None and self.every(loop.step)
        loop.after(self, lambda loop: self._step_done(loop, due))

    def _step_done(self, loop: Loop, due: bool) -> None:
        self._due = self._due or due
        if loop.epoch_step == loop.steps_per_epoch:
            return  # an epoch's last step is done once its epoch_end is
        self._boundary = loop.step
        if self._due:
            self._save(loop)

    def on_epoch_end(self, loop: Loop) -> None:
        if loop.exception is None:
            loop.after(self, self._epoch_done)

    def _epoch_done(self, loop: Loop) -> None:
        self._boundary = loop.step
        if self._due or (self.at_epoch_end and loop.epoch_done):
            self._save(loop)

    #: Seconds to wait for a save in progress at the end of a failed fit:
    #: the state it copies may come from a step that never finishes (a lost
    #: process), and the checkpoints before it stay intact.
    FAILING_WAIT_SECONDS = 30.0
    #: The same after a lost process: its state is never coming, and the
    #: process must exit soon (``flaxhooks.PeerLost``).
    LOST_PEER_WAIT_SECONDS = 1.0

    def on_fit_end(self, loop: Loop) -> None:
        # The last state, also when stopped early or interrupted: Ctrl-C and
        # signals stop at a step boundary; a KeyboardInterrupt raised anywhere
        # else is saved too if the state it left is whole.
        if loop.exception is None:
            loop.after(self, self._fit_done)
            return
        if isinstance(loop.exception, KeyboardInterrupt):
            self._save(loop)
        self._fit_done(loop)

    def _fit_done(self, loop: Loop) -> None:
        failed = loop.exception is not None and not isinstance(loop.exception, KeyboardInterrupt)
        if loop.exception is None:
            self._save(loop)
        lost = isinstance(loop.exception, PeerLost)
        wait = self.LOST_PEER_WAIT_SECONDS if lost else self.FAILING_WAIT_SECONDS if failed else None
        # Failing already: a peer lost meanwhile ends the wait, and the error
        # that ends the fit stays the first one.
        if self._wait(wait, step=loop.step, raise_lost=loop.exception is None):
            self._close_writer()  # each fit opens its own: nothing left behind between fits
        else:
            _log.warning(
                "the checkpoint save in progress did not finish %s; the checkpoints %s are intact",
                "before a process was lost" if wait is None else f"within {wait:g} s of the failure",
                self.saved_steps(),
            )

    def _close_writer(self) -> None:
        writer, self._writer = self._writer, None
        if writer is not None:
            writer.close()

    def wait(self, timeout: float | None = None) -> bool:
        """Waits for the save in progress, if any.

        Args:
            timeout: the longest to wait, in seconds (None: until it is done).

        Returns:
            Whether no save is in progress any more.

        Raises:
            CheckpointError: it failed.
            ProcessError: during a fit whose state is split across
                processes, a peer was lost (:class:`~flaxhooks.PeerLost`) or
                left the run while this process waited for its part.
        """
        return self._wait(timeout)

    def _wait(self, timeout: float | None, step: int | None = None, raise_lost: bool = True) -> bool:
        """:meth:`wait`; with ``raise_lost`` False a lost peer ends the wait
        (False) instead of raising. ``step``: where the loop is, for the error."""
        saving = self._saving
        if saving is None:
            return True
        try:
            if not self._finished(saving, timeout, step, raise_lost):
                return False
        except ProcessError:
            raise
        except Exception as error:
            raise CheckpointError(
                f"saving a checkpoint to {self.directory!r} failed: {type(error).__name__}: {error}; "
                f"the earlier checkpoints {self.saved_steps()} are intact"
            ) from error
        finally:
            if saving.done():
                self._saving = None
        return True

    def _finished(
        self, saving: _Background, timeout: float | None, step: int | None, raise_lost: bool
    ) -> bool:
        """Waits up to ``timeout`` for ``saving``; whether it finished.

        A save of a state split across processes waits for the others (for
        their word, and at orbax's barriers, which time out only after
        minutes): the main thread then polls, so that a peer lost meanwhile
        ends the wait with the loop's own :class:`~flaxhooks.PeerLost` (not
        the process's end, seconds later, for being stuck), and says whom it
        waits for when that takes long.
        """
        if jax.process_count() == 1:  # waits for no other process
            return saving.result(timeout)
        start = noted = time.monotonic()
        while True:
            left = None if timeout is None else timeout - (time.monotonic() - start)
            if saving.result(0.1 if left is None else max(0.0, min(0.1, left))):
                return True
            if left is not None and left <= 0.1:
                return False
            gone = peer_gone(step)
            if gone is not None:
                if raise_lost:
                    raise gone
                return False
            now = time.monotonic()
            if now - noted >= WAIT_NOTE_SECONDS:
                noted = now
                _log.warning(
                    "process %d is waiting for %s of the checkpoint at step %s (%.0f s so far)",
                    jax.process_index(), self._waiting_for, self._saving_step, now - start,
                )

    def _raise_failed_save(self) -> None:
        if self._saving is not None and self._saving.done():
            self.wait()

    def _save(self, loop: Loop) -> None:
        self._due = False
        state, (epoch, epoch_step), step = loop.state, loop.position, loop.step
        if jax.process_index() != 0:  # process 0 writes every process's data position
            post_position(distributed_client(), self._exchange, step, loop.data_position)
            if not self._across:
                return
        if step == self._saved_step:
            return  # saved (or being saved) already: never declined after the others agreed to save it
        if loop.diverged is not None:
            # The guard kept the state from before the non-finite step: it is not this step's.
            _log.info("not saving step %d: training diverged at step %d", step, loop.diverged)
            self._decline(step, f"training diverged at step {loop.diverged}")
            return
        if any(leaf.is_deleted() for leaf in jax.tree.leaves(state)):
            _log.warning("step %d's state was consumed by an interrupted step: not saved", step)
            self._decline(step, "its state was consumed by an interrupted step")
            return
        if loop.exception is not None and not self._at_boundary(loop):
            self._decline(step, "it was interrupted inside a step")
            return
        meta = {
            "format": FORMAT,
            "step": step,
            "epoch": epoch,
            "epoch_step": epoch_step,
            "time": time.time(),
            # A run that decided to stop (early stopping) stays stopped on resume.
            "stop_reason": loop.stop_reason if loop.interrupted is None else None,
            "callbacks": self._callback_states(loop),
        }
        self._wait(None, step=step)  # one save at a time
        # The next step donates the original. Split across processes, every
        # process copies its own shards, at the same step as the others.
        copy = jax.tree.map(_global_snapshot if self._across else _snapshot, state)
        # The TensorBoard logs up to this step reach the disk before the
        # checkpoint commits: a resumed run re-logs only what comes after it.
        logs_synced = loop.writers.sync_point()
        # Where the processes agree on this save (None: process 0 alone), fixed now.
        exchange = self._exchange if self._across else None
        self._saving_step, self._waiting_for = step, "the other processes' parts"
        self._saving = _Background(self._write, step, copy, meta, logs_synced, exchange, loop.data_position)
        self._saved_step = step

    def _decline(self, step: int, why: str) -> None:
        """Split across processes: tells the others this process does not save
        ``step`` (none commits it), so that none waits for its part."""
        if self._across:
            index, base = jax.process_index(), f"{self._exchange}/{step}"
            report = json.dumps({"declined": f"process {index}: {why}"})
            # Overwriting: a step can be declined twice (at the interrupted
            # step's end and at the fit's); never one this process saves.
            client = distributed_client()
            client.key_value_set(f"{base}/report/{index}", report, allow_overwrite=True)
            if index == 0:
                client.key_value_set(f"{base}/decision", report, allow_overwrite=True)

    def _at_boundary(self, loop: Loop) -> bool:
        """Whether a KeyboardInterrupt raised anywhere left a state that can
        be saved: every event of its step ran, and no later step was
        dispatched. Otherwise the resumed run could not be exact."""
        device_step = int(jax.device_get(device0_copy(loop.state.step)))
        if self._boundary == loop.step == device_step:
            return True
        _log.warning(
            "interrupted inside step %d's work: not saved (the latest checkpoint: step %s)",
            max(loop.step, device_step), max(self.saved_steps(), default=None),
        )
        return False

    def _callback_states(self, loop: Loop) -> dict[str, Any]:
        states = {}
        for key, callback in callback_keys(loop.callbacks).items():
            state = callback.state_dict()
            if state is None:
                continue
            try:  # a frozen copy, taken now
                states[key] = json.loads(json.dumps(state))
            except (TypeError, ValueError) as error:
                raise CheckpointError(
                    f"{callback!r}.state_dict() is not JSON-serializable: {error}"
                ) from error
        return states

    def _write(
        self, step: int, state: Any, meta: dict[str, Any], logs_synced: Any, exchange: str | None,
        data: DataPosition | None,
    ) -> None:
        import orbax.checkpoint as ocp

        paths, leaves = zip(*state_leaves(state), strict=True)
        arrays = (self._whole(step, paths, leaves, meta) if exchange is None else
                  self._parts(step, paths, leaves, meta, exchange))
        if arrays is None:
            return
        files: dict[str, str] = {}
        if jax.process_index() == 0:
            deadline = time.monotonic() + self.PEER_WAIT_SECONDS
            gathered = gather_positions(
                data, lambda key, whose: self._read_posted(key, whose, step, deadline), self._exchange, step)
            meta["data"], files = split_positions(gathered)
        items = {"state": ocp.args.StandardSave(arrays), "meta": ocp.args.JsonSave(meta)}
        if data is not None and data.state is not None:  # the same on every process that writes
            items[DATA_ITEM] = loader_states_args()(files)
        if not logs_synced.wait(timeout=300):
            _log.warning("TensorBoard logs did not reach the disk before checkpoint %d", step)
        if self._writer is None:
            self._writer = _writer(self.directory, self.keep, exchange)
        self._writer.save(step, args=ocp.args.Composite(**items), force=True)
        self._writer.wait_until_finished()
        _log.info("saved checkpoint at step %d to %s", step, _shown(self.directory))

    def _skip(self, step: int, nonfinite: Sequence[str]) -> None:
        self.skipped_steps.append(step)
        warnings.warn(
            f"not saving step {step}: {', '.join(nonfinite[:3])} hold NaN or inf; the checkpoints "
            f"at steps {self.saved_steps()} are kept", CheckpointWarning, stacklevel=1,
        )

    def _whole(
        self, step: int, paths: Sequence[str], leaves: Sequence[Any], meta: dict[str, Any]
    ) -> dict[str, Any] | None:
        """Format 1, process 0 alone: each leaf whole on the host, checked and
        checksummed; None if one is not finite (the save is skipped)."""
        host = [_host(x) for x in leaves]
        nonfinite = [
            path for path, x in zip(paths, host, strict=True)
            if jnp.issubdtype(x.dtype, jnp.inexact) and not np.isfinite(x).all()
        ]
        if nonfinite:
            self._skip(step, nonfinite)
            return None
        meta["leaves"] = [
            {"path": path, "shape": list(x.shape), "dtype": str(x.dtype), "crc32": _checksum(x)}
            for path, x in zip(paths, host, strict=True)
        ]
        return {str(i): x for i, x in enumerate(host) if x.size}  # orbax refuses empty arrays

    def _parts(
        self, step: int, paths: Sequence[str], leaves: Sequence[Any], meta: dict[str, Any], exchange: str
    ) -> dict[str, Any] | None:
        """Format 2, a state split across processes: this process checks and
        checksums the parts it writes (the shards of which it holds replica 0;
        process 0 also the replicated leaves), and every process agrees through
        JAX's key-value store, never a collective, whether to save. None if a
        process found a part not finite, or declined (none saves).

        Returns what orbax saves: the split leaves as global arrays (each
        process writes its parts), the replicated ones on the host (process 0
        writes them).
        """
        index = jax.process_index()
        arrays: dict[str, Any] = {}
        nonfinite: list[str] = []
        parts: dict[str, list[dict[str, Any]]] = {}
        for i, (path, x) in enumerate(zip(paths, leaves, strict=True)):
            if x.is_fully_replicated:
                whole = np.asarray(jax.device_get(x))
                if whole.size:
                    arrays[str(i)] = whole  # orbax refuses empty arrays
                pieces: Any = [([[0, n] for n in whole.shape], whole)] if index == 0 else []
            else:
                if x.size:  # orbax refuses empty arrays; restore makes them zeros
                    arrays[str(i)] = x
                pieces = (  # one part at a time on the host
                    (_bounds(shard.index, x.shape), np.asarray(shard.data))
                    for shard in x.addressable_shards if shard.replica_id == 0)
            for bounds, data in pieces:
                if jnp.issubdtype(data.dtype, jnp.inexact) and not np.isfinite(data).all():
                    nonfinite += [path] if path not in nonfinite else []
                parts.setdefault(str(i), []).append({"index": bounds, "crc32": _checksum(data)})
        decision = self._agree(exchange, step, {"nonfinite": nonfinite, "parts": parts})
        if decision.get("declined"):
            _log.warning("not saving step %d: %s", step, decision["declined"])
            return None
        if decision["nonfinite"]:
            self._skip(step, decision["nonfinite"])
            return None
        meta["format"] = FORMAT_PARTS
        meta["leaves"] = [
            {"path": path, "shape": list(x.shape), "dtype": str(x.dtype),
             "parts": sorted(decision.get("parts", {}).get(str(i), []), key=lambda p: p["index"])}
            for i, (path, x) in enumerate(zip(paths, leaves, strict=True))
        ]  # written by process 0, which has every process's parts
        return arrays

    #: Seconds a process waits for another's part of a save (orbax's own
    #: barriers wait 300 s) before the save fails with a ``CheckpointError``.
    PEER_WAIT_SECONDS = 300.0

    def _agree(self, exchange: str, step: int, report: dict[str, Any]) -> dict[str, Any]:
        """Every process's word on saving ``step``: process 0 reads every
        report and posts the decision, with every part's checksum; the others
        read it. Through JAX's key-value store, with a timeout."""
        client, index = distributed_client(), jax.process_index()
        base = f"{exchange}/{step}"
        client.key_value_set(f"{base}/report/{index}", json.dumps(report))
        deadline = time.monotonic() + self.PEER_WAIT_SECONDS

        def read(key: str, whose: str) -> dict[str, Any]:
            return json.loads(self._read_posted(key, whose, step, deadline))

        if index != 0:
            decision = read(f"{base}/decision", "process 0's decision")
        else:
            decision = self._decide(client, base, [
                read(f"{base}/report/{p}", f"process {p}'s part") for p in range(jax.process_count())])
        others = [p for p in range(jax.process_count()) if p != index]
        self._waiting_for = f"process{'es' if len(others) > 1 else ''} {', '.join(map(str, others))}'s part"
        return decision

    def _read_posted(self, key: str, whose: str, step: int, deadline: float) -> str:
        """What another process posted under ``key``, waiting until ``deadline``."""
        self._waiting_for = whose
        try:
            return distributed_client().blocking_key_value_get(
                key, max(1, int(1000 * (deadline - time.monotonic()))))
        except jax.errors.JaxRuntimeError as error:
            raise CheckpointError(
                f"process {jax.process_index()} waited {self.PEER_WAIT_SECONDS:g} s for {whose} of the "
                f"checkpoint at step {step}: {error}"
            ) from error

    @staticmethod
    def _decide(client: Any, base: str, reports: list[dict[str, Any]]) -> dict[str, Any]:
        """Process 0: the decision from every process's report, posted for the others."""
        for p in range(jax.process_count()):
            client.key_value_delete(f"{base}/report/{p}")
        declined = "; ".join(r["declined"] for r in reports if "declined" in r)
        nonfinite = [path for r in reports for path in r.get("nonfinite", [])]
        parts: dict[str, list[Any]] = {}
        for r in reports:
            for leaf, pieces in r.get("parts", {}).items():
                parts.setdefault(leaf, []).extend(pieces)
        # The others need only the verdict; the checksums go into process 0's meta.
        client.key_value_set(f"{base}/decision", json.dumps({"declined": declined, "nonfinite": nonfinite}))
        return {"declined": declined, "nonfinite": nonfinite, "parts": parts}
