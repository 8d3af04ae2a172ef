"""The layer a spike came from, found by replaying the spike's batch and the one before it."""

from __future__ import annotations

import dataclasses
import time
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from flaxhooks.contract import Finding, Loop
from flaxhooks.diagnose import first_spiked_layer
from flaxhooks.placement import first_replica
from flaxhooks.step import RepeatedTap, StepContributor, Tapped, Taps, WithLayout


class LayerGradNorms(StepContributor):
    """A spike replay's contributor: each tapped layer's parameter-gradient norm, in call order."""

    def __init__(self, taps: Taps):
        self.taps = Taps(capture=taps.capture)  # its outputs give the call order; no gradient taps needed

    def due(self, step: int) -> bool:
        return False  # only ever replayed

    def inside_step(self, tapped: Tapped) -> WithLayout:
        modules: list[tuple[str, ...]] = []
        for tap in tapped.activations:
            if not isinstance(tap, RepeatedTap) and tap.module and tap.module not in modules:
                modules.append(tap.module)
        squares: dict[tuple[str, ...], list[jax.Array]] = {m: [] for m in modules}
        unseen: list[str] = []  # the outermost modules of parameters no tapped layer owns
        for path, grad in jax.tree_util.tree_flatten_with_path(tapped.grads)[0]:
            owner = tuple(_key(k) for k in path[:-1])
            if owner in squares:
                squares[owner].append(jnp.sum(jnp.square(grad.astype(jnp.float32))))
            elif owner and owner[0] not in unseen:
                unseen.append(owner[0])
        norms = [jnp.sqrt(sum(s)) if s else jnp.zeros(()) for s in squares.values()]
        layout = (tuple("/".join(m) for m in modules), tuple(unseen))
        return WithLayout(jnp.stack(norms) if norms else jnp.zeros(0), layout)

    def take(self, loop: Any, result: Any) -> None:  # replays hand results back directly
        pass


def _key(entry: Any) -> str:
    return str(getattr(entry, "key", getattr(entry, "name", getattr(entry, "idx", entry))))


class Source(NamedTuple):
    """Where a spike came from: words for its evidence, values, and the layer (or None)."""

    text: str
    values: dict[str, Any]
    layer: str | None = None

    def added_to(self, finding: Finding) -> Finding:
        """``finding`` with this source in its evidence, values and layer."""
        return dataclasses.replace(finding, evidence=f"{finding.evidence}; {self.text}",
                                   layer=self.layer or finding.layer,
                                   values={**finding.values, **self.values})


def spike_source(loop: Loop, step: int, batches: dict[int, Any], taps: Taps, factor: float) -> Source:
    """The first layer, in call order, whose gradient norm is ``factor`` times larger at ``step``."""
    spiked, before = batches.get(step), batches.get(step - 1)
    replay = getattr(loop, "replay", None)
    if replay is None:
        return Source("the layer is not named: this loop cannot replay a step", {"layer_source": None})
    if spiked is None or before is None:
        held = "step" if spiked is None else "step before it"
        why = (f"the layer is not named: the batch of the {held} was no longer held (only the batches of "
               "steps whose loss was not yet read are)")
        return Source(why, {"layer_source": None})
    started = time.perf_counter()
    contributor = LayerGradNorms(taps)
    (hit,) = replay(spiked, (contributor,))
    (base,) = replay(before, (contributor,))
    layers, unseen = list(hit.layout[0]), list(hit.layout[1])
    layer, ratios = first_spiked_layer(layers, np.asarray(first_replica(hit.values), np.float64).tolist(),
                                       np.asarray(first_replica(base.values), np.float64).tolist(), factor)
    seconds = time.perf_counter() - started
    at = f"at the parameters after step {loop.step} (step {step} ran from those after step {step - 1})"
    how = f"replaying the batches of steps {step - 1} and {step} {at}, in {seconds:.1f} s"
    if unseen:  # their gradients were not compared: a spike may have begun in them
        how += (f"; not compared: the parameters of {', '.join(repr(u) for u in unseen[:3])}"
                f"{', ...' if len(unseen) > 3 else ''}, in no layer Diagnose taps")
    values = {"layer_source": layer, "layer_ratios": dict(zip(layers, ratios, strict=True)),
              "replayed_at": loop.step, "not_compared": unseen}
    if layer is None:
        largest = max(range(len(ratios)), key=ratios.__getitem__) if ratios else None
        most = f" (the most, {layers[largest]!r}, {ratios[largest]:.3g}x)" if largest is not None else ""
        return Source(f"no layer's gradient norm was {factor:g}x that on the batch before{most}, "
                     f"{how}", values)
    ratio = ratios[layers.index(layer)]
    text = (f"the first layer, in call order, whose gradient spiked is {layer!r}: its gradient norm is "
            f"{ratio:.3g}x that on the batch before ({how})")
    return Source(text, values, layer)
