"""What ``Diagnose`` sees of a Transformer: per attention head, the largest
pre-softmax logit and the entropy of the attention distributions, and, of
the model's output logits, the softmax normalizer ``log Z``.

Attention statistics are sown, reduced per head, into the :data:`ATTENTION`
collection while an instrumented step runs: by :func:`record_attention`,
which a model's own attention calls with its logits, and by
:func:`attention_interceptor`, which wraps the ``attention_fn`` of Flax's
``nn.MultiHeadDotProductAttention`` (Linen) and ``nnx.MultiHeadAttention``
(NNX) for the duration of the call. Outside an instrumented step both do nothing.
"""

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
from flaxhooks.diagnose._instep import _groups, chosen_rows

#: The collection (Linen) and variable type name (NNX) attention statistics are sown into.
ATTENTION = "attention_stats"
#: The name each statistic is sown under in its module.
SOWN_NAME = "attention_logit_stats"  # a name no submodule takes

#: The columns of a head's statistics (:func:`logit_stats`): the largest
#: ``|logit|`` over valid keys, the sum over queries of the attention's
#: entropy divided by ``log(valid keys)``, and how many queries (with at
#: least two valid keys) that sum is over.
HEAD_COLUMNS: tuple[str, ...] = ("max_abs_logit", "entropy_sum", "queries")
#: Which head columns add up over steps by their maximum (the rest by their sum).
HEAD_MAXED: tuple[bool, ...] = (True, False, False)
#: The sums of the output's ``log Z`` over its positions (:func:`log_z_stats`).
LOG_Z_COLUMNS: tuple[str, ...] = ("positions", "sum", "sum_abs", "max_abs")
LOG_Z_MAXED: tuple[bool, ...] = (False, False, False, True)


class AttentionStats(nnx.Intermediate):
    """The NNX variable type attention statistics are sown as (collection :data:`ATTENTION`)."""


variablelib.register_variable_name(ATTENTION, AttentionStats, overwrite=True)


# -- in the step -----------------------------------------------------------------------------------

def _valid(logits: jax.Array, mask: jax.Array | None) -> jax.Array:
    if mask is None:
        return jnp.ones(logits.shape, jnp.bool_)
    return jnp.broadcast_to(jnp.asarray(mask).astype(jnp.bool_), logits.shape)


#: The most logits of an attention layer whose entropies a step computes:
#: a larger layer's are computed at evenly spaced queries (chosen as a layer's
#: rows are, :func:`~flaxhooks.diagnose.chosen_rows`), its largest logit over
#: all of them. Entropy is a mean, added up over the window's steps.
MAX_ENTROPY_LOGITS = 4096


def entropy_queries(logits: jax.Array, valid: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The queries ``[examples, heads, queries, keys]`` logits (and their
    validity) whose entropies a step computes: all of them within
    :data:`MAX_ENTROPY_LOGITS`, else the rows :func:`chosen_rows` picks of
    ``examples x queries`` rows of ``heads x keys`` logits, gathered where each
    device's share of the batch lives.

    Examples:
        >>> import jax.numpy as jnp
        >>> logits = jnp.arange(64 * 4 * 11 * 11, dtype=jnp.float32).reshape(64, 4, 11, 11)
        >>> entropy_queries(logits, logits > 0)[0].shape  # one query of each example
        (64, 4, 1, 11)
    """
    examples, heads, queries, keys = logits.shape
    rows = chosen_rows(examples, queries, heads * keys, MAX_ENTROPY_LOGITS)
    if len(rows) == examples * queries:
        return logits, valid
    picked = rows.reshape(-1, len(rows) // len(np.unique(rows // queries)))
    spacing = examples // picked.shape[0]
    if spacing > 1:  # evenly spaced examples, as many in each group (on one device each)
        groups = _groups(examples)

        def spaced(x: jax.Array) -> jax.Array:
            return x.reshape(groups, examples // groups, *x.shape[1:])[:, ::spacing].reshape(-1, *x.shape[1:])

        logits, valid = spaced(logits), spaced(valid)
    index = jnp.asarray((picked % queries)[:, None, :, None], jnp.int32)
    return jnp.take_along_axis(logits, index, axis=2), jnp.take_along_axis(valid, index, axis=2)


def logit_stats(logits: jax.Array, mask: jax.Array | None = None) -> jax.Array:
    """Per head, float32 ``[heads, len(HEAD_COLUMNS)]``, of pre-softmax
    attention logits ``[batch..., heads, queries, keys]`` where ``mask``
    (broadcastable to them, True: valid) allows.

    The entropy of each query's distribution over its valid keys is divided
    by ``log(valid keys)`` (1: uniform, 0: one-hot); queries with fewer than
    two valid keys (the first of a causal mask) are left out.

    Examples:
        >>> import jax.numpy as jnp
        >>> logits = jnp.array([[[[0.0, 9.0], [1.0, 1.0]]]])  # one head, two queries
        >>> causal = jnp.tril(jnp.ones((2, 2), bool))  # 9.0 is masked out
        >>> [round(float(v), 3) for v in logit_stats(logits, causal)[0]]  # the 2nd query is uniform
        [1.0, 1.0, 1.0]
    """
    # Statistics, not part of the loss: nothing to differentiate (and the
    # variadic reduction below has no derivative rule).
    logits = jax.lax.stop_gradient(logits).astype(jnp.float32)
    heads = logits.shape[-3]
    valid = _valid(logits, mask).reshape(-1, *logits.shape[-3:])
    return _head_stats(logits.reshape(valid.shape), valid, heads)


def _head_stats(logits: jax.Array, valid: jax.Array, heads: int) -> jax.Array:
    # One pass per reduction and nothing stacked: on CPU XLA writes a stack of
    # features out before summing it (1.9 ms of op time a step on the
    # Transformer benchmark's 2 devices), where a variadic reduction keeps every sum.
    # The largest logit over every query (0 for a head with no valid key), entropy at some.
    largest = jnp.max(jnp.where(valid, jnp.abs(logits), 0.0), axis=(0, 2, 3))
    logits, valid = entropy_queries(logits, valid)
    top = jnp.max(jnp.where(valid, logits, -jnp.inf), axis=-1)  # [examples, heads, q]
    shifted = jnp.where(valid, logits - jnp.where(jnp.isfinite(top), top, 0.0)[..., None], 0.0)
    weights = jnp.where(valid, jnp.exp(shifted), 0.0)
    keys, total, weighted = jax.lax.reduce(
        (valid.astype(jnp.float32), weights, weights * shifted), (jnp.float32(0),) * 3,
        lambda a, b: tuple(x + y for x, y in zip(a, b, strict=True)), (logits.ndim - 1,))
    # H = log Z - E[l - top], over valid keys; 0 for a row of one key.
    safe = jnp.maximum(total, 1e-30)
    counted = keys >= 2
    normalized = jnp.where(counted, (jnp.log(safe) - weighted / safe) / jnp.log(jnp.maximum(keys, 2.0)), 0.0)
    entropy, queries = jnp.sum(normalized, axis=(0, 2)), jnp.sum(counted.astype(jnp.float32), axis=(0, 2))
    return jnp.stack([largest, entropy, queries], axis=1).reshape(heads, len(HEAD_COLUMNS))


def attention_logits(query: jax.Array, key: jax.Array, bias: jax.Array | None = None,
                     dtype: Any = None) -> jax.Array:
    """The pre-softmax logits ``[batch..., heads, queries, keys]`` as Flax's
    ``dot_product_attention_weights`` computes them: ``query / sqrt(depth)``
    dotted with ``key`` (in their promoted dtype), plus ``bias``. Keys with
    fewer heads than queries (grouped-query attention) serve consecutive query heads."""
    dtype = dtype or jnp.result_type(query, key)
    query, key = query.astype(dtype), key.astype(dtype)
    if key.shape[-2] != query.shape[-2]:
        key = jnp.repeat(key, query.shape[-2] // key.shape[-2], axis=-2)
    query = query / jnp.sqrt(query.shape[-1]).astype(dtype)
    logits = jnp.einsum("...qhd,...khd->...hqk", query, key)
    return logits if bias is None else logits + bias


# -- recording ---------------------------------------------------------------------------------------

def _linen_recording(module: nn.Module) -> bool:
    return (module.scope is not None and not module.is_initializing()
            and module.is_mutable_collection(ATTENTION))


def _nnx_recording(module: nnx.Module) -> bool:
    # nnx.capture sets __captures__ for its call; the step's capture asks for AttentionStats.
    return any(type(var) is AttentionStats for var in getattr(module, "__captures__", ()))


def recording(module: Any) -> bool:
    """Whether ``module`` runs in a step that collects attention statistics
    (a Linen module's :data:`ATTENTION` collection is mutable, an NNX module
    runs under an ``nnx.capture`` of :class:`AttentionStats`)."""
    if isinstance(module, nn.Module):
        return _linen_recording(module)
    return isinstance(module, nnx.Module) and _nnx_recording(module)


def record_attention(module: Any, logits: jax.Array, mask: jax.Array | None = None) -> None:
    """Hands a model's own attention to :class:`flaxhooks.Diagnose`: call it
    from the attention module with its pre-softmax logits
    ``[batch..., heads, queries, keys]`` (scaled, any bias added, before the
    mask) and the mask (broadcastable to them, True where a query may see a
    key). It sows the logits' per-head statistics (:func:`logit_stats`) when
    an instrumented step asks for them, and does nothing otherwise (nothing is
    computed in a lean step, at ``init`` or outside the Trainer).

    Args:
        module: the calling module (``self``): a Linen or NNX module.
        logits: the pre-softmax attention logits.
        mask: which keys each query may see, or None (all).

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
    if not recording(module):
        return
    stats = logit_stats(logits, mask)
    if isinstance(module, nn.Module):
        module.sow(ATTENTION, SOWN_NAME, stats)
    else:
        module.sow(AttentionStats, SOWN_NAME, stats)


def _combined_mask(mask: Any, is_causal: bool, queries: int, keys: int) -> Any:
    if not is_causal:
        return mask
    causal = jnp.tril(jnp.ones((queries, keys), jnp.bool_))
    return causal if mask is None else jnp.logical_and(jnp.asarray(mask).astype(jnp.bool_), causal)


def recorded_attention_fn(attention_fn: Callable[..., Any], module: Any) -> Callable[..., Any]:
    """``attention_fn`` that first records its logits' statistics on ``module``
    (:func:`record_attention`), then runs unchanged. It keeps the original's
    signature (``functools.wraps``), by which Linen's attention picks the
    keyword arguments it passes."""
    if getattr(attention_fn, "_flaxhooks_records", False):
        return attention_fn

    @functools.wraps(attention_fn)
    def recorded(query: jax.Array, key: jax.Array, value: jax.Array, *args: Any, **kwargs: Any) -> Any:
        bias = args[0] if args else kwargs.get("bias")
        mask = args[1] if len(args) > 1 else kwargs.get("mask")
        mask = _combined_mask(mask, bool(kwargs.get("is_causal", False)), query.shape[-3], key.shape[-3])
        record_attention(module, attention_logits(query, key, bias, kwargs.get("dtype")), mask)
        return attention_fn(query, key, value, *args, **kwargs)

    recorded._flaxhooks_records = True  # type: ignore[attr-defined]
    return recorded


#: Flax's attention modules whose ``attention_fn`` :func:`attention_interceptor` wraps.
ATTENTION_MODULES: tuple[type, ...] = (nn.MultiHeadDotProductAttention, nnx.MultiHeadAttention)


def attention_interceptor(next_fun: Callable[..., Any], args: Any, kwargs: Any, context: Any) -> Any:
    """A method interceptor (``flax.linen.intercept_methods``'s form; the NNX
    adapter calls it alike) that records the attention of Flax's attention
    modules: their ``attention_fn`` is wrapped by :func:`recorded_attention_fn`
    for the call, then put back. Other calls run unchanged."""
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
    """Sums over every position of ``log Z = logsumexp(logits, -1)``, float32
    ``[len(LOG_Z_COLUMNS)]``: positions, sum, sum of ``|log Z|``, largest ``|log Z|``.

    Examples:
        >>> import jax.numpy as jnp
        >>> [round(float(v), 3) for v in log_z_stats(jnp.zeros((2, 4)))]
        [2.0, 2.773, 2.773, 1.386]
    """
    log_z = jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1).reshape(-1)
    return jnp.stack([jnp.asarray(log_z.size, jnp.float32), log_z.sum(), jnp.abs(log_z).sum(),
                      jnp.max(jnp.abs(log_z))])


def output_logits(outputs: Any, batch: Mapping[str, Any], label_key: str | None) -> jax.Array | None:
    """The model's output when it is a sequence model's token logits: a
    floating array ``[batch, positions..., vocabulary]`` (at least 2) whose
    leading shape an integer batch array (``label_key``'s, else any) labels,
    else None. A classifier's ``[batch, classes]`` is left out: confident
    classifiers grow their logits, and z-loss is a language model's remedy."""
    if not isinstance(outputs, jax.Array) or outputs.ndim < 3 or outputs.shape[-1] < 2:
        return None
    if not jnp.issubdtype(outputs.dtype, jnp.floating):
        return None
    keys = [label_key] if label_key is not None and label_key in batch else list(batch)
    for name in keys:
        labels = batch.get(name)
        if isinstance(labels, jax.Array) and jnp.issubdtype(labels.dtype, jnp.integer) \
                and labels.shape == outputs.shape[:-1]:
            return outputs
    return None


def attention_layers(taps: Sequence[Any]) -> list[tuple[str, jax.Array]]:
    """``(layer, per-head statistics)`` of the :data:`ATTENTION` taps: a layer
    by its module's path (its tap's name where a module recorded several)."""
    found = [t for t in taps if t.collection == ATTENTION and t.value.ndim == 2
             and t.value.shape[-1] == len(HEAD_COLUMNS)]
    paths = ["/".join(t.module) or "model" for t in found]
    return [(path if paths.count(path) == 1 else t.name, t.value)
            for path, t in zip(paths, found, strict=True)]


# -- on the host -------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class AttentionThresholds:
    """When a Transformer's figures become a finding; docs/guides/diagnose.md gives the evidence.

    Attributes:
        max_logit: an attention layer's largest ``|logit|`` above this
            (MaxText and Kimi K2 cap or clip them around 50 to 100).
        logit_growth: its largest ``|logit|`` grown this many times since its
            first window, and at least ``growth_floor``.
        growth_floor: the least ``|logit|`` that growth alone reports.
        entropy_floor: an attention layer's mean entropy over ``log(keys)``
            below this (0: one-hot) ...
        entropy_drop: ... and below this share of its first window's (or
            below the floor from the first window on).
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
    """Each attention layer's figures from the window's per-head sums
    ``[heads in all, len(HEAD_COLUMNS)]``."""
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
                                     "per_head": list(f.max_logit)},
            ))
        entropy, was_entropy = f.layer_entropy, base.layer_entropy
        # Fallen well below its first window's, or one-hot from the start (random weights attend broadly).
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
                                     "per_head": list(f.entropy)},
            ))
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
        f"{figures['mean']:.3g} "
        f"(mean |log Z| {figures['mean_abs']:.3g}, at most {figures['max_abs']:.3g}; {was:.3g} in the first "
        f"window), over {thresholds.log_z:g}: the loss cannot see it, but large logits lose precision",
        "add PaLM's z-loss, 1e-4 * log(Z)**2 averaged over positions (`optax.losses."
        "softmax_cross_entropy_with_integer_labels` plus that term), or lower the learning rate",
        since=steps[0], values={**figures, "first_mean": was},
    )]
