"""Gradient-norm spikes and their source: the step, the batch's place in the
data, and the first layer whose gradient spiked, checked against gradients
computed by hand; a healthy or converged run has none."""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import flaxhooks
from flaxhooks.diagnose import GradNormWatch, LossThresholds, SpikeThresholds
from tests.helpers import cross_entropy

LAYERS = ("Dense_0", "Dense_1", "Dense_2")  # call order


class MLP(nn.Module):
    """Half the features enter at the first layer, half at the second (past the first)."""

    @nn.compact
    def __call__(self, x):
        h = nn.gelu(nn.Dense(32)(x[:, :4]))
        h = nn.gelu(nn.Dense(32)(jnp.concatenate([h, x[:, 4:]], axis=-1)))
        return nn.Dense(3)(h)


class Params(flaxhooks.Callback):
    """Each step's parameters after its update, on the host (a test's reference only)."""

    def __init__(self):
        self.after = {}

    def on_step_end(self, loop):
        self.after[loop.step] = jax.tree.map(np.asarray, loop.state.params)


def batches(count=60, spike_at=None, seed=0):
    rng = np.random.default_rng(seed)
    w = rng.normal(size=(8, 3))
    out = []
    for _ in range(count):
        x = rng.normal(size=(32, 8)).astype(np.float32)
        out.append({"image": x, "label": np.argmax(x @ w, axis=1).astype(np.int32)})
    if spike_at is not None:  # step spike_at (from 1) takes batch spike_at - 1: its 2nd layer's inputs x100
        scale = np.array([1.0] * 4 + [100.0] * 4, np.float32)
        out[spike_at - 1]["image"] = out[spike_at - 1]["image"] * scale
    return out


def train(data, steps, optimizer, keep_params=False, **kwargs):
    diagnose = flaxhooks.Diagnose(every=10, window=1000, table=False, heatmaps=False, **kwargs)
    params = Params()
    callbacks = [diagnose, params] if keep_params else [diagnose]
    trainer = flaxhooks.Trainer(MLP(), optimizer, cross_entropy, callbacks=callbacks)
    trainer.fit(data, steps=steps)
    return diagnose.findings, params


def layer_grad_norms(params, batch):
    """Each Dense's parameter-gradient norm on ``batch``, by jax.grad (the independent reference)."""
    def loss(p):
        return cross_entropy(MLP().apply({"params": p}, jnp.asarray(batch["image"])), batch)
    grads = jax.grad(loss)(params)
    return [math.sqrt(sum(float(np.sum(np.square(g))) for g in jax.tree.leaves(grads[name])))
            for name in LAYERS]


def test_a_corrupted_batch_is_a_gradient_norm_spike_at_its_step_with_its_place_and_first_layer():
    spike_at = 41  # batch 40 of an epoch of 60 (from 0)
    data = batches(spike_at=spike_at)
    spikes = SpikeThresholds(history=20)
    found, params = train(data, 60, optax.sgd(0.05), keep_params=True, spikes=spikes,
                          loss=LossThresholds(spike_history=20, outlier_history=20))
    norms = [f for f in found if f.kind == "grad_norm_spike"]
    assert len(norms) == 1, [f.message() for f in found]
    spike = norms[0]
    assert spike.step == spike.since == spike_at
    assert spike.values["batch"] == {"epoch": 0, "index": spike_at - 1}
    assert f"batch {spike_at - 1} of epoch 0" in spike.evidence
    # By hand: both batches at the parameters the replay used, each Dense's gradient norm.
    at = params.after[spike.values["replayed_at"]]
    hit, before = layer_grad_norms(at, data[spike_at - 1]), layer_grad_norms(at, data[spike_at - 2])
    ratios = [h / b for h, b in zip(hit, before, strict=True)]
    expected = next(name for name, r in zip(LAYERS, ratios, strict=True) if r >= spikes.layer_factor)
    # The corrupted features enter at the second layer: the first's gradient barely moves.
    assert expected == "Dense_1" and ratios[0] < spikes.layer_factor
    assert spike.layer == spike.values["layer_source"] == expected
    np.testing.assert_allclose([spike.values["layer_ratios"][n] for n in LAYERS], ratios, rtol=1e-3)
    assert f"{expected!r}" in spike.evidence and f"after step {spike.values['replayed_at']}" in spike.evidence
    # The loss spiked too, at the same step: its finding names the same layer, from the same replays.
    losses = [f for f in found if f.kind == "loss_spike"]
    assert all(f.since != spike_at or f.layer == expected for f in losses)


def test_a_healthy_run_and_a_converged_one_have_no_gradient_norm_spike():
    spikes = SpikeThresholds(history=20)
    found, _ = train(batches(60), 60, optax.adam(1e-2), spikes=spikes)
    assert [f for f in found if f.kind in ("grad_norm_spike", "loss_spike")] == []
    # Converged: one batch over and over, its norm tiny and all but constant; noise must not fire.
    one = batches(1) * 160
    found, _ = train(one, 160, optax.adam(1e-2), spikes=spikes)
    assert [f for f in found if f.kind in ("grad_norm_spike", "loss_spike")] == []


def test_the_watch_against_a_numpy_z_score():
    rng = np.random.default_rng(1)
    norms = np.abs(1.0 + 0.1 * rng.normal(size=200))
    norms[150] = 9.0
    thresholds = SpikeThresholds(history=32)
    watch = GradNormWatch(thresholds)
    found = [f for step, n in enumerate(norms) for f in watch.add(step, float(n))]
    # The reference: every step whose norm is 6 sample deviations and twice the mean above the 32 before it.
    expected = [s for s in range(32, 200)
                if norms[s] - norms[s - 32:s].mean() > 6 * norms[s - 32:s].std(ddof=1)
                and norms[s] >= 2 * max(norms[s - 32:s].mean(), norms[s - 5:s].max())]
    assert expected == [150] and [f.since for f in found] == expected


def test_a_blip_far_outside_a_tiny_spread_but_not_twice_the_mean_is_no_spike():
    # A converged model's norm, all but constant: a rise of 30% is thousands of deviations, not a spike.
    norms = [1e-3 * (1.0 + 1e-5 * (step % 3)) for step in range(60)]
    norms[50] = 1.3e-3
    history = norms[30:50]
    assert norms[50] - np.mean(history) > 6 * np.std(history, ddof=1)  # the z-score alone would fire
    watch = GradNormWatch(SpikeThresholds(history=20))
    assert [f for step, n in enumerate(norms) for f in watch.add(step, n)] == []


def test_a_norm_climbing_over_steps_is_a_trend_not_a_spike():
    # Flat, then doubling every 4 steps: each far above the flat history's spread and mean,
    # never twice the largest of the 5 before it.
    norms = [0.3 + 0.01 * (step % 2) for step in range(40)] + [0.3 * 2 ** (k / 4) for k in range(1, 15)]
    history = np.array(norms[20:40])
    assert norms[52] - history.mean() > 6 * history.std(ddof=1) and norms[52] > 2 * history.mean()
    watch = GradNormWatch(SpikeThresholds(history=20))
    assert [f for step, n in enumerate(norms) for f in watch.add(step, n)] == []
