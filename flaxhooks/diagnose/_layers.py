"""From a window's sums to each layer's figures, and from the figures to findings."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from flaxhooks.contract import Finding
from flaxhooks.diagnose._instep import COLUMNS, SLOPE_BINS

_BINS = len(SLOPE_BINS) + 1


@dataclasses.dataclass(frozen=True)
class Thresholds:
    """When a layer's figures become a finding; docs/guides/diagnose.md gives each one's source.

    Attributes:
        dead_fraction: a layer is reported from this share of its units with no gradient over a window.
        dormant_score: a unit is dormant when its mean ``max(z, 0)`` is at most this share of its
            layer's mean (ReDo's tau) ...
        dormant_fraction: ... and a layer is reported from this share of dormant units.
        flat_slope: a ``|z|`` bin is flat when its mean gradient is below this share of that at
            ``|z| < 0.5`` ...
        saturated_fraction: ... and a layer is reported from this share of pre-activations there.
        vanishing_ratio: a gradient RMS below this share of the largest after it.
        exploding_ratio: a gradient RMS above this multiple of the smallest after it.
        exploding_growth: the largest gradient RMS grown this many times since the first window.
        update_ratio_high: a window's mean ``|update| / |params|`` above this is too fast.
        update_ratio_step: one step's ``|update| / |params|`` above this is too fast.
        update_ratio_low: a mean below this (but not 0) is barely learning.
        exploding_depth: a gradient RMS grown this many times down through consecutive layers
            that each amplify it ...
        exploding_depth_layers: ... over at least this many layers.
        early_steps: a fit's first steps, judged on their own for what is conclusive from the
            start: a layer dead to its last unit, unused layers, gradients exploding through depth.
    """

    dead_fraction: float = 0.30
    dormant_score: float = 0.025
    dormant_fraction: float = 0.50
    flat_slope: float = 0.05
    saturated_fraction: float = 0.25
    vanishing_ratio: float = 1e-4
    exploding_ratio: float = 1e4
    exploding_growth: float = 100.0
    update_ratio_high: float = 0.1
    update_ratio_step: float = 0.5
    update_ratio_low: float = 1e-6
    exploding_depth: float = 100.0
    exploding_depth_layers: int = 4
    early_steps: int = 20


@dataclasses.dataclass(frozen=True)
class LayerFigures:
    """One layer's figures over one window (host floats).

    Attributes:
        mean: its pre-activations' mean.
        grad_rms: the RMS of the loss's gradient with respect to them.
        dead: the share of its units never positive that got no gradient (dead ReLU units).
        silent: the share of its units that got no gradient (dead, or passed none back).
        dormant: the share of its units whose ReDo score is at most the threshold (NaN unless a ReLU follows).
        saturated: the share of pre-activations where the activation after is flat (NaN if none).
        slopes: the mean gradient in each ``|z|`` bin over that at ``|z| < 0.5``.
    """

    name: str
    mean: float
    grad_rms: float
    dead: float
    silent: float
    dormant: float
    saturated: float
    slopes: tuple[float, ...]


def layer_figures(names: Sequence[str], units: Sequence[int], sums: Mapping[str, np.ndarray],
                  thresholds: Thresholds) -> list[LayerFigures]:
    """Each layer's figures from a window's sums, read on the host."""
    table = np.asarray(sums["layers"], np.float64)
    reached, fired, mass = (np.asarray(sums[key], np.float64) for key in ("reached", "fired", "mass"))
    col = {c: i for i, c in enumerate(COLUMNS)}
    bin_counts = table[:, col["bin0_count"]:col["bin0_count"] + _BINS]
    bin_grads = table[:, col["bin0_abs_g"]:col["bin0_abs_g"] + _BINS]
    figures, offset = [], 0
    for i, (name, n) in enumerate(zip(names, units, strict=True)):
        row, unit_reached, unit_mass = table[i], reached[offset:offset + n], mass[offset:offset + n]
        unit_fired = fired[offset:offset + n]
        offset += n
        count = max(row[col["count"]], 1.0)
        relu_like = row[col["nonpositive_with_gradient"]] == 0 and row[col["nonpositive"]] > 0
        dormant = (float(np.mean(unit_mass / unit_mass.mean() <= thresholds.dormant_score))
                   if relu_like and unit_mass.mean() > 0 else float("nan"))
        with np.errstate(divide="ignore", invalid="ignore"):
            mean_g = bin_grads[i] / bin_counts[i]
            known = bin_counts[i, 0] > 0 and bin_grads[i, 0] > 0
            slopes = mean_g / mean_g[0] if known else np.full(_BINS, np.nan)
        flat = np.isfinite(slopes) & (slopes < thresholds.flat_slope) & (bin_counts[i] > 0)
        # Flat from a bin up (ReLU's negative half is not saturation); the last layer's is the loss's shape.
        saturated = float("nan")
        if flat.any() and not relu_like and i < len(names) - 1:
            first = int(np.argmax(flat))
            if first > 0 and np.all(flat[first:] | (bin_counts[i, first:] == 0)):
                saturated = float(bin_counts[i, first:].sum() / count)
        figures.append(LayerFigures(
            name, float(row[col["sum_z"]] / count), float(np.sqrt(row[col["sum_g2"]] / count)),
            float(np.mean((unit_reached == 0) & (unit_fired == 0))) if n else 0.0,
            float(np.mean(unit_reached == 0)) if n else 0.0, dormant, saturated, tuple(map(float, slopes))))
    return figures


def _pct(x: float) -> str:
    return f"{100 * x:.0f}%"


def layer_findings(figures: Sequence[LayerFigures], first: Mapping[str, LayerFigures], steps: tuple[int, int],
                   thresholds: Thresholds, first_max_grad: float | None = None) -> list[Finding]:
    """The findings of one window's figures, ``first`` each layer's in its first window."""
    start, end = steps
    found: list[Finding] = []
    unused = unused_layers(figures)
    for f in figures:
        if f.name in unused:
            continue
        before = first.get(f.name)
        trend = (f"; its pre-activations' mean went from {before.mean:.3g} to {f.mean:.3g} since the "
                 "first window" if before is not None and before is not f else "")
        if f.dead >= thresholds.dead_fraction:
            found.append(Finding(
                "dead_units", end, f.name,
                f"{_pct(f.dead)} of its units were never positive and got no gradient on any example over "
                f"steps {start}-{end} (dead ReLU units; threshold {_pct(thresholds.dead_fraction)}){trend}",
                "a lower learning rate, LeakyReLU or GELU, or check the bias init (a large negative bias "
                "kills ReLU units)", since=start, values={"dead": f.dead, "mean": f.mean}))
        elif f.silent >= thresholds.dead_fraction:
            found.append(Finding(
                "dead_units", end, f.name,
                f"{_pct(f.silent)} of its units got no gradient on any example over steps {start}-{end}, "
                f"though some were positive: what comes after them (a normalization and ReLU, or a dead "
                f"layer) passes nothing back (threshold {_pct(thresholds.dead_fraction)}){trend}",
                "look at the layers after it; a lower learning rate, or LeakyReLU/GELU",
                since=start, values={"silent": f.silent, "mean": f.mean}))
        elif np.isfinite(f.dormant) and f.dormant >= thresholds.dormant_fraction:
            found.append(Finding(
                "dormant_units", end, f.name,
                f"{_pct(f.dormant)} of its ReLU units are dormant over steps {start}-{end} (mean output at "
                f"most {thresholds.dormant_score} of the layer's, ReDo; threshold "
                f"{_pct(thresholds.dormant_fraction)}){trend}",
                "reinitialize dormant units (ReDo), a lower learning rate, or LeakyReLU/GELU",
                since=start, values={"dormant": f.dormant}))
        if np.isfinite(f.saturated) and f.saturated >= thresholds.saturated_fraction:
            found.append(Finding(
                "saturation", end, f.name,
                f"{_pct(f.saturated)} of its pre-activations sit where the activation after it is flat (its "
                f"gradient there is under {thresholds.flat_slope:g} of its slope near 0) over steps "
                f"{start}-{end}",
                "normalize the inputs of that layer (LayerNorm/BatchNorm), a smaller init scale "
                "(Glorot/He), or ReLU/GELU instead of tanh/sigmoid", since=start,
                values={"saturated": f.saturated}))
    if unused:
        found.append(_unused_finding(figures, unused, steps))
    found += _gradient_findings(figures, steps, thresholds, first_max_grad)
    return _root_causes(found, figures)


def unused_layers(figures: Sequence[LayerFigures]) -> list[str]:
    """The layers whose outputs do not reach the loss: silent while firing, with no layer
    after them dead to its last unit (which :func:`layer_findings` names instead).

    Examples:
        >>> from flaxhooks.diagnose import LayerFigures
        >>> def layer(name, dead, silent):
        ...     return LayerFigures(name, 0.1, 0.0 if silent == 1 else 0.1, dead, silent, 0.0, 0.0, ())
        >>> unused_layers([layer("trunk", 0.0, 0.0), layer("head", 0.0, 0.0), layer("aux", 0.0, 1.0)])
        ['aux']
        >>> unused_layers([layer("before", 0.0, 1.0), layer("killed", 1.0, 1.0)])
        []
    """
    names = []
    for i, f in enumerate(figures):
        blocked = any(after.dead >= 1.0 for after in figures[i + 1:])
        if f.silent >= 1.0 and f.dead < 1.0 and f.grad_rms == 0 and not blocked:
            names.append(f.name)
    return names


def _unused_finding(figures: Sequence[LayerFigures], unused: Sequence[str],
                    steps: tuple[int, int]) -> Finding:
    start, end = steps
    live = {f.name: 1.0 - f.dead for f in figures}
    listed = ", ".join(f"{name!r} ({_pct(live[name])} of its units active)" for name in unused)
    plural = len(unused) > 1
    return Finding(
        "unused_layer", end, unused[0],
        f"{'these layers' if plural else 'this layer'}: {listed}, got a gradient of exactly 0 at every unit "
        f"on every example over steps {start}-{end} while {'their' if plural else 'its'} units are active, "
        f"and no layer after {'them' if plural else 'it'} is dead: {'their' if plural else 'its'} outputs do "
        "not reach the loss (a second head the loss ignores, an output left unused, a stop_gradient)",
        "add its output's loss to the total (weighted), or remove it; if it is trained apart on purpose, "
        "ignore this",
        since=start, values={"layers": list(unused)})


def _root_causes(found: list[Finding], figures: Sequence[LayerFigures]) -> list[Finding]:
    """The dead units of the layers around one dead to its last unit, named in its finding only."""
    names = [f.name for f in figures]
    root = next((i for i, f in enumerate(figures) if f.dead >= 1.0), None)
    if root is None:
        return found
    after, before = set(names[root + 1:]), set(names[:root])
    follow = {f.layer for f in found if f.kind == "dead_units"
              and (f.layer in after or (f.layer in before and "dead" not in f.values))}
    if not follow:
        return found
    listed = ", ".join(repr(n) for n in names if n in follow)
    kept = []
    for f in found:
        if f.kind == "dead_units" and f.layer in follow:
            continue
        if f.kind == "dead_units" and f.layer == names[root]:
            evidence = f"{f.evidence}; so {listed} get no gradient or a constant input"
            f = dataclasses.replace(f, evidence=evidence, values={**f.values, "follow": sorted(follow)})
        kept.append(f)
    return kept


def _gradient_findings(figures: Sequence[LayerFigures], steps: tuple[int, int], thresholds: Thresholds,
                       first_max_grad: float | None) -> list[Finding]:
    start, end = steps
    rms = np.array([f.grad_rms for f in figures])
    usable = np.isfinite(rms) & (rms > 0)
    found, vanishing, exploding = [], [], []
    for i in range(len(figures) - 1):
        later = rms[i + 1:][usable[i + 1:]]
        if not usable[i] or not later.size:
            continue
        if rms[i] < thresholds.vanishing_ratio * later.max():
            vanishing.append((i, rms[i] / later.max()))
        if rms[i] > thresholds.exploding_ratio * later.min():
            exploding.append((i, rms[i] / later.min()))
    if vanishing:
        i, ratio = vanishing[-1]  # nearest the loss: where it begins
        found.append(Finding(
            "vanishing_gradients", end, figures[i].name,
            f"its gradient RMS is {rms[i]:.2g}, {ratio:.1g} of the largest of the layers after it over steps "
            f"{start}-{end} ({len(vanishing)} layer{'s' if len(vanishing) > 1 else ''} from the input up to "
            f"it; threshold {thresholds.vanishing_ratio:g})",
            "residual connections, normalization (LayerNorm/BatchNorm), ReLU/GELU instead of sigmoid/tanh, "
            "or He/Glorot init", since=start, values={"ratio": float(ratio)}))
    run = _amplifying_run(rms, usable, thresholds.exploding_depth_layers)
    if run is not None and rms[run[0]] >= thresholds.exploding_depth * rms[run[1]]:
        found.append(_depth_finding(figures, run, steps, thresholds))
    elif exploding:
        i, ratio = exploding[-1]
        found.append(Finding(
            "exploding_gradients", end, figures[i].name,
            f"its gradient RMS is {rms[i]:.2g}, {ratio:.2g} times the smallest of the layers after it over "
            f"steps {start}-{end} (threshold {thresholds.exploding_ratio:g})",
            "clip gradients (optax.clip_by_global_norm), a lower learning rate, or normalization",
            since=start, values={"ratio": float(ratio)}))
    elif first_max_grad and usable.any() and rms[usable].max() > thresholds.exploding_growth * first_max_grad:
        i = int(np.nanargmax(np.where(usable, rms, np.nan)))
        growth = rms[i] / first_max_grad
        found.append(Finding(
            "exploding_gradients", end, figures[i].name,
            f"the largest gradient RMS, this layer's, grew {growth:.3g} times since the first window, to "
            f"{rms[i]:.2g} over steps {start}-{end} (threshold {thresholds.exploding_growth:g} times)",
            "clip gradients (optax.clip_by_global_norm), a lower learning rate, or warmup",
            since=start, values={"growth": float(growth)}))
    return found


def _amplifying_run(rms: np.ndarray, usable: np.ndarray, min_layers: int) -> tuple[int, int] | None:
    """The ``(bottom, top)`` of the run of at least ``min_layers`` layers, each with a larger gradient
    RMS than the next, over which it grows most."""
    best, best_growth = None, 1.0
    top = len(rms) - 1
    while top > 0:
        bottom = top
        while bottom > 0 and usable[bottom] and usable[bottom - 1] and rms[bottom - 1] > rms[bottom]:
            bottom -= 1
        if top - bottom + 1 >= min_layers and rms[bottom] / rms[top] > best_growth:
            best, best_growth = (bottom, top), rms[bottom] / rms[top]
        top = bottom - 1
    return best


def _depth_finding(figures: Sequence[LayerFigures], run: tuple[int, int], steps: tuple[int, int],
                   thresholds: Thresholds) -> Finding:
    start, end = steps
    bottom, top = run
    growth = figures[bottom].grad_rms / figures[top].grad_rms
    per_layer = growth ** (1.0 / (top - bottom))
    names = [f.name for f in figures[bottom:top + 1]]
    factors = ", ".join(f"{figures[k].grad_rms / figures[k + 1].grad_rms:.3g}x into {figures[k].name!r}"
                        for k in range(top - 1, bottom - 1, -1))
    return Finding(
        "exploding_gradients", end, figures[bottom].name,
        f"its gradient RMS is {figures[bottom].grad_rms:.2g}, {growth:.3g} times that of "
        f"{figures[top].name!r} over steps {start}-{end}: it grows at each of the {top - bottom} layers "
        f"from {figures[top].name!r} down to it, about {per_layer:.3g} times per layer ({factors}; threshold "
        f"{thresholds.exploding_depth:g} times over {thresholds.exploding_depth_layers} layers)",
        "the weights amplify what passes through them: a smaller init scale (He for ReLU, Glorot for "
        "tanh: variance 2/fan_in or less), normalization (LayerNorm/BatchNorm) or residual connections; "
        "clip gradients (optax.clip_by_global_norm) meanwhile",
        since=start, values={"ratio": float(growth), "per_layer": float(per_layer), "layers": names,
                             "rule": "depth"})


def param_findings(modules: Sequence[str], sums: np.ndarray, steps_added: float, steps: tuple[int, int],
                   thresholds: Thresholds, reached: Mapping[str, bool] | None = None) -> list[Finding]:
    """Findings from each module's ``Window.params`` sums; ``reached``: whether a gradient reached
    each layer named like a module."""
    start, end = steps
    if steps_added <= 0 or not len(modules):
        return []
    table = np.asarray(sums, np.float64)
    ratio, zero, peak = table[:, 0] / steps_added, table[:, 2] / steps_added, table[:, 3]
    found = []
    frozen = [i for i in range(len(modules)) if zero[i] >= 1.0]
    if len(frozen) == len(modules):
        # Every module at once: gradient accumulation or a schedule at 0, not a mask.
        frozen = []
    for i in frozen:
        gets = (reached or {}).get(modules[i])
        why = ("" if gets is None else ", while a gradient reaches its outputs" if gets else
               ", and no gradient reaches its outputs (is it used by the loss? is a layer after it dead?)")
        found.append(Finding(
            "frozen_params", end, modules[i],
            f"its parameters did not change at any step over steps {start}-{end}{why}",
            "check the optimizer's masks (optax.masked, multi_transform, set_to_zero) and the learning "
            "rate schedule, or freeze it on purpose and ignore this", since=start,
            values={"reached": gets} if gets is not None else {}))
    moving = [i for i in range(len(modules)) if i not in frozen]
    high = sorted((i for i in moving if ratio[i] > thresholds.update_ratio_high
                   or peak[i] > thresholds.update_ratio_step), key=lambda i: -peak[i])
    if high:
        listed = _listed(modules, high, lambda i: f"{ratio[i]:.2g} (at most {peak[i]:.2g})")
        found.append(Finding(
            "update_ratio_high", end, modules[high[0]],
            f"updates too large for {len(high)} of {len(modules)} modules over steps {start}-{end}: "
            f"|update| / |params| {listed}; healthy is about 1e-3 (CS231n), the thresholds "
            f"{thresholds.update_ratio_high:g} on the mean and {thresholds.update_ratio_step:g} at one step",
            "a lower learning rate (each decade above 1e-3 is about 10x too high), warmup, or gradient "
            "clipping (optax.clip_by_global_norm)",
            since=start, values={modules[i]: float(ratio[i]) for i in high}))
    low = sorted((i for i in moving if 0 < ratio[i] < thresholds.update_ratio_low), key=lambda i: ratio[i])
    if low:
        listed = _listed(modules, low, lambda i: f"{ratio[i]:.2g}")
        found.append(Finding(
            "update_ratio_low", end, modules[low[0]],
            f"updates too small for {len(low)} of {len(modules)} modules over steps {start}-{end}: mean "
            f"|update| / |params| {listed}, below {thresholds.update_ratio_low:g} (healthy: about "
            f"1e-3, CS231n)",
            "a higher learning rate, or check the schedule and weight decay; where the gradient vanishes "
            "before these modules, that comes first", since=start,
            values={modules[i]: float(ratio[i]) for i in low}))
    return found


def _listed(modules: Sequence[str], chosen: Sequence[int], figure: Callable[[int], str]) -> str:
    listed = ", ".join(f"{modules[i]!r} {figure(i)}" for i in chosen[:4])
    return listed + (f" and {len(chosen) - 4} more" if len(chosen) > 4 else "")
