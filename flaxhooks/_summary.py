"""A summary of the model at the start of training: ``flax.linen.tabulate`` through rich."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import flax.linen as nn
import jax
import numpy as np

from flaxhooks._callback import Callback
from flaxhooks._tensorboard import TOPIC

if TYPE_CHECKING:
    import rich.console

    from flaxhooks._loop import Loop
    from flaxhooks._trainer import Trainer

#: The TensorBoard Text tag the table is written under.
TAG = "model_summary"


def _abstract_key_like() -> np.ndarray:
    """A PRNG key of the default implementation's shape and dtype, as zeros.

    ``tabulate`` only traces the model (``jax.eval_shape``), so the key's value
    does not matter; building it with numpy compiles nothing.
    """
    shape = jax.eval_shape(jax.random.PRNGKey, 0)
    return np.zeros(shape.shape, shape.dtype)


class Summary(Callback):
    """Prints ``flax.linen.tabulate`` of the model once, when the first fit starts.

    The table is built from the layout of the training batch (one device's
    share of it) with ``jax.eval_shape``: it allocates no arrays and compiles
    nothing, unless ``compute_flops`` or ``compute_vjp_flops`` ask for FLOP
    counts. Parameter totals count parameters only: the model is traced with
    ``mutable=["params", *carried collections]``, so per-step collections
    (``perturbations``, ``intermediates``, sown values) are left out, where a
    plain ``nn.tabulate`` counts them as parameters. Carried collections such
    as ``batch_stats`` keep their own column, as in ``nn.tabulate``.

    The table is printed through rich, on process 0 only, and once per
    ``Summary`` (a second ``fit`` prints nothing). When a
    :class:`~flaxhooks.TensorBoard` callback publishes its writer, the same
    table, as plain text in a markdown code block, goes to TensorBoard's Text
    tab under the tag ``model_summary``.

    Args:
        depth: how many submodules deep the table goes (None: no limit).
        show_repeated: show repeated calls of the same submodule.
        compute_flops: add a ``flops`` column (lowers each call: costs time).
        compute_vjp_flops: add a ``vjp_flops`` column (backward-pass FLOPs).
        console_kwargs: keyword arguments of the ``rich.console.Console`` the
            table is rendered with (and, without ``console``, printed to).
        table_kwargs: keyword arguments of ``rich.table.Table``.
        column_kwargs: keyword arguments of ``rich.table.Table.add_column``.
        console: the rich console to print to (default: a new one made from
            ``console_kwargs``, writing to stdout).

    Attributes:
        table: the rendered table as plain text, once printed (else None).
        parameters: the number of scalars in the model's ``params``, counted
            from the train state (else None).

    Example:
        >>> from flaxhooks._summary import Summary
        >>> summary = Summary(depth=1)
        >>> summary.table is None
        True
    """

    order = -80  # after TensorBoard (-90) publishes its writer, before other output
    process_zero_only = True

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
        self._written_to: Any = None  # the run (a writer's logdir) the table went to

    def __repr__(self) -> str:
        return f"Summary(depth={self.depth!r})"

    def render(self, trainer: Trainer, carried: tuple[str, ...] = ()) -> str:
        """Runs ``nn.tabulate`` on one device's share of the training batch.

        Args:
            trainer: a Trainer whose ``batch_spec`` is set (by ``init`` or ``fit``).
            carried: the collections carried from step to step besides ``params``.

        Returns:
            The table as rich renders it (with ANSI styles when the console
            kwargs force a terminal, as tabulate's defaults do).
        """
        spec = trainer.batch_spec
        if spec is None:
            raise ValueError("the Trainer has no batch layout yet: call init or fit first")
        per_device = spec.batch_size // spec.num_devices
        # Concrete zeros (tabulate rejects abstract inputs), made by numpy: no compilation.
        inputs = [
            np.zeros((per_device, *spec.fields[key][1]), spec.fields[key][0])
            for key in trainer.call.input_keys
        ]
        kwargs: dict[str, Any] = {trainer.call.train_arg: False} if trainer.call.train_arg else {}
        key = _abstract_key_like()
        rngs: dict[str, Any] = {"params": key, **dict.fromkeys(trainer.call.rng_names, key)}
        console_kwargs = self.console_kwargs
        if self.console is not None and "width" not in console_kwargs:
            console_kwargs = {"width": self.console.width, **console_kwargs}
        tabulate = nn.tabulate(
            trainer.call.module,
            rngs,
            depth=self.depth,
            show_repeated=self.show_repeated,
            mutable=["params", *carried],
            console_kwargs=console_kwargs,
            table_kwargs=self.table_kwargs,
            column_kwargs=self.column_kwargs,
            compute_flops=self.compute_flops,
            compute_vjp_flops=self.compute_vjp_flops,
        )
        return tabulate(*inputs, **kwargs)

    def on_fit_start(self, loop: Loop) -> None:
        from rich.text import Text

        if self.table is None:
            carried = tuple(loop.state.model_state)
            rendered = Text.from_ansi(self.render(loop.trainer, carried))
            # Replicated leaves carry a leading device axis; shapes only, no transfer.
            self.parameters = sum(math.prod(np.shape(x)[1:]) for x in jax.tree.leaves(loop.state.params))
            self.table = rendered.plain
            if self.console is None:
                from rich.console import Console

                self.console = Console(**self.console_kwargs)
            self.console.print(rendered, soft_wrap=True)
        writer = loop.published.get(TOPIC)
        if writer is None:
            return
        # Each fit opens a new writer on the same run: the run is what counts.
        run = getattr(writer, "logdir", writer)
        if loop.resumed_from:  # the resumed run's first part wrote it
            self._written_to = run
        if run != self._written_to:
            writer.text(TAG, f"```\n{self.table.rstrip()}\n```", loop.step)
            self._written_to = run
