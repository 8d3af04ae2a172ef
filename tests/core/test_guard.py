"""The non-finite guard every Trainer has: it stops at the first NaN loss or
gradient, keeps the state from before it, and names the call that made it by
replaying that step instrumented."""

from __future__ import annotations

import logging

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import flaxhooks
from tests.helpers import (
    Diverging,
    HostReads,
    SquareRoot,
    cross_entropy,
    make_arrays,
    make_batches,
    sgd_trainer,
    tree_allclose,
)


class SetupDiverging(nn.Module):
    """Defines its layers in setup(); NaN from the first batch holding a NaN on."""

    def setup(self):
        self.encoder = nn.Dense(4)
        self.root = SquareRoot()
        self.head = nn.Dense(3)

    def __call__(self, x):
        return self.head(self.root(jnp.abs(self.encoder(x))))


class Findings(flaxhooks.Callback):
    def __init__(self):
        self.seen = []

    def on_finding(self, loop):
        self.seen.append(loop.payload)


def test_every_trainer_has_a_guard_that_names_the_call_and_keeps_the_state_before_it(caplog):
    findings = Findings()
    trainer = sgd_trainer(Diverging(), callbacks=[findings])
    assert isinstance(trainer.callbacks[0], flaxhooks.NonFiniteGuard)
    with caplog.at_level(logging.ERROR, logger="flaxhooks"), pytest.raises(flaxhooks.NonFiniteError) as error:
        trainer.fit(make_batches(10, batch_size=8), epochs=3)
    assert error.value.step == 1
    message = str(error.value)
    assert message.startswith("the loss is nan at step 1: the first call, in execution order, whose output "
                              "went non-finite is 'root'")
    assert "found by replaying step 1 instrumented, in" in message
    assert [r.getMessage() for r in caplog.records] == [message]  # said once
    assert int(trainer.state.step) == 0  # the state from before the step: nothing after it was applied
    assert [(f.kind, f.layer, f.step) for f in findings.seen] == [("nonfinite", "root", 1)]


def test_a_nan_on_any_step_is_named_by_a_replay_and_nothing_evaluates_the_state():
    batches = make_batches(12, batch_size=8)
    batches[4]["image"][0, 0] = np.nan  # step 5 goes non-finite
    evaluate = flaxhooks.Evaluate(make_arrays(16), batch_size=8)
    reference = sgd_trainer(SetupDiverging())
    reference.fit(batches[:4], epochs=1)
    trainer = sgd_trainer(SetupDiverging(), callbacks=[evaluate])
    with pytest.raises(flaxhooks.NonFiniteError) as error:
        trainer.fit(batches, epochs=2)
    assert error.value.step == 5
    # A setup() root: the child whose output went non-finite, not the model itself.
    assert "whose output went non-finite is 'encoder'" in str(error.value)
    assert evaluate.result is None  # the NaN state was never evaluated
    assert int(trainer.state.step) == 4
    assert tree_allclose(trainer.state.params, reference.state.params, rtol=0, atol=0)


class ZeroRoot(nn.Module):
    """``sqrt(0 * x)``: finite forward, NaN gradient (0 times the infinite slope)."""

    @nn.compact
    def __call__(self, x):
        return jnp.sqrt(0.0 * x) + x


class NanGradient(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.Dense(4, name="encoder")(x)
        x = ZeroRoot(name="zero_root")(x)
        return nn.Dense(3, name="head")(x)


def test_a_non_finite_gradient_under_a_finite_loss_is_caught_at_its_step():
    trainer = sgd_trainer(NanGradient())
    with pytest.raises(flaxhooks.NonFiniteError) as error:
        trainer.fit(make_batches(6, batch_size=8), epochs=1)
    message = str(error.value)
    assert error.value.step == 1 and message.startswith("the gradient norm is nan at step 1")
    # The backward pass starts at the loss: the deepest output whose gradient is not finite.
    assert "went non-finite in the backward pass of 'zero_root': the deepest output with a non-finite " \
        "gradient is 'encoder'" in message
    assert int(trainer.state.step) == 0


def test_warn_trains_on_and_off_watches_nothing(caplog):
    for mode in ("warn", "off"):
        caplog.clear()
        trainer = sgd_trainer(Diverging(), if_nonfinite=mode)
        with caplog.at_level(logging.WARNING, logger="flaxhooks"):
            trainer.fit(make_batches(6, batch_size=8), epochs=1)
        assert int(trainer.state.step) == 6
        said = [r.getMessage() for r in caplog.records if "training goes on" in r.getMessage()]
        assert len(said) == (1 if mode == "warn" else 0)
    with pytest.raises(ValueError, match="if_nonfinite must be one of"):
        sgd_trainer(Diverging(), if_nonfinite="ignore")


def test_a_guard_given_takes_the_place_of_the_default():
    guard = flaxhooks.NonFiniteGuard("stop", replay=False)
    trainer = sgd_trainer(Diverging(), callbacks=[guard])
    assert [cb for cb in trainer.callbacks if isinstance(cb, flaxhooks.NonFiniteGuard)] == [guard]
    with pytest.raises(flaxhooks.NonFiniteError, match="not replayed"):
        trainer.fit(make_batches(6, batch_size=8), epochs=1)


def test_the_guard_changes_no_healthy_step_and_compiles_nothing_more():
    # The same updates as a hand-written loop of plain SGD steps.
    batches = make_batches(5, batch_size=8)
    trainer = sgd_trainer(nn.Dense(3), optimizer_metrics=False)
    trainer.fit(batches, epochs=1)
    model = nn.Dense(3)
    params = trainer.init(batches[0]).params
    tx = optax.sgd(0.1, 0.9)
    opt = tx.init(params)
    for batch in batches:
        grads = jax.grad(lambda p, b=batch: cross_entropy(model.apply({"params": p}, b["image"]), b))(params)
        updates, opt = tx.update(grads, opt, params)
        params = optax.apply_updates(params, updates)
    assert tree_allclose(trainer.state.params, params, rtol=1e-5)
    assert trainer.runner.traces == {"train_step": 1}


def test_the_guard_reads_two_scalars_a_step_each_of_a_finished_step(monkeypatch):
    reads = HostReads(monkeypatch)
    sgd_trainer(callbacks=[reads]).fit(make_batches(10, batch_size=8), epochs=1)
    # The loss and the gradient norm, once the loop has waited for their step
    # anyway; the epoch's last two at its end, before any epoch-end handler.
    assert reads.count == 2 * 10 and reads.unready <= 2 * 2
    reads.count = 0
    sgd_trainer(callbacks=[reads], optimizer_metrics=False).fit(make_batches(10, batch_size=8), epochs=1)
    assert reads.count == 10  # no gradient norm: the loss alone


def test_a_fit_after_the_stop_goes_on_from_the_state_the_guard_kept():
    batches = make_batches(12, batch_size=8)
    poisoned = [dict(b) for b in batches]
    poisoned[4] = {**poisoned[4], "image": poisoned[4]["image"].copy()}
    poisoned[4]["image"][0, 0] = np.nan  # step 5
    trainer = sgd_trainer(SetupDiverging())
    with pytest.raises(flaxhooks.NonFiniteError):
        trainer.fit(poisoned, epochs=1)
    assert int(trainer.state.step) == 4
    # The steps dispatched after the NaN changed nothing: the next fit counts from step 4.
    state = trainer.fit(batches[4:], steps=6)
    assert int(state.step) == 6


def test_a_replay_that_fails_still_stops_and_says_why(monkeypatch):
    def out_of_memory(*args, **kwargs):
        raise RuntimeError("RESOURCE_EXHAUSTED: out of memory")

    monkeypatch.setattr(flaxhooks.step.StepRunner, "replay", out_of_memory)
    trainer = sgd_trainer(Diverging())
    failed = r"the replay that names the layer failed \(RuntimeError"
    with pytest.raises(flaxhooks.NonFiniteError, match=failed):
        trainer.fit(make_batches(6, batch_size=8), epochs=1)
    assert int(trainer.state.step) == 0
