"""Where arrays live: one device mesh, the batch split over its data axis, and
the train state placed by a sharding rule (replicated, FSDP) or by the
model's own annotations."""

from __future__ import annotations

import dataclasses
import functools
import math
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
    """A mesh, a sharding rule or an annotation that cannot place the arrays
    it names (raised before anything compiles)."""


class ShardRule(Protocol):
    """How a leaf of the train state without an annotation of its own is
    placed: :class:`Replicated` or :class:`FSDP`."""

    def spec(self, shape: tuple[int, ...], mesh: Mesh) -> PartitionSpec:
        """The leaf's partition over ``mesh``."""

    def check(self, mesh: Mesh) -> None:
        """Raises ShardingError if the rule names an axis ``mesh`` lacks."""


@dataclasses.dataclass(frozen=True)
class Replicated:
    """Every leaf whole on every device: data parallelism (the default).

    Example:
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
    """Fully sharded data parallelism: each leaf split along its largest
    dimension that ``axis`` divides; XLA gathers it inside the step where it is
    used. Leaves of fewer than ``min_size`` elements, or with no such
    dimension, stay replicated. A leaf the model annotates keeps its
    annotation and is split over ``axis`` along a dimension it leaves whole.

    Args:
        axis: the mesh axis the leaves are split over (the data axis).
        min_size: the smallest leaf (in elements) worth splitting.

    Example:
        >>> import flaxhooks
        >>> flaxhooks.FSDP("data").axis
        'data'
    """

    axis: str = DATA_AXIS
    min_size: int = 1024

    def spec(self, shape: tuple[int, ...], mesh: Mesh) -> PartitionSpec:
        ways = mesh.shape[self.axis]
        if ways == 1 or math.prod(shape) < self.min_size:
            return PartitionSpec()
        dividing = [d for d in range(len(shape)) if shape[d] % ways == 0]
        if not dividing:
            return PartitionSpec()
        largest = max(dividing, key=lambda d: (shape[d], -d))
        return PartitionSpec(*(self.axis if d == largest else None for d in range(len(shape))))

    def extend(self, spec: PartitionSpec, shape: tuple[int, ...], mesh: Mesh) -> PartitionSpec:
        """An annotated leaf's ``spec``, also split over ``axis`` along its
        largest dimension the annotation leaves whole (FSDP and tensor
        parallelism together), unless it names ``axis`` already."""
        named = [p for part in spec for p in ((part,) if isinstance(part, str) else (part or ()))]
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
                f"{dict(mesh.shape)}): name one of them, e.g. FSDP({next(iter(mesh.shape))!r})"
            )


def default_mesh(devices: Sequence[jax.Device] | None = None, axis: str = DATA_AXIS) -> Mesh:
    """One ``axis`` over ``devices`` (default: every device of every process),
    with automatic (GSPMD) sharding propagation."""
    if devices is None:
        return jax.make_mesh((jax.device_count(),), (axis,), axis_types=(AxisType.Auto,))
    return Mesh(np.asarray(list(devices)), (axis,), axis_types=(AxisType.Auto,))


def _spec_text(spec: PartitionSpec) -> str:
    return "P(" + ", ".join(repr(p) for p in spec) + ")"


@dataclasses.dataclass(frozen=True)
class Placement:
    """The mesh a fit runs on and where each array lives.

    Attributes:
        mesh: every device the step runs on.
        data_axis: the mesh axis the batch is split over.
        rule: where leaves without annotations go.
        axis_rules: logical axis names to mesh axes, for annotated models.
    """

    mesh: Mesh
    data_axis: str = DATA_AXIS
    rule: ShardRule = Replicated()
    axis_rules: tuple[tuple[str, Any], ...] = ()

    @classmethod
    def of(cls, mesh: Mesh | None, devices: Sequence[jax.Device] | None, data_axis: str, rule: ShardRule,
           axis_rules: AxisRules | None) -> Placement:
        """Checks the pieces against each other, before anything compiles.

        Raises:
            ShardingError: the data axis or the rule's axis is not the mesh's,
                a rule names an unknown mesh axis, or this process sees none
                of the mesh's devices.
        """
        if mesh is not None and devices:
            raise ShardingError("give devices= or mesh=, not both: a mesh names its devices")
        if devices and jax.process_count() > 1:
            raise ShardingError(
                f"devices= picks local devices, but this run has {jax.process_count()} processes: every "
                "compiled step spans every device of every process, so leave devices out"
            )
        mesh = mesh if mesh is not None else default_mesh(devices, data_axis)
        if data_axis not in mesh.shape:
            raise ShardingError(
                f"the batch is split over mesh axis {data_axis!r}, which the mesh lacks (its axes: "
                f"{dict(mesh.shape)}): name the data axis with Trainer(data_axis=...)"
            )
        rule.check(mesh)
        rules = tuple((str(name), target) for name, target in (axis_rules or ()))
        for name, target in rules:
            for axis in (target,) if isinstance(target, str) else (target or ()):
                if axis not in mesh.shape:
                    raise ShardingError(
                        f"axis_rules maps logical axis {name!r} to mesh axis {axis!r}, which the mesh "
                        f"lacks (its axes: {dict(mesh.shape)})"
                    )
        local = {d.id for d in jax.local_devices()}
        if not any(d.id in local for d in mesh.devices.flat):
            raise ShardingError(
                f"the mesh's devices {[d.id for d in mesh.devices.flat]} are none of this process's "
                f"{sorted(local)}: build the mesh from jax.devices()"
            )
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
    def replicated(self) -> NamedSharding:
        """Whole on every device of the mesh."""
        return NamedSharding(self.mesh, PartitionSpec())

    @functools.cached_property
    def spread(self) -> NamedSharding | None:
        """An array's first axis split over every device of the mesh: where
        the step shares out a reduction of a value every device holds whole
        (None when a mesh axis is not ``AxisType.Auto``: XLA then decides)."""
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

    def mesh_spec(self, names: Sequence[Any] | None, where: str, shape: tuple[int, ...]) -> PartitionSpec:
        """An annotation's axis names (logical, or the mesh's own) as mesh axes, checked.

        Raises:
            ShardingError: a name neither the rules nor the mesh know, a
                dimension the mesh axes do not divide, or a rank mismatch.
        """
        names = tuple(names or ())
        if len(names) != len(shape):
            raise ShardingError(f"{where} of shape {shape} is annotated with {len(names)} axes {names}")
        rules = dict(self.axis_rules)
        axes: list[Any] = []
        for dim, name in zip(shape, names, strict=True):
            if name is None or isinstance(name, tuple | list) and not name:
                axes.append(None)
                continue
            target = rules[name] if isinstance(name, str) and name in rules else name
            parts = (target,) if isinstance(target, str) else tuple(target or ())
            for part in parts:
                if part not in self.mesh.shape:
                    known = f"axis_rules names {sorted(rules)}" if rules else "no axis_rules were given"
                    raise ShardingError(
                        f"{where} of shape {shape} names axis {name!r}, which is neither a mesh axis "
                        f"({list(self.mesh.shape)}) nor a logical axis of the rules ({known}): pass "
                        "Trainer(axis_rules=[(name, mesh axis or None), ...])"
                    )
            ways = math.prod(self.mesh.shape[p] for p in parts)
            if dim % ways:
                raise ShardingError(
                    f"{where} of shape {shape}: dimension {dim} ({name!r} -> {target!r}) does not divide "
                    f"over {ways} devices"
                )
            axes.append(None if not parts else parts[0] if len(parts) == 1 else parts)
        return PartitionSpec(*axes)

    def state_shardings(self, state: Any, annotated: Mapping[str, Any] | None = None) -> Any:
        """The sharding of every leaf of the train state ``state`` (abstract).

        A parameter or carried collection leaf follows its annotation when
        ``annotated`` has one (``{collection: tree of axis names or None}``),
        else the rule; an optimizer-state leaf follows the parameter it
        mirrors (same path suffix and shape), else the rule; the step count
        and the PRNG key are replicated.
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
                known[(f"{collection}{key}" if collection != "params" else key, shape)] = spec

        def of_params(path: Any, leaf: Any) -> NamedSharding:
            key, shape = jax.tree_util.keystr(path), tuple(leaf.shape)
            return NamedSharding(self.mesh, known[(key, shape)])

        def of_opt(path: Any, leaf: Any) -> NamedSharding:
            key, shape = jax.tree_util.keystr(path), tuple(leaf.shape)
            # The parameter with the longest path that ends this leaf's (optax's ``mu['Dense_0']['kernel']``).
            mirrored = [(len(k), spec) for (k, s), spec in known.items()
                        if s == shape and k and key.endswith(k)]
            spec = (max(mirrored, key=lambda found: found[0])[1] if mirrored
                    else self.rule.spec(shape, self.mesh))
            return NamedSharding(self.mesh, spec)

        def of_carried(collection: str) -> Any:
            return jax.tree_util.tree_map_with_path(
                lambda path, leaf: NamedSharding(
                    self.mesh, known[(f"{collection}{jax.tree_util.keystr(path)}", tuple(leaf.shape))]),
                state.model_state[collection])

        return state.replace(
            step=self.replicated, rng=self.replicated,
            params=jax.tree_util.tree_map_with_path(of_params, state.params),
            model_state={c: of_carried(c) for c in state.model_state},
            opt_state=jax.tree_util.tree_map_with_path(of_opt, state.opt_state),
        )

    def replicated_constant(self, make: Any) -> Any:
        """A compiled function making ``make()``'s values (constants: zeros,
        empty metrics) whole on every device, each process for its own
        devices: keep it, and call it for each new copy. ``device_put`` of host
        values onto devices of several processes would first check, with a
        blocking collective, that every process gave the same."""
        return jax.jit(make, out_shardings=self.replicated)

    def put_batch(self, arrays: Mapping[str, np.ndarray]) -> dict[str, jax.Array]:
        """This process's share of a global batch, as global arrays split over
        the data axis: one transfer call for every leaf."""
        if jax.process_count() == 1:
            return jax.device_put(dict(arrays), self.batch_sharding)
        sharding = self.batch_sharding
        return {key: jax.make_array_from_process_local_data(sharding, value) for key, value in arrays.items()}


def _names_by_path(names: Any) -> dict[str, Any]:
    """``{keystr path: axis names tuple or None}`` of a tree of annotations."""
    flat = jax.tree_util.tree_flatten_with_path(
        names, is_leaf=lambda x: x is None or isinstance(x, tuple | PartitionSpec))[0]
    return {jax.tree_util.keystr(path): (None if leaf is None else tuple(leaf)) for path, leaf in flat}


def spec_text(sharding: Any) -> str:
    """A sharding as a person reads it: ``P('data', None)``, or ``replicated``."""
    spec = getattr(sharding, "spec", None)
    if spec is None or all(p is None for p in spec):
        return "replicated"
    return _spec_text(spec)
