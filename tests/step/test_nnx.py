"""Flax NNX models through the same Trainer and callbacks, checked against
hand-written NNX loops, numpy and ``jax.grad`` by hand."""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import jax_utils, nnx

import flaxhooks
from flaxhooks.step import NNXModel
from tests.helpers import cross_entropy


class CNN(nnx.Module):
    """Conv → BatchNorm (no axis_name, as NNX users write it) → Dropout → Linear."""

    def __init__(self, rngs: nnx.Rngs, rate: float = 0.3):
        self.conv = nnx.Conv(1, 4, (3, 3), rngs=rngs)
        self.bn = nnx.BatchNorm(4, momentum=0.5, rngs=rngs)
        self.drop = nnx.Dropout(rate, rngs=rngs)
        self.head = nnx.Linear(4 * 8 * 8, 3, rngs=rngs)

    def __call__(self, x):
        x = self.drop(nnx.relu(self.bn(self.conv(x))))
        return self.head(x.reshape(x.shape[0], -1))


class Twice(nnx.Module):
    """One layer called twice, an nnx.Sequential, and the model's own sow and perturb sites."""

    def __init__(self, rngs: nnx.Rngs):
        self.shared = nnx.Linear(5, 5, rngs=rngs)
        self.tail = nnx.Sequential(nnx.Linear(5, 4, rngs=rngs), nnx.relu, nnx.Linear(4, 3, rngs=rngs))

    def __call__(self, x):
        h = nnx.tanh(self.shared(nnx.tanh(self.shared(x))))
        self.sow(nnx.Intermediate, "hidden", h)
        h = self.perturb("hidden_grad", h)
        return self.tail(h)


class Block(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.linear = nnx.Linear(5, 5, rngs=rngs)

    def __call__(self, x):
        return nnx.tanh(self.linear(x))


class ScanStack(nnx.Module):
    """Three blocks with stacked parameters, applied with nnx.scan."""

    def __init__(self, rngs: nnx.Rngs):
        @nnx.split_rngs(splits=3)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def blocks(rngs):
            return Block(rngs)

        self.blocks = blocks(rngs)
        self.head = nnx.Linear(5, 3, rngs=rngs)

    def __call__(self, x):
        @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
        def body(block, x):
            return block(x)

        return self.head(body(self.blocks, x))


def images(n: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"image": rng.normal(size=(n, 8, 8, 1)).astype(np.float32),
            "label": rng.integers(0, 3, n).astype(np.int32)}


def vectors(n: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"image": rng.normal(size=(n, 5)).astype(np.float32),
            "label": rng.integers(0, 3, n).astype(np.int32)}


def batches(arrays: dict[str, np.ndarray], size: int) -> list[dict[str, np.ndarray]]:
    n = len(arrays["label"]) // size
    return [{k: v[i * size:(i + 1) * size] for k, v in arrays.items()} for i in range(n)]


def hand_written(model: nnx.Module, data: list[dict[str, np.ndarray]], lr: float = 0.05) -> nnx.Module:
    """Flax's own way: nnx.jit and nnx.Optimizer over the whole batch on one device."""
    model = nnx.clone(model)
    model.train()
    optimizer = nnx.Optimizer(model, optax.sgd(lr, momentum=0.9), wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, batch):
        def loss(model):  # under nnx.capture the model's sow and perturb calls do nothing
            return cross_entropy(nnx.capture(lambda m: m(batch["image"]))(model), batch)

        optimizer.update(model, nnx.grad(loss)(model))

    for batch in data:
        step(model, optimizer, batch)
    return model


def params_of(model: nnx.Module) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(nnx.to_pure_dict(nnx.state(model, nnx.Param)))]


def trainer(model, callbacks=(), devices=None, lr=0.05, **kwargs) -> flaxhooks.Trainer:
    return flaxhooks.Trainer(model, optax.sgd(lr, momentum=0.9), cross_entropy, callbacks=callbacks,
                             devices=devices, **kwargs)


@pytest.mark.parametrize("make", [lambda: CNN(nnx.Rngs(0, dropout=1)), lambda: Twice(nnx.Rngs(0)),
                                  lambda: ScanStack(nnx.Rngs(0))], ids=["cnn", "twice", "scan"])
def test_training_equals_a_hand_written_nnx_loop(devices, make):
    model = make()
    if isinstance(model, CNN) and len(devices) > 1:
        model.drop.rate = 0.0  # dropout masks differ per device by design (tested below)
    data = batches(images(64) if isinstance(model, CNN) else vectors(64), 16)
    reference = hand_written(model, data)
    state = trainer(model, devices=devices).fit(data, epochs=1)
    for ours, theirs in zip(jax.tree.leaves(state.params), params_of(reference), strict=True):
        np.testing.assert_allclose(np.asarray(ours), theirs, rtol=2e-5, atol=2e-6)
    if isinstance(model, CNN):  # BatchNorm statistics over the global batch, as under one jit
        np.testing.assert_allclose(np.asarray(state.model_state["batch_stats"]["bn"]["mean"]),
                                   np.asarray(reference.bn.mean[...]), rtol=1e-5, atol=1e-6)
        draws = 4 if model.drop.rate else 0  # one per step
        count = state.model_state["rngs"]["drop"]["rngs"]["count"]
        assert int(count) == draws == int(reference.drop.rngs.count[...])


def test_the_users_model_takes_the_trained_values_and_keeps_its_mode():
    model = CNN(nnx.Rngs(0, dropout=1))
    before = params_of(model)
    state = trainer(model).fit(batches(images(48), 16), epochs=1)
    trained = jax.tree.leaves(state.params)
    assert all(np.array_equal(a, np.asarray(b)) for a, b in zip(params_of(model), trained, strict=True))
    assert not all(np.array_equal(a, b) for a, b in zip(before, params_of(model), strict=True))
    assert int(model.drop.rngs.count[...]) == 3  # the RNG state advanced, one draw per step
    assert model.bn.axis_name is None and model.bn.use_running_average is False  # not switched by the Trainer
    assert not hasattr(model, "hidden")  # no sown attribute left behind


def test_dropout_masks_differ_per_device_and_per_step():
    class Mask(nnx.Module):
        def __init__(self, rngs):
            self.drop = nnx.Dropout(0.5, rngs=rngs)

        def __call__(self, x):
            return self.drop(x)

    adapter = NNXModel(Mask(nnx.Rngs(dropout=3)), "image")
    variables = adapter.own_variables()
    step = jax.pmap(lambda state, batch: adapter.apply({}, state, batch, train=True, rngs={}),
                    axis_name=flaxhooks.AXIS)
    replicated = jax_utils.replicate({"rngs": variables["rngs"]})
    batch = {"image": jnp.ones((len(jax.local_devices()), 64))}
    first, after = step(replicated, batch)
    second, _ = step(after, batch)
    masks = np.asarray(first) != 0
    assert len({m.tobytes() for m in masks}) == len(masks)  # one mask per device
    assert not np.array_equal(masks, np.asarray(second) != 0)  # and per step
    count = np.asarray(after["rngs"]["drop"]["rngs"]["count"])
    assert (count == 1).all()  # the count advanced on every device alike, the key kept
    np.testing.assert_array_equal(np.asarray(after["rngs"]["drop"]["rngs"]["key"])[0],
                                  np.asarray(variables["rngs"]["drop"]["rngs"]["key"]))


def _reference_values(model: Twice, x: np.ndarray) -> dict[str, np.ndarray]:
    """Every module output of ``Twice`` by hand, with the names the statistics use."""
    first = model.shared(jnp.asarray(x))
    second = model.shared(nnx.tanh(first))
    hidden = nnx.tanh(second)
    layer0 = model.tail.layers[0](hidden)
    layer2 = model.tail.layers[2](nnx.relu(layer0))
    return {"shared/0": first, "shared/1": second, "tail/layers/0": layer0,
            "tail/layers/2": layer2, "tail": layer2, "output": layer2, "hidden": hidden}


def test_activation_statistics_equal_numpy_in_call_order(compiles):
    model = Twice(nnx.Rngs(0))
    data = vectors(32)
    stats = flaxhooks.ActivationStats(every=1, stats="all")  # every statistic of every value
    state = trainer(nnx.clone(model), callbacks=[stats]).fit([data], steps=1)
    assert int(state.step) == 1
    want = _reference_values(model, data["image"])
    assert stats.latest.names == ("shared/0", "shared/1", "tail/layers/0",
                                  "tail/layers/2", "tail", "output", "hidden")
    got = stats.latest.to_dict()
    for name, value in want.items():
        value = np.asarray(value, np.float64)
        np.testing.assert_allclose(got[name]["mean"], value.mean(), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(got[name]["std"], value.std(), rtol=1e-4, atol=1e-6)
        np.testing.assert_allclose(got[name]["max"], value.max(), rtol=1e-6)
        np.testing.assert_allclose(got[name]["zero_fraction"], (value == 0).mean())


def test_gradients_of_intermediates_equal_jax_grad_by_hand(devices):
    model = Twice(nnx.Rngs(0))
    data = vectors(32)
    grads = flaxhooks.ActivationGradStats(every=1, stats="all")
    trainer(nnx.clone(model), callbacks=[grads], devices=devices).fit([data], steps=1)
    x, labels = jnp.asarray(data["image"]), {"label": data["label"]}
    first = model.shared(x)
    layer0 = model.tail.layers[0](nnx.tanh(model.shared(nnx.tanh(first))))

    def from_first(h):
        return cross_entropy(model.tail(nnx.tanh(model.shared(nnx.tanh(h)))), labels)

    def from_layer0(h):
        return cross_entropy(model.tail.layers[2](nnx.relu(h)), labels)

    def from_hidden(h):
        return cross_entropy(model.tail(h), labels)

    hidden = nnx.tanh(model.shared(nnx.tanh(first)))
    want = {"shared/0": jax.grad(from_first)(first),
            "tail/layers/0": jax.grad(from_layer0)(layer0),
            "hidden_grad": jax.grad(from_hidden)(hidden)}
    got = grads.latest.to_dict()
    assert "hidden_grad" in grads.latest.names and "shared/1" in grads.latest.names
    for name, value in want.items():
        value = np.asarray(value, np.float64)
        np.testing.assert_allclose(got[name]["l2"], np.sqrt((value ** 2).sum()), rtol=1e-4)
        np.testing.assert_allclose(got[name]["mean"], value.mean(), rtol=1e-3, atol=1e-8)


def test_one_compile_per_step_variant_and_any_batch_size(compiles):
    model = CNN(nnx.Rngs(0, dropout=1))
    stats, grads = flaxhooks.ActivationStats(every=2), flaxhooks.ActivationGradStats(every=2)
    tr = trainer(model, callbacks=[stats, grads])
    tr.fit(flaxhooks.ArrayLoader(images(64), batch_size=16), epochs=3)
    assert tr.runner.traces == {"train_step": 1, "instrumented_step": 1}
    assert stats.latest.names[:3] == ("conv", "bn", "drop")


def test_evaluation_is_exact_in_eval_mode():
    model = CNN(nnx.Rngs(0, dropout=1))
    evaluate = flaxhooks.Evaluate(images(37, seed=5), batch_size=16)
    state = trainer(model, callbacks=[evaluate]).fit(batches(images(64), 16), epochs=1)
    model.eval()  # the user's model holds the trained values
    test = images(37, seed=5)
    logits = np.asarray(model(jnp.asarray(test["image"])), np.float64)
    assert evaluate.result.examples == 37
    accuracy = (logits.argmax(-1) == test["label"]).mean()
    np.testing.assert_allclose(evaluate.result.metrics["accuracy"], accuracy)
    loss = -jax.nn.log_softmax(logits)[np.arange(37), test["label"]].mean()
    np.testing.assert_allclose(evaluate.result.metrics["loss"], loss, rtol=1e-5)
    assert int(state.step) == 4


def test_resume_is_bit_exact_including_the_rng_state(tmp_path):
    data = flaxhooks.ArrayLoader(images(96), batch_size=16, seed=1)
    straight = trainer(CNN(nnx.Rngs(0, dropout=1)), lr=0.02).fit(data, epochs=2)
    first = trainer(CNN(nnx.Rngs(0, dropout=1)), [flaxhooks.Checkpoint(tmp_path, every=5)], lr=0.02)
    first.fit(data, steps=5)
    # Another model object with other values: the checkpoint's values win.
    second = trainer(CNN(nnx.Rngs(3, dropout=3)), [flaxhooks.Checkpoint(tmp_path, every=5)], lr=0.02)
    final = second.fit(data, epochs=2, resume=True)
    assert int(final.step) == 12
    for ours, theirs in zip(jax.tree.leaves(final), jax.tree.leaves(straight), strict=True):
        np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs))
    assert int(final.model_state["rngs"]["drop"]["rngs"]["count"]) == 12


def test_the_non_finite_guard_names_the_layer(caplog):
    class Diverging(nnx.Module):
        def __init__(self, rngs):
            self.encode = nnx.Linear(5, 5, rngs=rngs)
            self.head = nnx.Linear(5, 3, rngs=rngs)

        def __call__(self, x):
            return self.head(jnp.log(self.encode(x) - 1e6))  # NaN from the log on

    run = trainer(Diverging(nnx.Rngs(0)))  # no statistics callback: the guard every Trainer has
    with caplog.at_level(logging.ERROR, logger="flaxhooks"), pytest.raises(flaxhooks.NonFiniteError) as error:
        run.fit(batches(vectors(64), 16), epochs=1)
    assert int(run.state.step) == 0  # the state from before the step
    # 'head', a Linear, cannot make a NaN from finite inputs: the parent's own code (the log) made it.
    assert str(error.value).startswith(
        "the loss is nan at step 1: the first call, in execution order, whose output went non-finite is "
        "'head' (a Linear), which makes no NaN or infinity from finite inputs and parameters: its input "
        "already was, made by the code of the model (not a submodule), after 'encode' (a Linear) returned")
    assert caplog.records[0].getMessage().startswith(
        "the loss is nan at step 1; first non-finite: the code of the model, before 'head' (a Linear)")


def test_scan_stacks_warn_that_their_layers_are_seen_through_the_stack():
    stats = flaxhooks.ActivationStats(every=1)
    expected = r"\['Block', 'Linear'\] ran inside a JAX or NNX transform .* by 'the model' \(ScanStack\)"
    with pytest.warns(UserWarning, match=expected):
        trainer(ScanStack(nnx.Rngs(0)), [stats]).fit(batches(vectors(32), 16), epochs=1)
    assert stats.latest.names == ("head",)  # the model's output is head's: logged once


def test_summary_counts_parameters_only_and_is_plain_text():
    summary = flaxhooks.Summary(console_kwargs={"width": 160})
    trainer(CNN(nnx.Rngs(0, dropout=1)), [summary]).fit(batches(images(32), 16), steps=1)
    params = 4 * 9 + 4 + 4 + 4 + 4 * 64 * 3 + 3
    assert summary.parameters == params
    assert f"Total Parameters: {params:,}" in summary.table and "nnx.Param only" in summary.table
    assert "BatchStat" in summary.table and "RngState" in summary.table  # shown apart, in their columns
    assert "\x1b[" not in summary.table


def test_the_recipes_nnx_cnn_trains_as_its_linen_cnn_from_the_same_weights():
    devices = jax.local_devices()  # all 8: the split over devices is what could differ
    from recipes.models import CNN as LinenCNN
    from recipes.models import NNXCNN, cross_entropy_loss

    rng = np.random.default_rng(0)
    data = [{"image": rng.random((16, 28, 28, 1), dtype=np.float32), "label": rng.integers(0, 10, 16)}
            for _ in range(3)]
    linen = flaxhooks.Trainer(LinenCNN(), optax.sgd(0.1, momentum=0.9), cross_entropy_loss, devices=devices)
    start = linen.init(data[0])
    names = {"Conv_0": "conv_0", "Conv_1": "conv_1", "Dense_0": "dense_0", "Dense_1": "dense_1"}
    model = NNXCNN(nnx.Rngs(0))
    nnx.update(model, {new: dict(start.params[old]) for old, new in names.items()})
    stats = flaxhooks.ActivationStats(every=3)
    ours = flaxhooks.Trainer(model, optax.sgd(0.1, momentum=0.9), cross_entropy_loss, devices=devices,
                             callbacks=[stats]).fit(data, epochs=1)
    theirs = linen.fit(data, epochs=1, state=start)
    for old, new in names.items():
        for leaf in ("kernel", "bias"):
            np.testing.assert_allclose(np.asarray(ours.params[new][leaf]),
                                       np.asarray(theirs.params[old][leaf]), rtol=1e-5, atol=1e-6)
    assert stats.latest.names == (  # the model's output is dense_1's: logged once
        "conv_0", "conv_1", "dense_0", "dense_1",
        "conv_0_relu", "conv_1_relu", "dense_0_relu",
    )


def test_a_sequential_root_and_a_train_parameter():
    layers = nnx.Sequential(nnx.Linear(5, 8, rngs=nnx.Rngs(0)), nnx.relu, nnx.Linear(8, 3, rngs=nnx.Rngs(1)))
    data = batches(vectors(32), 16)
    reference = hand_written(layers, data)
    state = trainer(layers).fit(data, epochs=1)  # no train= handed on to the layers
    for ours, theirs in zip(jax.tree.leaves(state.params), params_of(reference), strict=True):
        np.testing.assert_allclose(np.asarray(ours), theirs, rtol=2e-5, atol=2e-6)

    modes = []

    class Flagged(nnx.Module):
        def __init__(self, rngs):
            self.linear = nnx.Linear(5, 3, rngs=rngs)

        def __call__(self, x, train: bool):
            modes.append(train)  # while traced
            return self.linear(x)

    evaluate = flaxhooks.Evaluate(vectors(20), batch_size=16)
    trainer(Flagged(nnx.Rngs(0)), [evaluate]).fit(data, epochs=1)
    assert set(modes) == {True, False} and evaluate.result.examples == 20


def test_something_that_is_no_flax_model_is_refused_by_name():
    with pytest.raises(TypeError, match="cannot train a function: give a flax.linen Module, an nnx.Module"):
        trainer(lambda x: x)


class Unusual(nnx.Module):
    """A submodule called inside jax.vmap and a key the model advances itself."""

    def __init__(self, rngs: nnx.Rngs):
        self.inner = nnx.Linear(5, 5, rngs=rngs)
        self.head = nnx.Linear(5, 3, rngs=rngs)
        self.noise = nnx.Variable(jax.random.key(0))

    def __call__(self, x):
        h = jax.vmap(lambda row: self.inner(row))(x)  # a raw JAX transform over a known module
        key, new = jax.random.split(self.noise.get_value())
        self.noise.set_value(new)
        h = h + 0.01 * jax.random.normal(key, h.shape)
        return self.head(nnx.tanh(self.perturb("noisy", h)))


def test_raw_jax_transforms_the_models_own_keys_and_merged_filters():
    model = Unusual(nnx.Rngs(0))
    start = jax.random.key_data(model.noise.get_value())
    linear, named = flaxhooks.ActivationStats(every=1, capture=nnx.Linear), flaxhooks.ActivationStats(
        every=1, capture="hea*", prefix="named")
    grads = flaxhooks.ActivationGradStats(every=1)
    with pytest.warns(UserWarning, match=r"\['Linear'\] ran inside a JAX or NNX transform"):
        trainer(model, [linear, named, grads]).fit(batches(vectors(48), 16), epochs=1)
    assert linear.latest.names == ("head",)  # inner's outputs stay inside jax.vmap
    assert named.latest.names == ("head",)  # a path pattern merged with a type filter
    assert grads.latest.names == ("head", "noisy")  # the model's output is head's: logged once
    key = jax.random.key(0)
    for _ in range(3):  # the model's own key advanced once per step, not reset
        _, key = jax.random.split(key)
    np.testing.assert_array_equal(np.asarray(jax.random.key_data(model.noise.get_value())),
                                  np.asarray(jax.random.key_data(key)))
    assert not np.array_equal(np.asarray(start), np.asarray(jax.random.key_data(key)))
