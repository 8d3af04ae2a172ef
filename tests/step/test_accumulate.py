"""Gradient accumulation, ``Trainer(accumulate=k)``: k micro-batches in one compiled step
make one update, checked against hand-written optax loops on the whole batch (float64),
statistics and optimizer metrics against the same run without accumulation, on one
device, 8 devices (FSDP, a data=4 x model=2 mesh) and several steps a dispatch."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType, Mesh

import flaxhooks
from flaxhooks.step import StepRunner
from tests.helpers import BatchNormNet, assert_tables_close, cross_entropy, make_batches

FEATURES = 5


class Sowing(nn.Module):
    """Two Dense layers; sows a scalar (no batch axis) beside the activations."""

    @nn.compact
    def __call__(self, x):
        h = nn.relu(nn.Dense(16)(x))
        self.sow("intermediates", "mean_hidden", h.mean())
        return nn.Dense(3)(h)


class NNXNet(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.hidden, self.head = nnx.Linear(FEATURES, 16, rngs=rngs), nnx.Linear(16, 3, rngs=rngs)

    def __call__(self, x):
        return self.head(nnx.relu(self.hidden(x)))


class Losses(flaxhooks.Callback):
    order = 50

    def __init__(self):
        self.seen: dict[int, dict[str, float]] = {}

    def on_step_end(self, loop):
        self.seen[loop.step] = {k: float(v) for k, v in loop.metrics.items()}


def _whole_batch_reference(apply, params, batches, tx):
    """The optax loop on each whole batch, by hand, in float64: parameters and losses."""
    with jax.enable_x64():
        params = jax.tree.map(lambda x: jnp.asarray(np.asarray(x), jnp.float64), params)
        opt_state, losses = tx.init(params), []
        for batch in batches:
            loss, grads = jax.value_and_grad(
                lambda p, b=batch: cross_entropy(apply(p, b["image"]), b))(params)
            updates, opt_state = tx.update(grads, opt_state, params)
            params = optax.apply_updates(params, updates)
            losses.append(float(loss))
        return jax.tree.map(np.asarray, params), losses


@pytest.fixture
def looped(monkeypatch):
    """The micro-batches taken in a loop on CPU too, as on GPU and TPU (written out on CPU by default)."""
    monkeypatch.setattr(StepRunner, "LOOP_MICRO_BATCHES_ON", StepRunner.LOOP_MICRO_BATCHES_ON | {"cpu"})


@pytest.mark.parametrize("api, loop", [("linen", False), ("linen", True), ("nnx", False)])
def test_accumulated_micro_batches_train_as_the_whole_batch_does_in_a_hand_written_loop(api, loop, request):
    if loop:
        request.getfixturevalue("looped")
    batches = make_batches(4, batch_size=32)
    tx = optax.adam(1e-2)
    if api == "linen":
        model = Sowing()
        trainer = flaxhooks.Trainer(model, tx, cross_entropy, accumulate=4, callbacks=[losses := Losses()])

        def apply(params, x):
            return model.apply({"params": params}, x)
    else:
        model = NNXNet(nnx.Rngs(0))
        graph, _ = nnx.split(model)
        trainer = flaxhooks.Trainer(model, tx, cross_entropy, accumulate=4, callbacks=[losses := Losses()])

        def apply(params, x):
            return nnx.merge(graph, params)(x)
    initial = trainer.init(batches[0])
    state = trainer.fit(batches, epochs=1, state=initial)
    expected, expected_losses = _whole_batch_reference(apply, jax.device_get(initial.params), batches, tx)
    for got, want in zip(jax.tree.leaves(state.params), jax.tree.leaves(expected), strict=True):
        assert got.dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(got), want, rtol=2e-4, atol=2e-5)
    # One update a batch, its loss the whole batch's; one compiled step for it.
    assert int(state.step) == 4 and sorted(losses.seen) == [1, 2, 3, 4]
    np.testing.assert_allclose([losses.seen[s]["loss"] for s in range(1, 5)], expected_losses, rtol=1e-5)
    assert trainer.runner.traces == {"train_step": 1}


def test_batch_statistics_go_from_one_micro_batch_to_the_next_as_in_a_hand_written_loop():
    """A BatchNorm sees each micro-batch in train mode, its running averages updated by each in turn."""
    batches = make_batches(3, batch_size=16)
    model, tx, k = BatchNormNet(), optax.sgd(0.1, 0.9), 2
    trainer = flaxhooks.Trainer(model, tx, cross_entropy, accumulate=k, devices=jax.local_devices()[:2])
    initial = trainer.init(batches[0])
    state = trainer.fit(batches, epochs=1, state=initial)

    params, stats = jax.device_get((initial.params, initial.model_state["batch_stats"]))
    opt_state = tx.init(params)
    for batch in batches:
        grads = []
        for j in range(k):  # micro-batch j: examples j, j + k, ...
            micro = {key: value[j::k] for key, value in batch.items()}

            def loss(p, micro=micro, stats=stats):
                logits, new = BatchNormNet(axis_name=None).apply(
                    {"params": p, "batch_stats": stats}, micro["image"], train=True, mutable=["batch_stats"])
                return cross_entropy(logits, micro), new["batch_stats"]

            (_, stats), g = jax.value_and_grad(loss, has_aux=True)(params)
            grads.append(g)
        updates, opt_state = tx.update(jax.tree.map(lambda *g: sum(g) / k, *grads), opt_state, params)
        params = optax.apply_updates(params, updates)
    for got, want in zip(jax.tree.leaves((state.params, state.model_state["batch_stats"])),
                         jax.tree.leaves((params, stats)), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)


def _published(accumulate: int, batches, state):
    """Every step's published statistics and metrics with statistics due every step."""
    tables: dict[int, dict] = {}

    class Keep(flaxhooks.Callback):
        order = 50

        def on_step_end(self, loop):
            tables[loop.step] = {t: loop.published[t].to_dict()
                                 for t in ("activations", "activation_grads", "params")}

    trainer = flaxhooks.Trainer(Sowing(), optax.adam(1e-2), cross_entropy, accumulate=accumulate, callbacks=[
        flaxhooks.ActivationStats(every=1), flaxhooks.ActivationGradStats(every=1),
        flaxhooks.ParamStats(every=1), Keep(), losses := Losses()])
    state = trainer.fit(batches, epochs=1, state=state)
    return tables, losses.seen, state, trainer


@pytest.mark.parametrize("loop", [False, True])
def test_statistics_and_optimizer_metrics_read_the_whole_update_not_a_micro_batch(loop, request):
    """Activation statistics (a sown scalar included), activation gradients, parameter
    statistics, the gradient norm and the update ratio are those of the run without
    accumulation: the micro-batches' values joined in the batch's order."""
    if loop:
        request.getfixturevalue("looped")
    batches = make_batches(3, batch_size=32)
    initial = flaxhooks.Trainer(Sowing(), optax.adam(1e-2), cross_entropy).init(batches[0])
    whole, whole_metrics, _, _ = _published(1, batches, state=initial)
    tables, metrics, _, trainer = _published(4, batches, state=initial)
    assert "mean_hidden" in " ".join(tables[1]["activations"])
    assert_tables_close(tables, whole, rel=1e-4, abs=1e-6)
    for step, row in whole_metrics.items():
        assert set(metrics[step]) == {"loss", "grad_norm", "update_ratio"}
        for name, value in row.items():
            assert metrics[step][name] == pytest.approx(value, rel=1e-5), (step, name)
    assert trainer.runner.traces == {"instrumented_step": 1}


class Outputs(flaxhooks.callbacks.InstrumentedCallback):
    """The step's outputs and inputs, every step."""

    def __init__(self):
        self.seen = []

    def inside_step(self, tapped):
        return tapped.outputs, tapped.batch["image"]

    def take(self, loop, result):
        self.seen.append(jax.device_get(result))


class Dropped(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool):
        return nn.Dropout(0.5, deterministic=not train)(x) + 0 * nn.Dense(1)(x)


def test_each_micro_batch_draws_its_own_dropout_mask_and_outputs_come_back_in_batch_order():
    batch = {"image": np.ones((16, 32), np.float32), "label": np.zeros(16, np.int32)}
    outputs = Outputs()

    def loss_fn(out, batch):
        return jnp.mean(out)

    trainer = flaxhooks.Trainer(Dropped(), optax.sgd(0.1), loss_fn, accumulate=2, callbacks=[outputs])
    trainer.fit([batch], epochs=1)
    (got, images), = outputs.seen
    np.testing.assert_array_equal(images, batch["image"])  # the batch as given
    assert set(np.unique(got)) == {0.0, 2.0}  # 1 / keep where kept: each row its own example's
    # Examples j, j + 2, ... are micro-batch j: the two micro-batches' masks differ.
    assert not np.array_equal(got[0::2], got[1::2])


@pytest.mark.parametrize("placement", ["fsdp", "data_model", "dispatched"])
def test_accumulation_on_a_mesh_trains_as_the_same_mesh_without_it(placement):
    devices = jax.local_devices()
    if len(devices) < 8:
        pytest.skip("needs 8 devices")
    batches = make_batches(4, batch_size=32)
    if placement == "fsdp":
        options = {"devices": devices[:8], "shard": flaxhooks.FSDP(min_size=16)}
    elif placement == "data_model":
        mesh = Mesh(np.asarray(devices[:8]).reshape(4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
        options = {"mesh": mesh, "shard": flaxhooks.FSDP("model", min_size=16)}
    else:
        options = {"steps_per_dispatch": 2}
    initial = flaxhooks.Trainer(Sowing(), optax.adam(1e-2), cross_entropy, **options).init(batches[0])
    without = flaxhooks.Trainer(Sowing(), optax.adam(1e-2), cross_entropy, **options).fit(
        batches, epochs=1, state=initial)
    trainer = flaxhooks.Trainer(Sowing(), optax.adam(1e-2), cross_entropy, accumulate=2, **options)
    state = trainer.fit(batches, epochs=1, state=initial)
    for got, want in zip(jax.tree.leaves(state), jax.tree.leaves(without), strict=True):
        assert got.sharding == want.sharding
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
    assert sum(trainer.runner.traces.values()) == 1


@pytest.mark.parametrize("accumulate", [0, -2, True, 2.0, "2"])
def test_an_accumulation_count_that_is_not_a_whole_number_of_at_least_1_is_refused(accumulate):
    with pytest.raises(ValueError, match="accumulate must be a whole number of micro-batches of at least 1"):
        flaxhooks.Trainer(Sowing(), optax.sgd(0.1), cross_entropy, accumulate=accumulate)


def test_a_count_that_does_not_divide_each_devices_share_is_refused_before_anything_compiles():
    trainer = flaxhooks.Trainer(Sowing(), optax.sgd(0.1), cross_entropy, accumulate=2,
                                devices=jax.local_devices()[:4])
    with pytest.raises(flaxhooks.BatchError, match=(
            r"accumulate=2 micro-batches do not divide each device's share of the batch: 12 examples over 4 "
            r"devices is 3 each; use a batch size that is a multiple of 8")):
        trainer.fit(make_batches(2, batch_size=12), epochs=1)
    assert not trainer.runner.traces


class Convolutional(nn.Module):
    """Activations far larger than the parameters: what micro-batches save."""

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Conv(16, (3, 3))(x))
        x = nn.relu(nn.Conv(16, (3, 3))(x))
        return nn.Dense(3)(x.mean(axis=(1, 2)))


def test_micro_batches_in_a_loop_take_less_memory_and_count_the_flops_of_the_whole_update(looped):
    """XLA's analyses of the compiled step: temporaries shrink with the micro-batch; XLA
    counts a loop's body once, and the step's FLOPs still count every micro-batch."""
    rng = np.random.default_rng(0)
    batches = [{"image": rng.normal(size=(64, 16, 16, 1)).astype(np.float32),
                "label": rng.integers(0, 3, 64).astype(np.int32)} for _ in range(2)]
    memory, flops = {}, {}
    for k in (1, 4):
        trainer = flaxhooks.Trainer(Convolutional(), optax.sgd(0.1), cross_entropy, accumulate=k,
                                    devices=jax.local_devices()[:2])
        trainer.fit(batches, epochs=1)
        memory[k], flops[k] = trainer.runner.step_memory(), trainer.runner.step_flops()
        assert trainer.runner.traces == {"train_step": 1}  # counting compiled nothing more
    assert memory[4]["temporaries"] < 0.5 * memory[1]["temporaries"], memory
    assert memory[4]["arguments"] == memory[1]["arguments"]
    assert flops[4] == pytest.approx(flops[1], rel=0.03)


class Recurrent(nn.Module):
    """An LSTM whose sown values stack its time steps first: the batch is their second axis."""

    @nn.compact
    def __call__(self, x):
        rnn = nn.RNN(nn.LSTMCell(8), variable_axes={"intermediates": 0, "perturbations": 0})
        return nn.Dense(3)(rnn(x)[:, -1])


def test_values_whose_batch_axis_is_not_the_first_are_joined_along_it():
    rng = np.random.default_rng(0)
    batches = [{"image": rng.normal(size=(16, 5, 4)).astype(np.float32),
                "label": rng.integers(0, 3, 16).astype(np.int32)} for _ in range(2)]
    initial = flaxhooks.Trainer(Recurrent(), optax.adam(1e-2), cross_entropy).init(batches[0])
    tables = {}
    for k in (1, 2):
        tables[k] = {}

        class Keep(flaxhooks.Callback):
            order = 50

            def on_step_end(self, loop, seen=tables[k]):
                topics = ("activations", "activation_grads")
                seen[loop.step] = {t: loop.published[t].to_dict() for t in topics}

        flaxhooks.Trainer(Recurrent(), optax.adam(1e-2), cross_entropy, accumulate=k, callbacks=[
            flaxhooks.ActivationStats(every=1), flaxhooks.ActivationGradStats(every=1), Keep(),
        ]).fit(batches, epochs=1, state=initial)
    assert len(tables[1][1]["activations"]) > 5  # the cell's gates, each over the time steps
    assert_tables_close(tables[2], tables[1], rel=1e-4, abs=1e-6)
