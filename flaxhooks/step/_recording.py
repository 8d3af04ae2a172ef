"""The recording core both model adapters share: call order, sown values,
repeated outputs and unique names. Runs while a step is traced."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from flaxhooks.step._taps import Tap

#: A module's path in the model, e.g. ``("encoder", "Dense_0")`` (empty: the model itself).
Path = tuple[str, ...]
#: One module call: its module's path, its method and which call of that method (from 0).
CallKey = tuple[Path, str, int]


@dataclasses.dataclass(frozen=True)
class RepeatedTap(Tap):
    """The model's output when it is the very array a tapped module returned:
    a second copy of a curve, logged only when every value is asked for.

    Attributes:
        repeats: the path of the module whose output the model returns.
    """

    repeats: tuple[str, ...] = ()


class ReturnedBy(NamedTuple):
    """The module call a traced array came out of, as its caller received it."""

    array: Any  # kept alive while recording, so that no other array takes its id
    path: Path
    captured: bool
    perturbed: bool


def returned_by(returned: Mapping[int, ReturnedBy], array: Any) -> ReturnedBy | None:
    """The call that returned this very array (object identity), or None."""
    found = returned.get(id(array))
    return found if found is not None and found.array is array else None


def is_floating(value: Any) -> bool:
    return isinstance(value, jax.Array) and jnp.issubdtype(value.dtype, jnp.floating)


def as_repeated(tap: Tap, repeats: Path | None) -> Tap:
    """``tap`` marked as repeating the output of the module at ``repeats`` (if not None)."""
    if repeats is None:
        return tap
    fields = {f.name: getattr(tap, f.name) for f in dataclasses.fields(Tap)}
    return RepeatedTap(**fields, repeats=repeats)


class CallOrder:
    """The order module calls completed in (a parent's after its children's);
    a call completed twice (a scan traces its body twice) keeps its first rank."""

    def __init__(self) -> None:
        self.completed = 0  # calls completed so far: the next one's rank
        self._first: dict[Path, int] = {}  # path -> rank of its module's first completed call
        self._calls: dict[CallKey, int] = {}

    def complete(self, call: CallKey, outermost: bool = True) -> int:
        """Ranks a call that just completed; an ``outermost`` one (not a helper
        method its module calls itself) ranks its module too."""
        rank = self.completed
        self.completed += 1
        self._calls.setdefault(call, rank)
        if outermost:
            self._first.setdefault(call[0], rank)
        return rank

    def rank(self, path: Path) -> int:
        """The rank of ``path``'s module's first completed call (last if never)."""
        return self._first.get(path, self.completed)

    def call_rank(self, call: CallKey) -> int:
        """The rank of ``call``; its module's first call's if unknown."""
        return self._calls.get(call, self.rank(call[0]))


def variable_sites(tree: Mapping[Any, Any], path: Path = ()) -> Iterator[tuple[Path, str, Any]]:
    """``(module path, variable name, value)`` for each variable of a collection
    nested by module (a sown value is a tuple, never a dict)."""
    for key, value in tree.items():
        if isinstance(value, Mapping):
            yield from variable_sites(value, (*path, str(key)))
        else:
            yield path, str(key), value


def sown_values(value: Any, name: Path) -> Iterator[tuple[Path, jax.Array]]:
    """The floating arrays in a sown value (a tuple of calls, each any pytree)."""
    for _, item_name, array in sown_entries(value, name):
        yield item_name, array


def sown_entries(value: Any, name: Path) -> Iterator[tuple[int | None, Path, jax.Array]]:
    """:func:`sown_values`, each with its entry of the tuple (None: no tuple)."""
    if isinstance(value, Mapping):
        for key, item in value.items():
            for item_name, array in sown_values(item, (*name, str(key))):
                yield None, item_name, array
    elif isinstance(value, (tuple, list)):
        many = sum(item is not None for item in value) > 1
        for i, item in enumerate(value):
            for item_name, array in sown_values(item, (*name, str(i)) if many else name):
                yield i, item_name, array
    elif is_floating(value):
        yield None, name, value


def sown_taps(tree: Mapping[Any, Any], collection: str) -> Iterator[Tap]:
    """A tap for each floating array sown into ``tree``, a collection nested by module."""
    for module, key, value in variable_sites(tree):
        for name, array in sown_values(value, (key,)):
            yield Tap("/".join((*module, *name)), module, collection, array, key)


class Found:
    """The values one recorded call found, each with the rank of its call."""

    def __init__(self) -> None:
        self._entries: list[tuple[int, int, Tap]] = []

    def add(self, rank: int, tap: Tap) -> None:
        self._entries.append((rank, len(self._entries), tap))

    def in_call_order(self) -> tuple[Tap, ...]:
        """The values by rank (ties in the order found), a name two share
        suffixed by its collection (``x[custom]``)."""
        ordered = [tap for _, _, tap in sorted(self._entries, key=lambda entry: entry[:2])]
        return tuple(unique_names(ordered))


def unique_names(taps: Sequence[Tap]) -> list[Tap]:
    """``taps``, each name that several share suffixed by its collection."""
    names = [t.name for t in taps]
    return [t if names.count(t.name) == 1 else dataclasses.replace(t, name=f"{t.name}[{t.collection}]")
            for t in taps]
