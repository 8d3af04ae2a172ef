"""Models written as people write them: setup() roots, nn.RNN and scanned
recurrences, Sequential, Flax's deterministic convention, a mode set in the
constructor, keyword inputs and a named BatchNorm axis.

Names and warnings are fixed when the step is traced, so most checks build
the state with ``Trainer.init`` (abstract traces, nothing compiled)."""

import functools
import re
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import cross_entropy

import flaxhooks
from flaxhooks.step import LinenModel, ModelCall

rs = np.random.default_rng(0)
FLAT = {"image": rs.normal(size=(16, 5)).astype(np.float32), "label": rs.integers(0, 3, 16).astype(np.int32)}
SEQUENCE = {"image": rs.normal(size=(16, 4, 5)).astype(np.float32), "label": FLAT["label"]}


class SetupRoot(nn.Module):
    def setup(self):
        self.encoder = nn.Dense(8)
        self.head = nn.Dense(3)

    def __call__(self, x):
        return self.head(nn.relu(self.encoder(x)))


class CompactTwice(nn.Module):
    @nn.compact
    def __call__(self, x):
        shared = nn.Dense(5, name="shared")
        return nn.Dense(3, name="head")(shared(nn.tanh(shared(x))))


class RNNClassifier(nn.Module):
    variable_axes: tuple = ()

    @nn.compact
    def __call__(self, x):
        h = nn.RNN(nn.SimpleCell(6), variable_axes=dict(self.variable_axes))(x)
        return nn.Dense(3)(h[:, -1])


def _scan_cell(variable_axes):
    class Cell(nn.Module):  # sst2's style: a method lifted by nn.transforms.scan
        @functools.partial(nn.transforms.scan, variable_broadcast="params", in_axes=1, out_axes=1,
                           split_rngs={"params": False}, variable_axes=variable_axes)
        @nn.compact
        def __call__(self, carry, x):
            return nn.SimpleCell(6, name="cell")(carry, x)

    return Cell


class ClassCell(nn.Module):
    @nn.compact
    def __call__(self, carry, x):
        return nn.SimpleCell(6, name="cell")(carry, x)


class ScannedClassifier(nn.Module):
    method_form: bool
    variable_axes: tuple = ()

    @nn.compact
    def __call__(self, x):
        axes = dict(self.variable_axes)
        if self.method_form:
            cell = _scan_cell(axes)(name="rnn")
        else:
            cell = nn.scan(ClassCell, variable_broadcast="params", in_axes=1, out_axes=1,
                           split_rngs={"params": False}, variable_axes=axes)(name="rnn")
        _, h = cell(jnp.zeros((x.shape[0], 6)), x)
        return nn.Dense(3)(h[:, -1])


LOGGED = (("intermediates", 0), ("perturbations", 0))


def _names(model, data=FLAT, **options):
    stats = flaxhooks.ActivationStats(every=1, **options)
    grads = flaxhooks.ActivationGradStats(every=1, **options)
    flaxhooks.Trainer(model, optax.sgd(0.1), cross_entropy, callbacks=[stats, grads]).init(data)
    return stats.names, grads.names


class SelfAttend(nn.MultiHeadDotProductAttention):
    """Attention of the inputs to themselves through ``super().__call__``, as
    Flax's (deprecated) ``nn.SelfAttention`` does."""

    def __call__(self, x):
        return super().__call__(x)


@pytest.mark.parametrize("model, data, want", [
    (SetupRoot(), FLAT, ("encoder", "head", "output")),
    (CompactTwice(), FLAT, ("shared/0", "shared/1", "head", "output")),
    (nn.Sequential([nn.Dense(8), nn.relu, nn.Dense(3)]), FLAT, ("layers_0", "layers_2", "output")),
    (nn.Sequential([SelfAttend(num_heads=1), nn.Dense(3)]), FLAT,  # calls super().__call__: one output
     ("layers_0/query", "layers_0/key", "layers_0/value", "layers_0/out", "layers_0", "layers_1", "output")),
    (RNNClassifier(LOGGED), SEQUENCE, ("SimpleCell_0/i", "SimpleCell_0/h", "SimpleCell_0/0", "SimpleCell_0/1",
                                      "RNN_0", "Dense_0", "output")),
], ids=["setup", "compact-twice", "sequential", "super-call", "rnn"])
def test_names_follow_the_order_outputs_are_produced_without_the_method(model, data, want):
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # nothing dropped: no warning
        activations, gradients = _names(model, data)
    assert activations == want
    assert gradients == want


@pytest.mark.parametrize("model, what, fix", [
    (RNNClassifier(), r"nn.RNN 'RNN_0' \(its cell 'SimpleCell_0'\)",
     r"build it as nn.RNN\(cell, variable_axes=\{'intermediates': 0, 'perturbations': 0\}\)"),
    (ScannedClassifier(method_form=True), r"the nn.transforms.scan on Cell.__call__ \(module 'rnn'\)",
     r"pass variable_axes=\{'intermediates': 0, 'perturbations': 0\} to that nn.transforms.scan"),
    (ScannedClassifier(method_form=False), r"nn.scan module 'rnn'",
     r"pass variable_axes=\{'intermediates': 0, 'perturbations': 0\} to nn.scan"),
], ids=["rnn", "method-scan", "class-scan"])
def test_a_recurrence_that_drops_values_warns_once_with_the_fix(model, what, fix):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        activations, _ = _names(model, SEQUENCE)
    messages = {str(w.message) for w in caught if issubclass(w.category, UserWarning)}
    assert len(messages) == 1, messages  # one warning per scan, naming both collections
    (message,) = messages
    assert re.search(f"{what} drops .*{fix}", message), message
    assert "reduced over its time steps" in message
    assert activations[-2:] == ("Dense_0", "output")


def test_method_form_scan_logs_as_the_class_form_reduced_over_time():
    method = _names(ScannedClassifier(method_form=True, variable_axes=LOGGED), SEQUENCE)
    klass = _names(ScannedClassifier(method_form=False, variable_axes=LOGGED), SEQUENCE)
    assert method == klass
    assert method[0][:3] == ("rnn/cell/i", "rnn/cell/h", "rnn/cell/0")  # one curve over 4 time steps
    split = _names(ScannedClassifier(method_form=True, variable_axes=LOGGED), SEQUENCE, split_steps=True)
    assert split[0][:4] == ("rnn/0/cell/i", "rnn/1/cell/i", "rnn/2/cell/i", "rnn/3/cell/i")


def test_recurrence_statistics_cover_every_time_step():
    model = RNNClassifier(LOGGED)
    stats = flaxhooks.ActivationStats(every=1, capture=nn.Dense, stats=("mean", "rms"))
    trainer = flaxhooks.Trainer(model, optax.sgd(0.1), cross_entropy, callbacks=[stats])
    state = trainer.init(SEQUENCE)
    trainer.fit([SEQUENCE], steps=1, state=state)
    kernel = np.asarray(state.params["SimpleCell_0"]["i"]["kernel"], np.float64)
    bias = np.asarray(state.params["SimpleCell_0"]["i"]["bias"], np.float64)
    want = SEQUENCE["image"].astype(np.float64) @ kernel + bias  # every example, every time step
    got = stats.latest.to_dict()["SimpleCell_0/i"]
    np.testing.assert_allclose(got["mean"], want.mean(), rtol=1e-5)
    np.testing.assert_allclose(got["rms"], np.sqrt((want ** 2).mean()), rtol=1e-5)


# -- train and eval mode --------------------------------------------------------


class DeterministicArg(nn.Module):
    @nn.compact
    def __call__(self, x, deterministic: bool = True):
        return nn.Dropout(0.5)(nn.Dense(3)(x), deterministic=deterministic)


class DeterministicField(nn.Module):
    deterministic: bool = True

    @nn.compact
    def __call__(self, x):
        return nn.Dropout(0.5, deterministic=self.deterministic)(nn.Dense(3)(x))


class Config(nn.Module):  # lm1b's style: the mode is in a config the model is built with
    rate: float

    @nn.compact
    def __call__(self, x):
        return nn.Dropout(self.rate, deterministic=self.rate == 0)(nn.Dense(3)(x))


def _outputs(adapter: LinenModel, train: bool):
    variables = adapter.init(jax.random.PRNGKey(0), FLAT)
    rngs = {"dropout": jax.random.PRNGKey(1)}
    return adapter.apply(variables["params"], {}, FLAT, train=train, rngs=rngs)[0]


@pytest.mark.parametrize("make", [
    lambda: LinenModel.create(DeterministicArg()),
    lambda: LinenModel.create(DeterministicArg(), train_arg="deterministic"),
    lambda: LinenModel.create(DeterministicField()),
    lambda: LinenModel.create(DeterministicField(deterministic=False)),
    lambda: LinenModel.create(Config(0.5), eval_module=Config(0.0)),
], ids=["argument", "explicit-argument", "field", "field-false", "eval-model"])
def test_dropout_is_on_in_training_and_off_in_evaluation(make):
    adapter = make()
    train, evaluation = _outputs(adapter, True), _outputs(adapter, False)
    variables = adapter.init(jax.random.PRNGKey(0), FLAT)
    plain = FLAT["image"] @ variables["params"]["Dense_0"]["kernel"] + variables["params"]["Dense_0"]["bias"]
    np.testing.assert_allclose(evaluation, plain, rtol=1e-5, atol=1e-6)
    dropped = np.asarray(train) == 0
    assert 0.3 < dropped.mean() < 0.7  # half the units dropped, the rest scaled by 2
    np.testing.assert_allclose(np.asarray(train)[~dropped], 2 * np.asarray(plain)[~dropped], rtol=1e-5)


def test_a_deterministic_model_trains_with_dropout_and_evaluates_without_rngs():
    trainer = flaxhooks.Trainer(DeterministicArg(), optax.sgd(0.1), cross_entropy,
                                callbacks=[flaxhooks.Evaluate(FLAT, batch_size=8)])
    trainer.fit([FLAT], epochs=1)
    assert trainer.model.call == ModelCall(("image",), (), "deterministic", True)


# -- inputs by keyword ------------------------------------------------------------


class Lengths(nn.Module):  # sst2's style: the sequence lengths by name
    @nn.compact
    def __call__(self, inputs, lengths=None, *, train: bool = False):
        mask = jnp.arange(inputs.shape[1])[None, :] < lengths[:, None]
        pooled = (inputs * mask[..., None]).sum(1) / lengths[:, None]
        return nn.Dense(3)(pooled)


def test_batch_keys_reach_named_arguments():
    data = {"tokens": SEQUENCE["image"], "length": np.full(16, 2, np.int32), "label": FLAT["label"]}
    model = flaxhooks.as_model(Lengths(), input_keys={"inputs": "tokens", "lengths": "length"})
    trainer = flaxhooks.Trainer(model, optax.sgd(0.1), cross_entropy, devices=jax.devices()[:1])
    state = trainer.init(data)
    variables = {"params": state.params}
    want = Lengths().apply(variables, data["tokens"][:, :2].mean(1, keepdims=True).repeat(4, 1),
                           np.full(16, 4, np.int32))
    got = trainer.model.apply(state.params, {}, data, train=False, rngs={})[0]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match=r"input_keys maps batch keys to \['length'\], which the model"):
        flaxhooks.as_model(Lengths(), input_keys={"inputs": "t", "length": "l"})


class NNXLengths(nnx.Module):
    def __init__(self, rngs):
        self.head = nnx.Linear(5, 3, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, inputs, lengths, deterministic: bool = True):
        pooled = inputs[:, :2].mean(1) * (lengths[:, None] > 0)
        return self.drop(self.head(pooled), deterministic=deterministic)


def test_nnx_keyword_inputs_and_deterministic_argument():
    data = {"tokens": SEQUENCE["image"], "length": np.full(16, 2, np.int32), "label": FLAT["label"]}
    model = NNXLengths(nnx.Rngs(0, dropout=1))
    adapter = flaxhooks.as_model(model, input_keys={"inputs": "tokens", "lengths": "length"})
    trainer = flaxhooks.Trainer(adapter, optax.sgd(0.1), cross_entropy, devices=jax.devices()[:1])
    assert trainer.model.call.mode_arg == "deterministic" and trainer.model.call.inverted
    state = trainer.init(data)
    evaluation = trainer.model.apply(state.params, state.model_state, data, train=False, rngs={})[0]
    def train_mode(batch):  # on one device, as the mapped step calls it
        return trainer.model.apply(state.params, state.model_state, batch, train=True, rngs={})[0]

    train = jax.vmap(train_mode, axis_name=flaxhooks.AXIS)(jax.tree.map(lambda x: x[None], data))[0]
    np.testing.assert_allclose(evaluation, model(data["tokens"], data["length"]), rtol=1e-5)
    assert (np.asarray(train) == 0).mean() > 0.2


# -- the device axis ----------------------------------------------------------------


class ResNetStem(nn.Module):  # Flax's ImageNet ResNet hard-codes axis_name="batch"; this one names "data"
    @nn.compact
    def __call__(self, x, train: bool = True):
        x = nn.Dense(4)(x)
        x = nn.BatchNorm(use_running_average=not train, axis_name="data")(x)
        return nn.Dense(3)(nn.relu(x))


def test_batchnorm_reduces_over_the_named_axis():
    model = flaxhooks.as_model(ResNetStem(), axis_name="data")
    trainer = flaxhooks.Trainer(model, optax.sgd(0.1), cross_entropy, devices=jax.devices()[:2],
                                callbacks=[flaxhooks.ActivationStats(every=1)])
    state = trainer.init(FLAT)
    params = jax.device_get(state.params)
    final = trainer.fit([FLAT], steps=1, state=state)
    # BatchNorm's statistics cover the global batch of 16 (8 per device), as on one device.
    hidden = FLAT["image"].astype(np.float64) @ params["Dense_0"]["kernel"] + params["Dense_0"]["bias"]
    stats = final.model_state["batch_stats"]["BatchNorm_0"]
    np.testing.assert_allclose(stats["mean"], 0.01 * hidden.mean(0), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(stats["var"], 0.99 + 0.01 * hidden.var(0), rtol=1e-4)
    assert trainer.runner.traces == {"instrumented_step": 1}
