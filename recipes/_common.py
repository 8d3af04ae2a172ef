"""What the recipes share: a command line built from a Config dataclass, the
options a run was started with, and what a run says at its start and end.

Nothing here imports JAX at module level: ``--help`` stays quick.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import textwrap
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

#: The file in a run's directory that holds the options it was started with.
OPTIONS = "options.json"


def at_least(kind: type, least: float) -> Any:
    """An argparse type: ``kind``, refused below ``least`` with a usage error."""

    def parse(text: str) -> Any:
        value = kind(text)
        if value < least:
            raise argparse.ArgumentTypeError(f"must be at least {least}, got {text}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its message
    return parse


class HelpFormatter(argparse.HelpFormatter):
    """Wraps help without breaking an option's name (``--num-processes``) at
    a hyphen, or a default from its value."""

    def _split_lines(self, text: str, width: int) -> list[str]:
        glued = " ".join(text.split()).replace("(default: ", "(default:\0")  # \0: not a space to wrap at
        return [line.replace("\0", " ") for line in textwrap.wrap(glued, width, break_on_hyphens=False)]


def build_parser(
    config_class: type, helps: Mapping[str, str], *, prog: str, description: str, runs: Path,
    choices: Mapping[str, Sequence[str]] | None = None, least: Mapping[str, float] | None = None,
    metavars: Mapping[str, str] | None = None,
) -> argparse.ArgumentParser:
    """The command line: one option per field of the dataclass ``config_class``, and ``--workdir``.

    Each option's help ends with its default, once: unless it has none or its
    text already says it (``BooleanOptionalAction`` adds one of its own on
    some Python versions; it is replaced). A usage error shows a one-line
    usage, then the error.

    Args:
        config_class: a dataclass whose fields are ``bool``, ``int``, ``float``
            or ``str`` (optionally ``| None``), annotated as strings.
        helps: each field's help text.
        prog: the command, as the usage line shows it.
        description: the first line of ``--help``.
        runs: where new run directories go (said in ``--workdir``'s help).
        choices: fields that take one of a few values.
        least: the least value of numeric fields.
        metavars: the placeholder shown for string fields.
    """
    choices, least, metavars = choices or {}, least or {}, metavars or {}

    def with_default(text: str, flag: str, default: Any) -> str:
        if default is None or "(default" in text:
            return text
        if isinstance(default, bool):  # the flag that is in effect
            default = flag if default else "--no-" + flag[2:]
        return f"{text} (default: {default})".replace("%", "%%")  # argparse %-formats help

    parser = argparse.ArgumentParser(
        prog=prog, description=description, formatter_class=HelpFormatter,
        usage="%(prog)s [options] (see --help)",
    )
    parser.add_argument("--workdir", default=None, metavar="DIR", help=(
        f"where the run writes its files (default: a new directory under {runs} named by the time the run "
        "starts; with --resume, the latest there)"))
    for field in dataclasses.fields(config_class):
        flag = "--" + field.name.replace("_", "-")
        if field.type == "bool":
            action = parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=field.default)
        else:
            kind = {"int": int, "float": float, "int | None": int}.get(str(field.type), str)
            metavar = {int: "N", float: "X"}.get(kind) or metavars.get(field.name)
            if field.name in least:
                kind = at_least(kind, least[field.name])
            action = parser.add_argument(flag, type=kind, default=field.default,
                                         choices=choices.get(field.name), metavar=metavar)
        action.help = with_default(helps[field.name], flag, field.default)
    return parser


def given_options(parser: argparse.ArgumentParser, config_class: type,
                  argv: Sequence[str] | None = None) -> set[str]:
    """The fields of ``config_class`` the command line sets itself (the rest take their defaults)."""
    unset = object()  # argparse sets defaults only on what the namespace lacks
    names = [field.name for field in dataclasses.fields(config_class)]
    parsed = parser.parse_args(argv, argparse.Namespace(**dict.fromkeys(names, unset)))
    return {name for name in names if getattr(parsed, name) is not unset}


def saved_options(workdir: str | Path) -> dict[str, Any] | None:
    """The options a run in ``workdir`` was started with (None: none saved)."""
    path = Path(workdir) / OPTIONS
    return json.loads(path.read_text()) if path.is_file() else None


def resumed_config(config: Any, given: set[str], workdir: str | Path, placement: Collection[str]) -> Any:
    """``config`` for going on with the run in ``workdir``: the options it was
    started with, except those the command line sets itself and those of
    ``placement`` (where and how it runs, which a resumed run may change)."""
    saved = saved_options(workdir) or {}
    fields = {field.name for field in dataclasses.fields(config)}
    kept = {name: v for name, v in saved.items() if name in fields and name not in given | set(placement)}
    return dataclasses.replace(config, **kept)


def run_start(config: Any, workdir: str | Path, lines: Sequence[str], placement: Collection[str]) -> Any:
    """A callback that, once the Trainer has accepted the run (every check
    before anything is written passed), says what runs (``lines``) and saves
    the options it runs with, less ``placement``, into its directory."""
    import flaxhooks  # here: importing a recipe for --help stays quick

    class RunStart(flaxhooks.Callback):
        process_zero_only = True

        def on_fit_start(self, loop: flaxhooks.Loop) -> None:
            print("\n".join(lines), flush=True)
            options = {k: v for k, v in dataclasses.asdict(config).items() if k not in placement}
            temporary = Path(workdir) / (OPTIONS + ".tmp")
            temporary.write_text(json.dumps(options, indent=1) + "\n")
            temporary.replace(Path(workdir) / OPTIONS)

    return RunStart()


#: The file in a run's directory that holds its training and evaluation scalars (JSON lines).
METRICS = "metrics.jsonl"


def metrics_file(workdir: str | Path, every: int) -> Any:
    """The run's metrics file, ``workdir/metrics.jsonl``: TensorBoard's scalars, a record each."""
    import flaxhooks  # here: importing a recipe for --help stays quick

    return flaxhooks.MetricsFile(Path(workdir) / METRICS, every=every)


def metrics_line(workdir: str | Path) -> str:
    """Where the run's metrics file is, as the run says at its end."""
    return f"its scalars, a JSON object per write: {Path(workdir) / METRICS}"


def viewing(logdir: str, runs: Path) -> str:
    """The command that views the run (and every run of the recipe, when it is
    one of ``runs``), installing TensorBoard if missing."""
    import importlib.util

    command = f"tensorboard --logdir {logdir}"
    if importlib.util.find_spec("tensorboard") is None:
        command = f'pip install "flaxhooks[tensorboard]" && {command}'
    one_of_runs = Path(logdir).parent.parent == runs
    every = f"\nor every run side by side: tensorboard --logdir {runs}" if one_of_runs else ""
    return f"view this run: {command}{every}"


#: The variables a launcher sets that ``jax.distributed.initialize()``, with
#: no arguments, reads the coordinator, process count and index from; and the
#: one among them that holds the count.
_LAUNCHERS = {
    "SLURM": (("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID"),
              "SLURM_NTASKS"),
    "Open MPI": (("OMPI_MCA_orte_hnp_uri", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK"),
                 "OMPI_COMM_WORLD_SIZE"),
}


def launched_processes(environ: Mapping[str, str] | None = None) -> tuple[str, int] | None:
    """The launcher that started this process among others (``srun``,
    ``mpirun``) and how many processes it started, as JAX's own cluster
    detection reads them; None where none did, or it started one.

    Example:
        >>> launched_processes({"SLURM_JOB_ID": "7", "SLURM_STEP_NODELIST": "node[1-2]",
        ...                     "SLURM_NTASKS": "2", "SLURM_PROCID": "1", "SLURM_LOCALID": "0"})
        ('SLURM', 2)
        >>> launched_processes({}) is None
        True
    """
    environ = os.environ if environ is None else environ
    for launcher, (names, count) in _LAUNCHERS.items():
        if all(name in environ for name in names) and int(environ[count]) > 1:
            return launcher, int(environ[count])
    return None


def remove_if_unstarted(directory: Path) -> None:
    """Removes ``directory`` if it holds no file but the run's options
    (:data:`OPTIONS`), only (empty) directories: a run that never started."""
    if directory.is_dir() and all(path == directory / OPTIONS for path in directory.rglob("*")
                                  if path.is_file()):
        shutil.rmtree(directory, ignore_errors=True)


#: The mesh's axes, in order: batches split over ``data``, the model's wide axes over ``model``.
MESH_AXES = ("data", "model")


class MeshError(ValueError):
    """A ``--mesh`` that cannot be laid out on the devices; the message says why."""


def parse_mesh(text: str, device_count: int) -> dict[str, int]:
    """The mesh's axis sizes from ``name=size`` pairs separated by commas.

    Every axis of :data:`MESH_AXES` is in the result, in that order; one left
    out has size 1.

    Example:
        >>> parse_mesh("model=2,data=4", 8)
        {'data': 4, 'model': 2}
        >>> parse_mesh("data=8", 8)
        {'data': 8, 'model': 1}

    Raises:
        MeshError: a part is not ``name=size``, a name is not one of
            :data:`MESH_AXES` or is given twice, a size is not a positive
            integer, or the sizes do not multiply to ``device_count``.
    """
    sizes: dict[str, int] = {}
    for part in text.split(","):
        name, equals, size = (piece.strip() for piece in part.partition("="))
        if not equals or not name or not size:
            raise MeshError(f"{part.strip()!r} is not name=size (e.g. data=4,model=2)")
        if name not in MESH_AXES:
            raise MeshError(f"unknown axis {name!r}: the axes are {' and '.join(MESH_AXES)}")
        if name in sizes:
            raise MeshError(f"axis {name!r} is given twice")
        try:
            sizes[name] = int(size)
        except ValueError:
            raise MeshError(f"axis {name!r} has size {size!r}, not a whole number") from None
        if sizes[name] < 1:
            raise MeshError(f"axis {name!r} has size {sizes[name]}: sizes must be positive")
    mesh_sizes = {name: sizes.get(name, 1) for name in MESH_AXES}
    total = math.prod(mesh_sizes.values())
    if total != device_count:
        raise MeshError(f"the sizes multiply to {total}, not to the device count, {device_count}")
    return mesh_sizes


def mesh_of(sizes: Mapping[str, int]) -> Any:
    """The device mesh of ``sizes`` (from :func:`parse_mesh`), its axes
    automatic: XLA propagates the shardings."""
    import jax

    return jax.make_mesh(tuple(sizes.values()), tuple(sizes),
                         axis_types=(jax.sharding.AxisType.Auto,) * len(sizes))


def counted(count: int, noun: str) -> str:
    """``1 epoch``, ``2 epochs``.

    Example:
        >>> counted(2, "epoch")
        '2 epochs'
    """
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"



class Gather:
    """A batch of examples by their indices, gathered from equal-length arrays
    in one go (a grain ``map`` over batches of indices).

    Example:
        >>> import numpy as np
        >>> Gather({"x": np.arange(5) * 10})(np.array([3, 1]))["x"].tolist()
        [30, 10]
    """

    def __init__(self, arrays: dict[str, Any]):
        self.arrays = arrays

    def __call__(self, indices: Any) -> dict[str, Any]:
        return {key: value[indices] for key, value in self.arrays.items()}

    def __repr__(self) -> str:
        shapes = ", ".join(f"{key}: {value.shape}" for key, value in self.arrays.items())
        return f"Gather({shapes})"
