"""The loss, step by step: a spike, a plateau, a loss that does not fall
from its first values, and a first loss that an untrained classifier cannot
have (:class:`LossWatch`)."""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from typing import Any

from flaxhooks.contract import Finding


@dataclasses.dataclass(frozen=True)
class LossThresholds:
    """When the loss is a problem; the defaults of the spike rules are their sources' own.

    Attributes:
        spike_history: LLM-Foundry's rule: the finite losses a spike's mean is taken over (100).
        spike_factor: a loss at or above this times that mean is high (2).
        spike_patience: high losses in a row that are tolerated; one more is a spike (4).
        outlier_history: MaxText's rule: the losses one loss's mean and deviation are taken over (128).
        outlier_sigmas: a loss this many standard deviations above that mean is a spike (6).
        outlier_min_rise: ... if also this fraction of the mean above it (0.1; ours).
        spike_min_rise: either rule's spike must also rise this fraction of the loss's scale
            above the mean: ``log(C)`` for a classifier, else the first loss (0.05; ours: a
            converged classifier whose loss went from 6e-06 to 0.002 rose 0.1% of ``log(10)``,
            noise about zero, no spike).
        spike_quiet: ordinary losses in a row that end a spike's episode; a spike before
            them is the same episode, not said again (100, the spike history).
        plateau_history: W, the losses each plateau mean is taken over (200).
        plateau_min_fall: a fall between the means of two histories is at least this fraction (0.01) ...
        plateau_sigmas: ... and this many standard errors of the difference (2).
        plateau_clear: a plateau is over once the mean falls this fraction below it (0.1).
        initial_high_nats: a first loss more than ``max(this, initial_high_ratio * log(C))``
            above ``log(C)`` is too high (1.0).
        initial_high_ratio: see ``initial_high_nats`` (0.5).
        initial_low_ratio: a first loss below this times ``log(C)`` is too low, for C >= 3 (0.25).
        not_learning_steps: the losses of a fresh classifier's run after which one at chance,
            not fallen from its first ones (or fallen to chance from far above), is said to be
            not learning (50; 0 turns the rule off).
        not_learning_span: the losses at the start and at the end of those that are compared (10).
        not_learning_min_fall: learning is a fall of the mean of the last ``span`` losses below
            that of the first ``span`` of at least this fraction of ``log(C)`` (0.02) and
            ``plateau_sigmas`` standard errors of the difference.
        not_learning_chance: at chance is within this fraction of ``log(C)`` (0.05).

    Examples:
        >>> from flaxhooks.diagnose import LossThresholds
        >>> LossThresholds(plateau_history=500).plateau_history
        500
    """

    spike_history: int = 100
    spike_factor: float = 2.0
    spike_patience: int = 4
    outlier_history: int = 128
    outlier_sigmas: float = 6.0
    outlier_min_rise: float = 0.1
    spike_min_rise: float = 0.05
    spike_quiet: int = 100
    plateau_history: int = 200
    plateau_min_fall: float = 0.01
    plateau_sigmas: float = 2.0
    plateau_clear: float = 0.1
    initial_high_nats: float = 1.0
    initial_high_ratio: float = 0.5
    initial_low_ratio: float = 0.25
    not_learning_steps: int = 50
    not_learning_span: int = 10
    not_learning_min_fall: float = 0.02
    not_learning_chance: float = 0.05

    def __post_init__(self) -> None:
        for name in ("spike_history", "outlier_history", "plateau_history", "not_learning_span"):
            if getattr(self, name) < 2:
                raise ValueError(f"{name} must be at least 2, got {getattr(self, name)}")
        if self.not_learning_steps and self.not_learning_steps < 2 * self.not_learning_span:
            raise ValueError(f"not_learning_steps must be 0 or at least twice not_learning_span "
                             f"({2 * self.not_learning_span}), got {self.not_learning_steps}")
        if self.spike_factor <= 1:
            raise ValueError(f"spike_factor must be above 1, got {self.spike_factor}")


class _Recent:
    """The last ``size`` losses with their steps, and their mean and standard deviation.

    The sums are kept about a shift (the mean when last recomputed) and recomputed
    exactly every ``size`` pushes, so rounding neither drifts nor cancels, at O(1)
    amortized per push.
    """

    def __init__(self, size: int):
        self.size = size
        self.steps: deque[int] = deque(maxlen=size)
        self.values: deque[float] = deque(maxlen=size)
        self._shift = 0.0
        self._sum = 0.0
        self._sum_sq = 0.0
        self._until_exact = size

    def __len__(self) -> int:
        return len(self.values)

    @property
    def full(self) -> bool:
        return len(self.values) == self.size

    def push(self, step: int, value: float) -> tuple[int, float] | None:
        """Adds a loss; returns the ``(step, loss)`` it pushed out, if any."""
        evicted = (self.steps[0], self.values[0]) if self.full else None
        self.steps.append(step)
        self.values.append(value)
        self._count(value, 1.0)
        if evicted is not None:
            self._count(evicted[1], -1.0)
        self._until_exact -= 1
        if self._until_exact == 0:
            self._recompute()
        return evicted

    def _count(self, value: float, sign: float) -> None:
        offset = value - self._shift
        self._sum += sign * offset
        self._sum_sq += sign * offset * offset

    def _recompute(self) -> None:
        self._shift = math.fsum(self.values) / len(self.values)
        offsets = [value - self._shift for value in self.values]
        self._sum = math.fsum(offsets)
        self._sum_sq = math.fsum(offset * offset for offset in offsets)
        self._until_exact = self.size

    @property
    def mean(self) -> float:
        return self._shift + self._sum / len(self.values)

    @property
    def std(self) -> float:
        """With Bessel's correction, as MaxText's rule computes it."""
        n = len(self.values)
        if n < 2:
            return 0.0
        return math.sqrt(max(0.0, (self._sum_sq - self._sum * self._sum / n) / (n - 1)))

    @property
    def span(self) -> tuple[int, int]:
        return self.steps[0], self.steps[-1]

    def state(self) -> list[list[float]]:
        """Its ``[step, loss]`` pairs, oldest first (JSON)."""
        return [[step, value] for step, value in zip(self.steps, self.values, strict=True)]

    @staticmethod
    def restored(size: int, pairs: list[list[float]]) -> _Recent:
        """A history of ``size`` holding the pairs :meth:`state` gave."""
        history = _Recent(size)
        for step, value in pairs[-size:]:
            history.push(int(step), float(value))
        return history


@dataclasses.dataclass(frozen=True)
class _Level:
    """A history's mean, the steps it covers (as the evidence names them) and its spread."""

    mean: float
    first: int
    last: int
    std: float = 0.0
    count: int = 1

    @staticmethod
    def of(history: _Recent) -> _Level:
        return _Level(history.mean, *history.span, history.std, len(history))

    def steps(self) -> str:
        return f"steps {self.first}-{self.last}"

    @staticmethod
    def restored(state: dict[str, float] | None) -> _Level | None:
        if state is None:
            return None
        return _Level(float(state["mean"]), int(state["first"]), int(state["last"]), float(state["std"]),
                      int(state["count"]))


def _level_state(level: _Level | None) -> dict[str, float] | None:
    return None if level is None else dataclasses.asdict(level)


def _num(value: float) -> str:
    """A loss as the evidence writes it: two decimals where that reads well."""
    return f"{value:.2f}" if 1 <= abs(value) < 1e5 else f"{value:.3g}"


def _spike_advice(since: int, step: int) -> str:
    steps = f"step {step}" if since == step else f"steps {since}-{step}"
    return ("lower the learning rate or add warmup, clip gradients (optax.clip_by_global_norm), "
            f"and check the data of {steps}")


def _outlier_finding(step: int, loss: float, level: _Level) -> Finding:
    """MaxText's rule: one loss far above the previous history."""
    std = level.std
    if std > 0:
        sigmas = (loss - level.mean) / std
        how_far = f"{sigmas:.1f} standard deviations above its mean of {_num(level.mean)}"
    else:
        sigmas = math.inf
        how_far = f"from a constant {_num(level.mean)}"
    return Finding(
        "loss_spike", step, None,
        f"the loss rose to {_num(loss)} at step {step}, {how_far} over {level.steps()}",
        _spike_advice(step, step),
        since=step,
        values={"rule": "outlier", "loss": loss, "mean": level.mean, "std": std, "sigmas": sigmas,
                "baseline_steps": (level.first, level.last)},
    )


def _sustained_finding(step: int, since: int, count: int, baseline: _Level, factor: float,
                       peak: tuple[float, int]) -> Finding:
    """LLM-Foundry's rule: several losses in a row far above the history before them."""
    return Finding(
        "loss_spike", step, None,
        f"the loss stayed at or above {factor:g}x its mean of {_num(baseline.mean)} over {baseline.steps()} "
        f"for {count} losses in a row, steps {since}-{step}, reaching {_num(peak[0])} at step {peak[1]}",
        _spike_advice(since, step),
        since=since,
        values={"rule": "sustained", "loss": peak[0], "mean": baseline.mean, "factor": factor,
                "steps_high": count, "baseline_steps": (baseline.first, baseline.last)},
    )


def _fell(before: _Level, after: _Level, min_fall: float, sigmas: float) -> bool:
    """Whether the loss fell from one history to a later one: by a real amount, beyond their noise."""
    drop = before.mean - after.mean
    noise = math.sqrt(before.std**2 / before.count + after.std**2 / after.count)
    return drop > min_fall * abs(before.mean) and drop > sigmas * noise


def _plateau_finding(step: int, recent: _Level, previous: _Level, start: _Level) -> Finding:
    return Finding(
        "loss_plateau", step, None,
        f"the loss has not fallen since training began: its mean is {_num(recent.mean)} over "
        f"{recent.steps()}, against {_num(previous.mean)} over {previous.steps()} and "
        f"{_num(start.mean)} over {start.steps()}",
        "check the learning rate is not too low (the schedule, a long warmup), that gradients reach "
        "the parameters and that the labels match the inputs; try to overfit a single batch",
        since=start.first,
        values={"recent_mean": recent.mean, "previous_mean": previous.mean, "start_mean": start.mean,
                "recent": (recent.first, recent.last), "previous": (previous.first, previous.last),
                "start": (start.first, start.last)},
    )


def _not_learning_finding(step: int, first: _Level, last: _Level, num_classes: int, from_above: bool,
                          fall_needed: float) -> Finding:
    """A classifier's loss at chance over a fresh run's first steps: nothing is being learned."""
    if from_above:
        moved = "it fell to chance from above and no further"
    else:
        moved = (f"it {'rose' if last.mean > first.mean else 'fell only'} {abs(first.mean - last.mean):.3g} "
                 f"(learning is a fall of at least {fall_needed:.3g}, beyond the noise)")
    return Finding(
        "not_learning", step, None,
        f"the loss is at chance: its mean is {_num(last.mean)} over {last.steps()}, against "
        f"{_num(first.mean)} over {first.steps()}; log({num_classes}) = {math.log(num_classes):.2f} is the "
        f"loss of a classifier that gives every class the same probability, and {moved}",
        "check the learning rate first, the commonest cause: too high (a loss stuck at chance, dead units, "
        "large updates) or too low (tiny updates); try values a decade apart. Then check that gradients "
        "reach the parameters and the labels match the inputs; try to overfit a single batch",
        since=first.first,
        values={"first_mean": first.mean, "last_mean": last.mean, "first": (first.first, first.last),
                "last": (last.first, last.last), "num_classes": num_classes},
    )


def _initial_finding(step: int, loss: float, num_classes: int, thresholds: LossThresholds) -> Finding | None:
    """Karpathy's "verify loss @ init": an untrained classifier's loss is about log(C)."""
    chance = math.log(num_classes)
    high = chance + max(thresholds.initial_high_nats, thresholds.initial_high_ratio * chance)
    # For two classes a quarter of log(2) is within reach of an imbalanced label prior.
    low = thresholds.initial_low_ratio * chance if num_classes >= 3 else -math.inf
    expected = f"log({num_classes}) = {chance:.2f}"
    values = {"loss": loss, "expected": chance, "num_classes": num_classes, "high": high, "low": low}
    if loss > high:
        return Finding(
            "initial_loss", step, None,
            f"the first loss is {_num(loss)}, far above {expected}, the loss of a classifier that gives "
            "every class the same probability: its first logits are too large",
            "shrink the last layer's initialization (or start it at zero), normalize the inputs, and "
            "check the loss is given logits, as optax.softmax_cross_entropy expects",
            since=step, values=values,
        )
    if loss < low:
        return Finding(
            "initial_loss", step, None,
            f"the first loss is {_num(loss)}, far below {expected}: an untrained classifier cannot "
            "predict the labels yet",
            "check the labels do not leak into the inputs, that the loss is averaged over the examples "
            "(not divided by too much or mostly masked) and that the number of classes is right",
            since=step, values=values,
        )
    return None


class LossWatch:
    """Finds problems in the loss, one step at a time, and says each once.

    ``loss_spike`` (LLM-Foundry's ``KillLossSpike`` or MaxText's
    ``skip_step_on_spikes`` rule, either rising at least ``spike_min_rise``
    of the loss's scale; one per episode), ``not_learning`` (a fresh
    classifier's loss at chance and not fallen from its first values after
    ``not_learning_steps``),
    ``loss_plateau`` (no fall over ``3 * plateau_history`` losses; a resumed
    run is not judged) and ``initial_loss`` (:meth:`initial`: far from
    ``log(C)``). Non-finite losses are skipped. docs/guides/diagnose.md gives
    each rule. :meth:`state_dict` keeps it across a resume.

    Args:
        thresholds: when the loss is a problem.
        fresh: whether the first loss it takes is training's first (False for a resumed run).

    Attributes:
        num_classes: the classes of a classifier's logits, else None: its loss's scale is
            ``log(num_classes)``, and a loss at it is at chance (:meth:`initial` sets it).

    Examples:
        >>> from flaxhooks.diagnose import LossWatch
        >>> watch = LossWatch()
        >>> [f.kind for f in watch.initial(0, 30.0, num_classes=10)]
        ['initial_loss']
        >>> losses = [1.0 + 0.01 * (step % 3) for step in range(300)]
        >>> losses[250] = 9.0
        >>> found = [f for step, loss in enumerate(losses) for f in watch.add(step, loss)]
        >>> [(f.kind, f.since) for f in found]
        [('loss_spike', 250)]
        >>> print(found[0].evidence)  # doctest: +NORMALIZE_WHITESPACE
        the loss rose to 9.00 at step 250, 971.0 standard deviations above its mean of 1.01
        over steps 122-249
    """

    def __init__(self, thresholds: LossThresholds = LossThresholds(), *, fresh: bool = True):
        self.thresholds = thresholds
        self.fresh = fresh
        self.num_classes: int | None = None
        self._first_loss: float | None = None
        self._spike_history = _Recent(thresholds.spike_history)
        self._outlier_history = _Recent(thresholds.outlier_history)
        self._recent = _Recent(thresholds.plateau_history)
        self._previous = _Recent(thresholds.plateau_history)
        self._seen = 0
        self._start: _Level | None = None
        # The not-learning rule: the first losses, and the latest as many.
        self._opening = _Recent(thresholds.not_learning_span)
        self._latest = _Recent(thresholds.not_learning_span)
        # LLM-Foundry's rule: the run of high losses, against the baseline from before it began.
        self._high_baseline: _Level | None = None
        self._high_since = 0
        self._high_steps = 0
        self._high_peak = (0.0, 0)
        # What has been said and not yet cleared.
        self._spike_said = False
        self._calm_steps = 0
        self._plateau_at: _Level | None = None
        self._stuck_at: _Level | None = None  # where not_learning was said, until the loss falls
        self._initial_said = False

    @property
    def scale(self) -> float:
        """The loss's scale at the start: ``log(C)`` for a classifier, else the first loss's size."""
        if self.num_classes is not None and self.num_classes >= 2:
            return math.log(self.num_classes)
        return abs(self._first_loss) if self._first_loss is not None else 0.0

    @property
    def retained(self) -> int:
        """How many losses the watch holds: bounded by its histories, however long the run."""
        histories = (self._spike_history, self._outlier_history, self._recent, self._previous, self._opening,
                   self._latest)
        return sum(len(history) for history in histories)

    def add(self, step: int, loss: float) -> list[Finding]:
        """Takes one step's loss, in step order; returns the findings that appear at this step.

        Examples:
            >>> from flaxhooks.diagnose import LossWatch
            >>> LossWatch().add(0, float("nan"))
            []
        """
        loss = float(loss)
        if not math.isfinite(loss):
            return []
        if self._first_loss is None:
            self._first_loss = loss
        found = self._spike(step, loss)
        self._push(step, loss)
        return found + self._not_learning(step) + self._plateau(step)

    def initial(self, step: int, loss: float, num_classes: int | None) -> list[Finding]:
        """Checks the first loss of a fresh run against ``log(num_classes)``.

        Call it once, at the first step of a run that starts from initialization
        (not one resumed); ``add`` still takes that loss as well.

        Args:
            step: the first step.
            loss: its loss, a mean softmax cross-entropy in nats.
            num_classes: the classes, or None when the model is not a classifier (no check).

        Examples:
            >>> from flaxhooks.diagnose import LossWatch
            >>> LossWatch().initial(0, 2.35, num_classes=10)
            []
        """
        if num_classes is not None and num_classes < 2:
            raise ValueError(f"num_classes must be at least 2, got {num_classes}")
        if num_classes is not None:
            self.num_classes = num_classes
        if num_classes is None or self._initial_said or not math.isfinite(loss):
            return []
        finding = _initial_finding(step, float(loss), num_classes, self.thresholds)
        self._initial_said = finding is not None
        return [finding] if finding else []

    def state_dict(self) -> dict[str, Any]:
        """Its histories and what it has said, as JSON, so a resumed run keeps its
        baselines and says nothing twice (:meth:`load_state_dict`)."""
        return {
            "fresh": self.fresh, "num_classes": self.num_classes, "first_loss": self._first_loss,
            "seen": self._seen, "start": _level_state(self._start),
            "histories": {name: getattr(self, f"_{name}").state() for name in _HISTORIES},
            "high": {"baseline": _level_state(self._high_baseline), "since": self._high_since,
                     "steps": self._high_steps, "peak": list(self._high_peak)},
            "said": {"spike": self._spike_said, "calm_steps": self._calm_steps,
                     "plateau_at": _level_state(self._plateau_at), "stuck_at": _level_state(self._stuck_at),
                     "initial": self._initial_said},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Takes back what :meth:`state_dict` gave (its histories keep their own sizes).

        Examples:
            >>> from flaxhooks.diagnose import LossWatch
            >>> watch = LossWatch()
            >>> _ = [watch.add(step, 2.3) for step in range(60)]
            >>> resumed = LossWatch(fresh=False)
            >>> resumed.load_state_dict(watch.state_dict())
            >>> resumed.fresh, resumed.retained == watch.retained
            (True, True)
        """
        self.fresh, self.num_classes = bool(state["fresh"]), state["num_classes"]
        self._first_loss, self._seen = state["first_loss"], int(state["seen"])
        self._start = _Level.restored(state["start"])
        for name in _HISTORIES:
            history = getattr(self, f"_{name}")
            setattr(self, f"_{name}", _Recent.restored(history.size, state["histories"][name]))
        high = state["high"]
        self._high_baseline = _Level.restored(high["baseline"])
        self._high_since, self._high_steps = int(high["since"]), int(high["steps"])
        self._high_peak = (float(high["peak"][0]), int(high["peak"][1]))
        said = state["said"]
        self._spike_said, self._calm_steps = bool(said["spike"]), int(said["calm_steps"])
        self._plateau_at = _Level.restored(said["plateau_at"])
        self._stuck_at = _Level.restored(said["stuck_at"])
        self._initial_said = bool(said["initial"])

    def _push(self, step: int, loss: float) -> None:
        self._seen += 1
        self._spike_history.push(step, loss)
        self._outlier_history.push(step, loss)
        leaving = self._recent.push(step, loss)
        if leaving is not None:
            self._previous.push(*leaving)
        if self._start is None and self._recent.full:
            self._start = _Level.of(self._recent)
        if not self._opening.full:
            self._opening.push(step, loss)
        self._latest.push(step, loss)

    def _min_rise(self) -> float:
        """The least rise above the mean that can be a spike, in the loss's units."""
        return self.thresholds.spike_min_rise * self.scale

    def _spike(self, step: int, loss: float) -> list[Finding]:
        """Both spike rules, against the histories before this loss; one finding an episode."""
        outlier = self._outlier(loss)
        high = self._track_high(step, loss)
        if outlier is None and not high:
            self._calm_steps += 1
            if self._calm_steps >= self.thresholds.spike_quiet:
                self._spike_said = False
            return []
        self._calm_steps = 0
        if self._spike_said:
            return []
        if outlier is not None:
            finding = _outlier_finding(step, loss, outlier)
        elif self._high_baseline is not None and self._high_steps > self.thresholds.spike_patience:
            finding = _sustained_finding(step, self._high_since, self._high_steps, self._high_baseline,
                                         self.thresholds.spike_factor, self._high_peak)
        else:
            return []
        self._spike_said = True
        return [finding]

    def _outlier(self, loss: float) -> _Level | None:
        """MaxText's rule: the previous history, when ``loss`` is far above it."""
        limits = self.thresholds
        if not self._outlier_history.full:
            return None
        level = _Level.of(self._outlier_history)
        rise = loss - level.mean
        if (rise > limits.outlier_sigmas * level.std and rise > limits.outlier_min_rise * abs(level.mean)
                and rise > self._min_rise()):
            return level
        return None

    def _track_high(self, step: int, loss: float) -> bool:
        """LLM-Foundry's rule: whether ``loss`` is high, keeping the run of high losses."""
        factor = self.thresholds.spike_factor
        if self._high_baseline is None:
            history = self._spike_history
            # Twice a mean means nothing unless the mean is positive, nor a rise below the floor.
            if (not history.full or history.mean <= 0 or loss < factor * history.mean
                    or loss - history.mean <= self._min_rise()):
                return False
            self._high_baseline, self._high_since, self._high_steps = _Level.of(history), step, 1
            self._high_peak = (loss, step)
            return True
        baseline = self._high_baseline.mean
        if loss < factor * baseline or loss - baseline <= self._min_rise():
            self._high_baseline, self._high_steps = None, 0
            return False
        self._high_steps += 1
        if loss > self._high_peak[0]:
            self._high_peak = (loss, step)
        return True

    def _not_learning(self, step: int) -> list[Finding]:
        """Whether a fresh run's loss has not fallen from its first values (judged once)."""
        limits = self.thresholds
        fall_needed = limits.not_learning_min_fall * self.scale
        if self._stuck_at is not None:
            if _Level.of(self._latest).mean < self._stuck_at.mean - fall_needed:
                self._stuck_at = None  # learning at last: the plateau rule takes over
            return []
        # A classifier only: without a chance level, a loss that barely moves in its first steps
        # may be a fine-tuning run's, already near its floor (the plateau rule judges it later).
        if (not self.fresh or self.num_classes is None or not limits.not_learning_steps
                or self._seen != limits.not_learning_steps):
            return []
        first, last = _Level.of(self._opening), _Level.of(self._latest)
        chance, band = math.log(self.num_classes), limits.not_learning_chance * math.log(self.num_classes)
        if abs(last.mean - chance) > band:
            return []
        # A fall counts as learning from at or below chance: from far above (logits blown up by
        # too high a learning rate, then collapsed to uniform) it reaches chance and no further.
        from_above = first.mean > chance + band
        noise = math.sqrt(first.std**2 / first.count + last.std**2 / last.count)
        drop = first.mean - last.mean
        if not from_above and drop > fall_needed and drop > limits.plateau_sigmas * noise:
            return []
        self._stuck_at = last
        return [_not_learning_finding(step, first, last, self.num_classes, from_above, fall_needed)]

    def _plateau(self, step: int) -> list[Finding]:
        """Whether the loss has not fallen since training began, nor lately."""
        limits = self.thresholds
        if not self.fresh or self._seen <= 3 * limits.plateau_history or self._start is None:
            return []
        if self._stuck_at is not None:  # said as not learning, and still so: the same problem
            return []
        recent = _Level.of(self._recent)
        if self._plateau_at is not None:
            # Only a clear fall from where it was said ends a plateau, not noise around it.
            said = self._plateau_at.mean
            if recent.mean < said - limits.plateau_clear * abs(said):
                self._plateau_at = None
            return []
        previous, start = _Level.of(self._previous), self._start
        if any(_fell(before, recent, limits.plateau_min_fall, limits.plateau_sigmas)
               for before in (start, previous)):
            return []
        self._plateau_at = recent
        return [_plateau_finding(step, recent, previous, start)]


#: The histories a watch keeps, by attribute name (without the underscore).
_HISTORIES = ("spike_history", "outlier_history", "recent", "previous", "opening", "latest")
