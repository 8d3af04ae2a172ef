"""What ``Diagnose`` sees of a Transformer: per attention head the largest logit and the
entropy, sown into :data:`ATTENTION` in an instrumented step (:func:`record_attention`,
:func:`attention_interceptor`), and the output logits' ``log Z``."""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.nnx import variablelib

from flaxhooks.contract import Finding
from flaxhooks.diagnose._instep import _groups, _sum_rows, chosen_rows

#: The collection (Linen) and variable type name (NNX) attention statistics are sown into.
ATTENTION = "attention_stats"
#: The name each statistic is sown under in its module.
SOWN_NAME = "attention_logit_stats"  # a name no submodule takes

#: A head's statistics (:func:`logit_stats`): the largest ``|logit|``, the sum of entropy over
#: ``log(valid keys)`` over queries with two valid keys or more, and how many such queries.
HEAD_COLUMNS: tuple[str, ...] = ("max_abs_logit", "entropy_sum", "queries")
#: Which head columns add up over steps by their maximum (the rest by their sum).
HEAD_MAXED: tuple[bool, ...] = (True, False, False)
#: The sums of the output's ``log Z`` over its positions (:func:`log_z_stats`).
LOG_Z_COLUMNS: tuple[str, ...] = ("positions", "sum", "sum_abs", "max_abs")
LOG_Z_MAXED: tuple[bool, ...] = (False, False, False, True)


class AttentionStats(nnx.Intermediate):
    """The NNX variable type attention statistics are sown as (collection :data:`ATTENTION`)."""


variablelib.register_variable_name(ATTENTION, AttentionStats, overwrite=True)


#: The most logits of an attention layer whose entropies a step computes (a larger
#: layer's at evenly spaced queries, :func:`entropy_queries`); its largest logit is over all.
MAX_ENTROPY_LOGITS = 4096


def entropy_queries(logits: jax.Array, valid: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The logits ``[examples, heads, queries, keys]`` (and validity) whose entropies a step computes:
    all within :data:`MAX_ENTROPY_LOGITS`, else the rows :func:`chosen_rows` picks."""
    examples, heads, queries, keys = logits.shape
    rows = chosen_rows(examples, queries, heads * keys, MAX_ENTROPY_LOGITS)
    if len(rows) == examples * queries:
        return logits, valid
    picked = rows.reshape(-1, len(rows) // len(np.unique(rows // queries)))
    spacing = examples // picked.shape[0]
    if spacing > 1:  # evenly spaced examples, as many in each group (on one device each)
        groups = _groups(examples)
        logits, valid = (x.reshape(groups, examples // groups, *x.shape[1:])[:, ::spacing]
                         .reshape(-1, *x.shape[1:]) for x in (logits, valid))
    index = jnp.asarray((picked % queries)[:, None, :, None], jnp.int32)
    return jnp.take_along_axis(logits, index, axis=2), jnp.take_along_axis(valid, index, axis=2)


def logit_stats(logits: jax.Array, mask: jax.Array | None = None) -> jax.Array:
    """Per head, float32 ``[heads, len(HEAD_COLUMNS)]``, of logits ``[batch..., heads, queries, keys]``
    where ``mask`` (broadcastable, True: valid) allows; entropy is over ``log(valid keys)``."""
    # Nothing to differentiate (and the variadic reduction has no derivative rule).
    logits = jax.lax.stop_gradient(logits).astype(jnp.float32)
    heads = logits.shape[-3]
    valid = (jnp.ones(logits.shape, jnp.bool_) if mask is None
             else jnp.broadcast_to(jnp.asarray(mask).astype(jnp.bool_), logits.shape))
    valid = valid.reshape(-1, *logits.shape[-3:])
    logits = logits.reshape(valid.shape)
    # The largest logit over every query (0 for a head with no valid key), entropy at the chosen ones.
    largest = jnp.max(jnp.where(valid, jnp.abs(logits), 0.0), axis=(0, 2, 3))
    logits, valid = entropy_queries(logits, valid)
    top = jnp.max(jnp.where(valid, logits, -jnp.inf), axis=-1)  # [examples, heads, q]
    shifted = jnp.where(valid, logits - jnp.where(jnp.isfinite(top), top, 0.0)[..., None], 0.0)
    weights = jnp.where(valid, jnp.exp(shifted), 0.0)
    # One variadic reduction, nothing stacked: XLA on CPU writes a stack out before summing it.
    keys, total, weighted = _sum_rows([valid.astype(jnp.float32), weights, weights * shifted], axis=-1)
    # H = log Z - E[l - top], over valid keys; 0 for a row of one key.
    safe = jnp.maximum(total, 1e-30)
    counted = keys >= 2
    normalized = jnp.where(counted, (jnp.log(safe) - weighted / safe) / jnp.log(jnp.maximum(keys, 2.0)), 0.0)
    entropy, queries = jnp.sum(normalized, axis=(0, 2)), jnp.sum(counted.astype(jnp.float32), axis=(0, 2))
    return jnp.stack([largest, entropy, queries], axis=1).reshape(heads, len(HEAD_COLUMNS))


def attention_logits(query: jax.Array, key: jax.Array, bias: jax.Array | None = None,
                     dtype: Any = None) -> jax.Array:
    """The logits ``[batch..., heads, queries, keys]`` as Flax's ``dot_product_attention_weights``
    computes them; keys with fewer heads (grouped-query attention) serve consecutive query heads."""
    dtype = dtype or jnp.result_type(query, key)
    query, key = query.astype(dtype), key.astype(dtype)
    if key.shape[-2] != query.shape[-2]:
        key = jnp.repeat(key, query.shape[-2] // key.shape[-2], axis=-2)
    query = query / jnp.sqrt(query.shape[-1]).astype(dtype)
    logits = jnp.einsum("...qhd,...khd->...hqk", query, key)
    return logits if bias is None else logits + bias


def recording(module: Any) -> bool:
    """Whether ``module`` runs in a step that collects attention statistics."""
    if isinstance(module, nn.Module):
        return (module.scope is not None and not module.is_initializing()
                and module.is_mutable_collection(ATTENTION))
    # nnx.capture sets __captures__ for its call; the step's capture asks for AttentionStats.
    return isinstance(module, nnx.Module) and any(
        type(var) is AttentionStats for var in getattr(module, "__captures__", ()))


def record_attention(module: Any, logits: jax.Array, mask: jax.Array | None = None) -> None:
    """Hands a model's own attention to :class:`flaxhooks.Diagnose`; nothing outside its sampled steps.

    Args:
        module: the calling Linen or NNX module (``self``).
        logits: the pre-softmax logits ``[batch..., heads, queries, keys]`` (scaled, any bias
            added, before the mask).
        mask: broadcastable to them, True where a query may see a key; None: all.

    Examples:
        >>> import flax.linen as nn, jax, jax.numpy as jnp
        >>> class Attention(nn.Module):
        ...     @nn.compact
        ...     def __call__(self, q, k):
        ...         logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(q.shape[-1])
        ...         record_attention(self, logits)
        ...         return jax.nn.softmax(logits)
        >>> x = jnp.ones((1, 3, 2, 4))
        >>> _, sown = Attention().apply({}, x, x, mutable=[ATTENTION])
        >>> sown[ATTENTION][SOWN_NAME][0].shape  # heads, statistics
        (2, 3)
    """
    if recording(module):
        collection = ATTENTION if isinstance(module, nn.Module) else AttentionStats
        module.sow(collection, SOWN_NAME, logit_stats(logits, mask))


def recorded_attention_fn(attention_fn: Callable[..., Any], module: Any) -> Callable[..., Any]:
    """``attention_fn`` recording its logits on ``module`` first; ``functools.wraps`` keeps the
    signature, by which Linen picks the keyword arguments it passes."""
    if getattr(attention_fn, "_flaxhooks_records", False):
        return attention_fn

    @functools.wraps(attention_fn)
    def recorded(query: jax.Array, key: jax.Array, value: jax.Array, *args: Any, **kwargs: Any) -> Any:
        bias = args[0] if args else kwargs.get("bias")
        mask = args[1] if len(args) > 1 else kwargs.get("mask")
        if kwargs.get("is_causal", False):
            causal = jnp.tril(jnp.ones((query.shape[-3], key.shape[-3]), jnp.bool_))
            mask = causal if mask is None else jnp.logical_and(jnp.asarray(mask).astype(jnp.bool_), causal)
        record_attention(module, attention_logits(query, key, bias, kwargs.get("dtype")), mask)
        return attention_fn(query, key, value, *args, **kwargs)

    recorded._flaxhooks_records = True  # type: ignore[attr-defined]
    return recorded


#: Flax's attention modules whose ``attention_fn`` :func:`attention_interceptor` wraps.
ATTENTION_MODULES: tuple[type, ...] = (nn.MultiHeadDotProductAttention, nnx.MultiHeadAttention)


def attention_interceptor(next_fun: Callable[..., Any], args: Any, kwargs: Any, context: Any) -> Any:
    """A ``flax.linen.intercept_methods`` interceptor (NNX's adapter calls it alike) wrapping the
    ``attention_fn`` of :data:`ATTENTION_MODULES` for the call (:func:`recorded_attention_fn`)."""
    module = context.module
    ours = context.method_name == "__call__" and isinstance(module, ATTENTION_MODULES)
    if not ours or not recording(module):
        return next_fun(*args, **kwargs)
    original = module.__dict__.get("attention_fn", getattr(module, "attention_fn", None))
    if original is None or getattr(original, "_flaxhooks_records", False):
        return next_fun(*args, **kwargs)
    # Linen modules are frozen dataclasses: the field is set for this call only.
    object.__setattr__(module, "attention_fn", recorded_attention_fn(original, module))
    try:
        return next_fun(*args, **kwargs)
    finally:
        object.__setattr__(module, "attention_fn", original)


def log_z_stats(logits: jax.Array) -> jax.Array:
    """Sums over the positions of ``log Z = logsumexp(logits, -1)``, float32 ``[len(LOG_Z_COLUMNS)]``."""
    log_z = jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1).reshape(-1)
    return jnp.stack([jnp.asarray(log_z.size, jnp.float32), log_z.sum(), jnp.abs(log_z).sum(),
                      jnp.max(jnp.abs(log_z))])


def output_logits(outputs: Any, batch: Mapping[str, Any], label_key: str | None) -> jax.Array | None:
    """The outputs if they are a sequence model's token logits ``[batch, positions..., vocabulary]``
    labelled by an integer batch array (``label_key``'s, else any); a classifier's are not."""
    if (not isinstance(outputs, jax.Array) or outputs.ndim < 3 or outputs.shape[-1] < 2
            or not jnp.issubdtype(outputs.dtype, jnp.floating)):
        return None
    keys = [label_key] if label_key is not None and label_key in batch else list(batch)
    labels = [batch.get(name) for name in keys]
    return outputs if any(isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jnp.integer)
                          and x.shape == outputs.shape[:-1] for x in labels) else None


def attention_layers(taps: Sequence[Any]) -> list[tuple[str, jax.Array]]:
    """``(layer, per-head statistics)`` of the :data:`ATTENTION` taps, by module path (or tap name)."""
    found = [t for t in taps if t.collection == ATTENTION and t.value.ndim == 2
             and t.value.shape[-1] == len(HEAD_COLUMNS)]
    paths = ["/".join(t.module) or "model" for t in found]
    return [(path if paths.count(path) == 1 else t.name, t.value)
            for path, t in zip(paths, found, strict=True)]


@dataclasses.dataclass(frozen=True)
class AttentionThresholds:
    """When a Transformer's figures become a finding; docs/guides/diagnose.md gives the evidence.

    Attributes:
        max_logit: an attention layer's largest ``|logit|`` above this.
        logit_growth: its largest ``|logit|`` grown this many times since its first window ...
        growth_floor: ... and at least this.
        entropy_floor: an attention layer's mean entropy over ``log(keys)`` below this (0: one-hot) ...
        entropy_drop: ... and below this share of its first window's (or below the floor from it on).
        log_z: the mean ``|log Z|`` of the output logits above this.
    """

    max_logit: float = 50.0
    logit_growth: float = 10.0
    growth_floor: float = 20.0
    entropy_floor: float = 0.05
    entropy_drop: float = 0.25
    log_z: float = 25.0


@dataclasses.dataclass(frozen=True)
class AttentionFigures:
    """One attention layer's figures over a window (host floats, per head)."""

    name: str
    max_logit: tuple[float, ...]  # per head: the largest |logit|
    entropy: tuple[float, ...]  # per head: the mean entropy over log(valid keys) (NaN: no query)

    @property
    def layer_max_logit(self) -> float:
        return max(self.max_logit, default=0.0)

    @property
    def layer_entropy(self) -> float:
        finite = [e for e in self.entropy if np.isfinite(e)]
        return float(np.mean(finite)) if finite else math.nan


def attention_figures(layers: Sequence[tuple[str, int]], table: Any) -> list[AttentionFigures]:
    """Each attention layer's figures from the window's per-head sums ``[heads, len(HEAD_COLUMNS)]``."""
    table = np.asarray(table, np.float64).reshape(-1, len(HEAD_COLUMNS))
    figures, start = [], 0
    for name, heads in layers:
        rows = table[start:start + heads]
        start += heads
        with np.errstate(invalid="ignore", divide="ignore"):
            entropy = np.where(rows[:, 2] > 0, rows[:, 1] / rows[:, 2], np.nan)
        figures.append(AttentionFigures(name, tuple(rows[:, 0].tolist()), tuple(entropy.tolist())))
    return figures


def _heads(values: Sequence[float], chosen: Sequence[int]) -> str:
    return ", ".join(f"head {h}: {values[h]:.3g}" for h in chosen)


def attention_findings(figures: Sequence[AttentionFigures], first: Mapping[str, AttentionFigures],
                       steps: tuple[int, int], thresholds: AttentionThresholds) -> list[Finding]:
    """Attention logit growth and entropy collapse, per layer."""
    start, end = steps
    found = []
    for f in figures:
        base = first.get(f.name, f)
        top, was = f.layer_max_logit, base.layer_max_logit
        grown = was > 0 and top >= thresholds.logit_growth * was and top >= thresholds.growth_floor
        if np.isfinite(top) and (top > thresholds.max_logit or grown):
            worst = sorted(range(len(f.max_logit)), key=lambda h: -f.max_logit[h])[:3]
            found.append(Finding(
                "attention_logits", end, f.name,
                f"the largest pre-softmax attention logit is {top:.3g} ({_heads(f.max_logit, worst)}; "
                f"{was:.3g} in the first window), over {thresholds.max_logit:g} or grown "
                f"{thresholds.logit_growth:g}x: the softmax saturates and its gradients vanish",
                "normalize queries and keys (QK-norm: `normalize_qk=True` in Flax's attention), "
                "soft-cap the logits (`cap * tanh(logits / cap)`, cap about 50), or lower the learning rate "
                "or lengthen its warmup",
                since=start, values={"max_logit": top, "first_max_logit": was,
                                     "per_head": list(f.max_logit)}))
        entropy, was_entropy = f.layer_entropy, base.layer_entropy
        # Random weights attend broadly: one-hot from the start is a collapse too.
        fallen = entropy < thresholds.entropy_drop * was_entropy or was_entropy < thresholds.entropy_floor
        collapsed = np.isfinite(entropy) and np.isfinite(was_entropy) and entropy < thresholds.entropy_floor
        if collapsed and fallen:
            low = [h for h in range(len(f.entropy)) if np.isfinite(f.entropy[h])]
            low = sorted(low, key=lambda h: f.entropy[h])[:3]
            found.append(Finding(
                "attention_entropy", end, f.name,
                f"its attention has collapsed to near one-hot: mean entropy {entropy:.3g} of the uniform's "
                f"({_heads(f.entropy, low)}), {was_entropy:.3g} in the first window",
                "normalize queries and keys (QK-norm: `normalize_qk=True`), or lower the learning rate or "
                "lengthen its warmup (entropy collapse, Zhai et al. 2023)",
                since=start, values={"entropy": entropy, "first_entropy": was_entropy,
                                     "per_head": list(f.entropy)}))
    return found


def log_z_figures(sums: Any) -> dict[str, float]:
    """The window's mean and mean absolute ``log Z`` and its largest ``|log Z|``."""
    positions, total, total_abs, max_abs = (float(v) for v in np.asarray(sums, np.float64))
    if positions <= 0:
        return {}
    return {"mean": total / positions, "mean_abs": total_abs / positions, "max_abs": max_abs}


def log_z_findings(figures: Mapping[str, float], first: Mapping[str, float] | None, steps: tuple[int, int],
                   thresholds: AttentionThresholds) -> list[Finding]:
    """The output logits' normalizer drifting far from 0."""
    if not figures or not np.isfinite(figures["mean_abs"]) or figures["mean_abs"] <= thresholds.log_z:
        return []
    was = (first or figures)["mean"]
    return [Finding(
        "output_logit_drift", steps[1], None,
        "the output softmax's normalizer has drifted: mean log Z = logsumexp(logits) is "
        f"{figures['mean']:.3g} (mean |log Z| {figures['mean_abs']:.3g}, at most {figures['max_abs']:.3g}; "
        f"{was:.3g} in the first window), over {thresholds.log_z:g}: the loss cannot see it, but large "
        "logits lose precision",
        "add PaLM's z-loss, 1e-4 * log(Z)**2 averaged over positions (`optax.losses."
        "softmax_cross_entropy_with_integer_labels` plus that term), or lower the learning rate",
        since=steps[0], values={**figures, "first_mean": was})]
