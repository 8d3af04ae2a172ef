"""ReduceLROnPlateau: optax.contrib.reduce_on_plateau driven by each evaluation, against a
hand-written loop that feeds optax's rule the evaluation losses and scales the updates by
hand; its scale logged, checkpointed and resumed; bad input refused before compiling."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from optax.contrib import reduce_on_plateau
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import flaxhooks
from tests.helpers import MLP, cross_entropy, make_arrays, make_batches

RULE = {"factor": 0.5, "patience": 1, "rtol": 0.2}  # an improvement must be 20%: plateaus come early


def _plateau_trainer(plateau, callbacks=()):
    return flaxhooks.Trainer(MLP(), plateau.wrap(optax.sgd(0.5)), cross_entropy, callbacks=[
        flaxhooks.Evaluate(make_arrays(48, seed=9), every=2, at_epoch_end=False, batch_size=16), plateau,
        *callbacks])


def test_each_evaluation_drives_optaxs_rule_and_the_updates_take_its_scale():
    batches = make_batches(4, batch_size=16)
    plateau = flaxhooks.ReduceLROnPlateau("loss", **RULE)
    losses = []

    class Keep(flaxhooks.Callback):
        def on_eval_end(self, loop):
            losses.append(loop.payload.metrics["loss"])

    trainer = _plateau_trainer(plateau, [Keep()])
    initial = trainer.init(batches[0])
    state = trainer.fit(batches, epochs=3, state=initial)

    # By hand: SGD, each update times the scale optax's rule gave the evaluations so far.
    test = make_arrays(48, seed=9)
    rule, sgd = reduce_on_plateau(accumulation_size=1, **RULE), optax.sgd(0.5)
    params = jax.device_get(initial.params)
    opt_state, rule_state, scales, expected_losses = sgd.init(params), rule.init(params), [], []
    for step in range(1, 13):
        batch = batches[(step - 1) % 4]
        grads = jax.grad(lambda p, b=batch: cross_entropy(MLP().apply({"params": p}, b["image"]), b))(params)
        updates, opt_state = sgd.update(grads, opt_state, params)
        scale = rule_state.scale
        params = optax.apply_updates(params, jax.tree.map(lambda u, s=scale: s * u, updates))
        if step % 2 == 0:
            loss = float(cross_entropy(MLP().apply({"params": params}, test["image"]), test))
            expected_losses.append(loss)
            _, rule_state = rule.update({}, rule_state, value=loss)
            scales.append(float(rule_state.scale))
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)
    assert min(scales) < 1  # the run met plateaus
    assert plateau.scale == pytest.approx(scales[-1])
    for got, want in zip(jax.tree.leaves(state.params), jax.tree.leaves(params), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)


def test_a_metric_to_maximize_that_stays_put_halves_the_scale_each_patience_and_it_is_charted(tmp_path):
    plateau = flaxhooks.ReduceLROnPlateau("accuracy", mode="max", factor=0.5, patience=2)
    frozen = flaxhooks.Trainer(MLP(), plateau.wrap(optax.sgd(0.0)), cross_entropy, callbacks=[
        flaxhooks.Evaluate(make_arrays(48, seed=9), every=1, at_epoch_end=False, batch_size=16), plateau,
        flaxhooks.TensorBoard(tmp_path, every=4)])
    frozen.fit(make_batches(7, batch_size=16), epochs=1)
    # Step 1 sets the best; every 2 evaluations without a gain of 1e-4 halve the scale.
    events = EventAccumulator(str(tmp_path / "train"))
    events.Reload()
    logged = [(e.step, e.value) for e in events.Scalars("optimizer/plateau_scale")]
    assert logged == [(1, 1.0), (2, 1.0), (3, 0.5), (4, 0.5), (5, 0.25), (6, 0.25), (7, 0.125)]


def test_the_scale_is_checkpointed_and_a_resumed_run_goes_on_exactly(tmp_path):
    data = make_batches(4, batch_size=16)

    def run(workdir, epochs, resume=False):
        plateau = flaxhooks.ReduceLROnPlateau("loss", **RULE)
        trainer = _plateau_trainer(plateau, [flaxhooks.Checkpoint(workdir, every=4)])
        return trainer.fit(data, epochs=epochs, resume=resume), plateau

    straight, plateau = run(tmp_path / "straight", 3)
    run(tmp_path / "resumed", 1)
    resumed, again = run(tmp_path / "resumed", 3, resume=True)
    assert again.scale == plateau.scale < 1
    for got, want in zip(jax.tree.leaves(resumed), jax.tree.leaves(straight), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_an_optimizer_the_callback_did_not_wrap_is_refused_before_anything_compiles():
    plateau = flaxhooks.ReduceLROnPlateau()
    trainer = flaxhooks.Trainer(MLP(), optax.sgd(0.1), cross_entropy, callbacks=[plateau])
    with pytest.raises(ValueError, match=r"the Trainer's optimizer has 0: give the Trainer plateau.wrap"):
        trainer.fit(make_batches(2), epochs=1)
    assert not trainer.runner.traces


@pytest.mark.parametrize("options, message", [
    ({"mode": "up"}, "mode must be 'min' or 'max'"),
    ({"patience": 0}, "patience must be a whole number of evaluations of at least 1"),
    ({"mode": "max", "rtol": 0.1}, "mode='max' takes its tolerance as atol"),
    ({"factor": 1.5}, "Factor must be in the range"),
])
def test_bad_settings_are_refused_when_made(options, message):
    with pytest.raises(ValueError, match=message):
        flaxhooks.ReduceLROnPlateau(**options)


def test_the_wrapped_optimizer_scales_each_update_by_the_state_it_carries():
    plateau = flaxhooks.ReduceLROnPlateau()
    tx = plateau.wrap(optax.sgd(1.0))
    params = {"w": jnp.ones(2)}
    state = tx.init(params)
    updates, _ = tx.update({"w": jnp.ones(2)}, state, params)
    assert updates["w"].tolist() == [-1.0, -1.0]  # scale 1 until an evaluation lowers it
