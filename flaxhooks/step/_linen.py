"""The model adapter for ``flax.linen`` modules, and how an instrumented call
records inside one (see docs/architecture.md, "Inside the step")."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import flax.core.lift
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax.core.scope import in_filter
from flax.linen.module import TestScope  # the scope of Flax's abstract check of setup

from flaxhooks.placement import Annotation
from flaxhooks.step._call import INVERTED_MODE_ARGS, InputKeys, ModelCall
from flaxhooks.step._model import AXIS, Batch
from flaxhooks.step._recording import (
    CallOrder,
    Found,
    ReturnedBy,
    as_repeated,
    is_floating,
    returned_by,
    sown_entries,
    variable_sites,
)
from flaxhooks.step._taps import (
    INTERMEDIATES,
    PERTURBATIONS,
    ModuleFilter,
    Tap,
    Taps,
    module_path,
    output_name,
)

#: Collections of per-step values, never state (sown ones are found by :meth:`LinenModel.carried`).
PER_STEP_COLLECTIONS = frozenset({PERTURBATIONS, INTERMEDIATES})


def _mode_field(module: nn.Module, train_arg: str) -> str | None:
    """A field of the module's constructor that switches train and eval mode."""
    fields = {f.name for f in dataclasses.fields(module)}
    candidates = (train_arg, "train", *sorted(INVERTED_MODE_ARGS))
    return next((name for name in candidates if name in fields), None)


def _annotation(box: nn.Partitioned) -> Annotation:
    """A Linen box's names: logical (its own rules first) for ``nn.LogicallyPartitioned``, else mesh axes."""
    if isinstance(box, nn.LogicallyPartitioned):
        return Annotation(tuple(box.names), logical=True, rules=tuple(box.rules or ()))
    return Annotation(tuple(box.names), logical=False)


@dataclasses.dataclass(frozen=True)
class LinenModel:
    """A ``flax.linen`` Module as the Trainer calls it.

    Args:
        module: the Flax module the train step calls.
        call: how a batch and the mode reach its ``__call__``.
        eval_module: the module for evaluation, initialization and the summary
            (the same parameters; by default ``module``).
        rng_names: the RNG streams the model draws from (e.g. ``dropout``).
        state_collections: the collections carried from step to step besides
            ``params``; None: found by :meth:`carried`.
        axis_name: the device axis the model's own collectives
            (``nn.BatchNorm(axis_name=...)``) name.

    Examples:
        >>> import flax.linen as nn
        >>> from flaxhooks.step import LinenModel
        >>> LinenModel.create(nn.Dense(3), "x").input_keys
        ('x',)
    """

    module: nn.Module
    call: ModelCall
    eval_module: nn.Module
    rng_names: tuple[str, ...] = ("dropout",)
    state_collections: tuple[str, ...] | None = None
    axis_name: str = AXIS

    @classmethod
    def create(
        cls,
        module: nn.Module,
        input_keys: InputKeys = ("image",),
        train_arg: str | None = "train",
        rng_names: Sequence[str] = ("dropout",),
        state_collections: Sequence[str] | None = None,
        eval_module: nn.Module | None = None,
        axis_name: str = AXIS,
    ) -> LinenModel:
        """Builds the adapter from the module's signature.

        The mode reaches the model as ``train_arg`` (or ``deterministic``) when
        its ``__call__`` takes it, else as a constructor field of either name set
        on a copy per mode, else not at all unless ``eval_module`` is given.
        """
        call = ModelCall.of(type(module).__call__, input_keys, train_arg)
        if eval_module is None and call.mode_arg is None and train_arg is not None:
            field = _mode_field(module, train_arg)
            if field is not None:
                train = field not in INVERTED_MODE_ARGS
                as_train: dict[str, Any] = {field: train}
                as_eval: dict[str, Any] = {field: not train}
                module, eval_module = module.clone(**as_train), module.clone(**as_eval)
        collections = None if state_collections is None else tuple(state_collections)
        return cls(module, call, eval_module or module, tuple(rng_names), collections, axis_name)

    @property
    def input_keys(self) -> tuple[str, ...]:
        """The batch keys the model takes."""
        return self.call.input_keys

    def _call(
        self, variables: Mapping[str, Any], batch: Batch, *, train: bool, rngs: Mapping[str, jax.Array],
        mutable: Sequence[str], capture: bool | Callable[[nn.Module, str], bool] = False,
    ) -> tuple[Any, dict[str, Any]]:
        args, kwargs = self.call.arguments(batch, train=train)
        outputs, mutated = (self.module if train else self.eval_module).apply(
            variables, *args, rngs=dict(rngs), mutable=list(mutable), capture_intermediates=capture, **kwargs,
        )
        return outputs, dict(mutated)

    def init(self, key: jax.Array, batch: Batch) -> dict[str, Any]:
        """Initializes every collection the model creates, in inference mode."""
        # The state holds plain arrays; annotated parameters come boxed.
        return dict(nn.unbox(self._boxed_init(key, batch)))

    def _boxed_init(self, key: jax.Array, batch: Batch) -> Any:
        keys = jax.random.split(key, len(self.rng_names) + 1)
        rngs = {"params": keys[0], **dict(zip(self.rng_names, keys[1:], strict=False))}
        args, kwargs = self.call.arguments(batch, train=False)
        return self.eval_module.init(rngs, *args, **kwargs)

    def annotations(self, key: Any, batch: Batch) -> dict[str, Any]:
        """Each variable's :class:`~flaxhooks.placement.Annotation` (None where
        it has none), by collection; on abstract values."""
        boxed = jax.eval_shape(self._boxed_init, key, batch)
        is_box = lambda x: isinstance(x, nn.Partitioned)  # noqa: E731
        found = jax.tree.map(lambda x: _annotation(x) if is_box(x) else None, dict(boxed), is_leaf=is_box)
        return dict(found)

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
        """The collections carried from step to step: ``state_collections``
        (checked), else those a train-mode call returns with the same structure,
        shapes and dtypes (sown values come back changed); on abstract values.

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
        mapped = jax.vmap(mutated, in_axes=(None, 0), axis_name=self.axis_name)
        after = jax.eval_shape(mapped, inputs, leading)
        after = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), after)

        def signature(tree):
            leaves, treedef = jax.tree.flatten(tree)
            return treedef, [(jnp.shape(x), jnp.result_type(x)) for x in leaves]

        return tuple(c for c in candidates if c in after and signature(after[c]) == signature(inputs[c]))

    def tap(
        self, model_state: Mapping[str, Any], batch: Batch, *, rngs: Mapping[str, jax.Array], taps: Taps,
    ) -> _LinenRecordedCall:
        return _LinenRecordedCall(self, model_state, batch, rngs, taps)

    def tabulate(self, batch: Batch, carried: Sequence[str], **options: Any) -> str:
        """``flax.linen.tabulate`` on zeros like ``batch`` (one device's share),
        per-step collections left out of the parameters; ``options`` are tabulate's."""
        inputs, kwargs = self.call.zero_arguments(batch)
        shape = jax.eval_shape(jax.random.PRNGKey, 0)  # only traced: the key's value does not matter
        key = np.zeros(shape.shape, shape.dtype)
        rngs: dict[str, Any] = {"params": key, **dict.fromkeys(self.rng_names, key)}
        return nn.tabulate(self.eval_module, rngs, mutable=["params", *carried], **options)(*inputs, **kwargs)


class _LinenRecordedCall:
    """One instrumented call of a Linen model (see :class:`~flaxhooks.step.RecordedCall`)."""

    def __init__(
        self, model: LinenModel, model_state: Mapping[str, Any], batch: Batch,
        rngs: Mapping[str, jax.Array], taps: Taps,
    ):
        self.model, self.model_state, self.batch, self.rngs, self.taps = model, model_state, batch, rngs, taps
        self.carried = tuple(model_state)
        self.collections = [c for c in taps.activation_collections if c not in self.carried]
        self.recorder: _LinenCallRecorder | None = None

    def _run(self, params: Any, perturbations: Any, mutable: Sequence[str]) -> tuple[Any, dict[str, Any]]:
        self.recorder = _LinenCallRecorder(self.taps.perturb, self.taps.capture, self.collections)
        variables = {"params": params, **self.model_state}
        if perturbations:
            variables[PERTURBATIONS] = perturbations
        with contextlib.ExitStack() as stack:
            stack.enter_context(nn.intercept_methods(self.recorder))
            for interceptor in self.taps.intercept:  # inside the recorder's: they change no output it sees
                stack.enter_context(nn.intercept_methods(interceptor))
            return self.model._call(variables, self.batch, train=True, rngs=self.rngs, mutable=mutable,
                                    capture=self.recorder.capture_filter or False)

    def perturbations(self, params: Any) -> Any:
        if not self.taps.wants_gradients:
            return {}
        shapes = jax.eval_shape(
            lambda params: self._run(params, None, [*self.carried, PERTURBATIONS])[1].get(PERTURBATIONS, {}),
            params,
        )
        return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), dict(shapes))

    def __call__(self, params: Any, perturbations: Any) -> tuple[Any, dict[str, Any], tuple[Tap, ...]]:
        outputs, mutated = self._run(params, perturbations, [*self.carried, *self.collections])
        assert self.recorder is not None
        activations = recorded_values({c: mutated[c] for c in self.collections if c in mutated},
                                      self.recorder, self.taps.split_steps)
        return outputs, {c: mutated[c] for c in self.carried}, activations

    def gradients(self, perturbation_grads: Any) -> tuple[Tap, ...]:
        assert self.recorder is not None
        return recorded_values({PERTURBATIONS: perturbation_grads}, self.recorder, self.taps.split_steps)

    def finish(self, activations: Sequence[Tap], gradients: Sequence[Tap]) -> None:
        assert self.recorder is not None
        requested = [*self.taps.collections, *([PERTURBATIONS] if self.taps.model_perturbations else [])]
        warn_dropped(self.recorder, [*activations, *gradients], requested)


@functools.cache
def _scan_kwargs(cls: type, method: str) -> tuple[str, Mapping[str, Any]] | None:
    """``("class" | "method", nn.scan's arguments)`` when ``cls.method`` is
    lifted by ``nn.scan`` (a class made by it, or a method decorated with
    ``nn.transforms.scan``), else None. Flax keeps them only in the lifted
    method's closure."""
    function = next((c.__dict__[method] for c in cls.__mro__ if method in c.__dict__), None)
    if function is None:
        return None
    try:
        nonlocals = inspect.getclosurevars(function).nonlocals
    except (TypeError, ValueError):
        return None
    transform, kwargs = nonlocals.get("transform"), nonlocals.get("trafo_kwargs")
    if transform is not flax.core.lift.scan or not isinstance(kwargs, Mapping):
        return None
    return ("method" if "prewrapped_fns" in nonlocals else "class"), kwargs


def scan_axis(variable_axes: Mapping[Any, Any], collection: str) -> int | None:
    """The axis ``nn.scan`` stacks ``collection`` along, or None if it drops it."""
    for collection_filter, axis in variable_axes.items():
        if in_filter(collection_filter, collection) and axis is not None:
            return int(axis)
    return None


@dataclasses.dataclass(frozen=True)
class Scan:
    """A lifted scan whose body an instrumented call ran."""

    variable_axes: Mapping[Any, Any]  # the collections it hands out, stacked along an axis
    what: str  # the scan as a person finds it in the model
    fix: str  # how to make it hand out more collections, ``{axes}`` standing for them

    @property
    def recurrent(self) -> bool:
        """Every iteration shares the parameters: a recurrence, not a stack of layers."""
        return scan_axis(self.variable_axes, "params") is None


def _is_probe(module: nn.Module) -> bool:
    """Flax's abstract check of ``setup`` runs on a clone in a throw-away scope."""
    return isinstance(module.scope, TestScope)


class _LinenCallRecorder:
    """A method interceptor: ranks module calls as they complete, finds the scans
    they ran in, and perturbs the outputs of selected modules; sown values of the
    ``sown`` collections are attributed to the call that sowed them."""

    def __init__(
        self, perturb: ModuleFilter | None = None, capture: ModuleFilter | None = None,
        sown: Sequence[str] = (),
    ):
        self.perturb, self.capture, self.sown = perturb, capture, tuple(sown)
        self.order = CallOrder()
        #: (path, collection, name, entry) -> rank of the call that sowed that entry of the
        #: sown tuple (entry None: a value that is no tuple, by the call that last wrote it).
        self._sown_ranks: dict[tuple[tuple[str, ...], str, str, int | None], int] = {}
        self.scans: dict[tuple[str, ...], Scan] = {}  # path of the module a scan runs -> the scan
        #: (module path, variable or method) -> (module, method) of each perturbed / captured output.
        self.perturbed: dict[tuple[tuple[str, ...], str], tuple[nn.Module, str]] = {}
        self.captured: dict[tuple[tuple[str, ...], str], tuple[nn.Module, str]] = {}
        self._scanned_classes: dict[str, Mapping[Any, Any]] = {}  # name -> variable_axes
        self._rnn_cells: dict[tuple[str, ...], Scan] = {}  # path of an nn.RNN's cell -> its scan
        self.inside_scans: dict[tuple[str, ...], set[str]] = {}  # scan path -> collections wanted inside
        self._calls: dict[tuple[tuple[str, ...], str, int], int] = {}
        self._scopes: list[Any] = []  # keeps ids in _calls unique while recording
        self._running: list[tuple[tuple[str, ...], str]] = []  # (path, method) of the calls under way
        self._returned: dict[int, ReturnedBy] = {}  # id of each array a submodule returned -> its call
        #: The arrays of the model's captured output that a captured submodule returned.
        self.repeated_outputs: dict[int, ReturnedBy] = {}
        #: (path, variable) of the model's perturbed outputs that a perturbed submodule returned -> its path.
        self.repeated_sites: dict[tuple[tuple[str, ...], str], tuple[str, ...]] = {}

    def _outer(self, module: nn.Module, method: str) -> bool:
        """Not a module's method calling itself (``super().__call__``): only the
        outermost output of such a chain is its output."""
        return (module_path(module), method) not in self._running

    @property
    def capture_filter(self) -> Callable[[nn.Module, str], bool] | None:
        """The filter for ``capture_intermediates``, outermost calls only."""
        capture = self.capture
        if capture is None:
            return None
        return lambda module, method: self._outer(module, method) and capture(module, method)

    def _enter(self, module: nn.Module, method: str, path: tuple[str, ...]) -> None:
        """Notes the scan ``module`` runs in, if it is the root of a scan's body."""
        where = "/".join(path) or "the model"
        if isinstance(module, nn.RNN):
            cell = module_path(module.cell)
            self._rnn_cells[cell] = Scan(
                dict(module.variable_axes), f"nn.RNN {where!r} (its cell {'/'.join(cell)!r})",
                "build it as nn.RNN(cell, variable_axes={axes})",
            )
        if not path or isinstance(module.parent, nn.Module):
            return
        # The root of a lifted scope: the body of a transform.
        # mypy reads a class's own __hash__ as its objects' and so finds no class Hashable (false positive).
        lifted = _scan_kwargs(type(module), method)  # type: ignore[arg-type]
        if lifted is not None:  # a method decorated with nn.transforms.scan
            self.scans[path] = Scan(
                dict(lifted[1].get("variable_axes", {})),
                f"the nn.transforms.scan on {type(module).__name__}.{method} (module {where!r})",
                "pass variable_axes={axes} to that nn.transforms.scan",
            )
        elif path in self._rnn_cells:
            self.scans[path] = self._rnn_cells[path]
        elif path[-1] in self._scanned_classes:
            self.scans[path] = Scan(self._scanned_classes[path[-1]], f"nn.scan module {where!r}",
                                    "pass variable_axes={axes} to nn.scan")

    def __call__(self, next_fun: Callable[..., Any], args: Any, kwargs: Any, context: Any) -> Any:
        module, method = context.module, context.method_name
        if _is_probe(module):
            # The one intercepted call of a class made by nn.scan: its body runs on a clone,
            # the root of a new scope tree with the same name.
            lifted = _scan_kwargs(type(module), "__call__")  # type: ignore[arg-type]  # as in _enter
            if lifted is not None and lifted[0] == "class":
                self._scanned_classes[str(module.name)] = dict(lifted[1].get("variable_axes", {}))
            return next_fun(*args, **kwargs)
        path = module_path(module)
        self._enter(module, method, path)
        outer = self._outer(module, method)
        counted = outer and method != "setup"
        before = self._sown_state(module) if counted else {}
        self._running.append((path, method))
        try:
            output = next_fun(*args, **kwargs)
        finally:
            self._running.pop()
        if not counted:
            return output
        call = self._count(module, path, method)
        captured = self.capture is not None and self.capture(module, method)
        perturbed = self.perturb is not None and self.perturb(module, method)
        for scan in self.scans:
            if len(path) >= len(scan) and path[: len(scan)] == scan:
                wanted = self.inside_scans.setdefault(scan, set())
                if captured:
                    wanted.add(INTERMEDIATES)
                if perturbed:
                    wanted.add(PERTURBATIONS)
        if captured:
            self.captured[(path, method)] = (module, method)
        # Not a helper method the module calls itself (the recipe's ``self._relu``).
        outermost = all(running != path for running, _ in self._running)
        # Decided on the arrays themselves, before they leave the traced call.
        repeats = self._repeats(output) if not path and outermost else None
        if perturbed:
            output = self._perturbed(module, path, method, call, output, repeats)
        self._note_returned(output, path, captured, perturbed, repeats)
        rank = self.order.complete((path, method, call), outermost)
        self._note_sown(module, path, before, rank)
        return output

    def _count(self, module: nn.Module, path: tuple[str, ...], method: str) -> int:
        """Numbers this call of ``method`` from 0, per scope tree (nn.scan traces
        its body twice, each in a new one; a shared module's calls share one)."""
        assert module.scope is not None, "interceptors see bound modules"
        root = module.scope.root
        key = (path, method, id(root))
        call = self._calls.get(key, 0)
        self._calls[key] = call + 1
        self._scopes.append(root)
        return call

    def _sown_state(self, module: nn.Module) -> dict[tuple[str, str], Any]:
        """The values the module's own scope holds in the sown collections."""
        if not self.sown or module.scope is None:
            return {}
        variables = module.variables
        return {
            (collection, name): value
            for collection in self.sown
            for name, value in variables.get(collection, {}).items()
            if not isinstance(value, Mapping)  # a submodule's
        }

    def _note_sown(
        self, module: nn.Module, path: tuple[str, ...], before: Mapping[Any, Any], rank: int,
    ) -> None:
        """Attributes what the module sowed during this call: each entry a sow
        appended to a tuple, or a value (other reductions) it last wrote."""
        for (collection, name), value in self._sown_state(module).items():
            old = before.get((collection, name))
            if value is old:
                continue
            start = len(old) if isinstance(old, tuple) else 0
            if isinstance(value, tuple) and (old is None or isinstance(old, tuple)) and start <= len(value):
                for entry in range(start, len(value)):
                    self._sown_ranks.setdefault((path, collection, name, entry), rank)
            else:
                self._sown_ranks[(path, collection, name, None)] = rank

    def _repeats(self, output: Any) -> list[ReturnedBy | None]:
        """For each leaf of the model's output, the submodule call that returned this very array."""
        return [returned_by(self._returned, leaf) for leaf in jax.tree.leaves(output)]

    def _note_returned(
        self, output: Any, path: tuple[str, ...], captured: bool, perturbed: bool,
        repeats: list[ReturnedBy | None] | None,
    ) -> None:
        leaves = jax.tree.leaves(output)
        for leaf, source in zip(leaves, repeats or [None] * len(leaves), strict=True):
            if path:
                self._returned[id(leaf)] = ReturnedBy(leaf, path, captured, perturbed)
            elif source is not None and source.captured:
                # capture_intermediates records what the interceptors return: this leaf.
                self.repeated_outputs[id(leaf)] = ReturnedBy(leaf, source.path, True, source.perturbed)

    def _perturbed(
        self, module: nn.Module, path: tuple[str, ...], method: str, call: int, output: Any,
        repeats: list[ReturnedBy | None] | None = None,
    ) -> Any:
        leaves, treedef = jax.tree.flatten(output)
        name = method if call == 0 else f"{method}#{call}"
        for i, leaf in enumerate(leaves):
            if is_floating(leaf):
                variable = name if len(leaves) == 1 else f"{name}:{i}"
                self.perturbed[(path, variable)] = (module, method)
                source = repeats[i] if repeats is not None else None
                if source is not None and source.perturbed:
                    self.repeated_sites[(path, variable)] = source.path
                leaves[i] = module.perturb(variable, leaf)
        return jax.tree.unflatten(treedef, leaves)

    def sown_rank(self, path: tuple[str, ...], collection: str, name: str, entry: int | None) -> int:
        """The rank of the call that sowed ``entry`` of ``name`` (None: no tuple);
        the module's first call's if unknown."""
        return self._sown_ranks.get((path, collection, name, entry), self.order.rank(path))


def _perturbation_call(name: str) -> tuple[str, int]:
    """``__call__#2:1`` as ``("__call__", 2)``: the method and call it perturbs."""
    method, _, call = name.partition(":")[0].partition("#")
    return method, int(call) if call.isdigit() else 0


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
    scans: Mapping[tuple[str, ...], Scan],
    split_steps: bool,
) -> Iterator[tuple[tuple[str, ...], jax.Array]]:
    """One (display path, value) per layer of every scan the value passed through
    (a recurrence's time steps together unless ``split_steps``)."""
    enclosing = [s for s in scans if len(s) <= len(module) and module[: len(s)] == s]
    axes = []
    for scan in sorted(enclosing, key=len):
        axis = scan_axis(scans[scan].variable_axes, collection)
        if axis is not None and (split_steps or not scans[scan].recurrent):
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


def recorded_values(
    collections: Mapping[str, Mapping[str, Any]], recorder: _LinenCallRecorder, split_steps: bool = False,
) -> tuple[Tap, ...]:
    """Taps for every floating value in ``collections``, in the order the calls
    that made them completed; values a scan stacked split per layer (per time
    step of a recurrence only with ``split_steps``)."""
    found = Found()
    for collection, tree in collections.items():
        sites = list(variable_sites(tree))
        origins = {PERTURBATIONS: recorder.perturbed, INTERMEDIATES: recorder.captured}.get(collection, {})
        for module, key, value in sites:
            origin = origins.get((module, key))
            entries: Iterator[tuple[int, tuple[str, ...], Any]]
            if collection == PERTURBATIONS:
                siblings = {k for m, k, _ in sites if m == module}
                # An interceptor's site names its call; the model's own perturb sites do not.
                rank = recorder.order.call_rank((module, *_perturbation_call(key))) if origin is not None \
                    else recorder.order.rank(module)
                entries = iter([(rank, _perturbation_name(key, siblings), value)])
            elif origin is not None:  # a captured output: one entry per call
                entries = ((recorder.order.call_rank((module, key, call or 0)), name, array)
                           for call, name, array in sown_entries(value, (key,)))
            else:
                entries = ((recorder.sown_rank(module, collection, key, entry), name, array)
                           for entry, name, array in sown_entries(value, (key,)))
            for rank, name, array in entries:
                name = output_name(module, name) if origin is not None else name
                scanned = _split_scanned(module, name, array, collection, recorder.scans, split_steps)
                for display, layer_value in scanned:
                    tap = Tap("/".join(display), module, collection, layer_value, key, origin)
                    if origin is not None and not module:
                        tap = as_repeated(tap, _repeated(recorder, collection, key, layer_value))
                    found.add(rank, tap)
    return found.in_call_order()


def _repeated(
    recorder: _LinenCallRecorder, collection: str, key: str, value: jax.Array,
) -> tuple[str, ...] | None:
    """The path of the module whose output this tap of the model's output is, or None."""
    if collection == PERTURBATIONS:
        return recorder.repeated_sites.get(((), key))
    known = returned_by(recorder.repeated_outputs, value)
    return known.path if known is not None else None


def warn_dropped(recorder: _LinenCallRecorder, taps: Sequence[Tap], requested: Sequence[str]) -> None:
    """Warns once about each scan (``nn.scan``, ``nn.RNN``) that drops wanted
    values (selected inside it, or ``requested`` by name), naming the fix."""
    for path, scan in recorder.scans.items():
        inside = recorder.inside_scans.get(path, set())
        dropped = [
            c for c in dict.fromkeys([*sorted(inside), *requested])
            if scan_axis(scan.variable_axes, c) is None
            and not any(t.collection == c and t.module[: len(path)] == path for t in taps)
        ]
        if not dropped:
            continue
        made = [f"the {c!r} values made inside it" if c in inside else f"any {c!r} values put inside it"
                for c in dropped]
        axes = {**{str(k): v for k, v in scan.variable_axes.items()}, **dict.fromkeys(dropped, 0)}
        how = "reduced over its time steps" if scan.recurrent else "per layer"
        warnings.warn(
            f"{scan.what} drops {' and '.join(made)}, because its variable_axes {dict(scan.variable_axes)} "
            f"lacks {', '.join(map(repr, dropped))}: to log them ({how}), "
            f"{scan.fix.format(axes=axes)}",
            stacklevel=2,
        )
