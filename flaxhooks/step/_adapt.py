"""Which model adapter a model gets."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import flax.linen as nn
from flax import nnx

from flaxhooks.step._call import InputKeys
from flaxhooks.step._linen import LinenModel
from flaxhooks.step._model import AXIS, Model
from flaxhooks.step._nnx import NNXModel


def as_model(
    model: Any, input_keys: InputKeys = ("image",), train_arg: str | None = "train",
    rng_names: Sequence[str] = ("dropout",), state_collections: Sequence[str] | None = None, *,
    eval_model: Any = None, axis_name: str = AXIS,
) -> Model:
    """The adapter for ``model``: itself if it is one, :class:`NNXModel` for an
    ``nnx.Module``, else :class:`LinenModel` (``rng_names``,
    ``state_collections`` and ``eval_model`` concern Linen only: an NNX
    module carries its own ``nnx.Rngs``, variable types and ``eval()`` switch).

    Examples:
        >>> import flax.linen as nn
        >>> from flaxhooks.step import as_model
        >>> type(as_model(nn.Dense(3))).__name__
        'LinenModel'
    """
    # Types first: a Protocol check reads attributes, and a Linen module's
    # ``variables`` property raises when the module is unbound.
    if isinstance(model, nn.Module):
        return LinenModel.create(model, input_keys, train_arg, rng_names, state_collections, eval_model,
                                 axis_name)
    if eval_model is not None:
        raise ValueError("eval_model is for flax.linen modules: an nnx.Module switches modes with eval()")
    if isinstance(model, nnx.Module):
        return NNXModel(model, input_keys, train_arg, axis_name)
    if isinstance(model, Model):
        return model
    raise TypeError(
        f"cannot train a {type(model).__name__}: give a flax.linen Module, an nnx.Module or a "
        "flaxhooks.step.Model adapter"
    )
