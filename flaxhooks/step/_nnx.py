"""The model adapter for Flax NNX modules, and how an instrumented call records
inside one (see docs/guides/models.md and docs/architecture.md)."""

from __future__ import annotations

import contextlib
import functools
import re
import threading
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.nnx import variablelib

from flaxhooks.placement import Annotation
from flaxhooks.step._call import InputKeys, ModelCall
from flaxhooks.step._model import AXIS, Batch, share_index
from flaxhooks.step._recording import (
    CallOrder,
    Found,
    Path,
    ReturnedBy,
    as_repeated,
    is_floating,
    returned_by,
    sown_taps,
)
from flaxhooks.step._taps import (
    INTERMEDIATES,
    PERTURBATIONS,
    Interceptor,
    ModuleFilter,
    Tap,
    Taps,
    named_modules,
    output_name,
)


def collection_of(variable_type: type) -> str:
    """The collection of an NNX variable type: ``params``, ``batch_stats``,
    ``rngs`` (keys and counts), else the type's name in snake case."""
    if issubclass(variable_type, nnx.Param):
        return "params"
    if issubclass(variable_type, nnx.BatchStat):
        return "batch_stats"
    if issubclass(variable_type, nnx.RngState):
        return "rngs"
    return re.sub(r"(?<!^)(?=[A-Z])", "_", variable_type.__name__).lower()


def _get(tree: Mapping[str, Any], path: Path) -> Any:
    for key in path:
        tree = tree[key]
    return tree


def _put(tree: dict[Any, Any], path: Sequence[Any], value: Any) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


class _Leaf:
    """Where one variable of the module lives, and how its value is stored."""

    def __init__(self, path: tuple[Any, ...], variable: nnx.Variable):
        self.path = path  # as NNX names it (list indices stay ints)
        self.key: Path = tuple(str(p) for p in path)
        self.collection = collection_of(type(variable))
        # NNX never writes an RngKey (its count advances): the step keeps it and folds in the device.
        self.rng_key = isinstance(variable, nnx.RngKey)
        value = variable.get_value()
        # Typed PRNG keys are stored as raw data: checkpoints and np.asarray cannot take them.
        self.impl = jax.random.key_impl(value) if _is_typed_key(value) else None
        self.names = _annotation(variable.get_metadata())

    def stored(self, value: Any) -> Any:
        return jax.random.key_data(value) if self.impl is not None else value

    def live(self, value: Any) -> Any:
        return jax.random.wrap_key_data(value, impl=self.impl) if self.impl is not None else value


def _annotation(metadata: Mapping[str, Any]) -> Annotation | None:
    """``nnx.with_partitioning``'s mesh axes (``out_sharding``), if any, with
    NNX's own ``sharding_rules``."""
    names = metadata.get("out_sharding")
    if not names:  # None, or () as NNX writes "no sharding"
        return None
    rules = tuple((str(name), axes) for name, axes in metadata.get("sharding_rules") or ())
    return Annotation(tuple(getattr(names, "spec", names)), logical=False, rules=rules)


def _is_typed_key(value: Any) -> bool:
    return hasattr(value, "dtype") and jax.dtypes.issubdtype(value.dtype, jax.dtypes.prng_key)


class NNXModel:
    """A Flax NNX module as the Trainer calls it.

    Args:
        module: the user's ``nnx.Module`` (not changed until :meth:`update`).
        input_keys: batch keys passed to the model positionally, in order,
            or ``{argument: batch key}`` passed by keyword.
        train_arg: a ``__call__`` parameter telling the model it trains, if it
            names one (``deterministic`` too); NNX's ``train()`` / ``eval()``
            switch is always used.
        axis_name: the device axis every ``nnx.BatchNorm`` of the train-mode
            copy reduces over (docs/guides/models.md).

    Examples:
        >>> from flax import nnx
        >>> from flaxhooks.step import NNXModel
        >>> model = NNXModel(nnx.Linear(2, 3, rngs=nnx.Rngs(0)), "x")
        >>> sorted(model.variable_paths())
        ['params']
    """

    rng_names: tuple[str, ...] = ()  # the model carries its own nnx.Rngs

    def __init__(self, module: nnx.Module, input_keys: InputKeys = ("image",),
                 train_arg: str | None = None, axis_name: str = AXIS):
        self.module, self.axis_name = module, axis_name
        self.call = ModelCall.of(type(module).__call__, input_keys, train_arg)
        self.input_keys = self.call.input_keys
        template = nnx.clone(module)
        # Values sown or perturbed outside nnx.capture are attributes: per-step values, never state.
        nnx.pop(template, nnx.Intermediate)
        template.set_attributes(nnx.BatchNorm, axis_name=axis_name, raise_if_not_found=False)
        template.train()
        self._train_def, state = nnx.split(template)
        template.eval()
        self._eval_def, _ = nnx.split(template)
        self._leaves = [_Leaf(path, variable) for path, variable in nnx.to_flat_state(state)]

    def __repr__(self) -> str:
        return f"NNXModel({type(self.module).__name__}, input_keys={self.input_keys})"

    def variable_paths(self) -> dict[str, list[Path]]:
        """The variable paths of each collection."""
        found: dict[str, list[Path]] = {}
        for leaf in self._leaves:
            found.setdefault(leaf.collection, []).append(leaf.key)
        return found

    def _by_collection(self, value: Callable[[_Leaf], Any]) -> dict[str, Any]:
        grouped: dict[str, Any] = {}
        for leaf in self._leaves:
            _put(grouped.setdefault(leaf.collection, {}), leaf.key, value(leaf))
        return grouped

    def _collections(self, module: nnx.Module) -> dict[str, Any]:
        flat = dict(nnx.to_flat_state(nnx.state(module)))
        return self._by_collection(lambda leaf: leaf.stored(flat[leaf.path].get_value()))

    def own_variables(self) -> dict[str, Any]:
        """The module's current values by collection (concrete arrays)."""
        return self._collections(self.module)

    def annotations(self, key: Any, batch: Batch) -> dict[str, Any]:
        """Each variable's axis names from ``nnx.with_partitioning`` (None where it has none)."""
        del key, batch
        return self._by_collection(lambda leaf: leaf.names)

    def init(self, key: jax.Array, batch: Batch) -> dict[str, Any]:
        """The module's own values: an NNX module comes initialized."""
        del key, batch
        return self.own_variables()

    def carried(self, variables: Mapping[str, Any], batch: Batch) -> tuple[str, ...]:
        """Every collection but ``params``: BatchNorm statistics, RNG keys and counts."""
        del batch
        return tuple(c for c in variables if c != "params")

    def merged(self, params: Any, model_state: Mapping[str, Any], *, train: bool) -> nnx.Module:
        """A module of the train- or eval-mode graph holding these values (in train
        mode on several devices, RNG keys folded with the device index)."""
        folds = train and any(leaf.rng_key for leaf in self._leaves)
        devices = jax.lax.psum(1, self.axis_name) if folds else 1
        nested = self._leaf_values({"params": params, **model_state}, per_device=devices > 1)
        return nnx.merge(self._train_def if train else self._eval_def, nested)

    def _new_state(self, module: nnx.Module, model_state: Mapping[str, Any]) -> dict[str, Any]:
        """The carried state after a train-mode call, RNG keys as they were (the counts advanced)."""
        after = self._collections(module)
        for leaf in self._leaves:
            if leaf.rng_key:
                _put(after[leaf.collection], leaf.key, _get(model_state[leaf.collection], leaf.key))
        return {c: after[c] for c in model_state}

    def _call(self, module: nnx.Module, batch: Batch, train: bool) -> Any:
        args, kwargs = self.call.arguments(batch, train=train)
        return module(*args, **kwargs)

    def apply(
        self, params: Any, model_state: Mapping[str, Any], batch: Batch, *, train: bool,
        rngs: Mapping[str, jax.Array],
    ) -> tuple[Any, dict[str, Any]]:
        del rngs  # the model draws from its own nnx.Rngs
        module = self.merged(params, model_state, train=train)
        # Under nnx.capture with no variable types the model's sow and perturb calls do nothing.
        outputs = nnx.capture(lambda m: self._call(m, batch, train))(module)
        return outputs, (self._new_state(module, model_state) if train else dict(model_state))

    def tap(
        self, model_state: Mapping[str, Any], batch: Batch, *, rngs: Mapping[str, jax.Array], taps: Taps,
    ) -> _NNXRecordedCall:
        del rngs
        return _NNXRecordedCall(self, model_state, batch, taps)

    def update(self, params: Any, model_state: Mapping[str, Any]) -> None:
        """Writes trained values into the user's module (``nnx.update``)."""
        nnx.update(self.module, self._leaf_values({"params": params, **model_state}))

    def tabulate(self, batch: Batch, carried: Sequence[str], **options: Any) -> str:
        """``nnx.tabulate`` of the eval-mode model on zeros like ``batch``, traced
        under ``jax.eval_shape``; its total counts ``nnx.Param`` only."""
        del carried
        options.pop("show_repeated", None)
        console = {"force_terminal": False, **options.pop("console_kwargs", {})}
        inputs, kwargs = self.call.zero_arguments(batch)
        table: list[str] = []

        def rows(info: Any) -> bool:
            own_sites = bool(info.path) and info.path[-1] in ("sow", "perturb")
            return nnx.summary.filter_rng_streams(info) and not own_sites

        def render(module: nnx.Module) -> None:
            table.append(nnx.tabulate(module, *inputs, row_filter=rows, console_kwargs=console, **options,
                                      **kwargs))

        own = self.own_variables()
        jax.eval_shape(lambda values: nnx.capture(render)(nnx.merge(self._eval_def, values)),
                       self._leaf_values(own))
        leaves = jax.tree.leaves(own["params"])
        params = sum(int(np.prod(np.shape(x))) for x in leaves)
        size = sum(int(np.prod(np.shape(x))) * np.dtype(x.dtype).itemsize for x in leaves)
        return re.sub(r"Total Parameters: [\d,]+ \([^)]*\)",
                      f"Total Parameters: {params:,} ({_bytes(size)}, nnx.Param only)", table[0])

    def _leaf_values(self, collections: Mapping[str, Any], per_device: bool = False) -> dict[Any, Any]:
        """The values as NNX nests them, typed keys rewrapped (and, with
        ``per_device``, folded with the device index)."""
        nested: dict[Any, Any] = {}
        for leaf in self._leaves:
            value = leaf.live(_get(collections[leaf.collection], leaf.key))
            if leaf.rng_key and per_device:
                value = jax.random.fold_in(value, share_index(self.axis_name))
            _put(nested, leaf.path, value)
        return nested


def _bytes(size: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if size < 1000 or unit == "GB":
            return f"{size:,.0f} {unit}" if unit == "B" else f"{size:,.1f} {unit}"
        size /= 1000
    raise AssertionError


# --- recording module outputs -------------------------------------------------------------------

_active = threading.local()
_patch_lock = threading.Lock()
#: class -> (its own __call__, users, the wrapper put in its place)
_patched: dict[type, tuple[Callable[..., Any], int, Any]] = {}


def _owner_of_call(cls: type) -> type | None:
    return next((klass for klass in cls.__mro__ if "__call__" in klass.__dict__), None)


def _recording_call(original: Callable[..., Any]) -> Callable[..., Any]:
    def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
        recorder = getattr(_active, "recorder", None)
        if recorder is None:
            return original(self, *args, **kwargs)
        return recorder.call(original, self, args, kwargs)

    # Name and docstring only: markers other patchers keep in __dict__ stay theirs.
    return functools.update_wrapper(__call__, original, updated=())


@contextlib.contextmanager
def _recording(recorder: _NNXCallRecorder, classes: set[type]) -> Iterator[None]:
    """Wraps the ``__call__`` of ``classes`` while ``recorder`` records on this
    thread; other threads, and modules outside its graph, run unchanged."""
    owners = {owner for cls in classes if (owner := _owner_of_call(cls)) is not None}
    with _patch_lock:
        for owner in owners:
            original, users, wrapper = _patched.get(owner, (owner.__dict__["__call__"], 0, None))
            if users == 0:
                wrapper = _recording_call(original)
                owner.__call__ = wrapper  # type: ignore[method-assign]
            _patched[owner] = (original, users + 1, wrapper)
    previous = getattr(_active, "recorder", None)
    _active.recorder = recorder
    try:
        yield
    finally:
        _active.recorder = previous
        with _patch_lock:
            for owner in owners:
                original, users, wrapper = _patched[owner]
                if users > 1:
                    _patched[owner] = (original, users - 1, wrapper)
                    continue
                del _patched[owner]
                if owner.__dict__.get("__call__") is wrapper:  # not patched again since, by someone else
                    owner.__call__ = original  # type: ignore[method-assign]


class CallContext(NamedTuple):
    """What an interceptor learns of an NNX module call (as Linen's ``InterceptorContext``)."""

    module: Any
    method_name: str
    orig_method: Callable[..., Any]


def _intercepted(original: Callable[..., Any], module: Any,
                 interceptors: Sequence[Interceptor]) -> Callable[..., Any]:
    """``module.__call__`` wrapped by ``interceptors``, the last one innermost (as Linen nests them)."""
    run = functools.partial(original, module)
    context = CallContext(module, "__call__", run)
    for interceptor in interceptors:
        run = functools.partial(lambda i, f, *a, **k: i(f, a, k, context), interceptor, run)
    return run


class _NNXCallRecorder:
    """Records the outputs of the modules of one graph, in the order their
    calls complete, and adds perturbations to the selected ones."""

    def __init__(self, root: nnx.Module, capture: ModuleFilter | None, perturb: ModuleFilter | None,
                 perturbations: Mapping[str, jax.Array] | None, intercept: Sequence[Interceptor] = ()):
        self.intercept = tuple(intercept)
        self.modules = {id(m): (tuple(str(p) for p in path), m) for path, m in nnx.iter_modules(root)}
        self.capture, self.perturb, self.perturbations = capture, perturb, perturbations
        self.order = CallOrder()
        self.calls: dict[Path, int] = {}
        # (path, call, leaf, leaves, value or perturbation key, module) of each captured / perturbed output
        self.outputs: list[tuple[Path, int, int, int, Any, nnx.Module]] = []
        self.perturbed: list[tuple[Path, int, int, int, Any, nnx.Module]] = []
        self.shapes: dict[str, jax.ShapeDtypeStruct] = {}
        self.unseen: dict[str, str] = {}  # type of a module run inside a transform -> its caller
        self._returned: dict[int, ReturnedBy] = {}  # id of each array a submodule returned -> its call
        #: (call, leaf) of the model's outputs that a captured / perturbed submodule returned -> its path.
        self.repeated_outputs: dict[tuple[int, int], Path] = {}
        self.repeated_sites: dict[tuple[int, int], Path] = {}
        self._stack: list[Any] = []
        self._trace = nnx.tracers.TraceState()  # the trace of the instrumented call

    def call(self, original: Callable[..., Any], module: Any, args: Any, kwargs: Any) -> Any:
        known = self.modules.get(id(module))
        if known is not None and not self._trace.is_valid():
            known = None  # inside a JAX transform (jax.vmap, lax.scan, ...): its values cannot leave it
        if known is None or (self._stack and self._stack[-1] is module):  # unknown, or a super() call
            if known is None:
                caller = self._stack[-1] if self._stack else None
                path = self.modules[id(caller)][0] if caller is not None else ()
                where = "/".join(path) or "the model"
                named = f"{where!r} ({type(caller).__name__})" if caller is not None else where
                self.unseen.setdefault(type(module).__name__, named)
            return original(module, *args, **kwargs)
        path, _ = known
        self._stack.append(module)
        try:
            output = _intercepted(original, module, self.intercept)(*args, **kwargs)
        finally:
            self._stack.pop()
        call = self.calls.get(path, 0)
        self.calls[path] = call + 1
        leaves, treedef = jax.tree.flatten(output)
        floating = [i for i, x in enumerate(leaves) if is_floating(x)]
        captured = self.capture is not None and self.capture(module, "__call__")
        perturbed = self.perturb is not None and self.perturb(module, "__call__")
        if not path:  # the model's output: does it repeat a submodule's, the very same array?
            self._note_repeats(call, [leaves[i] for i in floating])
        if captured:
            for n, i in enumerate(floating):
                self.outputs.append((path, call, n, len(floating), leaves[i], module))
        if perturbed:
            for n, i in enumerate(floating):
                key = "/".join((*path, "__call__", str(call), str(n)))
                self.perturbed.append((path, call, n, len(floating), key, module))
                if self.perturbations is None:
                    self.shapes[key] = jax.ShapeDtypeStruct(leaves[i].shape, leaves[i].dtype)
                else:
                    leaves[i] = leaves[i] + self.perturbations[key]
            output = jax.tree.unflatten(treedef, leaves)
        if path:
            for leaf in jax.tree.leaves(output):  # as the caller receives them
                self._returned[id(leaf)] = ReturnedBy(leaf, path, captured, perturbed)
        self.order.complete((path, "__call__", call))
        return output

    def _note_repeats(self, call: int, outputs: Sequence[jax.Array]) -> None:
        """Notes which of the model's floating outputs are the very arrays a
        captured (perturbed) submodule returned."""
        for n, leaf in enumerate(outputs):
            source = returned_by(self._returned, leaf)
            if source is not None and source.captured:
                self.repeated_outputs[(call, n)] = source.path
            if source is not None and source.perturbed:
                self.repeated_sites[(call, n)] = source.path

    def taps(self, found: Found, collection: str, value: Callable[[Any], jax.Array]) -> None:
        """Adds the captured (``intermediates``) or perturbed outputs to ``found``."""
        captured = collection == INTERMEDIATES
        repeated = self.repeated_outputs if captured else self.repeated_sites
        for path, call, leaf, leaves, recorded, source in self.outputs if captured else self.perturbed:
            parts = [*path, *output_name(path, ())]
            if self.calls.get(path, 1) > 1:
                parts.append(str(call))
            if leaves > 1:
                parts.append(str(leaf))
            tap = Tap("/".join(parts), path, collection, value(recorded), "__call__", (source, "__call__"))
            if not path:
                tap = as_repeated(tap, repeated.get((call, leaf)))
            found.add(self.order.call_rank((path, "__call__", call)), tap)


def _sown_types(collections: Sequence[str]) -> dict[type, str]:
    """The NNX variable types of the ``sow`` collections named (``intermediates``:
    ``nnx.Intermediate``), subclasses first so each value is read under its own type."""
    found: dict[type, str] = {}
    for name in collections:
        try:
            found.setdefault(variablelib.variable_type_from_name(name, allow_register=False), name)
        except ValueError:
            continue  # no such variable type: nothing can be sown into it
    ordered = sorted(found, key=lambda t: -len(t.__mro__))
    return {t: found[t] for t in ordered}


class _NNXRecordedCall:
    """One instrumented call of an NNX model (see :class:`~flaxhooks.step.RecordedCall`)."""

    def __init__(self, model: NNXModel, model_state: Mapping[str, Any], batch: Batch, taps: Taps):
        self.model, self.model_state, self.batch, self.taps = model, model_state, batch, taps
        self.sown = {t: n for t, n in _sown_types(taps.sown_collections).items() if t is not nnx.Perturbation}
        # nnx.Perturbation first: it subclasses nnx.Intermediate.
        self.types = [*([nnx.Perturbation] if taps.model_perturbations else []), *self.sown]
        self.recorder: _NNXCallRecorder | None = None

    def _run(
        self, params: Any, perturbations: Mapping[str, Any] | None,
    ) -> tuple[Any, nnx.Module, dict[type, Any]]:
        module = self.model.merged(params, self.model_state, train=True)
        outputs = None if perturbations is None else perturbations.get("outputs", {})
        recorder = self.recorder = _NNXCallRecorder(module, self.taps.capture, self.taps.perturb, outputs,
                                                    self.taps.intercept)
        init = None
        if perturbations is not None and perturbations.get("model"):
            init = _as_variables(perturbations["model"], nnx.Perturbation)
        classes = {type(m) for _, m in recorder.modules.values()}
        with _recording(recorder, classes), named_modules([(m, p) for p, m in recorder.modules.values()]):
            def call(module: nnx.Module) -> Any:
                return self.model._call(module, self.batch, True)

            # flax annotates init as an nnx.State, but documents (and walks) any mutable mapping.
            result = nnx.capture(call, *self.types, init=init)(module)  # type: ignore[arg-type]
        if not self.types:
            return result, module, {}
        output, *states = result
        return output, module, dict(zip(self.types, states, strict=True))

    def perturbations(self, params: Any) -> Any:
        if not self.taps.wants_gradients:
            return {}

        def shapes(params: Any) -> Any:
            _, _, captured = self._run(params, None)
            assert self.recorder is not None
            model = nnx.to_pure_dict(captured[nnx.Perturbation]) if nnx.Perturbation in captured else {}
            return {"outputs": dict(self.recorder.shapes), "model": model}

        found = jax.eval_shape(shapes, params)
        return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), found)

    def __call__(self, params: Any, perturbations: Any) -> tuple[Any, dict[str, Any], tuple[Tap, ...]]:
        outputs, module, captured = self._run(params, perturbations or {})
        recorder = self.recorder
        assert recorder is not None
        found = Found()
        recorder.taps(found, INTERMEDIATES, lambda value: value)
        for var_type, state in captured.items():
            if var_type is not nnx.Perturbation:
                for tap in sown_taps(nnx.to_pure_dict(state), self.sown[var_type]):
                    found.add(recorder.order.rank(tap.module), tap)
        return outputs, self.model._new_state(module, self.model_state), found.in_call_order()

    def gradients(self, perturbation_grads: Any) -> tuple[Tap, ...]:
        recorder = self.recorder
        assert recorder is not None
        if not perturbation_grads:
            return ()
        found = Found()
        recorder.taps(found, PERTURBATIONS, lambda key: perturbation_grads["outputs"][key])
        for tap in sown_taps(perturbation_grads.get("model", {}), PERTURBATIONS):
            found.add(recorder.order.rank(tap.module), tap)
        return found.in_call_order()

    def finish(self, activations: Sequence[Tap], gradients: Sequence[Tap]) -> None:
        recorder = self.recorder
        assert recorder is not None
        wanted = self.taps.capture is not None or self.taps.perturb is not None
        if wanted and recorder.unseen:
            callers = sorted(set(recorder.unseen.values()))
            warnings.warn(
                f"modules of type {sorted(recorder.unseen)} ran inside a JAX or NNX transform "
                f"(nnx.RNN, nnx.scan, nnx.vmap, jax.vmap, lax.scan, ...) called by {', '.join(callers)}: "
                "their outputs cannot leave the transform, so only the output of the module that calls it "
                "is logged; to log them, call them from Python (for a recurrence, a loop over the time "
                "steps calling the cell: one value per step) instead of through the transform",
                stacklevel=2,
            )


def _as_variables(tree: Mapping[Any, Any], variable_type: type) -> dict[Any, Any]:
    """Module dicts as they are, each variable's value (any pytree) wrapped whole."""
    return {key: _as_variables(value, variable_type) if isinstance(value, Mapping) else variable_type(value)
            for key, value in tree.items()}
