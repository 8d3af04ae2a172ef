"""How a batch and the train/eval mode reach a model's call."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

#: Mode arguments that are True in eval mode (the inverse of ``train``).
INVERTED_MODE_ARGS = frozenset({"deterministic", "eval", "eval_mode", "inference", "is_eval"})

#: What ``input_keys`` takes: a batch key, batch keys passed positionally in
#: order, or ``{argument name: batch key}`` passed by keyword.
InputKeys = str | Sequence[str] | Mapping[str, str]


def _parameters(function: Callable[..., Any]) -> tuple[set[str], bool]:
    """The names ``function`` takes by keyword, and whether it takes ``**kwargs``."""
    try:
        params = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):  # no signature to read: take anything
        return set(), True
    named = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return named, any(p.kind is p.VAR_KEYWORD for p in params)


def mode_argument(function: Callable[..., Any], train_arg: str | None) -> tuple[str | None, bool]:
    """``(argument, inverted)``: the argument of ``function`` that switches
    train and eval mode (``train_arg`` if named, not through ``**kwargs``;
    ``train`` falls back on ``deterministic``), and whether it is True in eval mode."""
    named, _ = _parameters(function)
    if train_arg is None:
        return None, False
    if train_arg not in named and train_arg == "train" and "deterministic" in named:
        train_arg = "deterministic"
    if train_arg in named:
        return train_arg, train_arg in INVERTED_MODE_ARGS
    return None, False


@dataclasses.dataclass(frozen=True)
class ModelCall:
    """How one model is called on a batch, in train or eval mode.

    Attributes:
        positional: batch keys passed positionally, in order.
        keywords: ``(argument, batch key)`` pairs passed by keyword.
        mode_arg: the argument that switches modes, or None.
        inverted: ``mode_arg`` is True in eval mode (``deterministic``).

    Examples:
        >>> from flaxhooks.step import ModelCall
        >>> def apply(inputs, inputs_positions=None, deterministic=True): ...
        >>> call = ModelCall.of(apply, {"inputs": "tokens", "inputs_positions": "positions"}, "train")
        >>> call.arguments({"tokens": 1, "positions": 2}, train=True)
        ([], {'inputs': 1, 'inputs_positions': 2, 'deterministic': False})
    """

    positional: tuple[str, ...]
    keywords: tuple[tuple[str, str], ...] = ()
    mode_arg: str | None = None
    inverted: bool = False

    @classmethod
    def of(cls, function: Callable[..., Any], input_keys: InputKeys, train_arg: str | None) -> ModelCall:
        """Reads ``function``'s signature (a module's ``__call__``).

        Raises:
            ValueError: ``input_keys`` names an argument ``function`` does not take.
        """
        mode_arg, inverted = mode_argument(function, train_arg)
        if isinstance(input_keys, Mapping):
            named, any_keyword = _parameters(function)
            unknown = [name for name in input_keys if name not in named and not any_keyword]
            if unknown:
                raise ValueError(
                    f"input_keys maps batch keys to {unknown}, which the model's call does not take "
                    f"(it takes {sorted(named)})"
                )
            return cls((), tuple((str(a), str(k)) for a, k in input_keys.items()), mode_arg, inverted)
        positional = (input_keys,) if isinstance(input_keys, str) else tuple(input_keys)
        return cls(positional, (), mode_arg, inverted)

    @property
    def input_keys(self) -> tuple[str, ...]:
        """Every batch key the model takes."""
        return (*self.positional, *(key for _, key in self.keywords))

    def mode(self, train: bool) -> dict[str, bool]:
        """The keyword that puts the model in train or eval mode (empty without one)."""
        return {self.mode_arg: train != self.inverted} if self.mode_arg else {}

    def arguments(self, batch: Mapping[str, Any], *, train: bool) -> tuple[list[Any], dict[str, Any]]:
        """``(args, kwargs)`` for one call on ``batch``."""
        kwargs = {argument: batch[key] for argument, key in self.keywords}
        return [batch[key] for key in self.positional], {**kwargs, **self.mode(train)}

    def zero_arguments(self, batch: Mapping[str, Any]) -> tuple[list[Any], dict[str, Any]]:
        """Eval-mode arguments of numpy zeros like ``batch`` (concrete: summaries reject abstract inputs)."""
        zeros = {key: np.zeros(batch[key].shape, batch[key].dtype) for key in self.input_keys}
        return self.arguments(zeros, train=False)
