"""Tapped values come in the order of the *calls* that made them: a module
called twice (a shared dropout) has each output where its call ran, so the
non-finite guard blames the module whose output first went non-finite."""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

import flaxhooks
from tests.helpers import cross_entropy, make_batches, sgd_trainer

# -- Linen --------------------------------------------------------------------


class Broken(nn.Module):
    """A Dense whose output is NaN everywhere."""

    @nn.compact
    def __call__(self, x):
        return jnp.log(-jnp.abs(nn.Dense(8)(x)) - 1.0)


class SharedDropout(nn.Module):
    """Dense_0 -> Dropout -> Dense_1 (or Broken) -> the same Dropout -> Dense_2."""

    broken: bool = False

    @nn.compact
    def __call__(self, x, train: bool):
        drop = nn.Dropout(0.1, deterministic=not train)
        x = drop(nn.Dense(8)(x))
        x = (Broken() if self.broken else nn.Dense(8))(x)
        x = drop(x)
        return nn.Dense(3)(x)


class Scale(nn.Module):
    """Sows its input, then doubles it."""

    @nn.compact
    def __call__(self, x):
        self.sow("intermediates", "seen", x)
        return 2 * x


class SharedSower(nn.Module):
    """Dense_0 -> Scale -> Dense_1 -> the same Scale -> Dense_2."""

    @nn.compact
    def __call__(self, x):
        scale = Scale()
        x = scale(nn.Dense(8)(x))
        x = scale(nn.Dense(8)(x))
        return nn.Dense(3)(x)


CALL_ORDER = ("Dense_0", "Dropout_0/0", "Dense_1", "Dropout_0/1", "Dense_2")


def test_linen_outputs_and_gradients_come_in_call_order():
    stats = flaxhooks.ActivationStats(every=1, capture=True)
    grads = flaxhooks.ActivationGradStats(every=1, perturb=True)
    sgd_trainer(SharedDropout(), [stats, grads]).fit(make_batches(2, batch_size=8), epochs=1)
    # The model's output repeats Dense_2's: found (last), logged once.
    assert stats.names == (*CALL_ORDER, "output")
    assert stats.latest.names == CALL_ORDER
    assert grads.names == (*CALL_ORDER, "output")
    assert grads.latest.names == CALL_ORDER


def test_linen_values_sown_by_a_shared_module_come_with_the_call_that_sowed_them():
    stats = flaxhooks.ActivationStats(every=1, capture=True)
    sgd_trainer(SharedSower(), [stats]).fit(make_batches(2, batch_size=8), epochs=1)
    assert stats.latest.names == (
        "Dense_0", "Scale_0/seen/0", "Scale_0/0", "Dense_1", "Scale_0/seen/1", "Scale_0/1", "Dense_2",
    )


def test_linen_guard_blames_the_module_not_the_shared_dropout_after_it():
    stats = flaxhooks.ActivationStats(every=1)
    with pytest.raises(flaxhooks.NonFiniteError, match=r"went non-finite is 'Broken_0'") as error:
        sgd_trainer(SharedDropout(broken=True), [stats]).fit(make_batches(2, batch_size=8), epochs=1)
    assert "Dropout" not in str(error.value)


# -- NNX ----------------------------------------------------------------------


class BrokenLinear(nnx.Module):
    """A Linear whose output is NaN everywhere."""

    def __init__(self, rngs: nnx.Rngs):
        self.linear = nnx.Linear(8, 8, rngs=rngs)

    def __call__(self, x):
        return jnp.log(-jnp.abs(self.linear(x)) - 1.0)


class NNXSharedDropout(nnx.Module):
    """first -> drop -> middle (or BrokenLinear) -> the same drop -> last."""

    def __init__(self, rngs: nnx.Rngs, broken: bool = False):
        self.first = nnx.Linear(5, 8, rngs=rngs)
        self.drop = nnx.Dropout(0.1, rngs=rngs)
        self.middle = BrokenLinear(rngs) if broken else nnx.Linear(8, 8, rngs=rngs)
        self.last = nnx.Linear(8, 3, rngs=rngs)

    def __call__(self, x):
        x = self.drop(self.first(x))
        x = self.drop(self.middle(x))
        return self.last(x)


def nnx_trainer(model: nnx.Module, callbacks) -> flaxhooks.Trainer:
    return flaxhooks.Trainer(model, optax.sgd(0.1), cross_entropy, callbacks=callbacks)


def test_nnx_outputs_and_gradients_come_in_call_order():
    stats = flaxhooks.ActivationStats(every=1, capture=True)
    grads = flaxhooks.ActivationGradStats(every=1, perturb=True)
    nnx_trainer(NNXSharedDropout(nnx.Rngs(0, dropout=1)), [stats, grads]).fit(
        make_batches(2, batch_size=8), epochs=1)
    order = ("first", "drop/0", "middle", "drop/1", "last")
    assert stats.names == (*order, "output") and stats.latest.names == order
    assert grads.names == (*order, "output") and grads.latest.names == order


def test_nnx_guard_blames_the_module_not_the_shared_dropout_after_it():
    stats = flaxhooks.ActivationStats(every=1)
    model = NNXSharedDropout(nnx.Rngs(0, dropout=1), broken=True)
    with pytest.raises(flaxhooks.NonFiniteError, match=r"went non-finite is 'middle'") as error:
        nnx_trainer(model, [stats]).fit(make_batches(2, batch_size=8), epochs=1)
    assert "drop" not in str(error.value)
