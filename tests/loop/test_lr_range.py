"""The learning-rate range test on least squares, where gradient descent is stable below
2 / (the loss's largest curvature), computed with numpy: the sweep stops past that rate,
suggests one below it, charts what it returns, and leaves the model and the disk alone."""

from __future__ import annotations

import logging
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import flaxhooks


def squared_error(outputs, batch):
    return jnp.mean((outputs[:, 0] - batch["target"]) ** 2)


def _least_squares():
    """One batch, the same every step (full-batch gradient descent), and its stability bound."""
    rng = np.random.default_rng(0)
    x = (rng.normal(size=(64, 4)) * np.array([3.0, 1.0, 0.5, 0.2])).astype(np.float32)
    # Noise: a least loss above 0, as real data has (else it falls to rounding, and growing back takes long).
    target = (x @ np.array([1.0, -2.0, 0.5, 3.0]) + rng.normal(size=64)).astype(np.float32)
    hessian = 2 * x.astype(np.float64).T @ x / len(x)  # of the mean squared error in w
    return {"image": x, "target": target}, 2 / np.linalg.eigvalsh(hessian).max()


def test_the_sweep_stops_past_the_stability_bound_and_suggests_a_rate_below_it(tmp_path, caplog):
    batch, bound = _least_squares()
    caplog.set_level(logging.INFO, logger="flaxhooks")  # its line, as a record (else on stderr)
    found = flaxhooks.lr_range_test(nn.Dense(1, use_bias=False), optax.sgd, squared_error, [batch] * 80,
                                    min_lr=1e-4, max_lr=10.0, steps=80,
                                    callbacks=[flaxhooks.TensorBoard(tmp_path, every=1)])
    steps = len(found.losses)
    assert found.stopped is not None and "diverged" in found.stopped and steps < 80
    np.testing.assert_allclose(found.learning_rates, 1e-4 * (1e5 ** (np.arange(steps) / 79)), rtol=1e-5)
    # Gradient descent grows the error only past the bound: the sweep ends past it, not before (how far
    # past depends on how small the error along the steepest direction had become).
    assert bound < found.learning_rates[-1] < 10.0
    assert 0.01 * bound < found.suggestion < bound
    assert f"suggested learning rate {found.suggestion:.3g}" in caplog.text
    # The curve in TensorBoard: each step's loss and rate, and the smoothed loss, as returned.
    events = EventAccumulator(str(tmp_path / "train"))
    events.Reload()
    np.testing.assert_allclose([e.value for e in events.Scalars("loss")], found.losses, rtol=1e-6)
    np.testing.assert_allclose([e.value for e in events.Scalars("optimizer/learning_rate")],
                               found.learning_rates, rtol=1e-6)
    smoothed = [e.value for e in events.Scalars("lr_range/smoothed_loss")]
    np.testing.assert_allclose(smoothed, found.smoothed[np.isfinite(found.smoothed)], rtol=1e-6)
    # The debiased moving average, by hand.
    average, by_hand = 0.0, []
    for n, loss in enumerate(found.losses, start=1):
        average = 0.9 * average + 0.1 * loss
        by_hand.append(average / (1 - 0.9 ** n))
    np.testing.assert_allclose(found.smoothed, by_hand, rtol=1e-9)


class Linear(nnx.Module):
    def __init__(self, rngs):
        self.dense = nnx.Linear(4, 1, use_bias=False, rngs=rngs)

    def __call__(self, x):
        return self.dense(x)


def test_an_nnx_model_is_left_as_it_was_and_nothing_is_saved(tmp_path):
    batch, _ = _least_squares()
    model = Linear(nnx.Rngs(0))
    before = np.asarray(model.dense.kernel[...]).copy()
    found = flaxhooks.lr_range_test(model, optax.sgd, squared_error, [batch] * 20, min_lr=1e-4, max_lr=1e-2,
                                    steps=20)
    assert found.stopped is None and len(found.losses) == 20 and found.losses[-1] < found.losses[0]
    np.testing.assert_array_equal(np.asarray(model.dense.kernel[...]), before)
    checkpoint = flaxhooks.Checkpoint(tmp_path / "checkpoints")
    with pytest.raises(ValueError, match="an LR range test trains weights it throws away: leave Checkpoint"):
        flaxhooks.lr_range_test(model, optax.sgd, squared_error, [batch] * 20, steps=20,
                                callbacks=[checkpoint])
    assert not os.path.exists(tmp_path / "checkpoints") or not os.listdir(tmp_path / "checkpoints")


@pytest.mark.parametrize("options, error, message", [
    ({"min_lr": 1.0, "max_lr": 0.1}, ValueError, "must grow from min_lr > 0"),
    ({"steps": 5}, ValueError, "needs at least 10 steps"),
    ({"smoothing": 1.0}, ValueError, "smoothing must be in"),
    ({"optimizer": optax.sgd(0.1)}, TypeError, "takes an optimizer factory with a learning_rate argument"),
])
def test_bad_settings_are_refused_before_anything_runs(options, error, message):
    batch, _ = _least_squares()
    arguments = {"optimizer": optax.sgd, **options}
    with pytest.raises(error, match=message):
        flaxhooks.lr_range_test(nn.Dense(1), arguments.pop("optimizer"), squared_error, [batch] * 20,
                                **arguments)


def test_the_rates_are_those_of_the_optimizers_own_state():
    """What the test reports is what the optimizer applied: optax's injected learning rate."""
    batch, _ = _least_squares()
    seen = []

    class Rate(flaxhooks.Callback):
        def on_step_end(self, loop):  # the rate the step just applied, which its state keeps
            seen.append(float(jax.device_get(loop.state.opt_state.hyperparams["learning_rate"])))

    found = flaxhooks.lr_range_test(nn.Dense(1), optax.sgd, squared_error, [batch] * 12, min_lr=1e-3,
                                    max_lr=1e-1, steps=12, callbacks=[Rate()])
    np.testing.assert_allclose(seen, found.learning_rates, rtol=1e-6)
