"""Where each process's data stood at a checkpoint: saved with it, read back
for the resume.

Every process's :class:`~flaxhooks.data.DataPosition` goes into the
checkpoint's ``meta`` (epoch, batch, fingerprint); a loader's own state goes
into its ``data`` item, one file per process in grain's layout
(``process_<i>-of-<n>.json``, what ``grain.checkpoint.CheckpointHandler``
reads for that process). grain's handler writes only the calling process's
file, and a checkpoint of a replicated state is written by process 0 alone,
so process 0 gathers every process's position (through JAX's key-value
store, off the training thread) and writes them all, in one atomic commit
with the train state.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from collections.abc import Callable, Sequence
from typing import Any

import jax

from flaxhooks.data import DataPosition

#: The checkpoint item that holds the loaders' states.
DATA_ITEM = "data"


def file_name(index: int, count: int) -> str:
    """A process's file in the ``data`` item, named as grain names it."""
    return f"process_{index}-of-{count}.json"


def key(exchange: str, step: int, index: int) -> str:
    """Where process ``index`` posts its position at ``step`` for process 0."""
    return f"{exchange}/{step}/data/{index}"


def post_position(client: Any, exchange: str, step: int, position: DataPosition | None) -> None:
    """Posts this process's position at ``step`` (never waits)."""
    value = json.dumps(None if position is None else position.to_json())
    client.key_value_set(key(exchange, step, jax.process_index()), value, allow_overwrite=True)


def gather_positions(
    own: DataPosition | None, read: Callable[[str, str], str | None], exchange: str, step: int
) -> list[dict[str, Any] | None]:
    """Every process's position at ``step`` as JSON values, in process order:
    this one's, and the others' as posted (``read(key, whose)``, which waits)."""
    positions: list[dict[str, Any] | None] = []
    for index in range(jax.process_count()):
        if index == jax.process_index():
            positions.append(None if own is None else own.to_json())
        else:
            text = read(key(exchange, step, index), f"process {index}'s data position")
            positions.append(None if text is None else json.loads(text))
    return positions


def split_positions(
    positions: Sequence[dict[str, Any] | None],
) -> tuple[dict[str, Any] | None, dict[str, str]]:
    """What ``meta`` holds (None when a process has no position yet) and the
    ``data`` item's files (the loaders' states, grain's layout)."""
    if not positions or any(p is None for p in positions):
        return None, {}
    count, files, kept = len(positions), {}, []
    for index, position in enumerate(positions):
        assert position is not None
        position = dict(position)
        state = position.pop("state")
        if state is not None:
            name = file_name(index, count)
            as_bytes = isinstance(state, dict) and state.keys() == {"bytes"}
            # grain's DataLoader state is JSON text already; a dataset iterator's a dict.
            files[name] = state["bytes"] if as_bytes else json.dumps(state, indent=4)
            position["state_file"], position["state_kind"] = name, "bytes" if as_bytes else "json"
        kept.append(position)
    return {"processes": count, "positions": kept}, files


def read_positions(path: str, meta: dict[str, Any] | None) -> tuple[DataPosition, ...] | None:
    """Every process's position, loader states included, from a checkpoint's
    ``meta["data"]`` and ``data`` item (None: it holds none)."""
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
def loader_states_args() -> Callable[[dict[str, str]], Any]:
    """orbax's save arguments for the ``data`` item: ``{file name: text}``,
    written by process 0 (made once: orbax registers them globally)."""
    import orbax.checkpoint as ocp

    class LoaderStatesHandler(ocp.CheckpointHandler):  # type: ignore[misc]
        """Writes the given files into the item's directory."""

        def save(self, directory: Any, args: Any) -> None:
            for name, text in args.files.items():
                (directory / name).write_text(text)

        def restore(self, directory: Any, args: Any = None) -> dict[str, str]:
            return {p.name: p.read_text() for p in directory.iterdir()}

        def metadata(self, directory: Any) -> None:
            return None

        def finalize(self, directory: Any) -> None:
            pass

        def close(self) -> None:
            pass

    @ocp.args.register_with_handler(LoaderStatesHandler, for_save=True, for_restore=True)
    @dataclasses.dataclass
    class LoaderStates(ocp.args.CheckpointArgs):  # type: ignore[misc]
        files: dict[str, str]

    return LoaderStates

