"""What an instrumented step exposes of the model: sown values, captured
module outputs, and gradients of the loss with respect to intermediate values.

Everything here runs while the step is traced. Values come from Flax's own
mechanisms: ``Module.sow`` collections, ``capture_intermediates`` with a
filter, ``Module.perturb`` sites in the model, and ``perturb`` calls added to
chosen submodules' outputs through ``flax.linen.intercept_methods`` (the
model's code is not changed).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import functools
import inspect
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Union

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax.core.scope import in_filter

#: ``filter(module, method_name) -> bool``, as ``capture_intermediates`` takes.
ModuleFilter = Callable[[nn.Module, str], bool]
#: What selects modules: True (every submodule's ``__call__``), a module type
#: or tuple of types, a name pattern or list of them, or a ``ModuleFilter``.
ModuleSpec = Union[bool, type, tuple, str, Sequence[str], ModuleFilter, None]  # noqa: UP007

PERTURBATIONS = "perturbations"
INTERMEDIATES = "intermediates"


def select_modules(
    types: type | tuple[type, ...] = (),
    names: str | Sequence[str] = (),
    methods: str | Sequence[str] = ("__call__",),
) -> ModuleFilter:
    """A module filter by type, name and method, as in Flax's guide on
    extracting intermediates.

    Args:
        types: module classes to select (any, if empty).
        names: ``fnmatch`` patterns matched against the module's name and its
            path (``"encoder/Dense_0"``); any, if empty.
        methods: the methods whose outputs are selected.

    Example:
        >>> import flax.linen as nn
        >>> from flaxhooks import select_modules
        >>> dense = select_modules(types=nn.Dense, names="head*")
        >>> dense(nn.Dense(3, name="head_1", parent=None), "__call__")
        True
        >>> dense(nn.Conv(3, (3, 3), name="head_2", parent=None), "__call__")
        False
    """
    types = tuple(types) if isinstance(types, (tuple, list)) else (types,) if types else ()
    patterns = (names,) if isinstance(names, str) else tuple(names)
    wanted_methods = (methods,) if isinstance(methods, str) else tuple(methods)

    def select(module: nn.Module, method_name: str) -> bool:
        if method_name not in wanted_methods:
            return False
        if types and not isinstance(module, types):
            return False
        if patterns:
            path = "/".join(module_path(module))
            candidates = [c for c in (module.name, path) if c]
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
        capture: modules whose outputs ``capture_intermediates`` records.
        perturb: modules whose outputs are perturbed (through
            ``intercept_methods``) to take the loss's gradient with respect to them.
        model_perturbations: also take gradients at the model's own
            ``self.perturb(...)`` sites.
    """

    collections: tuple[str, ...] = ()
    capture: ModuleFilter | None = None
    perturb: ModuleFilter | None = None
    model_perturbations: bool = False

    @property
    def activation_collections(self) -> tuple[str, ...]:
        names = list(dict.fromkeys(self.collections))
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
        return tap.collection in self.collections

    def merge(self, other: Taps) -> Taps:
        """What both need."""
        return Taps(
            collections=tuple(dict.fromkeys(self.collections + other.collections)),
            capture=_either(self.capture, other.capture),
            perturb=_either(self.perturb, other.perturb),
            model_perturbations=self.model_perturbations or other.model_perturbations,
        )


@dataclasses.dataclass(frozen=True)
class Tap:
    """One intermediate value exposed by the step, as this device sees it.

    Attributes:
        name: a readable, unique name: the module path, the sown (or captured
            method) name, then indices where there are several (a module
            called twice, a tuple output, a layer of an ``nn.scan``).
        module: the path of the module that produced it (empty for the model).
        collection: the collection it came from (``perturbations`` for gradients).
        value: this device's share of the value (a traced array).
        variable: the variable's name in the collection.
        origin: ``(module, method)`` when the value was captured or perturbed
            by a filter, None when the model sowed or perturbed it itself.
    """

    name: str
    module: tuple[str, ...]
    collection: str
    value: jax.Array
    variable: str = ""
    origin: tuple[nn.Module, str] | None = dataclasses.field(default=None, compare=False, repr=False)


@dataclasses.dataclass(frozen=True)
class Tapped:
    """What an instrumented step hands to each callback's in-step function.

    Values are this device's: reduce over the device axis
    (``flaxhooks.AXIS``) with ``jax.lax`` collectives for global figures.

    Attributes:
        activations: sown and captured values, in execution order.
        gradients: gradients of the mean training loss over the whole batch
            (all devices) with respect to perturbed values, in execution order.
        loss: this device's loss.
        metrics: this device's extra metrics from ``loss_fn``.
        params: the parameters before the update.
        grads: the parameter gradients, averaged over devices.
        outputs: the model's outputs on this device's share of the batch.
        batch: this device's share of the batch.
        devices: how many devices share the batch.
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

    def only(self, taps: Taps) -> Tapped:
        """This view with only the activations and gradients ``taps`` asks for."""
        return dataclasses.replace(
            self,
            activations=tuple(t for t in self.activations if taps.selects(t)),
            gradients=tuple(t for t in self.gradients if taps.selects(t)),
        )


def module_path(module: nn.Module) -> tuple[str, ...]:
    """A bound module's path, e.g. ``("encoder", "Dense_0")`` (empty if unbound)."""
    return tuple(module.path) if module.scope is not None else ()


@functools.cache
def _scan_axes(cls: Any) -> Mapping[Any, Any] | None:
    """The ``variable_axes`` of a class made by ``nn.scan``, else None.

    Flax keeps them only in the closure of the lifted method.
    """
    method = cls.__dict__.get("__call__")
    if method is None:
        return None
    try:
        nonlocals = inspect.getclosurevars(method).nonlocals
    except (TypeError, ValueError):
        return None
    transform, kwargs = nonlocals.get("transform"), nonlocals.get("trafo_kwargs")
    if getattr(transform, "__name__", "") != "scan" or not isinstance(kwargs, Mapping):
        return None
    return dict(kwargs.get("variable_axes", {}))


def scan_axis(variable_axes: Mapping[Any, Any], collection: str) -> int | None:
    """The axis ``nn.scan`` stacks ``collection`` along, or None if it drops it."""
    for collection_filter, axis in variable_axes.items():
        if in_filter(collection_filter, collection):
            return int(axis)
    return None


class CallRecorder:
    """A method interceptor: records which modules ran, in the order their
    calls completed, finds ``nn.scan`` modules, and perturbs the outputs of
    selected modules so the loss can be differentiated with respect to them."""

    def __init__(self, perturb: ModuleFilter | None = None, capture: ModuleFilter | None = None):
        self.perturb = perturb
        self.capture = capture
        self._completed: dict[tuple[str, ...], int] = {}  # path -> rank of its first completed call
        self.scans: dict[tuple[str, ...], Mapping[Any, Any]] = {}
        #: (module path, variable) -> (module, method) of each perturbed output.
        self.perturbed: dict[tuple[tuple[str, ...], str], tuple[nn.Module, str]] = {}
        #: (module path, method) -> (module, method) of each captured output.
        self.captured: dict[tuple[tuple[str, ...], str], tuple[nn.Module, str]] = {}
        self._lifted: dict[str, Mapping[Any, Any]] = {}
        self.inside_scans: dict[tuple[str, ...], set[str]] = {}  # scan path -> collections wanted inside
        self._calls: dict[tuple[tuple[str, ...], str, int], int] = {}
        self._scopes: list[Any] = []  # keeps ids in _calls unique while recording

    def __call__(self, next_fun: Callable[..., Any], args: Any, kwargs: Any, context: Any) -> Any:
        module, method = context.module, context.method_name
        axes = _scan_axes(type(module))  # type: ignore[arg-type]
        if axes is not None:
            # The class nn.scan made. Its body runs on a clone, as the root of
            # a new scope tree, which is where the layers are found.
            self._lifted[str(module.name)] = axes
            return next_fun(*args, **kwargs)
        path = module_path(module)
        if path and not isinstance(module.parent, nn.Module) and path[-1] in self._lifted:
            self.scans[path] = self._lifted[path[-1]]
        output = next_fun(*args, **kwargs)
        captured = self.capture is not None and self.capture(module, method)
        perturbed = self.perturb is not None and self.perturb(module, method)
        for scan in self.scans:
            if len(path) > len(scan) and path[: len(scan)] == scan:
                wanted = self.inside_scans.setdefault(scan, set())
                if captured:
                    wanted.add(INTERMEDIATES)
                if perturbed:
                    wanted.add(PERTURBATIONS)
        if captured:
            self.captured[(path, method)] = (module, method)
        if perturbed:
            output = self._perturbed(module, path, method, output)
        self._completed.setdefault(path, len(self._completed))
        return output

    def _perturbed(self, module: nn.Module, path: tuple[str, ...], method: str, output: Any) -> Any:
        # Calls are counted per scope tree: nn.scan traces its body twice,
        # each time in a new one, while a shared module's calls share one.
        assert module.scope is not None, "interceptors see bound modules"
        root = module.scope.root
        key = (path, method, id(root))
        call = self._calls.get(key, 0)
        self._calls[key] = call + 1
        self._scopes.append(root)
        leaves, treedef = jax.tree.flatten(output)
        name = method if call == 0 else f"{method}#{call}"
        for i, leaf in enumerate(leaves):
            if isinstance(leaf, jax.Array) and jnp.issubdtype(leaf.dtype, jnp.floating):
                variable = name if len(leaves) == 1 else f"{name}:{i}"
                self.perturbed[(path, variable)] = (module, method)
                leaves[i] = module.perturb(variable, leaf)
        return jax.tree.unflatten(treedef, leaves)

    def rank(self, path: tuple[str, ...]) -> int:
        """The order in which ``path``'s module first completed a call (last if never)."""
        return self._completed.get(path, len(self._completed))


def _values(value: Any, name: tuple[str, ...]) -> Iterator[tuple[tuple[str, ...], jax.Array]]:
    """The floating arrays in a sown value (a tuple of calls, each any pytree)."""
    if isinstance(value, Mapping):
        for key, item in value.items():
            yield from _values(item, (*name, str(key)))
    elif isinstance(value, (tuple, list)):
        many = sum(item is not None for item in value) > 1
        for i, item in enumerate(value):
            yield from _values(item, (*name, str(i)) if many else name)
    elif isinstance(value, jax.Array) and jnp.issubdtype(value.dtype, jnp.floating):
        yield name, value


def _sites(tree: Mapping[str, Any], path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], str, Any]]:
    """(module path, variable name, value) for each variable of a collection."""
    for key, value in tree.items():
        if isinstance(value, Mapping):  # a submodule: sown values are tuples
            yield from _sites(value, (*path, key))
        else:
            yield path, key, value


def _perturbation_name(name: str, siblings: set[str]) -> tuple[str, ...]:
    """``__call__#2:1`` (third call, second output) as ``("__call__", "2", "1")``."""
    base, _, leaf = name.partition(":")
    method, _, call = base.partition("#")
    parts = [method]
    if call or f"{method}#1" in siblings:
        parts.append(call or "0")
    if leaf:
        parts.append(leaf)
    return tuple(parts)


def _split_scanned(
    module: tuple[str, ...],
    name: tuple[str, ...],
    value: jax.Array,
    collection: str,
    scans: Mapping[tuple[str, ...], Mapping[Any, Any]],
) -> Iterator[tuple[tuple[str, ...], jax.Array]]:
    """One (display path, value) per layer of every ``nn.scan`` the value passed through."""
    enclosing = [s for s in scans if len(s) <= len(module) and module[: len(s)] == s]
    axes = []
    for scan in sorted(enclosing, key=len):
        axis = scan_axis(scans[scan], collection)
        if axis is not None:
            axes.append((len(scan), axis))

    def split(value: jax.Array, done: list[str], todo: list[tuple[int, int]], at: int) -> Iterator[Any]:
        if not todo:
            yield (*done, *module[at:], *name), value
            return
        (depth, axis), rest = todo[0], todo[1:]
        prefix = [*done, *module[at:depth]]
        if value.ndim <= axis:
            yield from split(value, prefix, rest, depth)
            return
        for layer in range(value.shape[axis]):
            yield from split(jnp.take(value, layer, axis=axis), [*prefix, str(layer)], rest, depth)

    yield from split(value, [], axes, 0)


def collect_taps(
    collections: Mapping[str, Mapping[str, Any]], recorder: CallRecorder
) -> list[Tap]:
    """Taps for every floating value in ``collections``, in execution order.

    Values stacked by ``nn.scan`` are split into one tap per layer.
    """
    found: list[tuple[int, int, Tap]] = []
    for collection, tree in collections.items():
        sites = list(_sites(tree))
        origins = {PERTURBATIONS: recorder.perturbed, INTERMEDIATES: recorder.captured}.get(collection, {})
        for module, key, value in sites:
            if collection == PERTURBATIONS:
                siblings = {k for m, k, _ in sites if m == module}
                entries: Iterator[Any] = iter([(_perturbation_name(key, siblings), value)])
            else:
                entries = _values(value, (key,))
            for name, array in entries:
                for display, layer_value in _split_scanned(module, name, array, collection, recorder.scans):
                    origin = origins.get((module, key))
                    tap = Tap("/".join(display), module, collection, layer_value, key, origin)
                    found.append((recorder.rank(module), len(found), tap))
    taps = [tap for _, _, tap in sorted(found, key=lambda entry: entry[:2])]
    names = [t.name for t in taps]
    return [
        dataclasses.replace(t, name=f"{t.name}[{t.collection}]") if names.count(t.name) > 1 else t
        for t in taps
    ]


def warn_dropped(recorder: CallRecorder, taps: Sequence[Tap], requested: Sequence[str]) -> None:
    """Warns about each ``nn.scan`` that drops values that are wanted.

    A collection is wanted inside a scan when a capture or perturbation
    filter selected a module inside it, or when it is one the user asked for
    by name (sown values and the model's own ``perturb`` sites, which cannot
    be seen before they are dropped).
    """
    for scan, variable_axes in recorder.scans.items():
        inside = recorder.inside_scans.get(scan, set())
        wanted = [*inside, *requested]
        for collection in dict.fromkeys(wanted):
            if scan_axis(variable_axes, collection) is not None:
                continue
            if any(t.collection == collection and t.module[: len(scan)] == scan for t in taps):
                continue
            where = "/".join(scan) or "the model"
            axes = {**{str(k): v for k, v in variable_axes.items()}, collection: 0}
            made = (
                f"the {collection!r} values made inside it" if collection in inside
                else f"any values put in {collection!r} inside it"
            )
            warnings.warn(
                f"nn.scan module {where!r} drops {made}, because its variable_axes "
                f"{dict(variable_axes)} lacks {collection!r}; pass variable_axes={axes} to "
                "nn.scan to log them per layer",
                stacklevel=2,
            )
