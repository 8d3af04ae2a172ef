"""The moving average of the weights, ``flaxhooks.with_ema``: against a hand-written optax
loop in float64, placed as the parameters on 8 devices (FSDP, a data=4 x model=2 mesh),
saved and resumed with the state, evaluated beside the trained weights, bad input refused."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, Mesh
from tensorboard.backend.event_processing.event_multiplexer import EventMultiplexer

import flaxhooks
from tests.helpers import MLP, Recorder, cross_entropy, make_arrays, make_batches


def _hand_loop(params, batches, tx, decay):
    """optax by hand on each batch, the average kept beside it, in float64."""
    with jax.enable_x64():
        params = jax.tree.map(lambda x: jnp.asarray(np.asarray(x), jnp.float64), params)
        opt_state, ema = tx.init(params), params
        for count, batch in enumerate(batches):
            grads = jax.grad(
                lambda p, b=batch: cross_entropy(MLP().apply({"params": p}, b["image"]), b))(params)
            updates, opt_state = tx.update(grads, opt_state, params)
            params = optax.apply_updates(params, updates)
            d = decay(count)
            ema = jax.tree.map(lambda e, p, d=d: d * e + (1 - d) * p, ema, params)
        return jax.tree.map(np.asarray, params), jax.tree.map(np.asarray, ema)


@pytest.mark.parametrize("warmup", [True, False])
def test_the_average_follows_a_hand_written_loop_and_leaves_the_training_as_it_was(warmup):
    batches = make_batches(6, batch_size=16)
    adam = optax.adam(1e-2)
    trainer = flaxhooks.Trainer(MLP(), flaxhooks.with_ema(adam, 0.8, warmup=warmup), cross_entropy)
    initial = trainer.init(batches[0])
    state = trainer.fit(batches, epochs=1, state=initial)

    def decay(count):
        return min(0.8, (1 + count) / (10 + count)) if warmup else 0.8

    params, ema = _hand_loop(jax.device_get(initial.params), batches, adam, decay)
    got = flaxhooks.ema_params(state)
    for leaf, want in zip(jax.tree.leaves(got), jax.tree.leaves(ema), strict=True):
        assert leaf.dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(leaf), want, rtol=1e-5, atol=1e-6)
    for leaf, want in zip(jax.tree.leaves(state.params), jax.tree.leaves(params), strict=True):
        np.testing.assert_allclose(np.asarray(leaf), want, rtol=1e-5, atol=1e-6)
    # The average moved off the start, and not as far as the weights.
    start, now, average = (np.asarray(x["Dense_0"]["kernel"]) for x in (initial.params, state.params, got))
    assert 0 < np.abs(average - start).max() < np.abs(now - start).max()
    assert trainer.runner.traces == {"train_step": 1}


def test_a_decay_schedule_is_read_at_each_update():
    params = {"w": jnp.zeros(2)}
    tx = flaxhooks.with_ema(optax.sgd(1.0), decay=lambda count: 0.5 ** (count + 1), warmup=False)
    state = tx.init(params)
    ema = np.zeros(2)
    for count in range(4):
        updates, state = tx.update({"w": -jnp.ones(2)}, state, params)  # each update adds 1
        params = optax.apply_updates(params, updates)
        d = 0.5 ** (count + 1)
        ema = d * ema + (1 - d) * np.asarray(params["w"])
    np.testing.assert_allclose(np.asarray(flaxhooks.ema_params(state)["w"]), ema, rtol=1e-6)


@pytest.mark.parametrize("placement", ["fsdp", "data_model"])
def test_the_average_is_placed_as_the_parameters_and_computed_as_on_one_device(placement):
    devices = jax.local_devices()
    if len(devices) < 8:
        pytest.skip("needs 8 devices")
    batches = make_batches(4, batch_size=32)
    tx = flaxhooks.with_ema(optax.adam(1e-2), 0.9)
    if placement == "fsdp":
        options = {"devices": devices[:8], "shard": flaxhooks.FSDP(min_size=16)}
    else:
        mesh = Mesh(np.asarray(devices[:8]).reshape(4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
        options = {"mesh": mesh, "shard": flaxhooks.FSDP("model", min_size=16)}
    one = flaxhooks.Trainer(MLP(), tx, cross_entropy, devices=devices[:1])
    initial = one.init(batches[0])
    expected = one.fit(batches, epochs=1, state=initial)
    state = flaxhooks.Trainer(MLP(), tx, cross_entropy, **options).fit(batches, epochs=1, state=initial)
    ema = flaxhooks.ema_params(state)
    for average, param in zip(jax.tree.leaves(ema), jax.tree.leaves(state.params), strict=True):
        assert average.sharding == param.sharding
    assert not ema["Dense_0"]["kernel"].sharding.is_fully_replicated  # split, as its parameter is
    for got, want in zip(jax.tree.leaves(ema), jax.tree.leaves(flaxhooks.ema_params(expected)), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)


def test_the_average_is_saved_and_a_resumed_run_goes_on_with_it_exactly(tmp_path):
    data = flaxhooks.ArrayLoader(make_arrays(64), batch_size=16, seed=1)

    def trainer(workdir):
        return flaxhooks.Trainer(MLP(), flaxhooks.with_ema(optax.adam(1e-2), 0.9), cross_entropy,
                                 callbacks=[flaxhooks.Checkpoint(workdir, every=2)])

    straight = trainer(tmp_path / "straight").fit(data, epochs=2)
    trainer(tmp_path / "resumed").fit(data, epochs=1)
    resumed = trainer(tmp_path / "resumed").fit(data, epochs=2, resume=True)
    for got, want in zip(jax.tree.leaves(flaxhooks.ema_params(resumed)),
                         jax.tree.leaves(flaxhooks.ema_params(straight)), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_both_weights_are_evaluated_each_time_and_charted_as_two_runs(tmp_path):
    test = make_arrays(40, seed=9)
    log = []
    evaluate = flaxhooks.Evaluate(test, batch_size=16, weights="both")
    trainer = flaxhooks.Trainer(MLP(), flaxhooks.with_ema(optax.adam(1e-2), 0.9), cross_entropy, callbacks=[
        evaluate, flaxhooks.TensorBoard(tmp_path, every=2), Recorder("rec", log=log)])
    state = trainer.fit(make_batches(4, batch_size=16), epochs=2)
    evals = [(event, step) for _, event, step in log if event.startswith("eval")]
    assert evals == [("eval_start", 4), ("eval_end", 4), ("eval_start", 4), ("eval_end", 4),
                     ("eval_start", 8), ("eval_end", 8), ("eval_start", 8), ("eval_end", 8)]
    runs = EventMultiplexer().AddRunsFromDirectory(str(tmp_path))
    runs.Reload()
    for run, result in (("eval", evaluate.result), ("eval_ema", evaluate.ema_result)):
        points = [(e.step, e.value) for e in runs.Scalars(run, "accuracy")]
        assert [step for step, _ in points] == [4, 8]
        assert points[-1][1] == pytest.approx(result.metrics["accuracy"], rel=1e-6)
    # Each against the Trainer's own evaluation of those weights.
    trained = trainer.evaluate(test, batch_size=16, state=state, name="trained")
    averaged = trainer.evaluate(test, batch_size=16, state=state, weights="ema", name="averaged")
    assert evaluate.result.name == "eval" and evaluate.ema_result.name == "eval_ema"
    assert evaluate.result.metrics == pytest.approx(trained.metrics, rel=1e-6)
    assert evaluate.ema_result.metrics == pytest.approx(averaged.metrics, rel=1e-6)
    assert evaluate.ema_result.metrics["loss"] != pytest.approx(evaluate.result.metrics["loss"], rel=1e-3)
    # Predictions of the average: the module applied by hand to flaxhooks.ema_params.
    predicted = trainer.predict(test, batch_size=16, state=state, weights="ema")
    by_hand = MLP().apply({"params": flaxhooks.ema_params(state)}, test["image"])
    np.testing.assert_allclose(predicted, np.asarray(by_hand), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("decay", [0, 1, 1.5, -0.1, True, "0.9"])
def test_a_decay_outside_0_to_1_is_refused_at_once(decay):
    with pytest.raises(ValueError, match="the EMA decay must be a number in \\(0, 1\\) or a schedule"):
        flaxhooks.with_ema(optax.sgd(0.1), decay)


def test_evaluating_an_average_the_optimizer_does_not_keep_is_refused_before_anything_compiles(tmp_path):
    with pytest.raises(ValueError, match="weights must be one of"):
        flaxhooks.Evaluate(make_arrays(8), weights="average")
    evaluate = flaxhooks.Evaluate(make_arrays(8), weights="ema")
    trainer = flaxhooks.Trainer(MLP(), optax.sgd(0.1), cross_entropy, callbacks=[evaluate])
    with pytest.raises(ValueError, match="which the optimizer does not keep: train with flaxhooks.with_ema"):
        trainer.fit(make_batches(2), epochs=1)
    assert not trainer.runner.traces
    assert not os.listdir(tmp_path)
