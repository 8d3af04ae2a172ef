"""One jitted step over a device mesh: data parallel against a hand-written
per-device (pmap-style) loop, FSDP and tensor parallelism against data
parallelism, bytes per device, restoring onto another mesh, and bad
placements named before anything compiles."""

from __future__ import annotations

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import flaxhooks
from tests.helpers import assert_tables_close

FEATURES, HIDDEN, CLASSES = 16, 64, 4


def _needs(count: int) -> list[jax.Device]:
    devices = jax.local_devices()
    if len(devices) < count:
        pytest.skip(f"needs {count} devices")
    return devices[:count]


def _mesh(shape: tuple[int, ...], names: tuple[str, ...]) -> Mesh:
    return Mesh(np.asarray(_needs(int(np.prod(shape)))).reshape(shape), names,
                axis_types=(AxisType.Auto,) * len(names))


class Wide(nn.Module):
    """Two dense layers, the first annotated with logical axes when ``annotated``."""

    annotated: bool = False

    @nn.compact
    def __call__(self, x):
        init = nn.initializers.lecun_normal()
        if self.annotated:
            kernel = nn.with_logical_partitioning(init, ("embed", "mlp"))
            out = nn.with_logical_partitioning(init, ("mlp", "embed"))
            x = nn.relu(nn.Dense(HIDDEN, kernel_init=kernel)(x))
            x = nn.with_logical_constraint(x, ("batch", "mlp"))
            return nn.Dense(CLASSES, kernel_init=out)(x)
        x = nn.relu(nn.Dense(HIDDEN)(x))  # Dense_0, made first
        return nn.Dense(CLASSES)(x)


def loss_fn(logits, batch):
    return optax.losses.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()


def _batches(count: int = 4, size: int = 32) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    return [{"image": rng.normal(size=(size, FEATURES)).astype(np.float32),
             "label": rng.integers(0, CLASSES, size).astype(np.int32)} for _ in range(count)]


def _trainer(model=None, **kwargs) -> flaxhooks.Trainer:
    return flaxhooks.Trainer(model or Wide(), optax.adam(1e-2), loss_fn, **kwargs)


def _per_device_reference(params, batches, devices: int):
    """Adam on the mean of per-device mean losses, written by hand (what a
    pmap loop with pmean'd gradients computes), in float64 on the host."""
    tx = optax.adam(1e-2)
    with jax.enable_x64():
        params = jax.tree.map(lambda x: jnp.asarray(np.asarray(x), jnp.float64), params)
        opt_state = tx.init(params)
        for batch in batches:
            rows = len(batch["label"]) // devices
            shares = [{k: v[i * rows:(i + 1) * rows] for k, v in batch.items()} for i in range(devices)]
            grads = [jax.grad(lambda p, b=b: loss_fn(Wide().apply({"params": p}, b["image"]), b))(params)
                     for b in shares]
            mean = jax.tree.map(lambda *g: sum(g) / devices, *grads)
            updates, opt_state = tx.update(mean, opt_state, params)
            params = optax.apply_updates(params, updates)
        return jax.tree.map(np.asarray, params)


def test_data_parallel_on_the_mesh_equals_a_hand_written_per_device_loop():
    devices = _needs(8)
    batches = _batches()
    trainer = _trainer(devices=devices)
    initial = trainer.init(batches[0])
    state = trainer.fit(batches, epochs=1, state=initial)
    expected = _per_device_reference(initial.params, batches, len(devices))
    for got, want in zip(jax.tree.leaves(state.params), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(np.asarray(got), want, rtol=2e-4, atol=2e-5)
        assert got.sharding.is_fully_replicated
    assert trainer.runner.traces == {"train_step": 1}


def test_fsdp_equals_data_parallel_and_holds_an_eighth_of_the_state_per_device():
    devices = _needs(8)
    batches = _batches()
    replicated = _trainer(devices=devices)
    initial = replicated.init(batches[0])
    expected = replicated.fit(batches, epochs=1, state=initial)
    sharded = _trainer(devices=devices, shard=flaxhooks.FSDP("data", min_size=256))
    state = sharded.fit(batches, epochs=1, state=initial)
    for got, want in zip(jax.tree.leaves(state), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
    kernel = state.params["Dense_0"]["kernel"]  # [16, 64]: split along its larger dimension
    assert kernel.sharding.spec == P(None, "data")
    assert {s.data.shape for s in kernel.addressable_shards} == {(FEATURES, HIDDEN // 8)}
    # Bytes per device, from the shards each device holds, against the whole state.
    whole = sum(x.nbytes for x in jax.tree.leaves(state))
    first = devices[0]
    held = sum(s.data.nbytes for x in jax.tree.leaves(state)
               for s in x.addressable_shards if s.device == first)
    small = sum(x.nbytes for x in jax.tree.leaves(state) if x.size < 256)  # replicated by min_size
    assert held <= (whole - small) / 8 * 1.1 + small
    assert sharded.runner.traces == {"train_step": 1}


def test_tensor_parallel_from_linen_annotations_equals_data_parallel():
    mesh = _mesh((4, 2), ("data", "model"))
    batches = _batches()
    rules = (("batch", "data"), ("embed", None), ("mlp", "model"))
    # The same annotated model, data parallel: every logical axis kept whole.
    plain = _trainer(Wide(annotated=True), devices=list(mesh.devices.flat),
                     axis_rules=[("batch", "data"), ("embed", None), ("mlp", None)])
    initial = plain.init(batches[0])
    expected = plain.fit(batches, epochs=1, state=initial)
    parallel = _trainer(Wide(annotated=True), mesh=mesh, axis_rules=rules)
    state = parallel.fit(batches, epochs=1, state=initial)
    for got, want in zip(jax.tree.leaves(state.params), jax.tree.leaves(expected.params), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
    assert state.params["Dense_0"]["kernel"].sharding.spec == P(None, "model")
    assert state.params["Dense_1"]["kernel"].sharding.spec == P("model", None)
    # The optimizer's moments follow their parameters.
    mu = state.opt_state[0].mu["Dense_0"]["kernel"]
    assert mu.sharding.spec == P(None, "model")
    # The batch is split over "data" only: each shard is a quarter of it, whole over "model".
    arrays = {k: np.concatenate([b[k] for b in batches]) for k in batches[0]}
    result = parallel.evaluate(arrays, batch_size=24)
    assert result.examples == 128


def test_nnx_partitioning_metadata_places_the_parameters():
    mesh = _mesh((4, 2), ("data", "model"))

    class Net(nnx.Module):
        def __init__(self, rngs):
            init = nnx.initializers.lecun_normal()
            kernel_init = nnx.with_partitioning(init, (None, "model"))
            self.hidden = nnx.Linear(FEATURES, HIDDEN, kernel_init=kernel_init, rngs=rngs)
            self.out = nnx.Linear(HIDDEN, CLASSES, rngs=rngs)

        def __call__(self, x):
            return self.out(nnx.relu(self.hidden(x)))

    with jax.set_mesh(mesh):
        model = Net(nnx.Rngs(0))
    reference = nnx.clone(model)
    batches = _batches()
    state = _trainer(model, mesh=mesh).fit(batches, epochs=1)
    assert state.params["hidden"]["kernel"].sharding.spec == P(None, "model")
    expected = _trainer(reference, mesh=_mesh((8, 1), ("data", "model"))).fit(batches, epochs=1)
    for got, want in zip(jax.tree.leaves(state.params), jax.tree.leaves(expected.params), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kwargs, message", [
    (dict(shard=flaxhooks.FSDP("fsdp")), r"FSDP shards over mesh axis 'fsdp', which the mesh lacks"),
    (dict(axis_rules=[("mlp", "tensor")]), r"logical axis 'mlp' to mesh axis 'tensor', which the mesh lacks"),
    (dict(data_axis="batch"), r"split over mesh axis 'batch', which the mesh lacks"),
])
def test_a_placement_naming_an_axis_the_mesh_lacks_is_refused_at_once(kwargs, message):
    with pytest.raises(flaxhooks.ShardingError, match=message):
        _trainer(mesh=_mesh((4, 2), ("data", "model")), **kwargs)


class MeshAnnotated(nn.Module):
    """One dense layer whose kernel names mesh axes (``nn.with_partitioning``)."""

    @nn.compact
    def __call__(self, x):
        kernel = nn.with_partitioning(nn.initializers.lecun_normal(), (None, "tensor"))
        return nn.Dense(CLASSES, kernel_init=kernel)(x)


def test_an_annotation_naming_a_mesh_axis_the_mesh_lacks_is_refused_before_compiling(compiles):
    """(A logical name no rule maps is no longer refused: it stays whole, as in
    Flax; tests/step/test_annotations.py.)"""
    trainer = _trainer(MeshAnnotated(), mesh=_mesh((4, 2), ("data", "model")), axis_rules=[("embed", None)])
    expected = r"params\['Dense_0'\]\['kernel'\] of shape \(16, 4\) names axis 'tensor'"
    with pytest.raises(flaxhooks.ShardingError, match=expected):
        trainer.fit(_batches(), epochs=1)
    assert compiles == []


def test_a_batch_that_does_not_divide_over_the_data_axis_is_refused(compiles):
    trainer = _trainer(mesh=_mesh((4, 2), ("data", "model")))
    refused = r"a batch of 6 examples .* does not divide over 4 devices"
    with pytest.raises(flaxhooks.BatchError, match=refused):
        trainer.fit(_batches(size=6), epochs=1)
    assert compiles == []


def test_a_checkpoint_of_an_fsdp_run_on_8_devices_resumes_data_parallel_on_4_bit_exactly(tmp_path):
    batches = _batches(count=4)
    fsdp = _trainer(devices=_needs(8), shard=flaxhooks.FSDP(min_size=256),
                    callbacks=[flaxhooks.Checkpoint(tmp_path, every=2)])
    saved = fsdp.fit(batches, steps=2)
    four = _trainer(devices=_needs(4), callbacks=[flaxhooks.Checkpoint(tmp_path, every=2)])
    restored = four.fit(batches, steps=2, resume=True)  # nothing left to train: the restored state
    for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(saved), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
        assert got.sharding.device_set == set(_needs(4)) and got.sharding.is_fully_replicated


def test_the_summary_shows_each_split_parameter_and_the_bytes_per_device():
    summary = flaxhooks.Summary()
    trainer = _trainer(devices=_needs(8), shard=flaxhooks.FSDP(min_size=256), callbacks=[summary])
    state = trainer.fit(_batches(count=1), epochs=1)
    whole = sum(x.nbytes for x in jax.tree.leaves(state))
    assert "State on mesh data=8: " in summary.table
    assert f" per device of {whole / 1000:,.1f} KB" in summary.table
    assert f"params['Dense_0']['kernel'] float32[{FEATURES}, {HIDDEN}]: P(None, 'data')" in summary.table


def test_batches_arrive_as_global_arrays_split_over_the_data_axis():
    mesh = _mesh((4, 2), ("data", "model"))
    seen = []

    class Peek(flaxhooks.Callback):
        def on_step_start(self, loop):
            seen.append(loop.batch["image"])

    _trainer(mesh=mesh, callbacks=[Peek()]).fit(_batches(count=2), epochs=1)
    assert all(b.sharding == NamedSharding(mesh, P("data")) and b.shape == (32, FEATURES) for b in seen)


def test_fsdp_with_annotations_splits_annotated_leaves_over_the_data_axis_too():
    mesh = _mesh((4, 2), ("data", "model"))
    batches = _batches()
    rules = (("batch", "data"), ("embed", None), ("mlp", "model"))
    plain = _trainer(Wide(annotated=True), mesh=mesh, axis_rules=rules)
    initial = plain.init(batches[0])
    expected = plain.fit(batches, epochs=1, state=initial)
    both = _trainer(Wide(annotated=True), mesh=mesh, axis_rules=rules, shard=flaxhooks.FSDP(min_size=256))
    state = both.fit(batches, epochs=1, state=initial)
    for got, want in zip(jax.tree.leaves(state.params), jax.tree.leaves(expected.params), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
    kernel = state.params["Dense_0"]["kernel"]  # ("embed", "mlp") -> embed over data, mlp over model
    assert kernel.sharding.spec == P("data", "model")
    assert {s.data.shape for s in kernel.addressable_shards} == {(FEATURES // 4, HIDDEN // 2)}


def test_without_optimizer_metrics_the_step_trains_the_same_and_reports_loss_fns_metrics_only():
    batches = _batches()
    seen = []

    class Keep(flaxhooks.Callback):
        def on_step_end(self, loop):
            seen.append(set(loop.host_metrics()))

    full = _trainer(devices=_needs(2))
    initial = full.init(batches[0])
    expected = full.fit(batches, epochs=1, state=initial)
    lean = _trainer(devices=_needs(2), optimizer_metrics=False, callbacks=[Keep()])
    state = lean.fit(batches, epochs=1, state=initial)
    for got, want in zip(jax.tree.leaves(state), jax.tree.leaves(expected), strict=True):
        # XLA fuses the two steps differently: the same values to float rounding.
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-7)
    assert seen == [{"loss"}] * len(batches)
    assert set(full.runner.metric_names) == {"loss", "grad_norm", "update_ratio"}


def test_statistics_on_a_sharded_state_equal_those_on_one_device():
    """Activation and activation-gradient statistics reduce over the whole
    batch and every shard: on a (4, 2) mesh with FSDP and tensor parallelism
    they are those of one device (itself checked against float64 in
    tests/callbacks/test_activations.py)."""
    batches = _batches(count=3)
    rules = (("batch", "data"), ("embed", None), ("mlp", "model"))

    def published(rules, **placement):
        tables = {}

        class Keep(flaxhooks.Callback):
            order = 50

            def on_step_end(self, loop):
                topics = ("activations", "activation_grads")
                tables[loop.step] = {t: loop.published[t].to_dict() for t in topics}

        trainer = _trainer(Wide(annotated=True), axis_rules=rules, callbacks=[
            flaxhooks.ActivationStats(every=1), flaxhooks.ActivationGradStats(every=1), Keep()], **placement)
        trainer.fit(batches, epochs=1, state=initial)
        return tables

    whole = (("batch", "data"), ("embed", None), ("mlp", None))  # one device: nothing to split
    initial = _trainer(Wide(annotated=True), devices=_needs(1), axis_rules=whole).init(batches[0])
    one = published(whole, devices=_needs(1))
    sharded = published(rules, mesh=_mesh((4, 2), ("data", "model")), shard=flaxhooks.FSDP(min_size=256))
    assert sorted(one) == [1, 2, 3]
    assert_tables_close(sharded, one, rel=1e-4, abs=1e-6)


def test_optimizer_metrics_every_third_step_are_exact_there_and_their_means_are_over_those_steps():
    batches = _batches(count=7)
    seen: dict[str, dict[int, dict[str, float]]] = {"every": {}, "third": {}}

    class Keep(flaxhooks.Callback):
        def __init__(self, into):
            self.into = into

        def on_step_end(self, loop):
            self.into[loop.step] = loop.host_metrics()

        def on_fit_end(self, loop):
            totals = jax.device_get(loop.totals)
            self.means = flaxhooks.step.window_means(flaxhooks.step.window_sums(None, totals))

    every, third = Keep(seen["every"]), Keep(seen["third"])
    full = _trainer(devices=_needs(2), callbacks=[every])
    initial = full.init(batches[0])
    full.fit(batches, epochs=1, state=initial)
    sampled = _trainer(devices=_needs(2), optimizer_metrics=3, callbacks=[third])
    sampled.fit(batches, epochs=1, state=initial)
    assert [step for step, metrics in sorted(seen["third"].items()) if "grad_norm" in metrics] == [3, 6]
    for step in (3, 6):
        for name in ("grad_norm", "update_ratio", "loss"):
            assert seen["third"][step][name] == pytest.approx(seen["every"][step][name], rel=1e-5)
    assert third.means["grad_norm"] == pytest.approx(
        np.mean([seen["every"][3]["grad_norm"], seen["every"][6]["grad_norm"]]), rel=1e-5)
    assert third.means["loss"] == pytest.approx(every.means["loss"], rel=1e-5)  # every step's loss
    assert sampled.runner.traces == {"train_step": 2}  # with and without the norms


def test_optimizer_metrics_must_be_a_switch_or_a_positive_number_of_steps():
    for wrong in (0, -2, 1.5, "3"):
        with pytest.raises(ValueError, match="optimizer_metrics must be True, False or a number of steps"):
            _trainer(optimizer_metrics=wrong)


def test_the_norms_of_replicated_parameters_are_shared_out_between_the_devices_and_stay_exact():
    """A large replicated leaf's sums of squares are reduced in one part per
    device (the compiled step holds a reduction of one eighth of it), and the
    gradient norm and update ratio still equal float64 ones; leaves too small
    or that do not divide stay whole."""
    from flaxhooks.step import optimizer_metrics

    mesh = _mesh((4, 2), ("data", "model"))
    placement = flaxhooks.placement.Placement.of(mesh, None, "data", flaxhooks.Replicated(), ())
    rng = np.random.default_rng(3)
    shapes = {"big": (64, 128), "odd": (4097,), "small": (10,)}
    trees = [{name: rng.normal(size=shape).astype(np.float32) for name, shape in shapes.items()}
             for _ in range(3)]
    replicated = NamedSharding(mesh, P())
    params, grads, updates = (jax.device_put(tree, replicated) for tree in trees)
    split = [placement.spread] * len(shapes)
    metrics = jax.jit(optimizer_metrics, static_argnums=3)
    got = metrics(params, grads, updates, tuple(split))

    def norm(tree):
        return np.sqrt(sum(np.sum(np.float64(x) ** 2) for x in tree.values()))

    assert float(got["grad_norm"]) == pytest.approx(norm(trees[1]), rel=1e-6)
    assert float(got["update_ratio"]) == pytest.approx(norm(trees[2]) / norm(trees[0]), rel=1e-6)
    compiled = metrics.lower(params, grads, updates, tuple(split)).compile().as_text()
    assert "f32[1,1024]" in compiled and "f32[4097]" in compiled, compiled
    whole = jax.jit(optimizer_metrics).lower(params, grads, updates).compile().as_text()
    assert "f32[1,1024]" not in whole


class Big(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(CLASSES)(nn.relu(nn.Dense(256)(x)))  # a 16 x 256 kernel: 4096 values


def _collectives(trainer: flaxhooks.Trainer, norms: bool) -> list[str]:
    batch = _batches(count=1)[0]
    state = trainer.init(batch)
    step = trainer.runner.variant((), norms)
    lowered = step.lower(state, trainer.placement.put_batch(batch), trainer.runner.zero_totals())
    return re.findall(r" (all-reduce|all-gather|reduce-scatter)(?:-start)?\(", lowered.compile().as_text())


def test_on_cpu_devices_the_norms_add_no_collective_to_the_step():
    """CPU devices share the host's cores: the norms are computed whole, and the
    step keeps the lean step's one all-reduce (shared-out norms add their own)."""
    devices = _needs(2)
    assert _collectives(_trainer(Big(), devices=devices), norms=True) == ["all-reduce"]
    assert _collectives(_trainer(Big(), devices=devices), norms=False) == ["all-reduce"]
    shared = _trainer(Big(), devices=devices)
    shared.runner.SHARE_NORMS_ON = frozenset({"cpu"})  # as on GPU and TPU
    # The norms' parts, summed apart: the gradients' before the update (the non-finite
    # guard's freeze decides on it), the update's and the parameters' after.
    assert _collectives(shared, norms=True) == ["all-reduce"] * 3


def test_sharing_out_the_norms_leaves_the_data_parallel_update_whole_on_every_device():
    """Where the norms are shared out (GPU, TPU), XLA would carry their split
    back into the update (computed in halves, then gathered every step), and
    would copy every parameter for their norm: the compiled step gathers and
    copies none."""
    trainer = _trainer(Big(), devices=_needs(2))
    trainer.runner.SHARE_NORMS_ON = frozenset({"cpu"})  # as on GPU and TPU
    batch = _batches(count=1)[0]
    state = trainer.init(batch)
    step = trainer.runner.variant((), True)
    compiled = step.lower(state, trainer.placement.put_batch(batch), trainer.runner.zero_totals()).compile()
    text = compiled.as_text()
    assert "f32[1,2048]" in text  # the kernel's squares, half per device
    assert "all-gather" not in text
    # The parameters' norm does not keep the donated kernel alive past its update.
    kernels = re.findall(r"%(\S+) = f32\[16,256\]\{1,0\} parameter\(", text)
    assert kernels
    assert not [k for k in kernels if re.search(rf"copy\(%{re.escape(k)}\)", text)]


class Killed(nn.Module):
    """A ReLU layer killed by a large negative bias, between two live ones; the
    kernels annotated with logical axes (each kept whole unless a rule splits it)."""

    @nn.compact
    def __call__(self, x):
        init = nn.initializers.lecun_normal()

        def dense(features, axes, **kwargs):
            return nn.Dense(features, kernel_init=nn.with_logical_partitioning(init, axes), **kwargs)

        x = nn.relu(dense(HIDDEN, ("embed", "mlp"))(x))
        x = nn.with_logical_constraint(x, ("batch", "mlp"))
        dead = nn.initializers.constant(-20.0)
        x = nn.relu(dense(HIDDEN, ("mlp", "embed"), bias_init=dead, name="killed")(x))
        x = nn.relu(dense(HIDDEN, ("embed", "mlp"), name="after")(x))
        return dense(CLASSES, ("mlp", "embed"))(x)


@pytest.mark.parametrize("placement", ["fsdp", "fsdp+tensor"])
def test_diagnose_on_a_sharded_state_finds_and_figures_what_it_does_on_one_device(placement):
    """The layers' sums reduce over the whole batch and every shard: on 8
    devices with FSDP (and on a (4, 2) mesh with tensor parallelism too) the
    windows, the figures made of them and the findings are those of one device."""
    from flaxhooks.diagnose import Thresholds, layer_figures

    batches = _batches(count=8)
    whole = (("batch", "data"), ("embed", None), ("mlp", None))
    rules = (("batch", "data"), ("embed", None), ("mlp", "model"))

    class Kept(flaxhooks.Diagnose):
        """Diagnose that also keeps each step's sums of its window so far, read on the host."""

        def take(self, loop, result):
            self.kept.append(self.sums_of(result))
            super().take(loop, result)

    def diagnosed(**placement):
        diagnose = Kept(every=1, window=4, table=False)
        diagnose.kept = []
        state = _trainer(Killed(), callbacks=[diagnose], **placement).fit(batches, epochs=1, state=initial)
        diagnose.spec = state.params["killed"]["kernel"].sharding.spec
        return diagnose

    initial = _trainer(Killed(), devices=_needs(1), axis_rules=whole).init(batches[0])
    one = diagnosed(devices=_needs(1), axis_rules=whole)
    if placement == "fsdp":
        sharded = diagnosed(devices=_needs(8), axis_rules=whole, shard=flaxhooks.FSDP("data", min_size=256))
    else:
        sharded = diagnosed(mesh=_mesh((4, 2), ("data", "model")), axis_rules=rules,
                            shard=flaxhooks.FSDP("data", min_size=256))
    assert sharded.spec == (P("data", None) if placement == "fsdp" else P("model", "data"))

    assert [(f.kind, f.layer, f.step, f.since) for f in one.findings] == [("dead_units", "killed", 4, 1)]
    assert [(f.kind, f.layer, f.step, f.since) for f in sharded.findings] == [
        (f.kind, f.layer, f.step, f.since) for f in one.findings]
    for got, want in zip(sharded.findings, one.findings, strict=True):
        assert got.values.keys() == want.values.keys()
        for name, value in want.values.items():
            if isinstance(value, float):
                assert got.values[name] == pytest.approx(value, rel=1e-4, abs=1e-6), name
            else:
                assert got.values[name] == value, name

    assert len(one.kept) == len(sharded.kept) == 8
    names, units = ("Dense_0", "killed", "after", "Dense_1"), (HIDDEN, HIDDEN, HIDDEN, CLASSES)
    for start in (0, 4):  # each window's sums, added up on the devices step by step, and their figures
        windows = []
        for diagnose in (one, sharded):
            last = diagnose.kept[start + 3]  # the window's last step carries its whole sums
            assert last.steps == 4
            windows.append({"layers": last.layers, "mass": last.mass, "reached": last.reached,
                            "fired": last.fired, "params": last.params[:, :3]})
        for key in windows[0]:
            np.testing.assert_allclose(windows[1][key], windows[0][key], rtol=1e-4, atol=1e-5, err_msg=key)
        figures = [layer_figures(names, units, w, Thresholds()) for w in windows]
        assert [f.name for f in figures[0]] == list(names)
        assert figures[0][1].dead == figures[1][1].dead == 1.0  # every unit of "killed" dead
        for got, want in zip(figures[1], figures[0], strict=True):
            def numbers(f):
                return [f.mean, f.grad_rms, f.dead, f.silent, f.dormant, f.saturated, *f.slopes]

            np.testing.assert_allclose(numbers(got), numbers(want), rtol=1e-4, atol=1e-6, err_msg=want.name)
    # The heatmaps drawn from the windows: the same cells, on the same colour scale.
    figures = one.figures(), sharded.figures()
    assert sorted(figures[0]) == sorted(figures[1]) == ["dead_units", "gradient_rms", "update_ratio"]
    for name, figure in figures[0].items():
        want, got = figure.axes[0].images[0], figures[1][name].axes[0].images[0]
        assert np.array_equal(got.get_array().mask, want.get_array().mask), name
        np.testing.assert_allclose(got.get_array().filled(0), want.get_array().filled(0), rtol=1e-4,
                                   atol=1e-6, err_msg=name)
        assert got.norm.vmin == pytest.approx(want.norm.vmin, rel=1e-4, abs=1e-6), name
        assert got.norm.vmax == pytest.approx(want.norm.vmax, rel=1e-4, abs=1e-6), name


class Rooted(nn.Module):
    """``sqrt(|encoder(x)|)``: NaN from the first batch holding a NaN on."""

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(HIDDEN, name="encoder")(x)
        return nn.Dense(CLASSES, name="head")(jnp.sqrt(jnp.abs(x)))


def test_the_guard_replays_a_step_under_fsdp_and_names_the_layer():
    batches = _batches(count=6)
    batches[2]["image"][-1, 3] = np.nan  # step 3, in the last device's share
    shard = flaxhooks.FSDP("data", min_size=256)
    reference = _trainer(Rooted(), devices=_needs(8), shard=shard)
    initial = reference.init(batches[0])
    expected = reference.fit(batches[:2], epochs=1, state=initial)
    trainer = _trainer(Rooted(), devices=_needs(8), shard=shard)
    with pytest.raises(flaxhooks.NonFiniteError) as error:
        trainer.fit(batches, epochs=1, state=initial)
    assert error.value.step == 3
    assert "the first call, in execution order, whose output went non-finite is 'encoder'" in str(error.value)
    kernel = trainer.state.params["encoder"]["kernel"]
    assert kernel.sharding.spec == P(None, "data")  # still split: the state from before step 3
    assert int(trainer.state.step) == 2
    for got, want in zip(jax.tree.leaves(trainer.state), jax.tree.leaves(expected), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_a_state_given_from_one_device_stays_the_callers_when_a_mesh_trains_from_it():
    """device_put onto a replicated sharding over the caller's device may alias its buffer; the
    step donates its state, so the Trainer copies what it was given."""
    from tests.helpers import MLP, cross_entropy, make_batches

    batches = make_batches(2)
    one = flaxhooks.Trainer(MLP(), optax.sgd(0.1), cross_entropy, devices=_needs(1))
    initial = one.init(batches[0])
    # (Not read from `initial` itself: a host read caches its value, which hides the donation.)
    before = jax.tree.leaves(jax.device_get(one.init(batches[0])))
    flaxhooks.Trainer(MLP(), optax.sgd(0.1), cross_entropy, devices=_needs(8)).fit(
        batches, epochs=1, state=initial)
    after = jax.tree.leaves(initial)
    assert not any(x.is_deleted() for x in after)
    for was, now in zip(before, after, strict=True):
        np.testing.assert_array_equal(was, np.asarray(now))
