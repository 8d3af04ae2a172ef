"""LossWatch on synthetic loss curves: healthy ones say nothing; a spike, a
plateau and a wrong first loss are each said once, with the steps and numbers."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from flaxhooks import Finding
from flaxhooks.contract import KINDS
from flaxhooks.diagnose import LossThresholds, LossWatch

STEPS = np.arange(5000)


def watch_all(losses: np.ndarray | list[float], watch: LossWatch | None = None) -> list[Finding]:
    """Every finding a watch says over a series, its steps numbered from 0."""
    watch = watch or LossWatch()
    return [finding for step, loss in enumerate(losses) for finding in watch.add(step, float(loss))]


def decaying(seed: int) -> np.ndarray:
    """A healthy curve: exponential decay towards 0.1, with noise."""
    noise = np.random.default_rng(seed).normal(0.0, 0.05, STEPS.size)
    return 2.3 * np.exp(-STEPS / 300) + 0.1 + noise


def converged(seed: int) -> np.ndarray:
    """A healthy curve that falls for 1,000 steps and then stays flat and noisy."""
    noise = np.random.default_rng(seed).normal(0.0, 0.05, STEPS.size)
    return np.where(STEPS < 1000, 0.5 + 1.8 * np.exp(-STEPS / 200), 0.5) + noise


def noisy_flat(seed: int, steps: int, level: float = 1.0, noise: float = 0.05) -> np.ndarray:
    return level + np.random.default_rng(seed).normal(0.0, noise, steps)


def test_the_kinds_are_known():
    assert {"loss_spike", "loss_plateau", "initial_loss"} <= set(KINDS)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("curve", [decaying, converged])
def test_a_healthy_curve_says_nothing(curve, seed):
    assert watch_all(curve(seed)) == []


def test_a_short_spike_is_said_once_at_its_first_step_and_again_when_it_comes_back():
    losses = decaying(0)
    losses[600:605] *= 3
    losses[1500:1505] *= 3

    found = watch_all(losses)

    assert [(f.kind, f.step, f.since) for f in found] == [
        ("loss_spike", 600, 600), ("loss_spike", 1500, 1500)]
    assert found[0].values["loss"] == losses[600]
    assert f"the loss rose to {losses[600]:.2f} at step 600" in found[0].evidence
    assert "over steps 472-599" in found[0].evidence
    assert "standard deviations" in found[0].evidence
    assert "optax.clip_by_global_norm" in found[0].advice
    assert found[0].layer is None


def test_losses_twice_the_mean_for_five_steps_are_llm_foundrys_spike():
    # Noise wide enough that 2.5 is no 6-sigma outlier: only the run of high losses tells.
    losses = noisy_flat(1, 400, noise=0.3)
    losses[300:305] = 2.5

    (found,) = watch_all(losses)

    assert (found.kind, found.step, found.since) == ("loss_spike", 304, 300)
    assert found.values["rule"] == "sustained"
    assert found.values["baseline_steps"] == (200, 299)
    mean = losses[200:300].mean()
    assert found.values["mean"] == pytest.approx(mean)
    assert f"2x its mean of {mean:.3g} over steps 200-299" in found.evidence
    assert "5 losses in a row, steps 300-304" in found.evidence
    assert "steps 300-304" in found.advice


def test_four_high_losses_in_a_row_are_tolerated():
    losses = noisy_flat(1, 400, noise=0.3)
    losses[300:304] = 2.5
    assert watch_all(losses) == []


def test_a_single_ten_sigma_loss_is_maxtexts_spike():
    losses = noisy_flat(2, 300)
    history = losses[72:200]
    losses[200] = history.mean() + 10 * history.std(ddof=1)

    (found,) = watch_all(losses)

    assert (found.kind, found.step, found.since) == ("loss_spike", 200, 200)
    assert found.values["rule"] == "outlier"
    assert found.values["sigmas"] == pytest.approx(10.0)
    assert found.values["baseline_steps"] == (72, 199)
    assert found.values["mean"] == pytest.approx(history.mean())
    rose = f"the loss rose to {losses[200]:.2f} at step 200, 10.0 standard deviations above its mean"
    assert found.evidence.startswith(rose)
    assert found.evidence.endswith("over steps 72-199")


def test_an_outlier_before_128_losses_are_known_is_not_judged():
    losses = noisy_flat(2, 300)
    losses[100] = 5.0
    assert watch_all(losses) == []


def test_a_tiny_wobble_of_a_constant_loss_is_no_spike():
    losses = [0.5] * 300
    losses[200] = 0.5001
    assert watch_all(losses) == []


def test_a_flat_loss_at_chance_is_a_plateau_said_once():
    losses = noisy_flat(3, 1000, level=math.log(10), noise=0.02)

    (found,) = watch_all(losses)

    assert (found.kind, found.step, found.since) == ("loss_plateau", 600, 0)
    recent, previous, start = losses[401:601].mean(), losses[201:401].mean(), losses[:200].mean()
    assert found.evidence == (
        f"the loss has not fallen since training began: its mean is {recent:.2f} over steps 401-600, "
        f"against {previous:.2f} over steps 201-400 and {start:.2f} over steps 0-199"
    )
    assert found.values["recent_mean"] == pytest.approx(recent)
    assert "learning rate" in found.advice


def test_a_resumed_run_is_not_judged_for_a_plateau():
    assert watch_all(noisy_flat(3, 1000, level=0.1), LossWatch(fresh=False)) == []


def test_no_plateau_within_the_first_three_histories():
    assert watch_all(noisy_flat(3, 600, level=math.log(10))) == []


@pytest.mark.parametrize("tau", [1000, 3000])
def test_a_slow_noisy_fine_tuning_curve_is_no_plateau(tau):
    steps = np.arange(10_000)
    for seed in range(3):
        noise = np.random.default_rng(seed).normal(0.0, 0.05, steps.size)
        assert watch_all(1.0 + 0.2 * np.exp(-steps / tau) + noise) == []


def test_a_plateau_is_said_again_only_after_progress_was_made_and_lost():
    stuck = noisy_flat(4, 800, level=2.3, noise=0.02)
    better = noisy_flat(5, 600, level=1.5, noise=0.02)
    rising = np.linspace(1.5, 2.3, 400)  # slow, so no spike
    losses = np.concatenate([stuck, better, rising, noisy_flat(6, 1000, level=2.3, noise=0.02)])

    found = watch_all(losses)

    assert [f.kind for f in found] == ["loss_plateau", "loss_plateau"]
    assert found[0].step == 600 and found[1].step > 1400
    assert found[1].values["recent_mean"] > 2.2


def test_a_first_loss_far_above_log_classes_is_said():
    watch = LossWatch()

    (found,) = watch.initial(0, 30.0, num_classes=10)

    assert (found.kind, found.step) == ("initial_loss", 0)
    assert "30.00" in found.evidence and "log(10) = 2.30" in found.evidence
    assert "initialization" in found.advice
    assert watch.initial(0, 30.0, num_classes=10) == []


@pytest.mark.parametrize("loss", [2.3, 2.5, 3.4])
def test_a_first_loss_near_log_classes_is_fine(loss):
    assert LossWatch().initial(0, loss, num_classes=10) == []


def test_a_first_loss_far_below_log_classes_is_said():
    (found,) = LossWatch().initial(1, 0.2, num_classes=10)
    assert (found.kind, found.step) == ("initial_loss", 1)
    assert "far below log(10)" in found.evidence
    assert "leak" in found.advice


def test_the_first_loss_of_a_model_that_is_no_classifier_is_not_judged():
    watch = LossWatch()
    assert watch.initial(0, 30.0, num_classes=None) == []
    assert watch.initial(0, float("nan"), num_classes=10) == []
    assert LossWatch().initial(0, 0.1, num_classes=2) == []  # a low bound only from 3 classes


def test_non_finite_losses_are_skipped_and_leave_the_histories_alone():
    losses = decaying(0)
    losses[600:605] *= 3
    clean, holed = LossWatch(), LossWatch()
    found, found_holed = [], []
    for index, loss in enumerate(losses):
        # The same losses at the same (even) steps; the holed watch also gets non-finite odd steps.
        found += clean.add(2 * index, float(loss))
        if index in (100, 599, 601, 602, 3000):
            assert holed.add(2 * index - 1, math.nan if index % 2 else math.inf) == []
        found_holed += holed.add(2 * index, float(loss))

    assert found_holed == found
    assert [(f.kind, f.step) for f in found] == [("loss_spike", 1200)]
    assert LossWatch().add(0, float("nan")) == []


def test_the_watch_holds_a_bounded_number_of_losses():
    thresholds = LossThresholds()
    watch = LossWatch(thresholds)
    watch_all(np.concatenate([decaying(0), converged(1)]), watch)
    bound = (thresholds.spike_history + thresholds.outlier_history + 2 * thresholds.plateau_history
             + 2 * thresholds.not_learning_span)
    assert watch.retained == bound


def test_histories_shorter_than_two_are_refused():
    with pytest.raises(ValueError, match="plateau_history"):
        LossThresholds(plateau_history=1)
    with pytest.raises(ValueError, match="not_learning_steps must be 0 or at least twice"):
        LossThresholds(not_learning_steps=15)  # its first and last 10 losses would overlap
    assert LossThresholds(not_learning_steps=0).not_learning_steps == 0  # the rule off


def converged_to_zero(seed: int, steps: int = 1000) -> np.ndarray:
    """A classifier that fits its data: from log(10) down to about 6e-06 by step 300, then flat
    with noise a hundred times its size in ratio (as a converged MLP's loss looks on a log scale)."""
    rng = np.random.default_rng(seed)
    falling = np.exp(np.linspace(math.log(2.3), math.log(6e-6), 300))
    flat = 6e-6 * np.exp(rng.normal(0.0, 1.0, steps - 300))
    return np.concatenate([falling, flat])


def classifier_watch(thresholds: LossThresholds | None = None, classes: int = 10) -> LossWatch:
    watch = LossWatch(thresholds or LossThresholds())
    assert watch.initial(0, math.log(classes), num_classes=classes) == []
    return watch


def spikes(found: list[Finding]) -> list[Finding]:
    return [f for f in found if f.kind == "loss_spike"]


def test_a_converged_loss_rising_from_6e_06_to_0_002_is_no_spike():
    losses = converged_to_zero(0)
    losses[[500, 540, 700]] = 0.002  # the user's case: three "spikes" of 0.002 nats
    # Against their own history these are dozens of standard deviations: the old rule said each one.
    unfloored = watch_all(losses, classifier_watch(LossThresholds(spike_min_rise=0.0, spike_quiet=5)))
    assert [f.since for f in spikes(unfloored)][:3] == [500, 540, 700]
    assert spikes(unfloored)[0].values["sigmas"] > 6
    # A rise of 0.002 nats is 0.1% of log(10), the loss's scale at start: below the floor of 5%.
    assert 0.002 < LossThresholds().spike_min_rise * math.log(10)
    assert watch_all(losses, classifier_watch()) == []


def test_a_real_spike_after_converging_is_still_said():
    losses = converged_to_zero(1)
    losses[600:603] = 1.0  # 43% of log(10) above a converged loss
    (found,) = watch_all(losses, classifier_watch())
    assert (found.kind, found.since, found.values["rule"]) == ("loss_spike", 600, "outlier")


def test_the_floor_of_a_loss_that_is_no_classifier_is_its_first_loss():
    # A regression loss from 4.0: a rise of 0.1 above a converged 0.01 is 2.5% of 4.0, under the floor;
    # one of 0.5 is 12.5%, over it.
    rng = np.random.default_rng(2)
    losses = np.concatenate([np.linspace(4.0, 0.01, 200), 0.01 + rng.normal(0, 0.001, 600)])
    small, large = losses.copy(), losses.copy()
    small[500] += 0.1
    large[500] += 0.5
    watch = LossWatch()
    assert watch_all(small, watch) == [] and watch.scale == 4.0
    assert [f.since for f in spikes(watch_all(large))] == [500]


def test_a_spike_is_said_once_per_episode():
    losses = decaying(0)
    for start in (600, 620, 680, 900):  # calm gaps of 15 and 55 losses, then of 215
        losses[start:start + 5] = 3.0
    found = watch_all(losses)
    assert [f.since for f in spikes(found)] == [600, 900]
    assert LossThresholds().spike_quiet == 100
    # With a short quiet, each is its own episode.
    assert [f.since for f in spikes(watch_all(losses, LossWatch(LossThresholds(spike_quiet=10))))] == [
        600, 620, 680, 900]


def test_a_classifier_stuck_at_chance_is_not_learning_at_step_50():
    # SGD at ten times its learning rate: the loss sits at log(10) from the first step.
    losses = noisy_flat(7, 400, level=math.log(10), noise=0.01)
    found = watch_all(losses, classifier_watch())
    assert [(f.kind, f.step, f.since) for f in found] == [("not_learning", 49, 0)]
    first, last = losses[:10].mean(), losses[40:50].mean()
    assert found[0].values["first_mean"] == pytest.approx(first)
    assert found[0].values["last_mean"] == pytest.approx(last)
    assert found[0].evidence.startswith(
        f"the loss is at chance: its mean is {last:.2f} over steps 40-49, against {first:.2f} over steps 0-9")
    assert "log(10) = 2.30" in found[0].evidence and "chance" in found[0].evidence
    assert "learning rate" in found[0].advice


def test_a_classifier_that_falls_slowly_at_first_is_learning():
    # Falling 3% of log(10) over its first 50 steps (the recipe CNN under SGD at 1e-3 falls so).
    steps = np.arange(400)
    noise = np.random.default_rng(8).normal(0.0, 0.01, steps.size)
    losses = math.log(10) - 0.0016 * steps + noise
    assert watch_all(losses, classifier_watch()) == []


def test_a_loss_at_chance_after_a_fall_is_not_judged_not_learning():
    # Fine-tuning a loss that is no classifier, flat from the start: no chance level, no finding.
    assert watch_all(noisy_flat(9, 100, level=math.log(10), noise=0.01)) == []
    # A classifier whose loss is far from chance (a pre-trained one being fine-tuned).
    assert watch_all(noisy_flat(9, 100, level=0.3, noise=0.01), classifier_watch()) == []
    # A resumed run.
    watch = LossWatch(fresh=False)
    watch.num_classes = 10
    assert watch_all(noisy_flat(9, 100, level=math.log(10), noise=0.01), watch) == []


def test_not_learning_and_then_no_plateau_for_the_same_flat_loss():
    losses = noisy_flat(3, 1000, level=math.log(10), noise=0.02)
    assert [f.kind for f in watch_all(losses, classifier_watch())] == ["not_learning"]


def test_a_resumed_watch_says_what_an_uninterrupted_one_says():
    losses = decaying(0)
    losses[600:605] *= 3
    losses[1500:1505] *= 3
    whole = watch_all(losses, classifier_watch())
    first = classifier_watch()
    found = [f for step, loss in enumerate(losses[:602]) for f in first.add(step, float(loss))]
    state = json.loads(json.dumps(first.state_dict()))  # as a checkpoint keeps it
    resumed = LossWatch(fresh=False)
    resumed.load_state_dict(state)
    found += [f for step, loss in enumerate(losses[602:], 602) for f in resumed.add(step, float(loss))]
    assert [(f.kind, f.step) for f in whole] == [("loss_spike", 600), ("loss_spike", 1500)]
    assert [(f.kind, f.step, f.since, f.evidence) for f in found] == [
        (f.kind, f.step, f.since, f.evidence) for f in whole]
    assert [f.values["std"] for f in found] == pytest.approx([f.values["std"] for f in whole], rel=1e-12)
    assert resumed.fresh and resumed.retained == first.retained


def test_a_classifier_blown_up_and_collapsed_to_chance_is_not_learning():
    # SGD at ten times its learning rate on an MLP: the first losses near 16, then uniform outputs.
    losses = np.concatenate([np.linspace(30.0, 3.0, 10), noisy_flat(10, 90, level=math.log(10), noise=0.01)])
    (found,) = watch_all(losses, classifier_watch())
    assert (found.kind, found.step) == ("not_learning", 49)
    assert "fell to chance from above and no further" in found.evidence
    # Once the loss falls below chance, the watch judges plateaus again.
    assert found.values["last_mean"] == pytest.approx(losses[40:50].mean())
