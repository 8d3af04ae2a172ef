"""Trainer.predict: every example's outputs, once and in order, in inference mode, on any mesh; checked
against the model applied by hand (or numpy in float64); bad data refused before anything compiles."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType, Mesh
from jax.sharding import PartitionSpec as P

import flaxhooks
from flaxhooks import BatchError, EmptyDataError
from tests.helpers import BatchNormNet, cross_entropy, make_arrays, make_batches, sgd_trainer, split_batches


def numpy_relu_net(params, x):
    """``Dense_1(relu(Dense_0(x)))`` in float64: the reference for the two-layer nets here."""
    layers = [{k: np.asarray(v, np.float64) for k, v in params[f"Dense_{i}"].items()} for i in (0, 1)]
    hidden = np.maximum(np.asarray(x, np.float64) @ layers[0]["kernel"] + layers[0]["bias"], 0)
    return hidden @ layers[1]["kernel"] + layers[1]["bias"]


def inputs(n, seed=0):
    """Images only: predict needs no labels."""
    return {"image": make_arrays(n, seed=seed)["image"]}


def test_a_batch_norm_model_predicts_with_its_running_averages_in_order_padding_dropped():
    model = BatchNormNet(axis_name=None)
    trainer = sgd_trainer(model)
    state = trainer.fit(make_batches(3), epochs=2)
    test = inputs(77, seed=4)  # 4 batches of 16 and a ragged 13, padded
    outputs = trainer.predict(test, batch_size=16)
    expected = model.apply(state.variables, test["image"], train=False)  # running statistics
    assert isinstance(outputs, np.ndarray) and outputs.shape == (77, 3) and outputs.dtype == np.float32
    np.testing.assert_allclose(outputs, np.asarray(expected), rtol=1e-5, atol=1e-6)
    # A batch statistics call differs: the test tells the modes apart.
    train_mode, _ = model.apply(state.variables, test["image"], train=True, mutable=["batch_stats"])
    assert np.abs(np.asarray(train_mode) - outputs).max() > 1e-2
    # The outputs evaluate scores: its loss is theirs.
    labelled = make_arrays(77, seed=4)
    loss = numpy_loss(outputs, labelled["label"])
    assert trainer.evaluate(labelled, batch_size=16).metrics["loss"] == pytest.approx(loss, rel=1e-5)
    # The state is only read.
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(trainer.state), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_one_compilation_per_padded_batch_size():
    trainer = sgd_trainer()
    trainer.fit(make_batches(2), epochs=1)
    predictor = trainer.evaluations.predictor
    test = inputs(100, seed=1)
    trainer.predict(test, batch_size=32)  # 3 batches of 32 and a ragged 4 padded to 32
    trainer.predict(split_batches(test, [32, 20, 32, 16]))  # every batch padded to the first's 32
    assert predictor.traces == 1
    trainer.predict(test, batch_size=50)
    assert predictor.traces == 2 and trainer.evaluations.traces == 2


def test_iterable_batches_of_uneven_sizes_give_every_example_once_in_order():
    trainer = sgd_trainer()
    state = trainer.fit(make_batches(2), epochs=1)
    test = inputs(116, seed=2)
    # The first batch (5, padded to 8 on the 8 devices) fixes the size: the later ones are split into it.
    batches = split_batches(test, [5, 40, 0, 64, 7])
    outputs = trainer.predict(iter(batches))  # a one-shot iterator
    np.testing.assert_allclose(outputs, numpy_relu_net(state.params, test["image"]), rtol=1e-5, atol=1e-6)
    # Other shard sizes, other float32 roundings.
    np.testing.assert_allclose(outputs, trainer.predict(test, batch_size=24), rtol=1e-6, atol=1e-6)
    assert trainer.evaluations.predictor.traces == 2  # 8 rows, then 24


def numpy_loss(logits, labels):
    """Mean cross-entropy in float64."""
    logits = np.asarray(logits, np.float64)
    log_probs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    return -log_probs[np.arange(len(labels)), labels].mean()


class Samples(nn.Module):
    """Adds noise from the ``sample`` stream in eval mode (as a decoder that samples)."""

    @nn.compact
    def __call__(self, x, train: bool):
        logits = nn.Dense(3)(x)
        return logits if train else logits + jax.random.normal(self.make_rng("sample"), logits.shape)


def test_a_model_that_samples_gets_the_keys_evaluation_gives_the_same_batches():
    trainer = sgd_trainer(flaxhooks.as_model(Samples(), rng_names=("dropout", "sample")))
    state = trainer.fit(make_batches(2), epochs=1)
    test = make_arrays(40, seed=10)
    outputs = trainer.predict(test, batch_size=16)
    np.testing.assert_array_equal(outputs, trainer.predict(test, batch_size=16))  # fixed keys
    dense = {k: np.asarray(v, np.float64) for k, v in state.params["Dense_0"].items()}
    noise = outputs - (test["image"] @ dense["kernel"] + dense["bias"])
    assert 0.5 < noise.std() < 2  # standard normal noise
    loss = trainer.evaluate(test, batch_size=16).metrics["loss"]
    assert loss == pytest.approx(numpy_loss(outputs, test["label"]), rel=1e-5)


class TwoHeads(nn.Module):
    """Outputs a dict: class logits and a per-example embedding."""

    @nn.compact
    def __call__(self, x):
        embedding = nn.Dense(4)(x)
        return {"logits": nn.Dense(3)(jnp.tanh(embedding)), "embedding": embedding}


def test_an_output_pytree_comes_back_whole_with_a_leading_example_axis():
    trainer = flaxhooks.Trainer(TwoHeads(), optax.sgd(0.1),
                                lambda outputs, batch: cross_entropy(outputs["logits"], batch))
    state = trainer.fit(make_batches(2), epochs=1)
    test = inputs(19, seed=3)
    outputs = trainer.predict(test, batch_size=8)
    assert set(outputs) == {"logits", "embedding"}
    kernel, bias = (np.asarray(state.params["Dense_0"][k], np.float64) for k in ("kernel", "bias"))
    embedding = test["image"].astype(np.float64) @ kernel + bias
    np.testing.assert_allclose(outputs["embedding"], embedding, rtol=1e-5, atol=1e-6)
    head = {k: np.asarray(v, np.float64) for k, v in state.params["Dense_1"].items()}
    np.testing.assert_allclose(outputs["logits"], np.tanh(embedding) @ head["kernel"] + head["bias"],
                               rtol=1e-5, atol=1e-6)


class NNXNet(nnx.Module):
    """Linear → BatchNorm → Dropout → Linear."""

    def __init__(self, rngs: nnx.Rngs):
        self.hidden = nnx.Linear(5, 8, rngs=rngs)
        self.bn = nnx.BatchNorm(8, momentum=0.5, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)
        self.head = nnx.Linear(8, 3, rngs=rngs)

    def __call__(self, x):
        return self.head(self.drop(nnx.relu(self.bn(self.hidden(x)))))


def test_an_nnx_model_predicts_in_eval_mode():
    model = NNXNet(nnx.Rngs(0, dropout=1))
    trainer = sgd_trainer(model)
    trainer.fit(make_batches(3), epochs=2)
    test = inputs(45, seed=5)
    outputs = trainer.predict(test, batch_size=16)
    model.eval()  # the user's module holds the trained values: running statistics, no dropout
    np.testing.assert_allclose(outputs, np.asarray(model(jnp.asarray(test["image"]))), rtol=1e-5, atol=1e-6)


def test_predict_from_a_callback_during_a_fit_and_with_a_given_state():
    test = inputs(30, seed=6)
    seen = []

    class Predict(flaxhooks.Callback):
        def on_epoch_end(self, loop):
            seen.append((trainer.predict(test, batch_size=8), jax.device_get(loop.state.params)))

    trainer = sgd_trainer(callbacks=[Predict()])
    trainer.fit(make_batches(2), epochs=2)
    assert len(seen) == 2 and np.abs(seen[0][0] - seen[1][0]).max() > 1e-4  # the state of each epoch
    for outputs, params in seen:
        np.testing.assert_allclose(outputs, numpy_relu_net(params, test["image"]), rtol=1e-5, atol=1e-6)
    # A state of another Trainer's, before any fit of this one.
    fresh = sgd_trainer()
    with pytest.raises(ValueError, match="nothing to predict with yet: call fit first, or pass state="):
        fresh.predict(test, batch_size=8)
    given = trainer.state
    np.testing.assert_allclose(fresh.predict(test, batch_size=8, state=given),
                               numpy_relu_net(given.params, test["image"]), rtol=1e-5, atol=1e-6)


def _mesh(shape, names):
    devices = jax.local_devices()
    if len(devices) < 8:
        pytest.skip("needs 8 devices")
    return Mesh(np.asarray(devices[:8]).reshape(shape), names, axis_types=(AxisType.Auto,) * len(names))


class Wide(nn.Module):
    """Two dense layers, their hidden units split over mesh axis ``split`` (None: whole)."""

    split: str | None = None

    @nn.compact
    def __call__(self, x):
        def init(*axes):
            plain = nn.initializers.lecun_normal()
            return nn.with_partitioning(plain, axes) if self.split else plain

        x = nn.relu(nn.Dense(64, kernel_init=init(None, self.split))(x))  # Dense_0, made first
        return nn.Dense(3, kernel_init=init(self.split, None))(x)


def test_outputs_are_exact_with_fsdp_over_eight_devices():
    trainer = sgd_trainer(Wide(), mesh=_mesh((8,), ("data",)), shard=flaxhooks.FSDP(min_size=64))
    state = trainer.init(make_batches(1)[0])
    kernel = state.params["Dense_0"]["kernel"]
    assert kernel.sharding.spec == P(None, "data")  # each device holds 8 of the 64 hidden units
    test = inputs(101, seed=7)
    outputs = trainer.predict(test, batch_size=24, state=state)
    np.testing.assert_allclose(outputs, numpy_relu_net(state.params, test["image"]), rtol=1e-5, atol=1e-6)


def test_outputs_are_exact_on_a_data_and_model_mesh_of_a_tensor_parallel_model():
    trainer = sgd_trainer(Wide(split="model"), mesh=_mesh((4, 2), ("data", "model")))
    state = trainer.fit(make_batches(2), epochs=1)
    assert state.params["Dense_0"]["kernel"].sharding.spec == P(None, "model")
    assert state.params["Dense_1"]["kernel"].sharding.spec == P("model", None)
    test = inputs(53, seed=8)
    expected = numpy_relu_net(state.params, test["image"])
    np.testing.assert_allclose(trainer.predict(test), expected, rtol=1e-5, atol=1e-6)  # the fit's 16
    batches = split_batches(test, [16, 30, 7])
    np.testing.assert_allclose(trainer.predict(batches), expected, rtol=1e-5, atol=1e-6)
    assert trainer.evaluations.predictor.traces == 1


class OneNumber(nn.Module):
    """Logits, and one number for the whole batch: not an output per example."""

    @nn.compact
    def __call__(self, x):
        logits = nn.Dense(3)(x)
        return {"logits": logits, "mean": logits.mean()}


def test_bad_data_fails_before_anything_compiles(compiles):
    trainer = sgd_trainer()
    trainer.fit(make_batches(1), epochs=1)
    scalar = flaxhooks.Trainer(OneNumber(), optax.sgd(0.1),
                               lambda outputs, batch: cross_entropy(outputs["logits"], batch))
    scalar_state = scalar.init(make_batches(1)[0])
    compiles.clear()
    pixels = {"pixels": np.zeros((8, 5), np.float32)}
    for data in (pixels, [pixels]):
        with pytest.raises(BatchError, match=r"the batch has no key 'image', the model's input by default"):
            trainer.predict(data, batch_size=8)
    with pytest.raises(EmptyDataError, match="the prediction arrays are empty"):
        trainer.predict({"image": np.zeros((0, 5), np.float32)}, batch_size=8)
    for empty in ([], [{"image": np.zeros((0, 5), np.float32)}]):
        with pytest.raises(EmptyDataError, match="prediction: the data yielded no example"):
            trainer.predict(empty)
    with pytest.raises(BatchError, match="cannot be called in eval mode on batches of image float32"):
        trainer.predict({"image": np.zeros((8, 4), np.float32)})
    with pytest.raises(BatchError, match="batch size must be positive"):
        trainer.predict(inputs(8), batch_size=0)
    with pytest.raises(BatchError, match=r"output\['mean'\] has shape \(\): its first axis must be"):
        scalar.predict(inputs(8), batch_size=8, state=scalar_state)
    assert compiles == []
    assert trainer.evaluations.traces == scalar.evaluations.traces == 0
