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
    """The model as the Trainer calls it; give it to :class:`~flaxhooks.Trainer` where defaults do not fit.

    Args:
        model: a Linen Module, an ``nnx.Module``, or an adapter (returned as it is).
        input_keys: batch keys passed positionally, or ``{argument: batch key}``.
        train_arg: the call argument or constructor field saying the model trains
            (``deterministic`` is recognized); docs/guides/models.md.
        rng_names: Linen only: the RNG streams, each given a key per step.
        state_collections: Linen only: collections carried besides ``params`` (default: found).
        eval_model: Linen only: the eval-mode twin (same parameters).
        axis_name: the axis the model's own collectives name (``BatchNorm(axis_name=...)``).

    Returns:
        A :class:`LinenModel` for a Linen module, an :class:`NNXModel` for an NNX one.

    Raises:
        TypeError: not a model.
        ValueError: ``eval_model`` for an NNX module.

    Examples:
        >>> import flax.linen as nn
        >>> import flaxhooks
        >>> model = flaxhooks.as_model(nn.Dense(3), input_keys=("tokens",), rng_names=())
        >>> type(model).__name__, model.input_keys
        ('LinenModel', ('tokens',))
    """
    # Types first: the Protocol check reads ``variables``, which an unbound Linen module raises on.
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
