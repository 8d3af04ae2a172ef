"""Mixed precision: parameters in float32, compute in bfloat16 (Linen and NNX ``dtype=``)."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import flaxhooks
from tests.helpers import make_batches

BF16 = jnp.bfloat16


def float32_loss(logits, batch):
    """The loss in float32 from bfloat16 logits (the documented pattern)."""
    logits = logits.astype(jnp.float32)
    return optax.losses.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()


class LinenMLP(nn.Module):
    kernel_init: nn.initializers.Initializer = nn.initializers.lecun_normal()

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(32, dtype=BF16, kernel_init=self.kernel_init, name="hidden")(x))
        return nn.Dense(3, dtype=BF16, kernel_init=self.kernel_init, name="head")(x)


class NNXMLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.hidden = nnx.Linear(5, 32, dtype=BF16, rngs=rngs)
        self.head = nnx.Linear(32, 3, dtype=BF16, rngs=rngs)

    def __call__(self, x):
        return self.head(nnx.relu(self.hidden(x)))


def _hand_loop(apply, params, batches, tx):
    """A hand-written optax loop over ``apply(params, image) -> logits``."""
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(lambda p: float32_loss(apply(p, batch["image"]), batch))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    losses = []
    for batch in batches:
        params, opt_state, loss = step(params, opt_state, batch)
        losses.append(float(loss))
    return params, losses


class Losses(flaxhooks.Callback):
    def __init__(self):
        self.seen = []

    def on_step_end(self, loop):
        self.seen.append(float(loop.metrics["loss"]))


@pytest.mark.parametrize("api", ["linen", "nnx"])
def test_a_bfloat16_model_keeps_float32_parameters_and_trains_as_a_hand_written_loop(api):
    batches = make_batches(6, batch_size=16)
    model = LinenMLP() if api == "linen" else NNXMLP(nnx.Rngs(0))
    losses, tx = Losses(), optax.sgd(0.1, momentum=0.9)
    trainer = flaxhooks.Trainer(model, tx, float32_loss, callbacks=[losses], devices=jax.local_devices()[:1])
    initial = trainer.init(batches[0])
    assert {x.dtype for x in jax.tree.leaves(initial.params)} == {jnp.dtype(jnp.float32)}
    state = trainer.fit(batches, epochs=1, state=initial)
    assert {x.dtype for x in jax.tree.leaves(state.params)} == {jnp.dtype(jnp.float32)}
    if api == "linen":
        def apply(params, image):
            return model.apply({"params": params}, image)
    else:
        graph, _ = nnx.split(model)

        def apply(params, image):
            return nnx.merge(graph, params)(image)
    expected, expected_losses = _hand_loop(apply, jax.device_get(initial.params), batches, tx)
    # The same bfloat16 arithmetic: equal to float32 rounding, not merely to bfloat16's.
    np.testing.assert_allclose(losses.seen, expected_losses, rtol=1e-5)
    trained = jax.tree.leaves(jax.device_get(state.params))
    for got, want in zip(trained, jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def _ternary(key, shape, dtype=jnp.float32):
    """Weights in {-1, 0, 1}: with inputs in {-1, 0, 1} every activation is an integer that
    bfloat16 holds exactly, so the statistics' reference needs no rounding model."""
    return jax.random.randint(key, shape, -1, 2).astype(dtype)


def test_statistics_of_bfloat16_activations_are_reduced_in_float32():
    rng = np.random.default_rng(0)
    image = rng.integers(-1, 2, (64, 5)).astype(np.float32)
    batch = {"image": image, "label": rng.integers(0, 3, 64).astype(np.int32)}
    stats = flaxhooks.ActivationStats(every=1, stats=("mean", "rms"))
    model = LinenMLP(kernel_init=_ternary)
    trainer = flaxhooks.Trainer(model, optax.sgd(0.1), float32_loss, callbacks=[stats],
                                devices=jax.local_devices()[:1])
    params = jax.device_get(trainer.init(batch).params)
    trainer.fit([batch], epochs=1)
    # float64 numpy from the weights (biases start at 0): exact integers, as bfloat16 computed them.
    hidden = image.astype(np.float64) @ np.asarray(params["hidden"]["kernel"], np.float64)
    head = np.maximum(hidden, 0) @ np.asarray(params["head"]["kernel"], np.float64)
    assert np.abs(head).max() < 256  # exact in bfloat16's 8 bits
    got = stats.latest.to_dict()
    for name, value in (("hidden", hidden), ("head", head)):
        want = [value.mean(), np.sqrt(np.mean(value * value))]
        # Summed in bfloat16, the squares of these values give an rms off in its first digits.
        np.testing.assert_allclose([got[name]["mean"], got[name]["rms"]], want, rtol=1e-6, err_msg=name)


def test_a_bfloat16_overflow_is_named_by_the_guard():
    class Overflowing(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.Dense(8, dtype=BF16, name="hidden")(x)
            x = nn.Dense(8, dtype=BF16, kernel_init=nn.initializers.constant(3e37), name="blowup")(x * 1e3)
            return nn.Dense(3, dtype=BF16, name="head")(x)

    trainer = flaxhooks.Trainer(Overflowing(), optax.sgd(0.1), float32_loss, devices=jax.local_devices()[:1])
    with pytest.raises(flaxhooks.NonFiniteError) as error:
        trainer.fit(make_batches(2, batch_size=8), epochs=1)
    assert error.value.step == 1
    assert "is 'blowup'" in str(error.value), str(error.value)
