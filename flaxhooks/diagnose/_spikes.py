"""The gradient norm, step by step: a spike (:class:`GradNormWatch`), and
which layer's gradient spiked, from two replays (:func:`first_spiked_layer`)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

from flaxhooks.contract import Finding
from flaxhooks.diagnose._loss import _Level, _Recent


@dataclasses.dataclass(frozen=True)
class SpikeThresholds:
    """When a gradient norm is a spike, and when a layer's gradient spiked with it.

    Attributes:
        history: the previous finite gradient norms whose mean and standard deviation a
            norm is judged against (128: OLMo-core's ``SkipStepOptimizer`` and MaxText's
            ``skip_step_on_spikes`` interval).
        sigmas: a norm this many standard deviations above that mean is a spike (6: both sources).
        min_factor: ... if also at least this times the mean (2, LLM-Foundry's spike factor;
            ours here): a gradient norm has no scale of its own, so the floor against a
            tiny-spread false alarm (a converged model's near-constant norm) is relative.
        recent: ... and at least ``min_factor`` times the largest of the last this many norms
            (5; ours): a spike is sudden, while a norm that climbs over tens of steps (a
            healthy LSTM's rose from 0.3 to 2 over steps 100-128, noisily) is a trend,
            far above a history's mean and spread but not above its own latest steps.
        quiet: ordinary norms in a row that end a spike's episode (100).
        layer_factor: a layer's gradient spiked when its norm on the spike's batch is at
            least this times its norm on the batch before, at the same parameters (3).

    Examples:
        >>> from flaxhooks.diagnose import SpikeThresholds
        >>> SpikeThresholds(history=64).sigmas
        6.0
    """

    history: int = 128
    sigmas: float = 6.0
    min_factor: float = 2.0
    recent: int = 5
    quiet: int = 100
    layer_factor: float = 3.0

    def __post_init__(self) -> None:
        if not 1 <= self.recent <= self.history:
            raise ValueError(f"recent must be between 1 and history ({self.history}), got {self.recent}")
        if self.history < 2:
            raise ValueError(f"history must be at least 2, got {self.history}")
        if self.min_factor <= 1 or self.layer_factor <= 1:
            raise ValueError(f"min_factor and layer_factor must be above 1, got {self.min_factor} and "
                             f"{self.layer_factor}")


class GradNormWatch:
    """Says a gradient-norm spike once per episode: a norm at least ``sigmas``
    standard deviations above the mean of the ``history`` norms before it, and
    ``min_factor`` times both that mean and the largest of the ``recent`` norms
    before it (non-finite norms are the guard's, skipped).

    Examples:
        >>> from flaxhooks.diagnose import GradNormWatch, SpikeThresholds
        >>> watch = GradNormWatch(SpikeThresholds(history=20))
        >>> norms = [1.0 + 0.05 * (step % 4) for step in range(60)]
        >>> norms[40] = 30.0
        >>> [(f.kind, f.since) for step, norm in enumerate(norms) for f in watch.add(step, norm)]
        [('grad_norm_spike', 40)]
    """

    def __init__(self, thresholds: SpikeThresholds = SpikeThresholds()):
        self.thresholds = thresholds
        self._history = _Recent(thresholds.history)
        self._said = False
        self._calm = 0

    def add(self, step: int, norm: float) -> list[Finding]:
        """Takes one step's gradient norm, in step order; returns the finding that appears at it."""
        norm = float(norm)
        if not math.isfinite(norm):
            return []
        found: list[Finding] = []
        level = self._spiking(norm)
        if level is None:
            self._calm += 1
            if self._calm >= self.thresholds.quiet:
                self._said = False
        else:
            self._calm = 0
            if not self._said:
                self._said = True
                found.append(_spike_finding(step, norm, level))
        self._history.push(step, norm)
        return found

    def state_dict(self) -> dict[str, Any]:
        """Its history and what it has said, as JSON, so a resumed run keeps its baseline."""
        return {"history": self._history.state(), "said": self._said, "calm": self._calm}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Takes back what :meth:`state_dict` gave (the history keeps its own size).

        Examples:
            >>> from flaxhooks.diagnose import GradNormWatch
            >>> watch = GradNormWatch()
            >>> _ = [watch.add(step, 1.0) for step in range(200)]
            >>> resumed = GradNormWatch()
            >>> resumed.load_state_dict(watch.state_dict())
            >>> [f.since for f in resumed.add(200, 50.0)]
            [200]
        """
        self._history = _Recent.restored(self.thresholds.history, state["history"])
        self._said, self._calm = bool(state["said"]), int(state["calm"])

    def _spiking(self, norm: float) -> _Level | None:
        limits = self.thresholds
        if not self._history.full:
            return None
        level = _Level.of(self._history)
        rise = norm - level.mean
        latest = max(list(self._history.values)[-limits.recent:])
        if (rise > limits.sigmas * level.std and level.mean > 0
                and norm >= limits.min_factor * max(level.mean, latest)):
            return level
        return None


def _spike_finding(step: int, norm: float, level: _Level) -> Finding:
    sigmas = (norm - level.mean) / level.std if level.std > 0 else math.inf
    spread = f"{sigmas:.1f} standard deviations" if level.std > 0 else "from a constant"
    return Finding(
        "grad_norm_spike", step, None,
        f"the gradient norm rose to {norm:.3g} at step {step}, {norm / level.mean:.3g} times its mean of "
        f"{level.mean:.3g} and {spread} above it over {level.steps()}",
        f"check the data of step {step} (replay its batch); if spikes recur, lower the learning rate, add "
        "warmup or clip gradients (optax.clip_by_global_norm)",
        since=step,
        values={"grad_norm": norm, "mean": level.mean, "std": level.std, "sigmas": sigmas,
                "baseline_steps": (level.first, level.last)},
    )


def first_spiked_layer(layers: Sequence[str], spiked: Sequence[float], before: Sequence[float],
                       factor: float) -> tuple[str | None, list[float]]:
    """The first layer, in call order, whose gradient norm on the spike's batch
    is at least ``factor`` times that on the batch before; and every layer's ratio.

    Call order, not from the loss backwards: a parameter's gradient is its input
    times its output's gradient, so a blow-up (a bad batch, a layer's outputs
    growing) shows in every layer after its source as well; the first is the source.

    Examples:
        >>> first_spiked_layer(["a", "b", "c"], [1.0, 40.0, 90.0], [1.0, 2.0, 3.0], 3.0)
        ('b', [1.0, 20.0, 30.0])
    """
    ratios = [s / b if b > 0 else (math.inf if s > 0 else 1.0) for s, b in zip(spiked, before, strict=True)]
    first = next((name for name, r in zip(layers, ratios, strict=True) if r >= factor), None)
    return first, ratios
