"""Where each process's data stood at a checkpoint: written with it by that
process, read back for the resume.

The checkpoint's ``data`` item holds, per process ``i`` of ``n``:
``position_<i>-of-<n>.json`` (epoch, batch, fingerprint) and, for a loader
with a state of its own, ``process_<i>-of-<n>.json``: grain's own file, what
``grain.checkpoint.CheckpointHandler`` reads for that process. Each process
writes its own files inside orbax's save, so nothing passes between
processes; the files commit with the train state, after the TensorBoard logs
up to the checkpoint's step reach the disk.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import logging
import os
import re
import threading
from collections.abc import Callable, Mapping
from typing import Any

import jax

from flaxhooks.data import DataPosition

#: The checkpoint item that holds the data positions and loaders' states.
DATA_ITEM = "data"
#: The longest a checkpoint's commit waits for the logs up to its step.
LOGS_WAIT_SECONDS = 300.0

_log = logging.getLogger("flaxhooks")

_POSITION = re.compile(r"position_(\d+)-of-(\d+)\.json")


def state_file(index: int, count: int) -> str:
    """A process's loader state in the ``data`` item, named as grain names it."""
    return f"process_{index}-of-{count}.json"


def own_files(position: DataPosition | None) -> dict[str, str]:
    """This process's files for the ``data`` item (none before its first batch)."""
    if position is None:
        return {}
    index, count = jax.process_index(), jax.process_count()
    value = position.to_json()
    state = value.pop("state")
    files = {}
    if state is not None:
        as_bytes = isinstance(state, dict) and state.keys() == {"bytes"}
        # grain's DataLoader state is JSON text already; a dataset iterator's a dict.
        files[state_file(index, count)] = state["bytes"] if as_bytes else json.dumps(state, indent=4)
        value["state_kind"] = "bytes" if as_bytes else "json"
    files[f"position_{index}-of-{count}.json"] = json.dumps(value)
    return files


def read_positions(directory: str) -> tuple[DataPosition, ...] | None:
    """Every process's position, loader state included, from a ``data`` item
    (None: a process had none).

    Raises:
        ValueError: the item is incomplete.
    """
    found = {}
    for name in os.listdir(directory):
        match = _POSITION.fullmatch(name)
        if match:
            found[int(match[1])] = int(match[2])
    counts = set(found.values())
    if not found:
        return None
    if len(counts) != 1 or sorted(found) != list(range(next(iter(counts)))):
        raise ValueError(
            f"{directory!r} holds data positions of processes {sorted(found)} of {sorted(counts)}")
    count = counts.pop()
    positions = []
    for index in range(count):
        with open(os.path.join(directory, f"position_{index}-of-{count}.json")) as file:
            value = json.load(file)
        kind = value.pop("state_kind", None)
        value["state"] = None
        if kind is not None:
            with open(os.path.join(directory, state_file(index, count))) as file:
                text = file.read()
            value["state"] = {"bytes": text} if kind == "bytes" else json.loads(text)
        positions.append(DataPosition.from_json(value))
    return tuple(positions)


def read_legacy_positions(path: str, meta: Mapping[str, Any] | None) -> tuple[DataPosition, ...] | None:
    """The same from a checkpoint of 0.8 or older: positions in ``meta["data"]``
    (written by process 0 for all), loader states in the ``data`` item."""
    if not meta:
        return None
    positions = []
    for position in meta["positions"]:
        position = dict(position)
        name, kind = position.pop("state_file", None), position.pop("state_kind", None)
        if name is not None:
            with open(os.path.join(path, DATA_ITEM, name)) as file:
                text = file.read()
            position["state"] = {"bytes": text} if kind == "bytes" else json.loads(text)
        positions.append(DataPosition.from_json(position))
    return tuple(positions)


@functools.cache
def data_item_args() -> Callable[[dict[str, str], threading.Event], Any]:
    """orbax's save arguments for the ``data`` item: this process's files, and
    an event set once the logs up to the checkpoint are on disk (made once:
    orbax registers them globally)."""
    import orbax.checkpoint as ocp

    class DataFilesHandler(ocp.AsyncCheckpointHandler):
        """Writes this process's files off the training thread, once the logs are on disk."""

        async def async_save(self, directory: Any, args: Any) -> list[Any]:
            async def write() -> None:
                if not args.logs_synced.wait(timeout=LOGS_WAIT_SECONDS):
                    _log.warning("the TensorBoard logs did not reach the disk within %g s of a checkpoint's "
                                 "save: it commits without them", LOGS_WAIT_SECONDS)
                for name, text in args.files.items():
                    (directory / name).write_text(text)

            future = ocp.future.CommitFutureAwaitingContractedSignals(write(), name="flaxhooks-data")
            return [future]

        def save(self, directory: Any, args: Any) -> None:
            for future in asyncio.run(self.async_save(directory, args)):
                future.result()

        def restore(self, directory: Any, args: Any = None) -> dict[str, str]:
            return {p.name: p.read_text() for p in directory.iterdir()}

        def metadata(self, directory: Any) -> None:
            return None

        def finalize(self, directory: Any) -> None:
            pass

        def close(self) -> None:
            pass

    @ocp.args.register_with_handler(DataFilesHandler, for_save=True, for_restore=True)
    @dataclasses.dataclass
    class DataFiles(ocp.args.CheckpointArgs):
        files: dict[str, str]
        logs_synced: threading.Event

    # orbax ships no types, so the checker cannot see that CheckpointArgs (a
    # dataclass without fields) leaves DataFiles' fields positional.
    return DataFiles  # type: ignore[return-value]
