"""What an instrumented step exposes of the model (:class:`Taps`), and what
each in-step function sees of it (:class:`Tapped`)."""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
import threading
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Union

import flax.linen as nn
import jax
from flax import nnx

#: ``filter(module, method_name) -> bool``, as ``capture_intermediates`` takes (or an ``nnx.Module``).
ModuleFilter = Callable[[nn.Module | nnx.Module, str], bool]
#: What selects modules: True (every submodule's ``__call__``), a module type
#: or tuple of types, a name pattern or list of them, or a ``ModuleFilter``.
ModuleSpec = Union[bool, type, tuple, str, Sequence[str], ModuleFilter, None]  # noqa: UP007
#: ``interceptor(next_fun, args, kwargs, context) -> output``, as ``flax.linen.intercept_methods``
#: takes (``context.module``, ``context.method_name``; the NNX adapter passes the same).
Interceptor = Callable[[Callable[..., Any], tuple, dict, Any], Any]

PERTURBATIONS = "perturbations"
INTERMEDIATES = "intermediates"


def select_modules(
    types: type | tuple[type, ...] = (),
    names: str | Sequence[str] = (),
    methods: str | Sequence[str] = ("__call__",),
) -> ModuleFilter:
    """A module filter by type, name and method.

    Args:
        types: module classes to select (any, if empty).
        names: ``fnmatch`` patterns matched against the module's name and its
            path (``"encoder/Dense_0"``); any, if empty.

    Examples:
        >>> import flax.linen as nn
        >>> from flaxhooks.step import select_modules
        >>> dense = select_modules(types=nn.Dense, names="head*")
        >>> dense(nn.Dense(3, name="head_1", parent=None), "__call__")
        True
        >>> dense(nn.Conv(3, (3, 3), name="head_2", parent=None), "__call__")
        False
    """
    types = tuple(types) if isinstance(types, (tuple, list)) else (types,) if types else ()
    patterns = (names,) if isinstance(names, str) else tuple(names)
    wanted_methods = (methods,) if isinstance(methods, str) else tuple(methods)

    def select(module: nn.Module | nnx.Module, method_name: str) -> bool:
        if method_name not in wanted_methods:
            return False
        if types and not isinstance(module, types):
            return False
        if patterns:
            path = module_path(module)
            name = module.name if isinstance(module, nn.Module) else (path[-1] if path else None)
            candidates = [c for c in (name, "/".join(path)) if c]
            return any(fnmatch.fnmatchcase(c, p) for c in candidates for p in patterns)
        return True

    return select


def as_module_filter(spec: ModuleSpec) -> ModuleFilter | None:
    """Normalizes a :data:`ModuleSpec` to a filter (None selects nothing)."""
    if spec is None or spec is False:
        return None
    if spec is True:
        return select_modules()
    is_types = isinstance(spec, tuple) and spec and all(isinstance(t, type) for t in spec)
    if isinstance(spec, type) or is_types:
        return select_modules(types=spec)  # type: ignore[arg-type]
    if isinstance(spec, str) or (
        isinstance(spec, (list, tuple)) and all(isinstance(n, str) for n in spec)
    ):
        return select_modules(names=spec)
    if callable(spec):
        return spec
    raise TypeError(
        f"cannot select modules with {spec!r}: give True, module types, name patterns or a filter"
    )


def _either(a: ModuleFilter | None, b: ModuleFilter | None) -> ModuleFilter | None:
    if a is None or b is None:
        return a or b
    return lambda module, method: a(module, method) or b(module, method)


@dataclasses.dataclass(frozen=True)
class Taps:
    """What the instrumented step must expose.

    Attributes:
        collections: ``sow`` collections whose values are returned.
        optional_collections: the same, never warned about when a scan drops them.
        capture: modules whose outputs are recorded.
        perturb: modules whose outputs get the loss's gradient with respect to them.
        model_perturbations: also take gradients at the model's own ``self.perturb(...)`` sites.
        split_steps: a value per time step of a recurrence (``nn.RNN``), not one over all.
        intercept: method interceptors around the module calls of the
            instrumented call only (``Diagnose`` sows attention logits with one).
    """

    collections: tuple[str, ...] = ()
    optional_collections: tuple[str, ...] = ()
    capture: ModuleFilter | None = None
    perturb: ModuleFilter | None = None
    model_perturbations: bool = False
    split_steps: bool = False
    intercept: tuple[Interceptor, ...] = ()

    @property
    def sown_collections(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(self.collections + self.optional_collections))

    @property
    def activation_collections(self) -> tuple[str, ...]:
        names = list(self.sown_collections)
        if self.capture is not None and INTERMEDIATES not in names:
            names.append(INTERMEDIATES)
        return tuple(names)

    @property
    def wants_gradients(self) -> bool:
        return self.perturb is not None or self.model_perturbations

    def selects(self, tap: Tap) -> bool:
        """Whether ``tap`` is one of the values these taps ask for."""
        if tap.collection == PERTURBATIONS:
            if tap.origin is not None:
                return self.perturb is not None and self.perturb(*tap.origin)
            return self.model_perturbations
        if tap.origin is not None:
            return self.capture is not None and self.capture(*tap.origin)
        return tap.collection in self.sown_collections

    def merge(self, other: Taps) -> Taps:
        """What both need."""
        return Taps(
            collections=tuple(dict.fromkeys(self.collections + other.collections)),
            optional_collections=tuple(dict.fromkeys(self.optional_collections + other.optional_collections)),
            capture=_either(self.capture, other.capture),
            perturb=_either(self.perturb, other.perturb),
            model_perturbations=self.model_perturbations or other.model_perturbations,
            split_steps=self.split_steps or other.split_steps,
            intercept=tuple(dict.fromkeys(self.intercept + other.intercept)),
        )


@dataclasses.dataclass(frozen=True)
class Tap:
    """One intermediate value exposed by the step (the whole batch's).

    Attributes:
        name: a unique name: the module path, the sown (or captured method)
            name, then indices where there are several (calls, outputs, layers).
        module: the path of the module that produced it (empty for the model).
        collection: the collection it came from (``perturbations`` for gradients).
        variable: the variable's name in the collection.
        origin: ``(module, method)`` when a filter captured or perturbed the
            value, None when the model sowed or perturbed it itself.
    """

    name: str
    module: tuple[str, ...]
    collection: str
    value: jax.Array
    variable: str = ""
    origin: tuple[nn.Module | nnx.Module, str] | None = dataclasses.field(
        default=None, compare=False, repr=False)


def output_name(module: tuple[str, ...], name: tuple[str, ...]) -> tuple[str, ...]:
    """A module output's name, ``__call__`` left out (the model's own output is ``output``)."""
    if name[:1] == ("__call__",):
        name = name[1:]
    return name if module or name else ("output",)


@dataclasses.dataclass(frozen=True)
class Tapped:
    """What an instrumented step hands to each callback's in-step function.

    Values are global arrays (the whole batch); a collective over
    :attr:`axis_name` spans one share, the whole batch, so it is the identity.

    Attributes:
        activations: sown and captured values, in execution order.
        gradients: gradients of the mean loss over the whole batch with
            respect to perturbed values, in execution order.
        metrics: the extra metrics from ``loss_fn``.
        params: the parameters before the update (the updated ones less the update).
        grads: the parameter gradients.
        outputs: the model's outputs on the whole batch.
        devices: the shares the batch is seen in: 1 (the step sees it whole).
        axis_name: the axis of those shares (``as_model(model, axis_name=...)``).
        updates: the updates the optimizer applied to ``params`` this step.
    """

    activations: tuple[Tap, ...]
    gradients: tuple[Tap, ...]
    loss: jax.Array
    metrics: Mapping[str, jax.Array]
    params: Any
    grads: Any
    outputs: Any
    batch: Mapping[str, jax.Array]
    devices: int
    axis_name: str = "batch"
    updates: Any = None

    def only(self, taps: Taps) -> Tapped:
        """This view with only the activations and gradients ``taps`` asks for."""
        return dataclasses.replace(
            self,
            activations=tuple(t for t in self.activations if taps.selects(t)),
            gradients=tuple(t for t in self.gradients if taps.selects(t)),
        )


#: Paths of NNX modules met by instrumented calls (NNX modules do not know their path).
_nnx_paths: weakref.WeakKeyDictionary[Any, tuple[str, ...]] = weakref.WeakKeyDictionary()
_naming = threading.local()


@contextlib.contextmanager
def named_modules(modules: Sequence[tuple[Any, tuple[str, ...]]]) -> Iterator[None]:
    """Lets :func:`module_path` name the ``(module, path)`` pairs of one NNX call,
    during it and while the modules live (filters run again on the taps)."""
    previous = getattr(_naming, "paths", None)
    _naming.paths = {id(module): path for module, path in modules}
    for module, path in modules:
        with contextlib.suppress(TypeError):  # not weakly referable: named during the call only
            _nnx_paths[module] = path
    try:
        yield
    finally:
        _naming.paths = previous


def module_path(module: Any) -> tuple[str, ...]:
    """A bound Linen module's or a recorded NNX module's path, e.g.
    ``("encoder", "Dense_0")``; empty if unbound or unknown."""
    if isinstance(module, nn.Module):
        return tuple(module.path) if module.scope is not None else ()
    paths = getattr(_naming, "paths", None)
    if paths is not None and id(module) in paths:
        return paths[id(module)]
    try:
        return _nnx_paths.get(module, ())
    except TypeError:  # not weakly referable
        return ()
