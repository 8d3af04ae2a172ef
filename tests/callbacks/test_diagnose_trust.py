"""Diagnose names the cause, early, and only what is wrong: a classifier stuck at
chance is ``not_learning`` by step 50 and a layer dead from the start is said at
step 20 (not at a 200-step window's end); gradients exploding through depth are
named as the cause of a large first loss; a head the loss ignores is
``unused_layer``, not dead units; a run resumed from a checkpoint says what an
uninterrupted one says."""

from __future__ import annotations

import math

import flax.linen as nn
import numpy as np
import optax
import pytest

import flaxhooks
from flaxhooks.callbacks import Checkpoint
from flaxhooks.diagnose import LossThresholds, Thresholds
from tests.callbacks.test_diagnose import Confident, Findings, Healthy, Killed, fit, kinds
from tests.helpers import cross_entropy


def balanced(n=512, features=8, seed=0):
    """Inputs with exactly balanced labels: a model whose outputs ignore them sits at log(3)."""
    rng = np.random.default_rng(seed)
    label = rng.permutation(np.arange(n) % 3).astype(np.int32)
    x = rng.normal(size=(n, features)).astype(np.float32)
    return flaxhooks.ArrayLoader({"image": x, "label": label}, 48, seed=seed)


class AllDead(nn.Module):
    """What a learning rate far too high leaves: every ReLU dead, the logits a constant."""

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(32, bias_init=nn.initializers.constant(-20.0), name="killed")(x))
        return nn.Dense(3, kernel_init=nn.initializers.zeros, name="head")(x)


def test_a_dead_classifier_at_chance_is_said_in_the_first_tens_of_steps():
    # Defaults: every 10th step sampled, windows of 200 steps. Before, the first word came at step 200.
    found, _ = fit(AllDead(), optax.sgd(0.1), steps=60, every=10, window=200, train=balanced())
    assert [(f.kind, f.step, f.layer) for f in found] == [
        ("dead_units", 20, "killed"), ("not_learning", 50, None)]
    dead, stuck = found
    assert dead.since == 1 and "100% of its units were never positive" in dead.evidence
    assert "over steps 1-20" in dead.evidence
    assert stuck.values["last_mean"] == pytest.approx(math.log(3), abs=0.01)
    assert "log(3) = 1.10" in stuck.evidence and "chance" in stuck.evidence
    assert "learning rate" in stuck.advice


def test_a_layer_dead_from_the_start_is_said_once_early_and_not_again_at_the_window():
    found, _ = fit(Killed(), steps=120, every=10, window=200)  # the part-window (120 >= 100) is judged too
    dead = [f for f in found if f.kind == "dead_units"]
    assert [(f.layer, f.step) for f in dead] == [("killed", 20)]


def test_the_early_judgment_and_not_learning_are_silent_on_a_healthy_model():
    assert fit(Healthy(), optax.sgd(0.1), steps=60, every=5, window=200)[0] == []


class Amplifying(nn.Module):
    """A deep ReLU stack without normalization, initialized at 8 times He's variance:
    each layer grows the gradient about 2.8 times on its way back from the loss."""

    @nn.compact
    def __call__(self, x):
        init = nn.initializers.variance_scaling(16.0, "fan_in", "normal")
        for _ in range(8):
            x = nn.relu(nn.Dense(32, kernel_init=init)(x))
        return nn.Dense(3)(x)


def test_gradients_exploding_through_depth_are_named_as_the_cause_of_the_large_first_loss():
    # The user's case: before, the only finding was the symptom, a large first loss, with advice
    # about the last layer's initialization.
    found, _ = fit(Amplifying(), optax.sgd(1e-4), steps=20, every=5, window=200)
    assert kinds(found) == [("exploding_gradients", "Dense_0")]  # and no initial_loss of its own
    (exploding,) = found
    assert exploding.step == 20 and exploding.values["rule"] == "depth"
    layers = [f"Dense_{i}" for i in range(8)]
    assert exploding.values["layers"] == layers  # the output layer, Dense_8, gets more than Dense_7
    ratio = exploding.values["ratio"]
    # Thousands of times: under the 1e4 of the rule that compares any two layers, which said nothing.
    assert 100 < ratio < Thresholds().exploding_ratio
    listed = exploding.evidence.split("(")[1].split(";")[0]
    factors = [float(part.split("x into")[0]) for part in listed.split(", ")]
    assert len(factors) == 7 and min(factors) > 1
    assert np.prod(factors) == pytest.approx(ratio, rel=0.02)  # each factor printed to 3 digits
    assert exploding.values["per_layer"] == pytest.approx(ratio ** (1 / 7))
    first_loss = exploding.values["initial_loss"]
    assert first_loss > 100 * math.log(3)
    assert f"the first loss, {first_loss:.3g}, far above log(3) = 1.10, is its symptom" in exploding.evidence
    assert "init scale" in exploding.advice


class SecondHead(nn.Module):
    """A trunk with two heads; the loss is given only the first."""

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(32, name="trunk")(x))
        aux = nn.Dense(3, name="aux")(nn.relu(nn.Dense(16, name="aux_hidden")(x)))
        del aux  # computed, never given to the loss
        return nn.Dense(3, name="head")(x)


def test_a_head_the_loss_ignores_is_unused_not_dead():
    # Said at step 20 (the early judgment); the part-window of steps 1-110, judged whole at the end,
    # names it neither dead nor frozen (its parameters get no gradient: the same problem).
    found, _ = fit(SecondHead(), steps=110, every=10, window=200)
    assert kinds(found) == [("unused_layer", "aux_hidden")]
    (unused,) = found
    assert unused.step == 20 and unused.values["layers"] == ["aux_hidden", "aux"]
    assert "do not reach the loss" in unused.evidence and "second head" in unused.evidence


def spiky_batches(steps=60, spike_at=45):
    rng = np.random.default_rng(0)
    batches = [{"image": rng.normal(size=(32, 8)).astype(np.float32),
                "label": rng.integers(0, 3, 32).astype(np.int32)} for _ in range(steps)]
    for batch in batches[spike_at - 1:spike_at + 1]:  # two batches of garbage, 100 times the scale
        batch["image"] *= 100.0
    return {key: np.concatenate([b[key] for b in batches]) for key in batches[0]}


def diagnosed_trainer(tmp_path, findings):
    diagnose = flaxhooks.Diagnose(every=1, window=10, table=False,
                                  loss=LossThresholds(spike_history=20, outlier_history=20))
    return flaxhooks.Trainer(Killed(), optax.sgd(0.01), cross_entropy, callbacks=[
        Checkpoint(tmp_path / "checkpoints", every=30, at_epoch_end=False), diagnose, findings])


def test_a_run_resumed_from_a_checkpoint_says_what_an_uninterrupted_one_says(tmp_path):
    arrays = spiky_batches()
    loader = lambda: flaxhooks.ArrayLoader(arrays, 32, shuffle=False)  # noqa: E731
    whole = Findings()
    diagnosed_trainer(tmp_path / "whole", whole).fit(loader(), steps=60)
    first, second = Findings(), Findings()
    diagnosed_trainer(tmp_path / "resumed", first).fit(loader(), steps=30)
    resumed = diagnosed_trainer(tmp_path / "resumed", second)
    resumed.fit(loader(), steps=60, resume=True)

    said = [(f.kind, f.layer, f.step) for f in whole.seen]
    assert ("dead_units", "killed", 10) in said and [k for k, _, _ in said].count("loss_spike") == 1
    # The dead layer is not said again after the resume, and the spike at step 45 is judged against
    # the losses from before it (the resumed fit has seen only 15 of the 20 its window needs).
    assert [(f.kind, f.layer, f.step) for f in first.seen + second.seen] == said
    state = resumed.bus.of(flaxhooks.Diagnose)[0].state_dict()
    assert state["loss"]["fresh"] and ["dead_units", "killed", 10] in state["active"]


def test_a_loss_spike_names_the_batch_it_began_at():
    # Two epochs of 20 unshuffled batches; batch 15 of each is garbage, 100 times the scale.
    rng = np.random.default_rng(0)
    arrays = {"image": rng.normal(size=(640, 8)).astype(np.float32),
              "label": rng.integers(0, 3, 640).astype(np.int32)}
    arrays["image"][15 * 32:16 * 32] *= 100.0
    loader = flaxhooks.ArrayLoader(arrays, 32, shuffle=False)
    loss = LossThresholds(spike_history=10, outlier_history=10, spike_quiet=10)
    found, _ = fit(Healthy(), optax.sgd(0.01), steps=40, every=10, window=1000, train=loader, loss=loss)
    spikes = [f for f in found if f.kind == "loss_spike"]
    # Step s (from 1) takes batch (s - 1) % 20 of epoch (s - 1) // 20.
    assert [f.since for f in spikes] == [16, 36]
    assert [f.values["batch"] for f in spikes] == [{"epoch": 0, "index": 15}, {"epoch": 1, "index": 15}]
    assert spikes[1].evidence.endswith("step 36's batch is batch 15 of epoch 1 (both from 0)")


def test_a_large_first_loss_waits_for_no_judgment_that_is_not_coming():
    class Said(flaxhooks.Callback):
        """The step at which each finding is said."""

        def __init__(self):
            self.at = []

        def on_finding(self, loop):
            self.at.append((loop.payload.kind, loop.payload.step, loop.step))

    said = Said()
    # Every 50th step sampled: nothing to judge by step 20, when the first loss's finding is said.
    diagnose = flaxhooks.Diagnose(every=50, window=200, table=False)
    trainer = flaxhooks.Trainer(Confident(), optax.adam(1e-2), cross_entropy, callbacks=[diagnose, said])
    trainer.fit(balanced(), steps=25)
    assert said.at == [("initial_loss", 1, 20)]
