"""Where arrays live: one mesh, the batch split over its data axis, the state by a rule or annotations."""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

#: The default name of the mesh axis the batch is split over.
DATA_AXIS = "data"

#: Logical axis rules: ``(logical name, mesh axis or axes or None)`` pairs, as
#: ``flax.linen.logical_axis_rules`` takes them.
AxisRules = Sequence[tuple[str, "str | tuple[str, ...] | None"]]


class ShardingError(ValueError):
    """A mesh, a sharding rule or an annotation that cannot place its arrays (raised before compiling)."""


class ShardRule(Protocol):
    """How an unannotated leaf of the train state is placed: :class:`Replicated` or :class:`FSDP`."""

    def spec(self, shape: tuple[int, ...], mesh: Mesh) -> PartitionSpec:
        """The leaf's partition over ``mesh``."""

    def check(self, mesh: Mesh) -> None:
        """Raises ShardingError if the rule names an axis ``mesh`` lacks."""


@dataclasses.dataclass(frozen=True)
class Replicated:
    """Every leaf whole on every device: data parallelism (the default).

    Examples:
        >>> import flaxhooks
        >>> flaxhooks.Replicated()
        Replicated()
    """

    def spec(self, shape: tuple[int, ...], mesh: Mesh) -> PartitionSpec:
        return PartitionSpec()

    def check(self, mesh: Mesh) -> None:
        return None


@dataclasses.dataclass(frozen=True)
class FSDP:
    """Fully sharded data parallelism: each leaf split over ``axis`` along its largest dimension it divides.

    Leaves under ``min_size`` elements, or with no such dimension, stay
    replicated; an annotated leaf is split along a dimension it leaves whole.

    Examples:
        >>> import flaxhooks
        >>> flaxhooks.FSDP("data").axis
        'data'
    """

    axis: str = DATA_AXIS
    min_size: int = 1024

    def spec(self, shape: tuple[int, ...], mesh: Mesh) -> PartitionSpec:
        return self.extend(PartitionSpec(), shape, mesh)

    def extend(self, spec: PartitionSpec, shape: tuple[int, ...], mesh: Mesh) -> PartitionSpec:
        """An annotated leaf's ``spec``, also split over ``axis`` along its largest whole dimension."""
        named = [p for part in spec for p in _axes_of(part)]
        ways = mesh.shape[self.axis]
        if self.axis in named or ways == 1 or math.prod(shape) < self.min_size:
            return spec
        parts = list(spec) + [None] * (len(shape) - len(spec))
        free = [d for d in range(len(shape)) if parts[d] is None and shape[d] % ways == 0]
        if not free:
            return spec
        parts[max(free, key=lambda d: (shape[d], -d))] = self.axis
        return PartitionSpec(*parts)

    def check(self, mesh: Mesh) -> None:
        if self.axis not in mesh.shape:
            raise ShardingError(
                f"FSDP shards over mesh axis {self.axis!r}, which the mesh lacks (its axes: "
                f"{dict(mesh.shape)}): name one of them, e.g. FSDP({next(iter(mesh.shape))!r})")


def default_mesh(devices: Sequence[jax.Device] | None = None, axis: str = DATA_AXIS) -> Mesh:
    """One ``axis`` over ``devices`` (default: every device of every process), with automatic sharding."""
    if devices is None:
        return jax.make_mesh((jax.device_count(),), (axis,), axis_types=(AxisType.Auto,))
    return Mesh(np.asarray(list(devices)), (axis,), axis_types=(AxisType.Auto,))


def _axes_of(part: Any) -> tuple[str, ...]:
    """A spec entry's (or a rule's target's) mesh axes: one name, several, or none."""
    return (part,) if isinstance(part, str) else tuple(part or ())


def _spec_text(spec: PartitionSpec) -> str:
    return "P(" + ", ".join(repr(p) for p in spec) + ")"


@dataclasses.dataclass(frozen=True)
class Annotation:
    """A variable's sharding annotation, as the model wrote it.

    Attributes:
        names: one axis name (or None) per leading dimension.
        logical: logical names (unmapped: whole), else mesh-axis names (unmapped: must be a mesh axis).
        rules: the variable's own logical axis rules, tried before the Trainer's.

    Examples:
        >>> Annotation(("embed", "mlp")).logical
        True
    """

    names: tuple[Any, ...]
    logical: bool = True
    rules: tuple[tuple[str, Any], ...] = ()


def _assign(names: Sequence[Any], rules: AxisRules) -> list[tuple[str, ...] | None]:
    """Each dimension's mesh axes by ``rules``, as ``nn.logical_to_mesh_axes`` does; None: unassigned."""
    axes: list[tuple[str, ...] | None] = [
        None if isinstance(name, str) else tuple(name) if isinstance(name, tuple | list) else ()
        for name in names]
    for logical, target in rules:
        if logical not in names:
            continue
        dim = list(names).index(logical)
        parts = _axes_of(target)
        taken = {p for assigned in axes if assigned for p in assigned}
        if axes[dim] is None and not taken & set(parts):
            axes[dim] = parts
    return axes


def ambiguous_split(spec: PartitionSpec, named: int, mesh: Mesh) -> int | None:
    """The first dimension after the first that a shorter annotation of ``named`` names splits, or None.

    Which dimension such a name meant is ambiguous (docs/guides/mesh.md).

    Examples:
        >>> import jax, numpy as np
        >>> from jax.sharding import Mesh
        >>> mesh = Mesh(np.asarray(jax.devices()[:1]).reshape(1, 1), ("data", "model"))
        >>> ambiguous_split(PartitionSpec(None, "model", None), 2, mesh) is None  # model has 1 device
        True
    """
    if named >= len(spec):
        return None
    split = (dim for dim in range(1, named) if math.prod(mesh.shape[p] for p in _axes_of(spec[dim])) > 1)
    return next(split, None)


@dataclasses.dataclass(frozen=True)
class Placement:
    """The mesh a fit runs on and where each array lives.

    """

    mesh: Mesh
    data_axis: str = DATA_AXIS
    rule: ShardRule = Replicated()
    axis_rules: tuple[tuple[str, Any], ...] = ()
    # The ambiguous annotations warned of, each once.
    _warned: set[Any] = dataclasses.field(default_factory=set, init=False, repr=False, compare=False)

    @classmethod
    def of(cls, mesh: Mesh | None, devices: Sequence[jax.Device] | None, data_axis: str, rule: ShardRule,
           axis_rules: AxisRules | None) -> Placement:
        """Checks the pieces against each other, before anything compiles.

        Raises:
            ShardingError: an axis is not the mesh's, or this process sees none of its devices.
        """
        if mesh is not None and devices:
            raise ShardingError("give devices= or mesh=, not both: a mesh names its devices")
        if devices and jax.process_count() > 1:
            raise ShardingError(
                f"devices= picks local devices, but this run has {jax.process_count()} processes: every "
                "compiled step spans every device of every process, so leave devices out")
        mesh = mesh if mesh is not None else default_mesh(devices, data_axis)
        if data_axis not in mesh.shape:
            raise ShardingError(
                f"the batch is split over mesh axis {data_axis!r}, which the mesh lacks (its axes: "
                f"{dict(mesh.shape)}): name the data axis with Trainer(data_axis=...)")
        rule.check(mesh)
        rules = tuple((str(name), target) for name, target in (axis_rules or ()))
        for name, target in rules:
            for axis in _axes_of(target):
                if axis not in mesh.shape:
                    raise ShardingError(
                        f"axis_rules maps logical axis {name!r} to mesh axis {axis!r}, which the mesh "
                        f"lacks (its axes: {dict(mesh.shape)})")
        local = {d.id for d in jax.local_devices()}
        if not any(d.id in local for d in mesh.devices.flat):
            raise ShardingError(
                f"the mesh's devices {[d.id for d in mesh.devices.flat]} are none of this process's "
                f"{sorted(local)}: build the mesh from jax.devices()")
        if jax.process_count() > 1 and {d.process_index for d in mesh.devices.flat} != set(
                range(jax.process_count())):
            raise ShardingError("on several processes the mesh must span every process's devices")
        return cls(mesh, data_axis, rule, rules)

    @property
    def data_size(self) -> int:
        """How many ways the batch is split."""
        return int(self.mesh.shape[self.data_axis])

    @property
    def local_devices(self) -> list[jax.Device]:
        """This process's devices of the mesh."""
        return [d for d in self.mesh.devices.flat if d.process_index == jax.process_index()]

    @functools.cached_property
    def local_data_size(self) -> int:
        """How many of the batch's parts this process feeds."""
        where = self.batch_sharding.devices_indices_map((self.data_size,))
        return max(len({where[d][0].start for d in self.local_devices}), 1)

    @functools.cached_property
    def platform(self) -> str:
        """The mesh's devices' platform: ``"cpu"``, ``"gpu"``, ``"tpu"``."""
        return str(self.mesh.devices.flat[0].platform)

    @functools.cached_property
    def replicated(self) -> NamedSharding:
        """Whole on every device of the mesh."""
        return NamedSharding(self.mesh, PartitionSpec())

    @functools.cached_property
    def spread(self) -> NamedSharding | None:
        """An array's first axis split over every device (None unless every axis is ``AxisType.Auto``)."""
        if any(kind != AxisType.Auto for kind in self.mesh.axis_types):
            return None
        return NamedSharding(self.mesh, PartitionSpec(tuple(self.mesh.axis_names)))

    @functools.cached_property
    def batch_sharding(self) -> NamedSharding:
        """Split along the first axis over the data axis."""
        return NamedSharding(self.mesh, PartitionSpec(self.data_axis))

    def describe(self) -> str:
        """e.g. ``mesh data=4, model=2``."""
        return "mesh " + ", ".join(f"{name}={size}" for name, size in self.mesh.shape.items())

    def mesh_spec(self, names: Annotation | Sequence[Any] | None, where: str,
                  shape: tuple[int, ...]) -> PartitionSpec:
        """An annotation as mesh axes, read as Flax and JAX read it (docs/guides/mesh.md), and checked.

        Warns once per leaf whose shorter annotation is ambiguous (:func:`ambiguous_split`).

        Raises:
            ShardingError: too many names, a name twice, a mesh axis lacking
                or used twice, or a dimension its mesh axes do not divide.

        Examples:
            >>> import jax, numpy as np
            >>> from jax.sharding import Mesh
            >>> mesh = Mesh(np.asarray(jax.devices()[:1]).reshape(1, 1), ("data", "model"))
            >>> placement = Placement(mesh, axis_rules=(("mlp", "model"),))
            >>> placement.mesh_spec(("embed", "mlp"), "kernel", (16, 64))
            P(None, 'model')
        """
        annotation = names if isinstance(names, Annotation) else Annotation(tuple(names or ()))
        names = annotation.names
        if len(names) > len(shape):
            raise ShardingError(
                f"{where} of shape {shape} is annotated with {len(names)} axes {names}, more than its "
                f"{len(shape)} dimensions")
        twice = sorted({n for n in names if isinstance(n, str) and names.count(n) > 1})
        if twice:
            raise ShardingError(f"{where} of shape {shape} names axis {twice[0]!r} more than once: {names}")
        rules = (*annotation.rules, *self.axis_rules)
        axes = _assign(names, rules)
        for dim, name in enumerate(names):
            if axes[dim] is not None:
                continue
            if any(logical == name for logical, _ in rules):
                axes[dim] = ()  # its rules' mesh axes went to other dimensions: whole, as in Flax
            elif name in self.mesh.shape:
                axes[dim] = (name,)  # a mesh axis no rule renames (as flaxhooks 0.7 read logical names too)
            elif annotation.logical:
                axes[dim] = ()  # Flax: a logical name no rule maps stays whole
            else:
                known = (f"axis_rules names {sorted({r for r, _ in rules})}" if rules
                         else "no axis_rules were given")
                raise ShardingError(
                    f"{where} of shape {shape} names axis {name!r}, which is neither a mesh axis "
                    f"({list(self.mesh.shape)}) nor a logical axis of the rules ({known}): pass "
                    "Trainer(axis_rules=[(name, mesh axis or None), ...])")
        used: list[str] = []
        for dim, (size, name, parts) in enumerate(zip(shape, names, axes, strict=False)):
            assert parts is not None  # the loop above gave every named dimension its mesh axes
            for part in parts:
                if part not in self.mesh.shape:
                    raise ShardingError(
                        f"{where} of shape {shape}: axis {name!r} maps to mesh axis {part!r}, which the mesh "
                        f"lacks (its axes: {dict(self.mesh.shape)})")
                if part in used:
                    raise ShardingError(
                        f"{where} of shape {shape} splits two dimensions over mesh axis {part!r}")
                used.append(part)
            ways = math.prod(self.mesh.shape[p] for p in parts)
            if size % ways:
                raise ShardingError(
                    f"{where} of shape {shape}: dimension {dim} of size {size} ({name!r} -> mesh "
                    f"{parts if len(parts) != 1 else parts[0]!r}) does not divide over {ways} devices")
        spec = PartitionSpec(*(None if not p else p[0] if len(p) == 1 else p for p in axes),
                             *[None] * (len(shape) - len(names)))
        split = ambiguous_split(spec, len(names), self.mesh)
        if split is not None and (where, shape, spec) not in self._warned:
            self._warned.add((where, shape, spec))
            warnings.warn(
                f"{where} of shape {shape} is annotated with {len(names)} axes {names} for its "
                f"{len(shape)} dimensions: as JAX reads a shorter PartitionSpec they name the leading "
                f"dimensions and the rest stay whole, which splits dimension {split} (size {shape[split]}) "
                f"as {_spec_text(spec)}. Names written for a flattened kernel (flax's DenseGeneral, "
                "MultiHeadDotProductAttention) may have meant another dimension: name all "
                f"{len(shape)} to say which", UserWarning, stacklevel=2)
        return spec

    def state_shardings(self, state: Any, annotated: Mapping[str, Any] | None = None) -> Any:
        """The sharding of every leaf of the (abstract) train state ``state``.

        Variables follow their annotation in ``annotated`` (``{collection: tree
        of axis names}``), else the rule; optimizer leaves follow the parameter
        they mirror (path suffix and shape); step and rng are replicated.
        """
        known: dict[tuple[str, tuple[int, ...]], PartitionSpec] = {}
        variables = {"params": state.params, **dict(state.model_state)}
        for collection, tree in variables.items():
            names = (annotated or {}).get(collection)
            flat = jax.tree_util.tree_flatten_with_path(tree)[0]
            named = _names_by_path(names) if names is not None else {}
            for path, leaf in flat:
                key = jax.tree_util.keystr(path)
                shape = tuple(leaf.shape)
                where = f"{collection}{key}"
                if named.get(key) is not None:
                    spec = self.mesh_spec(named[key], where, shape)
                    extend = getattr(self.rule, "extend", None)
                    spec = extend(spec, shape, self.mesh) if extend else spec
                else:
                    spec = self.rule.spec(shape, self.mesh)
                known[(where if collection != "params" else key, shape)] = spec

        def of_variables(collection: str, tree: Any) -> Any:
            prefix = collection if collection != "params" else ""
            return jax.tree_util.tree_map_with_path(lambda path, leaf: NamedSharding(
                self.mesh, known[(f"{prefix}{jax.tree_util.keystr(path)}", tuple(leaf.shape))]), tree)

        def of_opt(path: Any, leaf: Any) -> NamedSharding:
            key, shape = jax.tree_util.keystr(path), tuple(leaf.shape)
            # The parameter with the longest path that ends this leaf's (optax's ``mu['Dense_0']['kernel']``).
            mirrored = [(len(k), spec) for (k, s), spec in known.items()
                        if s == shape and k and key.endswith(k)]
            spec = (max(mirrored, key=lambda found: found[0])[1] if mirrored
                    else self.rule.spec(shape, self.mesh))
            return NamedSharding(self.mesh, spec)

        return state.replace(
            step=self.replicated, rng=self.replicated,
            params=of_variables("params", state.params),
            model_state={c: of_variables(c, state.model_state[c]) for c in state.model_state},
            opt_state=jax.tree_util.tree_map_with_path(of_opt, state.opt_state))

    def replicated_constant(self, make: Any) -> Any:
        """A compiled function making ``make()``'s constants whole on every device.

        Unlike ``device_put`` on several processes, it needs no blocking collective.
        """
        return jax.jit(make, out_shardings=self.replicated)

    def put_batch(self, arrays: Mapping[str, np.ndarray]) -> dict[str, jax.Array]:
        """This process's share of a global batch, as global arrays split over the data axis."""
        if jax.process_count() == 1:
            return jax.device_put(dict(arrays), self.batch_sharding)
        sharding = self.batch_sharding
        return {key: jax.make_array_from_process_local_data(sharding, value) for key, value in arrays.items()}


def _names_by_path(names: Any) -> dict[str, Annotation | None]:
    """``{keystr path: annotation or None}`` of a tree of annotations (tuples read as logical)."""
    flat = jax.tree_util.tree_flatten_with_path(
        names, is_leaf=lambda x: x is None or isinstance(x, tuple | PartitionSpec | Annotation))[0]
    return {jax.tree_util.keystr(path): (leaf if leaf is None or isinstance(leaf, Annotation)
                                         else Annotation(tuple(leaf))) for path, leaf in flat}


def spec_text(sharding: Any) -> str:
    """A sharding as a person reads it: ``P('data', None)``, or ``replicated``."""
    spec = getattr(sharding, "spec", None)
    if spec is None or all(p is None for p in spec):
        return "replicated"
    return _spec_text(spec)
