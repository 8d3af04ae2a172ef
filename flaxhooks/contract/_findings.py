"""What a diagnosis found: one problem with training, with the layer, the evidence and what to try."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

#: The kinds of finding, in the order a report lists them: the worst first.
KINDS: tuple[str, ...] = (
    "nonfinite", "not_learning", "exploding_gradients", "attention_logits", "output_logit_drift",
    "dead_units", "unused_layer", "dormant_units", "saturation", "attention_entropy", "vanishing_gradients",
    "update_ratio_high", "update_ratio_low", "frozen_params", "loss_spike", "grad_norm_spike",
    "loss_plateau", "initial_loss", "dropout_in_eval", "rng_streams",
)


@dataclasses.dataclass(frozen=True)
class Finding:
    """One problem a diagnosis found (the payload of the ``finding`` event).

    Attributes:
        kind: what is wrong, one of :data:`KINDS` (``"dead_units"``, ...).
        step: the step at which it was found.
        layer: the layer's path (``"encoder/layers_3/mlp"``), or None for the whole model.
        since: the first step the evidence covers, or None.
        values: the numbers behind the evidence, by name.
        brief: the evidence in a few words, for a finding said in full elsewhere (a table shows it).

    Examples:
        >>> from flaxhooks import Finding
        >>> Finding("dead_units", 340, "Dense_1", "41% of its units never fired",
        ...         "try a lower learning rate", since=120).message()
        "step 340: 'Dense_1': 41% of its units never fired (since step 120). Try: try a lower learning rate"
    """

    kind: str
    step: int
    layer: str | None
    evidence: str
    advice: str
    since: int | None = None
    values: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    brief: str | None = None

    @property
    def key(self) -> tuple[str, str | None]:
        """What identifies the problem: a finding with the same key is the same problem."""
        return self.kind, self.layer

    def message(self) -> str:
        """The finding as a person reads it, on one line."""
        where = f"{self.layer!r}: " if self.layer else ""
        since = f" (since step {self.since})" if self.since is not None and self.since != self.step else ""
        return f"step {self.step}: {where}{self.evidence}{since}. Try: {self.advice}"
