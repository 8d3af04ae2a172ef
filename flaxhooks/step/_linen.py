"""The model adapter for ``flax.linen`` modules, and how an instrumented
call sees inside one without changing its code.

Values come from Flax's own mechanisms: ``Module.sow`` collections,
``capture_intermediates`` with a filter, ``Module.perturb`` sites in the
model, and ``perturb`` calls added to chosen submodules' outputs through
``flax.linen.intercept_methods``. Everything but :class:`LinenModel`'s
constructor runs while a step is traced.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax.core.scope import in_filter

from flaxhooks.step._model import AXIS, Batch
from flaxhooks.step._taps import INTERMEDIATES, PERTURBATIONS, ModuleFilter, Tap, Taps, module_path

#: Collections that hold per-step values, never state: Flax's perturbation and
#: intermediates collections. Sown collections are found by :meth:`LinenModel.carried`.
PER_STEP_COLLECTIONS = frozenset({PERTURBATIONS, INTERMEDIATES})


def _accepts_keyword(module: nn.Module, name: str) -> bool:
    params = inspect.signature(type(module).__call__).parameters
    return name in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


@dataclasses.dataclass(frozen=True)
class LinenModel:
    """A ``flax.linen`` Module as the Trainer calls it.

    Args:
        module: the Flax module.
        input_keys: batch keys passed to the model, positionally, in order.
        train_arg: the keyword that tells the model whether it trains
            (``train=True`` in the step, ``False`` at init and evaluation),
            dropped when the model's ``__call__`` has no such parameter.
        rng_names: the RNG streams the model draws from (e.g. ``dropout``).
        state_collections: the collections carried from step to step besides
            ``params``; None: found by :meth:`carried`.

    Example:
        >>> import flax.linen as nn
        >>> from flaxhooks.step import LinenModel
        >>> LinenModel.create(nn.Dense(3), "x").input_keys
        ('x',)
    """

    module: nn.Module
    input_keys: tuple[str, ...]
    train_arg: str | None = None
    rng_names: tuple[str, ...] = ("dropout",)
    state_collections: tuple[str, ...] | None = None

    @classmethod
    def create(
        cls,
        module: nn.Module,
        input_keys: str | Sequence[str] = ("image",),
        train_arg: str | None = "train",
        rng_names: Sequence[str] = ("dropout",),
        state_collections: Sequence[str] | None = None,
    ) -> LinenModel:
        """Builds the adapter, dropping ``train_arg`` if the model lacks it."""
        if isinstance(input_keys, str):
            input_keys = (input_keys,)
        if train_arg is not None and not _accepts_keyword(module, train_arg):
            train_arg = None
        collections = None if state_collections is None else tuple(state_collections)
        return cls(module, tuple(input_keys), train_arg, tuple(rng_names), collections)

    def _call(
        self, variables: Mapping[str, Any], batch: Batch, *, train: bool, rngs: Mapping[str, jax.Array],
        mutable: Sequence[str], capture: bool | ModuleFilter = False,
    ) -> tuple[Any, dict[str, Any]]:
        kwargs: dict[str, Any] = {self.train_arg: train} if self.train_arg else {}
        args = [batch[key] for key in self.input_keys]
        outputs, mutated = self.module.apply(
            variables, *args, rngs=dict(rngs), mutable=list(mutable), capture_intermediates=capture, **kwargs,
        )
        return outputs, dict(mutated)

    def init(self, key: jax.Array, batch: Batch) -> dict[str, Any]:
        """Initializes every collection the model creates, in inference mode."""
        keys = jax.random.split(key, len(self.rng_names) + 1)
        rngs = {"params": keys[0], **dict(zip(self.rng_names, keys[1:], strict=False))}
        kwargs: dict[str, Any] = {self.train_arg: False} if self.train_arg else {}
        args = [batch[key] for key in self.input_keys]
        return dict(self.module.init(rngs, *args, **kwargs))

    def own_variables(self) -> None:
        """None: a Linen module holds no values; :meth:`init` makes them."""
        return None

    def update(self, params: Any, model_state: Mapping[str, Any]) -> None:
        """Nothing to do: a Linen module holds no values."""

    def apply(
        self, params: Any, model_state: Mapping[str, Any], batch: Batch, *, train: bool,
        rngs: Mapping[str, jax.Array],
    ) -> tuple[Any, dict[str, Any]]:
        carried = tuple(model_state) if train else ()
        outputs, mutated = self._call({"params": params, **model_state}, batch, train=train, rngs=rngs,
                                      mutable=carried)
        return outputs, ({c: mutated[c] for c in carried} if train else dict(model_state))

    def carried(self, variables: Mapping[str, Any], batch: Batch) -> tuple[str, ...]:
        """Names the collections that are state carried from step to step.

        Given ``state_collections``, those (checked). Otherwise a candidate is
        any collection ``init`` made other than ``params`` and the per-step
        ones. It is state when a train-mode call returns it with the same
        structure, shapes and dtypes (BatchNorm's ``batch_stats``); sown
        values, which ``sow`` appends to, come back changed and are dropped.
        Works on abstract values; compiles nothing.

        Raises:
            ValueError: a named state collection is not among the model's.
        """
        if self.state_collections is not None:
            missing = sorted(set(self.state_collections) - set(variables))
            if missing:
                raise ValueError(f"state_collections {missing} are not among the model's {sorted(variables)}")
            return self.state_collections
        candidates = [c for c in variables if c != "params" and c not in PER_STEP_COLLECTIONS]
        if not candidates:
            return ()
        def mutated(variables, batch):
            rngs = dict.fromkeys(self.rng_names, jax.random.PRNGKey(0))
            return self._call(variables, batch, train=True, rngs=rngs, mutable=candidates)[1]

        inputs = {c: variables[c] for c in ["params", *candidates]}
        leading = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct((1, *jnp.shape(x)), jnp.result_type(x)), dict(batch)
        )
        after = jax.eval_shape(jax.vmap(mutated, in_axes=(None, 0), axis_name=AXIS), inputs, leading)
        after = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), after)

        def signature(tree):
            leaves, treedef = jax.tree.flatten(tree)
            return treedef, [(jnp.shape(x), jnp.result_type(x)) for x in leaves]

        return tuple(c for c in candidates if c in after and signature(after[c]) == signature(inputs[c]))

    def tap(
        self, model_state: Mapping[str, Any], batch: Batch, *, rngs: Mapping[str, jax.Array], taps: Taps,
    ) -> _LinenTapRun:
        return _LinenTapRun(self, model_state, batch, rngs, taps)

    def tabulate(self, batch: Batch, carried: Sequence[str], **options: Any) -> str:
        """``flax.linen.tabulate`` on zeros like ``batch`` (one device's share).

        The model is traced with ``mutable=["params", *carried]``, so per-step
        collections (perturbations, sown values) are never counted as
        parameters, as a plain ``nn.tabulate`` would. ``options`` are
        tabulate's (``depth``, ``console_kwargs``, ...).
        """
        # Concrete zeros (tabulate rejects abstract inputs), made by numpy: no compilation.
        inputs = [np.zeros(batch[key].shape, batch[key].dtype) for key in self.input_keys]
        kwargs: dict[str, Any] = {self.train_arg: False} if self.train_arg else {}
        shape = jax.eval_shape(jax.random.PRNGKey, 0)  # only traced: the key's value does not matter
        key = np.zeros(shape.shape, shape.dtype)
        rngs: dict[str, Any] = {"params": key, **dict.fromkeys(self.rng_names, key)}
        return nn.tabulate(self.module, rngs, mutable=["params", *carried], **options)(*inputs, **kwargs)


class _LinenTapRun:
    """One instrumented call of a Linen model (see :class:`~flaxhooks.step.TapRun`)."""

    def __init__(
        self, model: LinenModel, model_state: Mapping[str, Any], batch: Batch,
        rngs: Mapping[str, jax.Array], taps: Taps,
    ):
        self.model, self.model_state, self.batch, self.rngs, self.taps = model, model_state, batch, rngs, taps
        self.carried = tuple(model_state)
        self.collections = [c for c in taps.activation_collections if c not in self.carried]
        self.recorder: CallRecorder | None = None

    def _run(self, params: Any, perturbations: Any, mutable: Sequence[str]) -> tuple[Any, dict[str, Any]]:
        self.recorder = CallRecorder(self.taps.perturb, self.taps.capture)
        variables = {"params": params, **self.model_state}
        if perturbations:
            variables[PERTURBATIONS] = perturbations
        with nn.intercept_methods(self.recorder):
            return self.model._call(variables, self.batch, train=True, rngs=self.rngs, mutable=mutable,
                                    capture=self.taps.capture or False)

    def perturbations(self, params: Any) -> Any:
        if not self.taps.wants_gradients:
            return {}
        shapes = jax.eval_shape(  # zeros shaped like this batch's values
            lambda params: self._run(params, None, [*self.carried, PERTURBATIONS])[1].get(PERTURBATIONS, {}),
            params,
        )
        return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), dict(shapes))

    def __call__(self, params: Any, perturbations: Any) -> tuple[Any, dict[str, Any], tuple[Tap, ...]]:
        outputs, mutated = self._run(params, perturbations, [*self.carried, *self.collections])
        assert self.recorder is not None
        activations = collect_taps({c: mutated[c] for c in self.collections if c in mutated}, self.recorder)
        return outputs, {c: mutated[c] for c in self.carried}, tuple(activations)

    def gradients(self, perturbation_grads: Any) -> tuple[Tap, ...]:
        assert self.recorder is not None
        return tuple(collect_taps({PERTURBATIONS: perturbation_grads}, self.recorder))

    def finish(self, activations: Sequence[Tap], gradients: Sequence[Tap]) -> None:
        assert self.recorder is not None
        requested = [*self.taps.collections, *([PERTURBATIONS] if self.taps.model_perturbations else [])]
        warn_dropped(self.recorder, [*activations, *gradients], requested)


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


def sown_values(value: Any, name: tuple[str, ...]) -> Iterator[tuple[tuple[str, ...], jax.Array]]:
    """The floating arrays in a sown value (a tuple of calls, each any pytree)."""
    if isinstance(value, Mapping):
        for key, item in value.items():
            yield from sown_values(item, (*name, str(key)))
    elif isinstance(value, (tuple, list)):
        many = sum(item is not None for item in value) > 1
        for i, item in enumerate(value):
            yield from sown_values(item, (*name, str(i)) if many else name)
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
                entries = sown_values(value, (key,))
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
