"""LossWatch on synthetic loss curves: healthy ones say nothing; a spike, a
plateau and a wrong first loss are each said once, with the steps and numbers."""

from __future__ import annotations

import math

import numpy as np
import pytest

from flaxhooks import Finding
from flaxhooks.core import KINDS
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
    assert found.values["window"] == (200, 299)
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
    window = losses[72:200]
    losses[200] = window.mean() + 10 * window.std(ddof=1)

    (found,) = watch_all(losses)

    assert (found.kind, found.step, found.since) == ("loss_spike", 200, 200)
    assert found.values["rule"] == "outlier"
    assert found.values["sigmas"] == pytest.approx(10.0)
    assert found.values["window"] == (72, 199)
    assert found.values["mean"] == pytest.approx(window.mean())
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


def test_no_plateau_within_the_first_three_windows():
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


def test_non_finite_losses_are_skipped_and_leave_the_windows_alone():
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
    bound = thresholds.spike_window + thresholds.outlier_window + 2 * thresholds.plateau_window
    assert watch.retained == bound


def test_windows_shorter_than_two_are_refused():
    with pytest.raises(ValueError, match="plateau_window"):
        LossThresholds(plateau_window=1)
