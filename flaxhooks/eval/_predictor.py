"""Every example's outputs, once and in order: evaluation's padded pass, keeping outputs, not metrics."""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from flaxhooks.data import BatchError, HostBatch
from flaxhooks.eval._sweep import FAILED, MAX_BATCHES_IN_FLIGHT, VALID, Sweep, describe, eval_rngs, flags_of
from flaxhooks.placement import Placement
from flaxhooks.step import Batch, Model

if TYPE_CHECKING:
    from flaxhooks.step import TrainState


def local_rows(x: jax.Array) -> np.ndarray:
    """This process's rows of ``x``, split along its first axis, in the order this process fed them.

    Examples:
        >>> import jax.numpy as jnp
        >>> local_rows(jnp.arange(3)).tolist()
        [0, 1, 2]
    """
    if x.is_fully_addressable:
        return np.asarray(x)
    # One shard per block of rows: the devices of other mesh axes hold copies.
    shards = {shard.index[0].start or 0: shard for shard in x.addressable_shards}
    return np.concatenate([np.asarray(shards[start].data) for start in sorted(shards)])


class Predictor(Sweep):
    """Compiles and runs the model's inference-mode call on every example of some data, keeping the outputs
    of the examples this process fed (the padding dropped), in their order."""

    def __init__(self, model: Model, placement: Placement,
                 wait: Callable[[Any], None] = jax.block_until_ready):
        super().__init__(model, placement, wait, keys=model.input_keys)  # labels and the rest stay home
        axis = self.axis

        def predict_step(variables: tuple[Any, Any], examples: jax.Array, batch: Batch,
                         ) -> tuple[tuple[jax.Array, jax.Array], Any]:
            batch = dict(batch)
            valid, failed = batch.pop(VALID), batch.pop(FAILED)
            # The keys evaluation gives the same batches: predict returns the outputs evaluate scores.
            rngs = eval_rngs(examples, model.rng_names, axis)
            outputs, _ = model.apply(*variables, batch, train=False, rngs=rngs)
            return (examples + valid.sum(dtype=jnp.int32), flags_of(valid, failed)), outputs

        # The outputs split over the data axis as the batch is: each process reads the rows it fed.
        self._step = self._compile(predict_step, (placement.replicated, placement.batch_sharding))
        self._checked: set[Any] = set()
        self._no_examples = placement.replicated_constant(lambda: jnp.zeros((), jnp.int32))

    def check(self, state: TrainState, arrays: Mapping[str, np.ndarray]) -> None:
        """Checks on abstract values that the model's eval-mode call on batches like ``arrays`` gives
        outputs of one row per example.

        Raises:
            BatchError: naming the batch and the cause.
        """
        variables, batch, key = self._abstract_inputs(state, arrays)
        if key in self._checked:
            return
        outputs = self._abstract_outputs(variables, batch, arrays)
        rows = batch[VALID].shape[0]
        for path, leaf in jax.tree_util.tree_flatten_with_path(outputs)[0]:
            shape = tuple(getattr(leaf, "shape", ()))
            if not shape or shape[0] != rows:
                raise BatchError(
                    f"predict returns the outputs of each example, but on batches of {rows} examples "
                    f"({describe(arrays)}) the model's output{jax.tree_util.keystr(path)} has shape "
                    f"{shape}: its first axis must be the batch's")
        self._checked.add(key)

    def run(self, state: TrainState, batches: Iterable[HostBatch],
            layout: Mapping[str, np.ndarray] | None = None) -> Any:
        """The outputs of ``state``'s model for every example of ``batches`` this process fed, in order: the
        output pytree of host arrays with a leading example axis. On several processes one with no batch
        feeds padding shaped like ``layout`` (and gets no rows)."""
        variables = (state.params, state.model_state)
        pending: collections.deque[tuple[Any, int]] = collections.deque()  # on the devices: (outputs, rows)
        kept: list[Any] = []

        def keep(outputs: Any, rows: int) -> None:
            self.wait(outputs)  # on several processes, a lost peer ends the wait
            kept.append(jax.tree.map(lambda x: local_rows(x)[:rows], outputs))

        def check(first: Mapping[str, np.ndarray]) -> None:
            self.check(state, first)

        def dispatch(examples: jax.Array, arrays: dict[str, np.ndarray]) -> tuple[jax.Array, jax.Array]:
            (examples, flags), outputs = self._step(variables, examples, self.placement.put_batch(arrays))
            pending.append((outputs, int(arrays[VALID].sum())))  # the real rows lead each padded batch
            if len(pending) > MAX_BATCHES_IN_FLIGHT:  # read as they settle: not every output on the devices
                keep(*pending.popleft())
            return examples, flags

        self.sweep(batches, layout, check, dispatch, self._no_examples, "prediction")
        while pending:
            keep(*pending.popleft())
        return jax.tree.map(lambda *parts: np.concatenate(parts), *kept)
