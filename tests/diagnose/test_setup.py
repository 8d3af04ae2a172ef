"""Set-up traps found on abstract values before training: dropout left on in
evaluation, and RNG streams the model and ``rng_names`` disagree about."""

from __future__ import annotations

import contextlib
import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import flaxhooks
from flaxhooks.diagnose import output_sources, setup_findings
from flaxhooks.step import as_model
from recipes.models import CNN, NNXCNN
from recipes.transformer import Transformer
from tests.helpers import BatchNormNet, cross_entropy, make_arrays

VECTORS = {"image": jax.ShapeDtypeStruct((16, 5), jnp.float32)}


@dataclasses.dataclass(frozen=True)
class Config:
    deterministic: bool = False
    rate: float = 0.5


class ConfigModel(nn.Module):
    """The mode in a config object, as Flax's lm1b ``TransformerLM(config)``."""

    config: Config

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(8)(x))
        x = nn.Dropout(self.config.rate, deterministic=self.config.deterministic)(x)
        return nn.Dense(3)(x)


class TrainArgModel(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool):
        x = nn.relu(nn.Dense(8)(x))
        return nn.Dense(3)(nn.Dropout(0.5, deterministic=not train)(x))


class Plain(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(3)(nn.relu(nn.Dense(8)(x)))


class Draws(nn.Module):
    """Adds noise from ``stream`` in both modes (a sampling model)."""

    stream: str = "noise"

    @nn.compact
    def __call__(self, x, train: bool):
        x = nn.Dense(3)(x)
        x = nn.Dropout(0.5, deterministic=not train)(x)
        return x + jax.random.normal(self.make_rng(self.stream), x.shape)


class Body(nn.Module):
    deterministic: bool

    @nn.compact
    def __call__(self, x, _):
        return nn.Dropout(0.5, deterministic=self.deterministic)(nn.Dense(5)(x)), None


class Scanned(nn.Module):
    """Layers stacked by ``nn.scan``: the keys pass into the scan whether drawn or not."""

    config: Config

    @nn.compact
    def __call__(self, x, train: bool):
        stack = nn.scan(Body, variable_axes={"params": 0}, split_rngs={"params": True, "dropout": True},
                        length=3)
        x, _ = stack(not train, name="layers")(x, None)
        x, _ = stack(self.config.deterministic, name="fixed")(x, None)
        return x


@contextlib.contextmanager
def no_compilation():
    """Fails if XLA compiles anything inside."""
    seen = []

    def listener(name, duration, **kwargs):
        if name == "/jax/core/compile/backend_compile_duration":
            seen.append(kwargs.get("fun_name"))

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert seen == []


def findings(module, batch=VECTORS, **kwargs):
    """The set-up findings of ``module`` on the abstract ``batch``; asserts nothing compiled."""
    model = as_model(module, tuple(batch), **kwargs)
    with no_compilation():
        variables = jax.eval_shape(model.init, jax.eval_shape(jax.random.PRNGKey, 0), batch)
        params = variables.pop("params")
        state = {c: variables[c] for c in model.carried(variables, batch)}
        return setup_findings(model, params, state, batch, step=7)


def kinds(found):
    return [f.kind for f in found]


# -- dropout_in_eval -------------------------------------------------------------------------------


def test_a_config_mode_model_keeps_dropout_on_in_evaluation():
    found = findings(ConfigModel(Config(deterministic=False)))
    assert kinds(found) == ["dropout_in_eval"]
    finding = found[0]
    assert finding.step == 7 and finding.layer == "Dropout_0"
    assert "'dropout'" in finding.evidence and "eval_model=" in finding.advice
    assert finding.values["streams"] == ["dropout"]


def test_the_eval_mode_twin_or_a_call_argument_switches_it_off():
    assert findings(ConfigModel(Config(False)), eval_model=ConfigModel(Config(True))) == []
    assert findings(TrainArgModel()) == []
    assert findings(Plain()) == []


def test_the_recipes_models_give_none():
    images = {"image": jax.ShapeDtypeStruct((8, 28, 28, 1), jnp.float32)}
    assert findings(CNN(), images) == []
    tokens = {"tokens": jax.ShapeDtypeStruct((4, 11), jnp.int32)}
    assert findings(Transformer(vocab_size=16, length=11, width=32, depth=1, heads=2), tokens) == []
    assert findings(NNXCNN(nnx.Rngs(0)), images) == []


def test_randomness_other_than_dropout_is_taken_as_meant():
    assert findings(Draws(), rng_names=("dropout", "noise")) == []


def test_keys_passing_unused_through_a_lifted_scan_count_for_nothing():
    assert findings(Scanned(Config(deterministic=True))) == []
    found = findings(Scanned(Config(deterministic=False)))
    assert kinds(found) == ["dropout_in_eval"] and found[0].layer == "fixed/Dropout_0"


class NNXCallFixed(nnx.Module):
    """Passes ``deterministic=False`` at the call: ``eval()`` cannot switch it."""

    def __init__(self, rngs):
        self.linear = nnx.Linear(5, 3, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x):
        return self.drop(self.linear(x), deterministic=False)


class NNXDropout(nnx.Module):
    def __init__(self, rngs):
        self.linear = nnx.Linear(5, 3, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x):
        return self.drop(self.linear(x))


def test_nnx_dropout_is_switched_by_eval_unless_its_call_fixes_it():
    assert findings(NNXDropout(nnx.Rngs(0))) == []
    assert findings(NNXDropout(nnx.Rngs(0, dropout=1))) == []
    found = findings(NNXCallFixed(nnx.Rngs(0)))
    assert kinds(found) == ["dropout_in_eval"] and found[0].layer == "drop"
    assert "eval()" in found[0].advice


# -- rng_streams ----------------------------------------------------------------------------------


def test_a_stream_the_model_draws_that_rng_names_lacks():
    found = findings(Draws("drop"))  # rng_names: the default ("dropout",)
    assert kinds(found) == ["rng_streams"]
    assert found[0].values["missing"] == ["drop"]
    assert "('dropout', 'drop')" in found[0].advice


def test_a_missing_stream_is_found_where_flax_would_draw_it_from_params():
    # Given a "params" key, Flax draws a stream it lacks from it silently.
    found = findings(Draws("drop"), rng_names=("dropout", "params"))
    assert kinds(found) == ["rng_streams"] and found[0].values["missing"] == ["drop"]


def test_a_named_stream_never_drawn_in_train_mode():
    found = findings(TrainArgModel(), rng_names=("dropout", "noise"))
    assert kinds(found) == ["rng_streams"]
    assert found[0].values["unused"] == ["noise"] and "rng_names=('dropout',)" in found[0].advice
    assert kinds(findings(Plain(), rng_names=("noise",))) == ["rng_streams"]


def test_the_default_stream_of_a_model_with_no_randomness_is_fine():
    assert findings(Plain()) == []
    assert findings(Plain(), rng_names=()) == []


def test_dropout_off_in_training_is_said_even_with_the_default_streams():
    found = findings(ConfigModel(Config(deterministic=True)))
    assert kinds(found) == ["rng_streams"]
    assert found[0].values["deterministic_layers"] == ["Dropout_0"]
    assert "off in training" in found[0].evidence


def test_a_dropout_rate_of_zero_draws_nothing_and_says_nothing():
    assert findings(ConfigModel(Config(deterministic=False, rate=0.0))) == []


# -- from a Trainer's plan -------------------------------------------------------------------------


class Planned(Exception):
    pass


class Inspect(flaxhooks.Callback):
    def check_fit(self, plan):
        self.found = setup_findings(plan.model, plan.state.params, plan.state.model_state,
                                    plan.spec.global_batch(), plan.step)
        raise Planned  # before anything compiles


@pytest.mark.parametrize("module,expected", [
    (ConfigModel(Config(deterministic=False)), ["dropout_in_eval"]),
    (BatchNormNet(), []),  # BatchNorm reduces over the step's device axis
    (NNXCallFixed(nnx.Rngs(0)), ["dropout_in_eval"]),  # its RNG state in the plan's model_state
])
def test_findings_from_a_trainers_plan(module, expected, compiles):
    inspect = Inspect()
    trainer = flaxhooks.Trainer(module, optax.sgd(0.1), cross_entropy, callbacks=[inspect],
                                devices=jax.local_devices()[:2])
    with pytest.raises(Planned):
        trainer.fit([make_arrays(16)], steps=1)
    assert kinds(inspect.found) == expected
    assert compiles == []


# -- the dependency walk ----------------------------------------------------------------------------


def sources(function, *args):
    closed = jax.make_jaxpr(function)(*args)
    return [sorted(s) for s in output_sources(closed, [frozenset({i}) for i in range(len(args))])]


def test_the_walk_follows_values_through_loops_branches_and_calls():
    x, y = jnp.ones(3), jnp.ones(())

    def scan(x, y):
        def body(carry, _):
            a, b = carry
            return (a + 1.0, b * y), a
        (a, b), ys = jax.lax.scan(body, (x, x), None, length=2)
        return a, b, ys

    assert sources(scan, x, y) == [[0], [0, 1], [0]]
    assert sources(lambda x, y: jax.jit(lambda a, b: (a * 2, b))(x, y), x, y) == [[0], [1]]
    assert sources(lambda x, y: jax.checkpoint(lambda a: a * 2)(x) + 0 * 0, x, y) == [[0]]
    # The branch taken depends on the index.
    assert sources(lambda x, y: jax.lax.cond(y > 0, lambda a: a, lambda a: -a, x), x, y) == [[0, 1]]

    def loop(x, y):  # the number of iterations depends on y
        return jax.lax.while_loop(lambda c: c[0] < y, lambda c: (c[0] + 1.0, c[1] * 2), (0.0, x))

    assert sources(loop, x, y) == [[1], [0, 1]]


# -- BatchNorm statistics span the global batch ---------------------------------------------------------


def test_batchnorm_statistics_span_the_global_batch_without_an_axis_name():
    """No per-device BatchNorm trap: the step is one jit over the mesh seeing
    the whole batch, so even ``axis_name=None`` reduces over all of it."""
    devices = jax.local_devices()[:8]
    if len(devices) < 8:
        pytest.skip("needs 8 devices")
    batch = make_arrays(32, seed=4)
    batch["image"][:16] += 3.0  # the devices' shares differ: a per-device mean would show
    trainer = flaxhooks.Trainer(BatchNormNet(axis_name=None), optax.sgd(0.1), cross_entropy, devices=devices)
    state = trainer.init(batch)
    params = jax.device_get(state.params)
    final = trainer.fit([batch], steps=1, state=state)
    hidden = batch["image"].astype(np.float64) @ params["Dense_0"]["kernel"] + params["Dense_0"]["bias"]
    stats = jax.device_get(final.model_state["batch_stats"]["BatchNorm_0"])
    np.testing.assert_allclose(stats["mean"], 0.5 * hidden.mean(0), rtol=1e-4, atol=1e-6)  # momentum 0.5
    np.testing.assert_allclose(stats["var"], 0.5 + 0.5 * hidden.var(0), rtol=1e-4, atol=1e-6)
    first_share = hidden[: 32 // 8]
    assert not np.allclose(stats["mean"], 0.5 * first_share.mean(0), rtol=1e-2)
