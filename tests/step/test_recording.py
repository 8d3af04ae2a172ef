"""The recording core both adapters share: an equivalent Linen and NNX model
give the same values, in the same call order, under the same names; and
tracing a step changes nothing on a contributor's host object."""

from __future__ import annotations

import copy
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

import flaxhooks
from flaxhooks.step import AXIS, Taps, WithLayout, build_step
from tests.helpers import cross_entropy, make_batches, sgd_trainer


class LinenNet(nn.Module):
    """first -> Scale (sows) -> the shared drop -> middle -> the same drop -> last, by attribute name."""

    def setup(self):
        self.first = nn.Dense(8)
        self.scale = LinenScale()
        self.drop = nn.Dropout(0.1, deterministic=False)
        self.middle = nn.Dense(8)
        self.last = nn.Dense(3)

    def __call__(self, x):
        x = self.drop(self.scale(self.first(x)))
        x = self.drop(self.middle(x))
        return self.last(x) * 2.0


class LinenScale(nn.Module):
    def __call__(self, x):
        self.sow("intermediates", "seen", x)
        return nn.relu(x)


class NNXScale(nnx.Module):
    def __call__(self, x):
        self.sow(nnx.Intermediate, "seen", x)
        return nnx.relu(x)


class NNXNet(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.first = nnx.Linear(5, 8, rngs=rngs)
        self.scale = NNXScale()
        self.drop = nnx.Dropout(0.1, rngs=rngs)
        self.middle = nnx.Linear(8, 8, rngs=rngs)
        self.last = nnx.Linear(8, 3, rngs=rngs)

    def __call__(self, x):
        x = self.drop(self.scale(self.first(x)))
        x = self.drop(self.middle(x))
        return self.last(x) * 2.0


def _recorded(model) -> tuple[tuple[str, ...], tuple[str, ...]]:
    # Scale's own output is not captured: the adapters place a value a module sows
    # differently from its output at the same call (Linen before it, NNX after it).
    capture = (nn.Dense, nn.Dropout, nnx.Linear, nnx.Dropout)
    stats = flaxhooks.ActivationStats(every=1, stats="all", capture=capture)
    grads = flaxhooks.ActivationGradStats(every=1, stats="all")
    trainer = flaxhooks.Trainer(model, optax.sgd(0.1), cross_entropy, callbacks=[stats, grads])
    trainer.fit(make_batches(1, batch_size=8), steps=1)
    return stats.names, grads.names


def test_an_equivalent_linen_and_nnx_model_are_recorded_alike():
    linen, nnx_names = _recorded(LinenNet()), _recorded(NNXNet(nnx.Rngs(0, dropout=1)))
    assert linen == nnx_names
    activations, gradients = linen
    assert activations == ("first", "scale/seen", "drop/0", "middle", "drop/1", "last")
    assert gradients == ("first", "scale", "drop/0", "middle", "drop/1", "last", "output")


def _contributors():
    return [flaxhooks.ActivationStats(every=1, histograms=True), flaxhooks.ActivationGradStats(every=1),
            flaxhooks.ParamStats(every=1), flaxhooks.Diagnose(every=1, window=2, table=False)]


@pytest.mark.parametrize("model", [LinenNet(), NNXNet(nnx.Rngs(0, dropout=1))], ids=["linen", "nnx"])
def test_tracing_the_step_changes_nothing_on_a_contributors_host_object(model):
    trainer = sgd_trainer(model)
    batches = make_batches(1, batch_size=8)
    trainer.fit(batches, steps=1)
    contributors = _contributors()
    before = [copy.copy(vars(c)) for c in contributors]
    taps = functools.reduce(Taps.merge, (c.taps for c in contributors), Taps())
    inside = [lambda tapped, c=c: c.inside_step(tapped.only(c.taps)) for c in contributors]
    step = build_step(trainer.model, cross_entropy, taps, inside)
    batch = jax.tree.map(lambda x: jnp.asarray(x)[None], batches[0])
    mapped = jax.vmap(step, in_axes=(None, 0), axis_name=AXIS, axis_size=1)
    _, _, results = jax.eval_shape(mapped, trainer.state, batch)
    assert [vars(c) for c in contributors] == before
    # What the trace found came out with each result, as static data.
    layouts = [r.layout for r in results if isinstance(r, WithLayout)]
    assert len(layouts) == len(contributors) and all(layouts)
