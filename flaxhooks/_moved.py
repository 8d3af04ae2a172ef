"""Old import paths that keep working for one minor version, with a warning."""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable


def moved_names(old: str, new: dict[str, str],
                renamed: dict[str, str] | None = None) -> Callable[[str], object]:
    """A module ``__getattr__`` for ``old``, whose names moved to the modules
    ``new`` maps to (each to a space-separated list of names), or were
    ``renamed`` (old name to ``module.new_name``): the old path works until
    0.9 with a ``DeprecationWarning`` naming the new one."""
    where = {name: f"{module}.{name}" for module, names in new.items() for name in names.split()}
    where.update(renamed or {})

    def __getattr__(name: str) -> object:
        if name not in where:
            raise AttributeError(f"module {old!r} has no attribute {name!r}")
        module, _, new_name = where[name].rpartition(".")
        verb = "moved to" if new_name == name else "was renamed"
        warnings.warn(f"{old}.{name} {verb} {where[name]}; the old path goes in 0.9",
                      DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module(module), new_name)

    return __getattr__
