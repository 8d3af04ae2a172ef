"""A summary of the model at the start of training: the model adapter's
table (``flax.linen.tabulate`` for Linen) through rich."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from flaxhooks.contract import Callback, Loop
from flaxhooks.placement import spec_text

if TYPE_CHECKING:
    import rich.console

#: The width a table is rendered at off a terminal: more than any table
#: needs, so each takes its natural width (a table that does not expand is
#: never wider than its contents).
_UNSQUEEZED_WIDTH = 1000


class Summary(Callback):
    """Prints ``flax.linen.tabulate`` of the model once, when the first fit starts.

    Built with ``jax.eval_shape`` from one device's share of the batch (no FLOPs
    unless asked), counting parameters only; printed through rich on process 0,
    and written to ``loop.writers`` as ``model_summary`` (TensorBoard's Text tab).

    Args:
        depth: how many submodules deep the table goes (None: no limit).
        show_repeated: show repeated calls of the same submodule.
        compute_flops: add a ``flops`` column (lowers each call: costs time).
        compute_vjp_flops: add a ``vjp_flops`` column (backward-pass FLOPs).
        console_kwargs: keyword arguments of the ``rich.console.Console`` the
            table is rendered with; a ``width`` here is the table's width.
        table_kwargs: keyword arguments of ``rich.table.Table``.
        column_kwargs: keyword arguments of ``rich.table.Table.add_column``.
        console: the rich console to print to (default: one made from ``console_kwargs``).

    Attributes:
        table: the rendered table as plain text, once printed (else None).
        parameters: the number of scalars in the model's ``params`` (else None).

    Examples:
        >>> from flaxhooks import Summary
        >>> summary = Summary(depth=1)
        >>> summary.table is None
        True
    """

    process_zero_only = True
    #: The Text tag the table is written under.
    tag = "model_summary"

    def __init__(
        self,
        depth: int | None = None,
        *,
        show_repeated: bool = False,
        compute_flops: bool = False,
        compute_vjp_flops: bool = False,
        console_kwargs: Mapping[str, Any] | None = None,
        table_kwargs: Mapping[str, Any] | None = None,
        column_kwargs: Mapping[str, Any] | None = None,
        console: rich.console.Console | None = None,
    ):
        self.depth = depth
        self.show_repeated = show_repeated
        self.compute_flops = compute_flops
        self.compute_vjp_flops = compute_vjp_flops
        self.console_kwargs = dict(console_kwargs or {})
        self.table_kwargs = dict(table_kwargs or {})
        self.column_kwargs = dict(column_kwargs or {})
        self.console = console
        self.table: str | None = None
        self.parameters: int | None = None
        self._written = False  # the table went to the run's writers

    def __repr__(self) -> str:
        return f"Summary(depth={self.depth!r})"

    def render(self, loop: Loop) -> str:
        """The model's table on one device's share of the training batch.

        The table is as wide as ``console_kwargs["width"]``, else the
        console's terminal, else its own natural width.

        Returns:
            The table as rich renders it (with ANSI styles when the console
            kwargs force a terminal, as tabulate's defaults do).
        """
        if loop.model is None or loop.spec is None:
            raise ValueError("no model or batch spec yet: render during a fit")
        # Where to print is the console's business: tabulate renders into a buffer of its own.
        console_kwargs = {key: value for key, value in self.console_kwargs.items() if key != "file"}
        if self.console is not None and "width" not in console_kwargs:
            console_kwargs = {"width": self._width_for(self.console), **console_kwargs}
        return loop.model.tabulate(
            loop.spec.per_device(), tuple(loop.state.model_state), depth=self.depth,
            show_repeated=self.show_repeated, console_kwargs=console_kwargs, table_kwargs=self.table_kwargs,
            column_kwargs=self.column_kwargs, compute_flops=self.compute_flops,
            compute_vjp_flops=self.compute_vjp_flops,
        )

    def _width_for(self, console: rich.console.Console) -> int:
        """The width to render the table at for ``console``: its terminal's,
        else room enough for the table's natural width."""
        if console.is_terminal or self.table_kwargs.get("expand"):  # an expanding table fills any width
            return console.width
        return _UNSQUEEZED_WIDTH

    def on_fit_start(self, loop: Loop) -> None:
        from rich.text import Text

        if self.table is None:
            if self.console is None:
                from rich.console import Console

                self.console = Console(**self.console_kwargs)
            rendered = Text.from_ansi(self.render(loop))
            rendered.rstrip()  # the note below sits right under the table
            self.parameters = parameter_count(loop.state.params)
            shapes = "\n".join(filter(None, [_per_device_note(loop.spec), sharding_note(loop.state)]))
            self.table = rendered.plain.rstrip() + (f"\n{shapes}" if shapes else "")
            self.console.print(rendered, soft_wrap=True)  # as rendered: never wrapped again
            if shapes:
                self.console.print(shapes, markup=False, highlight=False, soft_wrap=True)
        if loop.resumed_from:  # the resumed run's first part wrote it
            self._written = True
        if loop.writers and not self._written:
            loop.writers.text(self.tag, f"```\n{self.table.rstrip()}\n```", loop.step)
            self._written = True


def parameter_count(params: Any) -> int:
    """How many scalars ``params`` holds (every leaf's size, whole)."""
    return sum(math.prod(np.shape(x)) for x in jax.tree.leaves(params))


def _size(size: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if size < 1000 or unit == "TB":
            return f"{size:,.0f} {unit}" if unit == "B" else f"{size:,.1f} {unit}"
        size /= 1000
    raise AssertionError


def per_device_bytes(x: Any) -> int:
    """The bytes of ``x`` (an array or abstract value with a sharding) on its most loaded device."""
    sharding = getattr(x, "sharding", None)
    shape = sharding.shard_shape(x.shape) if sharding is not None else x.shape
    return math.prod(shape) * np.dtype(x.dtype).itemsize


#: Split parameters listed by name under the table; the rest are counted.
SHOWN_SPLIT = 12


def sharding_note(state: Any) -> str:
    """How the train state lies on the mesh: the bytes per device against the
    whole, and each parameter split over devices with its partition."""
    leaves = jax.tree.leaves(state)
    mesh = next((x.sharding.mesh for x in leaves if hasattr(getattr(x, "sharding", None), "mesh")), None)
    if mesh is None or mesh.size == 1:
        return ""
    whole = sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in leaves)
    each = sum(per_device_bytes(x) for x in leaves)
    if each == whole:
        return f"State replicated on each of the {mesh.size} devices: {_size(each)} each."
    axes = ", ".join(f"{name}={size}" for name, size in mesh.shape.items())
    lines = [f"State on mesh {axes}: {_size(each)} per device of {_size(whole)} "
             "(parameters, carried collections, optimizer state)."]
    flat = jax.tree_util.tree_flatten_with_path(state.params)[0]
    split = [(jax.tree_util.keystr(path), x) for path, x in flat if not x.sharding.is_fully_replicated]
    for name, x in split[:SHOWN_SPLIT]:
        lines.append(f"  params{name} {x.dtype}{list(x.shape)}: {spec_text(x.sharding)}, "
                     f"{_size(per_device_bytes(x))} per device")
    if len(split) > SHOWN_SPLIT:
        lines.append(f"  and {len(split) - SHOWN_SPLIT} more split parameters")
    if split and len(split) < len(flat):
        lines.append(f"  the other {len(flat) - len(split)} parameters are replicated")
    return "\n".join(lines)


def _per_device_note(spec: Any) -> str:
    """What the table's shapes are, when the batch is split over devices."""
    processes = jax.process_count()  # each process's batch is its share of the global one
    if spec is None or spec.num_devices * processes == 1:
        return ""
    share = spec.batch_size // spec.num_devices
    return (f"Shapes per device: {share} of the global batch of {spec.batch_size * processes}, split over "
            f"{spec.num_devices * processes} devices.")
