"""Checkpoints on orbax's ``CheckpointManager``, saved asynchronously by every process."""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import functools
import json
import logging
import math
import os
import threading
import time
import warnings
import zlib
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from flaxhooks.callbacks._data_positions import (
    DATA_ITEM,
    data_item_args,
    own_files,
    read_legacy_positions,
    read_positions,
)
from flaxhooks.contract import Callback, Every, Loop, PeerLost, ProcessError, as_every, note
from flaxhooks.data import DataPosition
from flaxhooks.placement import device0_copy
from flaxhooks.processes import WAIT_NOTE_SECONDS, peer_gone, wait_ready
from flaxhooks.writers import check_writable

if TYPE_CHECKING:
    from flaxhooks.contract import FitPlan
    from flaxhooks.eval import EvalResult
    from flaxhooks.step import TrainState

_log = logging.getLogger("flaxhooks")

#: The items written: orbax ``state`` (leaves by index), ``meta`` (JSON) and ``data``.
FORMAT = 3
#: Formats of 0.7 and 0.8 (each leaf or part with a CRC32), still read.
LEGACY_FORMATS = (1, 2)


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written, read, or used for this model."""


class CheckpointConflictError(CheckpointError):
    """A fresh run's ``directory`` holds another run's checkpoints (``steps``) after its ``start``."""

    def __init__(self, directory: str, steps: Sequence[int], start: int):
        self.directory, self.steps, self.start = directory, list(steps), start
        super().__init__(f"{directory!r} holds checkpoints of another run (steps {self.steps}) beyond this "
                         f"run's start at step {start}: pass resume=True to go on from them, or use another "
                         "directory")


class CheckpointMismatchError(CheckpointError):
    """A checkpoint's (``path``) train state does not fit this model and optimizer.

    ``difference`` says what differs, e.g. ``.params['Dense_0']['kernel'] is
    float32[32, 10] there and float32[64, 10] here``.
    """

    def __init__(self, path: str, difference: str):
        self.path, self.difference = path, difference
        super().__init__(f"the checkpoint {path!r} does not fit this model and optimizer: {difference}. The "
                         "model or the optimizer changed since it was saved: train this one in another "
                         "directory, or resume with the ones that saved it")


class CheckpointWarning(UserWarning):
    """A checkpoint was skipped: unreadable on restore, or a non-finite state on save."""


#: What a checkpoint that cannot be used raises when read.
_UNREADABLE = (CheckpointError, ValueError, OSError, KeyError, IndexError, TypeError)


def state_leaves(state: Any) -> list[tuple[str, Any]]:
    """The leaves of a train state by key path, e.g. ``.params['Dense_0']['kernel']`` (``tx`` is static)."""
    flat, _ = jax.tree_util.tree_flatten_with_path(state)
    return [(jax.tree_util.keystr(path), leaf) for path, leaf in flat]


def callback_keys(callbacks: Sequence[Callback]) -> dict[str, Callback]:
    """A stable name per callback: its class name, with ``#i`` for the i-th repeat."""
    keys: dict[str, Callback] = {}
    seen: collections.Counter[str] = collections.Counter()
    for callback in callbacks:
        name = type(callback).__name__
        keys[f"{name}#{seen[name]}" if seen[name] else name] = callback
        seen[name] += 1
    return keys


def _shown(path: str) -> str:
    """``path`` relative to the working directory when inside it."""
    relative = os.path.relpath(path)
    return path if relative.startswith("..") else relative


def _words(x: jax.Array) -> jax.Array:
    """``x``'s bits as uint32, one word per element (wider types folded)."""
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    if jnp.issubdtype(x.dtype, jnp.complexfloating):
        return _words(x.real) ^ (_words(x.imag) * np.uint32(0x9E3779B1))
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    bits = jnp.dtype(x.dtype).itemsize * 8
    if bits == 64:
        pair = jax.lax.bitcast_convert_type(x, jnp.uint32)
        return pair[..., 0] ^ (pair[..., 1] * np.uint32(0x9E3779B1))
    unsigned = {8: jnp.uint8, 16: jnp.uint16, 32: jnp.uint32}[bits]
    return jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)


def _fingerprint(x: jax.Array) -> jax.Array:
    """A uint32 sum of every element's bits times an odd weight of its global place.

    Integer sums are exact in any order, so it does not depend on the sharding.
    """
    words = _words(x)
    place = jnp.zeros(words.shape, jnp.uint32)
    stride = 1
    for axis in reversed(range(words.ndim)):
        place = place + jax.lax.broadcasted_iota(jnp.uint32, words.shape, axis) * np.uint32(stride % 2**32)
        stride *= words.shape[axis]
    weight = place * np.uint32(2654435761) + np.uint32(1) | np.uint32(1)
    return jnp.sum(words * weight, dtype=jnp.uint32)


@jax.jit
def _checks(leaves: Sequence[jax.Array]) -> tuple[jax.Array, jax.Array]:
    """Per leaf: whether it is finite, and its fingerprint (the same on every process)."""
    finite = [jnp.all(jnp.isfinite(x)) if jnp.issubdtype(x.dtype, jnp.inexact) else jnp.bool_(True)
              for x in leaves]
    prints = [_fingerprint(x) if x.size else jnp.uint32(0) for x in leaves]
    return jnp.stack(finite), jnp.stack(prints)


def _checked(leaves: Sequence[Any]) -> tuple[list[bool], list[int]]:
    if not leaves:
        return [], []
    checks = _checks(list(leaves))
    wait_ready(checks)  # polls: a peer lost meanwhile raises PeerLost instead of hanging
    finite, prints = jax.device_get(checks)
    return [bool(f) for f in finite], [int(p) for p in prints]


def _leaf_difference(missing: Sequence[str], unexpected: Sequence[str]) -> str:
    """What a checkpoint lacks and holds beyond a train state, a few of each."""
    def few(paths: Sequence[str]) -> str:
        return ", ".join(paths[:3]) + (f" and {len(paths) - 3} more" if len(paths) > 3 else "")

    parts = ([f"this train state has {few(missing)}, which it lacks"] if missing else []) + (
        [f"it holds {few(unexpected)}, which this train state lacks"] if unexpected else [])
    return "; ".join(parts)


@dataclasses.dataclass(frozen=True)
class Restored:
    """A checkpoint found good; :meth:`train_state` reads its arrays onto the shardings asked for.

    Attributes:
        step: the optimizer steps the saved state had taken.
        position: ``(epoch, batches into it)`` where training goes on.
        leaves: the state's arrays' shapes and dtypes by key path (see :func:`state_leaves`).
        callbacks: each callback's saved state, by :func:`callback_keys` name.
        stop_reason: why the saved run had decided to stop, if it had.
        data: every process's data position, in process order (None: a checkpoint of 0.7 or older).
        fingerprints: each leaf's fingerprint as saved, by key path (None: formats 1 and 2).
    """

    step: int
    position: tuple[int, int]
    leaves: Mapping[str, jax.ShapeDtypeStruct]
    callbacks: Mapping[str, Any]
    path: str
    stop_reason: str | None = None
    data: tuple[DataPosition, ...] | None = None
    fingerprints: Mapping[str, int] | None = None
    read: Callable[[Sequence[str], Sequence[Any]], list[Any]] = dataclasses.field(
        default=lambda paths, targets: [], repr=False, compare=False)

    def train_state(self, like: TrainState) -> TrainState:
        """The saved arrays in the structure of ``like``, each read onto its leaf's sharding.

        Raises:
            CheckpointMismatchError: other leaves, shapes or dtypes than saved (checked before reading).
            CheckpointError: the arrays cannot be read back.
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
        try:
            arrays = self.read(paths, [leaf for _, leaf in flat])
        except (CheckpointError, ProcessError):
            raise
        except Exception as error:  # noqa: BLE001 - whatever orbax or tensorstore raised, said in one line
            what = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
            raise CheckpointError(f"the checkpoint at step {self.step} cannot be read ({what}): move "
                                  f"{self.path!r} aside to resume from the one before it") from error
        return jax.tree_util.tree_unflatten(treedef, arrays)

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
                raise CheckpointError(f"{callback!r} cannot load its state from {self.path!r}: "
                                      f"{type(error).__name__}: {error}") from error


def _this_process_only() -> Any:
    """orbax options under which this process reads alone (no barrier on slower processes)."""
    import orbax.checkpoint as ocp

    index = jax.process_index()
    return ocp.options.MultiprocessingOptions(primary_host=index, active_processes={index})


def _reader() -> Any:
    """An orbax Checkpointer with which this process reads alone."""
    import orbax.checkpoint as ocp

    alone = _this_process_only()
    return ocp.Checkpointer(ocp.PyTreeCheckpointHandler(multiprocessing_options=alone),
                            multiprocessing_options=alone)


def _sharding_of(leaf: Any) -> jax.sharding.Sharding:
    sharding = getattr(leaf, "sharding", None)
    return sharding if sharding is not None else jax.sharding.SingleDeviceSharding(jax.local_devices()[0])


def _read_arrays(path: str, indices: Mapping[str, int], paths: Sequence[str], targets: Sequence[Any],
                 ) -> list[Any]:
    """Format 3: each leaf read onto its target's sharding; empty ones made."""
    import orbax.checkpoint as ocp

    wanted = {str(indices[p]): jax.ShapeDtypeStruct(jnp.shape(t), jnp.result_type(t),
                                                    sharding=_sharding_of(t))
              for p, t in zip(paths, targets, strict=True) if math.prod(jnp.shape(t))}
    read: dict[str, Any] = {}
    with _reader() as checkpointer:
        for group in _read_groups(wanted):
            restore_args = ocp.checkpoint_utils.construct_restore_args(group)
            read.update(checkpointer.restore(os.path.join(path, "state"), args=ocp.args.PyTreeRestore(
                group, restore_args=restore_args, partial_restore=True)))
    return [read[str(indices[p])] if str(indices[p]) in read else
            jax.device_put(np.zeros(jnp.shape(t), jnp.result_type(t)), _sharding_of(t))
            for p, t in zip(paths, targets, strict=True)]


#: The least a group of leaves read together may hold (see ``_read_groups``).
READ_GROUP_BYTES = 64 << 20


def _read_groups(wanted: Mapping[str, jax.ShapeDtypeStruct]) -> list[dict[str, jax.ShapeDtypeStruct]]:
    """``wanted`` in groups of at most the largest leaf's bytes (or :data:`READ_GROUP_BYTES`).

    orbax reads a restore's leaves concurrently into host buffers: grouped, at
    most one leaf's size of them is alive at once."""
    size = {key: math.prod(leaf.shape) * jnp.dtype(leaf.dtype).itemsize for key, leaf in wanted.items()}
    budget = max([READ_GROUP_BYTES, *size.values()])
    groups: list[dict[str, jax.ShapeDtypeStruct]] = []
    held = budget + 1
    for key, leaf in wanted.items():
        if held + size[key] > budget:
            groups.append({})
            held = 0
        groups[-1][key] = leaf
        held += size[key]
    return groups


def _checksum(array: np.ndarray) -> int:
    return zlib.crc32(np.ascontiguousarray(array).reshape(-1).view(np.uint8).data)


def _read_legacy(path: str, meta: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """Formats 1 and 2: every leaf whole on the host, its CRC32s (whole, or per part) checked."""
    import orbax.checkpoint as ocp

    as_numpy = {str(i): ocp.RestoreArgs(restore_type=np.ndarray)
                for i, info in enumerate(meta["leaves"]) if np.prod(info["shape"])}
    with _reader() as checkpointer:
        arrays = checkpointer.restore(os.path.join(path, "state"), args=ocp.args.PyTreeRestore(
            restore_args=as_numpy)) if as_numpy else {}
    leaves = {}
    for index, info in enumerate(meta["leaves"]):
        shape, dtype = tuple(info["shape"]), jnp.dtype(info["dtype"])
        array = np.asarray(arrays[str(index)]) if np.prod(shape) else np.zeros(shape, dtype)
        parts = [info] if meta["format"] == 1 else info["parts"]
        covered = 0
        for part in parts:
            index_ = tuple(slice(a, b) for a, b in part.get("index", [[0, n] for n in shape]))
            covered += int(np.prod([s.stop - s.start for s in index_]))
            if len(index_) != array.ndim or _checksum(array[index_]) != part["crc32"]:
                covered = -1
                break
        if array.shape != shape or array.dtype != dtype or covered != array.size:
            raise CheckpointError(f"{info['path']} does not match the shape, dtype and checksum saved with "
                                  "it")
        leaves[info["path"]] = array
    return leaves


def read_checkpoint(path: str, step: int) -> Restored:
    """The checkpoint in ``path`` (of ``step``) found good: its metadata and data positions, not its arrays.

    Raises:
        CheckpointError, ValueError, OSError, KeyError: it cannot be used.
    """
    with open(os.path.join(path, "meta", "metadata")) as file:
        meta = json.load(file)
    if meta.get("format") not in (FORMAT, *LEGACY_FORMATS) or meta.get("step") != step:
        raise CheckpointError(f"{path!r} is not a flaxhooks checkpoint for step {step}")
    leaves = {info["path"]: jax.ShapeDtypeStruct(tuple(info["shape"]), jnp.dtype(info["dtype"]))
              for info in meta["leaves"]}
    common = dict(step=step, position=(meta["epoch"], meta["epoch_step"]), leaves=leaves,
                  callbacks=meta["callbacks"], path=path, stop_reason=meta["stop_reason"])
    if meta["format"] in LEGACY_FORMATS:
        arrays = _read_legacy(path, meta)
        return Restored(**common, data=read_legacy_positions(path, meta.get("data")),
                        read=lambda paths, targets: [arrays[p] for p in paths])
    import orbax.checkpoint as ocp
    from etils import epath

    recorded = ocp.StandardCheckpointHandler(multiprocessing_options=_this_process_only()).metadata(
        epath.Path(path) / "state").tree if any(math.prod(s.shape) for s in leaves.values()) else {}
    indices = {info["path"]: i for i, info in enumerate(meta["leaves"])}
    for i, info in enumerate(meta["leaves"]):
        if math.prod(info["shape"]) and (str(i) not in recorded or tuple(recorded[str(i)].shape) != tuple(
                info["shape"])):
            raise CheckpointError(f"{info['path']} is missing from the saved arrays or has another shape "
                                  "there")
    return Restored(**common, data=read_positions(os.path.join(path, DATA_ITEM)),
                    fingerprints={info["path"]: info["fingerprint"] for info in meta["leaves"]},
                    read=functools.partial(_read_arrays, path, indices))


def _manager(directory: str, keep: int, best: tuple[str, str] | None, keep_best: int, barrier: str,
             committed: Callable[[], None]) -> Any:
    """orbax's asynchronous manager of ``directory``; ``committed()`` runs once each save is in place."""
    import orbax.checkpoint as ocp
    from orbax.checkpoint import checkpoint_managers as policies

    keeping: list[Any] = [policies.LatestN(keep)]
    metric_fn = None
    if best is not None:
        name, mode = best
        metric_fn = lambda metrics: metrics[name]  # noqa: E731
        keeping.append(policies.BestN(get_metric_fn=metric_fn, reverse=mode == "min", n=keep_best,
                                      keep_checkpoints_without_metrics=False))
    options = ocp.CheckpointManagerOptions(
        # Directories made asynchronously wait on orbax's save count, which differs between processes.
        async_options=ocp.options.AsyncOptions(create_directories_asynchronously=False,
                                               post_finalization_callback=committed),
        preservation_policy=policies.AnyPreservationPolicy(keeping),
        best_fn=metric_fn, best_mode=best[1] if best else "max",
        create=False,  # made (and checked) by Checkpoint itself
        cleanup_tmp_directories=True,  # what a save killed halfway left
        enable_async_checkpointing=True,
        # Barriers in JAX's key-value store, never a collective interleaved with the train step's.
        multiprocessing_options=ocp.options.MultiprocessingOptions(
            primary_host=0, active_processes=set(range(jax.process_count())),
            barrier_sync_key_prefix=barrier)
        if jax.process_count() > 1 else ocp.options.MultiprocessingOptions())
    handlers = ocp.handlers.DefaultCheckpointHandlerRegistry()
    handlers.add("state", ocp.args.PyTreeSave, _state_handler())
    return ocp.CheckpointManager(directory, options=options, handler_registry=handlers)


#: The least bytes of a replica's slice when orbax splits a replicated array's writing (a dispatch each).
REPLICA_SLICE_BYTES = 16 << 20


def _state_handler() -> Any:
    """orbax's train state handler, splitting arrays between replicas only by ``REPLICA_SLICE_BYTES``."""
    import orbax.checkpoint as ocp
    from orbax.checkpoint import type_handlers

    handlers = [(ty, type_handlers.get_type_handler(ty)) for ty in type_handlers.supported_types()]
    # The default handler's per-array metadata store (no public name; without it none is written).
    store = getattr(type_handlers.get_type_handler(jax.Array), "_array_metadata_store", None)
    arrays = type_handlers.ArrayHandler(array_metadata_store=store,
                                        min_slice_bytes_for_replica_parallel=REPLICA_SLICE_BYTES)
    registry = type_handlers.create_type_handler_registry(
        *[(ty, arrays if ty is jax.Array else handler) for ty, handler in handlers])
    return ocp.PyTreeCheckpointHandler(type_handler_registry=registry)


_managers = iter(range(1 << 62))


class Checkpoint(Callback):
    """Saves the train state and callbacks' states with orbax; restores for ``fit(..., resume=True)``.

    Saves are atomic and asynchronous; a non-finite state is never saved. On
    several processes the directory must be shared (docs/guides/checkpoints.md).

    Args:
        directory: where checkpoints go (one subdirectory per step).
        every: when to save; None: only at epoch ends and at the end.
        keep: how many of the latest checkpoints to keep.
        best: ``("<Evaluate name>/<metric>", "max" or "min")``: also keep (and save) the
            best ``keep_best`` checkpoints by that metric.

    Examples:
        >>> import tempfile, flaxhooks
        >>> checkpoint = flaxhooks.Checkpoint(tempfile.mkdtemp(), every=500, keep=3,
        ...                                   best=("eval/accuracy", "max"))
        >>> checkpoint.saved_steps(), checkpoint.best_step()
        ([], None)
    """

    def __init__(self, directory: str | os.PathLike[str], *, every: Every | int | None = None,
                 at_epoch_end: bool = True, keep: int = 3, best: tuple[str, str] | None = None,
                 keep_best: int = 1):
        if keep < 1 or keep_best < 1:
            raise ValueError(f"keep and keep_best must be at least 1, got {keep} and {keep_best}")
        if best is not None and (len(best) != 2 or "/" not in best[0] or best[1] not in ("max", "min")):
            raise ValueError(f'best is (an evaluation\'s "<name>/<metric>", "max" or "min"), got {best!r}')
        self.directory = os.path.abspath(os.fspath(directory))
        check_writable(self.directory, "checkpoints", CheckpointError)
        self.every = None if every is None else as_every(every)
        self.at_epoch_end = at_epoch_end
        self.keep, self.best, self.keep_best = keep, best, keep_best
        #: Steps whose state was not saved because it was not finite.
        self.skipped_steps: list[int] = []
        self._manager: Any = None
        self._due = False
        self._saved_step: int | None = None
        self._boundary: int | None = None  # the last step whose events all ran
        self._metric: tuple[int, float] | None = None  # (step, value) of ``best``'s latest evaluation
        self._scores: list[float] = []  # ``best``'s values of the checkpoints kept
        self._unreadable: list[int] = []
        self._restored: Restored | None = None
        self._verify: Restored | None = None  # the checkpoint this fit resumed from

    def __repr__(self) -> str:
        best = "" if self.best is None else f", best={self.best!r}, keep_best={self.keep_best}"
        return f"Checkpoint({self.directory!r}, every={self.every!r}, keep={self.keep}{best})"

    def saved_steps(self) -> list[int]:
        """The steps of the complete checkpoints on disk, oldest first."""
        try:
            names = os.listdir(self.directory)
        except FileNotFoundError:
            return []
        except OSError as error:
            raise CheckpointError(f"cannot list the checkpoints in {self.directory!r}: {error}") from error
        return sorted(int(n) for n in names if n.isdigit() and os.path.isdir(f"{self.directory}/{n}"))

    def best_step(self) -> int | None:
        """The step of the best checkpoint on disk by ``best`` (None: none has the metric)."""
        if self.best is None:
            return None
        name, mode = self.best
        scored = [(metrics[name], step) for step in self.saved_steps()
                  if (metrics := self._metrics(step)) and name in metrics]
        return (max if mode == "max" else min)(scored)[1] if scored else None

    def _metrics(self, step: int) -> dict[str, float] | None:
        try:
            with open(os.path.join(self.directory, str(step), "metrics", "metrics")) as file:
                return json.load(file)
        except (OSError, ValueError):
            return None

    def restore(self, step: int | None = None, *, best: bool = False) -> Restored:
        """Reads the checkpoint of ``step`` (default: the latest; ``best``: the best), e.g.::

            state = checkpoint.restore(best=True).train_state(trainer.state)

        Raises:
            CheckpointError: there is no such checkpoint, or it cannot be read.
        """
        if best:
            step = self.best_step()
            if step is None:
                raise CheckpointError(f"no checkpoint in {self.directory!r} holds {self.best!r}")
        elif step is None:
            step = max(self.saved_steps(), default=None)
        if step is None or step not in self.saved_steps():
            raise CheckpointError(f"{self.directory!r} holds no checkpoint of step {step}")
        try:
            return read_checkpoint(os.path.join(self.directory, str(step)), step)
        except _UNREADABLE as error:
            raise CheckpointError(f"the checkpoint at step {step} in {self.directory!r} cannot be read: "
                                  f"{type(error).__name__}: {error}") from error

    def restore_latest(self) -> Restored | None:
        """Reads the newest checkpoint that reads back (None: there is none).

        Raises:
            CheckpointError: there are checkpoints, but none can be read.
        """
        steps = self.saved_steps()
        self._unreadable, self._restored = [], None
        if not steps:
            return None
        failures = []
        for step in reversed(steps):
            try:
                self._restored = read_checkpoint(os.path.join(self.directory, str(step)), step)
                return self._restored
            except (TimeoutError, jax.errors.JaxRuntimeError):
                raise  # waiting or the runtime failed: the checkpoint itself may be fine
            except _UNREADABLE as error:
                # Corrupted, truncated, or not ours (anything else is the reader's fault).
                self._unreadable.append(step)
                failures.append(f"step {step}: {type(error).__name__}: {error}")
                warnings.warn(f"the checkpoint at step {step} in {self.directory!r} cannot be restored "
                              f"({type(error).__name__}: {error}); trying the one before it",
                              CheckpointWarning, stacklevel=2)
        raise CheckpointError(f"no checkpoint in {self.directory!r} can be restored:\n  "
                              + "\n  ".join(failures))

    def check_fit(self, plan: FitPlan) -> None:
        """Refuses a directory that cannot be written, or holds another run's later checkpoints."""
        if jax.process_index() == 0:
            check_writable(self.directory, "checkpoints", CheckpointError)
        later = [s for s in self.saved_steps() if s > plan.step]
        if later and plan.resumed_from != plan.step:
            raise CheckpointConflictError(self.directory, later, plan.step)
        restored = self._restored
        self._verify = restored if restored is not None and plan.resumed_from == restored.step else None

    def on_fit_start(self, loop: Loop) -> None:
        self._due = False
        self._metric = None
        name = self.best[0] if self.best else ""
        self._scores = [m[name] for step in self.saved_steps() if (m := self._metrics(step)) and name in m]
        self._boundary = loop.step
        self._set_aside_unreadable(loop.step)
        self._saved_step = loop.step if loop.step in self.saved_steps() else None
        self._manager = None  # opened afresh: its list of steps may be stale
        verify, self._verify = self._verify, None
        if verify is not None and verify.fingerprints is not None:
            self._check_fingerprints(verify, loop.state)

    def _check_fingerprints(self, restored: Restored, state: Any) -> None:
        """Checks that the resumed state reads back as it was saved (any mesh, every process alike)."""
        assert restored.fingerprints is not None
        paths, leaves = zip(*state_leaves(state), strict=True)
        _, prints = _checked(leaves)
        changed = [p for p, got in zip(paths, prints, strict=True) if restored.fingerprints.get(p) != got]
        if changed:
            before = [s for s in self.saved_steps() if s < restored.step]
            raise CheckpointError(
                f"the checkpoint at step {restored.step} in {self.directory!r} reads back other than it was "
                f"saved in {', '.join(changed[:3])}{' and more' if len(changed) > 3 else ''} (its files "
                f"changed on disk): move {restored.path!r} aside to resume from "
                + (f"step {before[-1]}" if before else "the start"))

    def _set_aside_unreadable(self, step: int) -> None:
        """Sets aside the unreadable checkpoints after the resumed start as ``unreadable-<step>``."""
        unreadable, self._unreadable = [s for s in self._unreadable if s > step], []
        if jax.process_index() != 0:
            return
        for found in unreadable:
            aside = os.path.join(self.directory, f"unreadable-{found}-{time.time_ns()}")
            os.replace(os.path.join(self.directory, str(found)), aside)
            _log.warning("set the unreadable checkpoint at step %d aside as %s", found, aside)

    def on_step_start(self, loop: Loop) -> None:
        if self._manager is not None and not self._manager.is_saving_in_progress():
            self._failed_save(self._manager.check_for_errors)

    def on_eval_end(self, loop: Loop) -> None:
        result: EvalResult = loop.payload
        if self.best is None or not self.best[0].startswith(f"{result.name}/"):
            return
        metric = self.best[0][len(result.name) + 1:]
        if metric not in result.metrics:
            raise KeyError(f"Checkpoint keeps the best {self.best[0]!r}; {result.name!r} has "
                           f"{sorted(result.metrics)}")
        value = float(result.metrics[metric])
        self._metric = None if math.isnan(value) else (result.step, value)

    # Saves run after every handler of the event (loop.after): callbacks' states match the parameters.
    def on_step_end(self, loop: Loop) -> None:
        due = self.every is not None and self.every(loop.step)
        loop.after(self, lambda loop: self._step_done(loop, due))

    def dispatch_ends_at(self, step: int) -> bool:
        """A save by steps is due after ``step``: the state of it is kept."""
        return self.every is not None and self.every.steps is not None and step % self.every.steps == 0

    def _step_done(self, loop: Loop, due: bool) -> None:
        self._due = self._due or due or self._among_best(loop.step)
        if loop.epoch_step == loop.steps_per_epoch or loop.step < loop.dispatch_end:
            return  # an epoch's last step is done once its epoch_end is; a save by time waits for the state
        self._boundary = loop.step
        if self._due:
            self._save(loop)

    def on_epoch_end(self, loop: Loop) -> None:
        if loop.exception is None:
            loop.after(self, self._epoch_done)

    def _epoch_done(self, loop: Loop) -> None:
        self._boundary = loop.step
        if self._due or self._among_best(loop.step) or (self.at_epoch_end and loop.epoch_done):
            self._save(loop)

    def _among_best(self, step: int) -> bool:
        """Whether ``step``'s evaluation ranks among the best ``keep_best`` (never by the disk's
        view now, which a save in flight may make differ between processes)."""
        if self.best is None or self._metric is None or self._metric[0] != step:
            return False
        sign = 1 if self.best[1] == "max" else -1  # the better, the larger
        kept = sorted((sign * score for score in self._scores), reverse=True)
        return len(kept) < self.keep_best or sign * self._metric[1] > kept[self.keep_best - 1]

    #: Seconds to wait for a save in progress at the end of a failed fit.
    FAILING_WAIT_SECONDS = 30.0
    #: The same after a lost process.
    LOST_PEER_WAIT_SECONDS = 1.0

    def on_fit_end(self, loop: Loop) -> None:
        # A KeyboardInterrupt raised inside a step is saved if the state it left is whole.
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
        # Failing already: a peer lost ends the wait without hiding the first error.
        if self._wait(wait, step=loop.step, raise_lost=loop.exception is None):
            manager, self._manager = self._manager, None
            if manager is not None:  # each fit opens its own: nothing left behind between fits
                manager.close()
        else:
            _log.warning("the checkpoint save in progress did not finish %s; the checkpoints %s are intact",
                         "before a process was lost" if wait is None else f"within {wait:g} s of the failure",
                         self.saved_steps())

    def wait(self, timeout: float | None = None) -> bool:
        """Waits for the save in progress, up to ``timeout`` seconds; whether none is left.

        Raises:
            CheckpointError: it failed.
            ProcessError: a peer was lost (:class:`~flaxhooks.PeerLost`) or left the run meanwhile.
        """
        return self._wait(timeout)

    def _wait(self, timeout: float | None, step: int | None = None, raise_lost: bool = True) -> bool:
        """:meth:`wait`; with ``raise_lost`` False a lost peer returns False instead of raising."""
        manager = self._manager
        if manager is None:
            return True
        if not self._poll(manager.is_saving_in_progress, timeout, step, raise_lost, "to commit"):
            return False
        self._failed_save(manager.wait_until_finished)
        return True

    def _poll(self, busy: Callable[[], bool], timeout: float | None, step: int | None, raise_lost: bool,
              what: str) -> bool:
        """Waits while ``busy()``, up to ``timeout``; whether it ended. A lost peer ends
        it (orbax's barriers would wait minutes); a long wait is logged."""
        start = noted = time.monotonic()
        while busy():
            waited = time.monotonic() - start
            if timeout is not None and waited >= timeout:
                return False
            if jax.process_count() > 1:
                gone = peer_gone(step)
                if gone is not None:
                    if raise_lost:
                        raise gone
                    return False
                if time.monotonic() - noted >= WAIT_NOTE_SECONDS:
                    noted = time.monotonic()
                    _log.warning("process %d is waiting for the checkpoint of step %s %s (%.0f s so far)",
                                 jax.process_index(), self._saved_step, what, waited)
            time.sleep(0.005)
        return True

    def _start_save(self, save: Callable[[], Any], step: int) -> None:
        """Runs orbax's ``save`` on a daemon thread and waits for it: orbax's commit thread is
        then a daemon too (never holding the exit), and a lost peer is noticed."""
        outcome: concurrent.futures.Future[None] = concurrent.futures.Future()

        def run() -> None:
            try:
                save()
                outcome.set_result(None)
            except BaseException as error:  # noqa: BLE001 - handed to the waiting thread
                outcome.set_exception(error)

        threading.Thread(target=run, name="flaxhooks-checkpoint-save", daemon=True).start()
        self._poll(lambda: not outcome.done(), None, step, True, "to reach the host")
        if outcome.exception() is not None:
            self._manager = None  # in no known state: the next save opens another
        self._failed_save(outcome.result)

    def _failed_save(self, check: Callable[[], Any]) -> None:
        try:
            check()
        except Exception as error:
            raise CheckpointError(
                f"saving a checkpoint to {self.directory!r} failed: {type(error).__name__}: {error}; "
                f"the earlier checkpoints {self.saved_steps()} are intact") from error

    def _save(self, loop: Loop) -> None:
        self._due = False
        step = loop.step
        if step == self._saved_step:
            return  # saved (or being saved, or skipped) already
        if loop.diverged is not None:  # the guard kept the state from before the non-finite step
            _log.info("not saving step %d: training diverged at step %d", step, loop.diverged)
            return
        if loop.exception is not None and (jax.process_count() > 1 or not self._at_boundary(loop)):
            return  # several processes save only where they agreed to stop
        if loop.exception is None and (kept := int(jax.device_get(device0_copy(loop.state.step)))) != step:
            # The guard reads losses a few steps late; the step had kept the state from before the NaN.
            _log.info("not saving step %d: a non-finite step kept the state of step %d", step, kept)
            return
        paths, leaves = zip(*state_leaves(loop.state), strict=True)
        if any(leaf.is_deleted() for leaf in leaves if isinstance(leaf, jax.Array)):
            _log.warning("step %d's state was consumed by an interrupted step: not saved", step)
            return
        finite, prints = _checked(leaves)
        nonfinite = [p for p, ok in zip(paths, finite, strict=True) if not ok]
        if nonfinite:
            self._saved_step = step  # decided: not again at the fit's end
            self.skipped_steps.append(step)
            warnings.warn(f"not saving step {step}: {', '.join(nonfinite[:3])} hold NaN or inf; the "
                          f"checkpoints at steps {self.saved_steps()} are kept", CheckpointWarning,
                          stacklevel=1)
            return
        epoch, epoch_step = loop.position
        meta = {
            "format": FORMAT, "step": step, "epoch": epoch, "epoch_step": epoch_step, "time": time.time(),
            # A run that decided to stop (early stopping) stays stopped on resume.
            "stop_reason": loop.stop_reason if loop.interrupted is None else None,
            "callbacks": self._callback_states(loop),
            "leaves": [{"path": p, "shape": list(jnp.shape(x)), "dtype": str(jnp.result_type(x)),
                        "fingerprint": f} for p, x, f in zip(paths, leaves, prints, strict=True)],
        }
        import orbax.checkpoint as ocp

        self._wait(None, step=step)  # one save at a time
        if self._manager is None:
            self._manager = _manager(self.directory, self.keep, self.best, self.keep_best,
                                     f"flaxhooks/checkpoint-{next(_managers)}", self._committed)
        metrics = None
        if self.best is not None and self._metric is not None and self._metric[0] == step:
            metrics = {self.best[0]: self._metric[1]}
            self._scores.append(self._metric[1])
        # By index (orbax names files after keys); orbax refuses empty arrays.
        arrays = {str(i): x for i, x in enumerate(leaves) if math.prod(jnp.shape(x))}
        items = {
            "state": ocp.args.PyTreeSave(arrays),
            "meta": ocp.args.JsonSave(meta),
            # Commits once the TensorBoard logs up to this step are on disk.
            DATA_ITEM: data_item_args()(own_files(loop.data_position), loop.writers.sync_point()),
        }
        manager = self._manager
        self._saved_step = step
        self._start_save(lambda: manager.save(step, args=ocp.args.Composite(**items), metrics=metrics,
                                              force=True), step)

    def _committed(self) -> None:
        """On orbax's thread, once the save in flight is in place."""
        note("saved checkpoint at step %d to %s", self._saved_step, _shown(self.directory))

    def _at_boundary(self, loop: Loop) -> bool:
        """Whether a KeyboardInterrupt left a whole step: its events all ran, no later step dispatched."""
        device_step = int(jax.device_get(device0_copy(loop.state.step)))
        if self._boundary == loop.step == device_step:
            return True
        _log.warning("interrupted inside step %d's work: not saved (the latest checkpoint: step %s)",
                     max(loop.step, device_step), max(self.saved_steps(), default=None))
        return False

    def _callback_states(self, loop: Loop) -> dict[str, Any]:
        states = {}
        for key, callback in callback_keys(loop.callbacks).items():
            state = callback.state_dict()
            try:  # a frozen copy, taken now
                if state is not None:
                    states[key] = json.loads(json.dumps(state))
            except (TypeError, ValueError) as error:
                raise CheckpointError(f"{callback!r}.state_dict() is not JSON-serializable: {error}"
                                      ) from error
        return states
