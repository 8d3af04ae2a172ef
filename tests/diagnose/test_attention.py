"""Diagnose's Transformer findings: attention logit growth, attention entropy
collapse and output log Z drift, each shown by a Transformer broken on
purpose and absent from healthy runs; the in-step statistics checked
against numpy float64 from the same queries, keys and mask."""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import flaxhooks
from flaxhooks.diagnose import (
    ATTENTION,
    SOWN_NAME,
    AttentionStats,
    attention_interceptor,
    logit_stats,
    record_attention,
)
from flaxhooks.step._nnx import _intercepted

VOCAB, LENGTH, WIDTH, HEADS = 16, 8, 32, 2


def reference_stats(q: np.ndarray, k: np.ndarray, mask: np.ndarray | None, bias=None) -> np.ndarray:
    """Per head: largest |logit| over valid keys, summed entropy / log(valid keys) over
    queries with two or more, and their count; numpy float64, by loops over rows."""
    q, k = np.asarray(q, np.float64), np.asarray(k, np.float64)
    logits = np.einsum("bqhd,bkhd->bhqk", q / np.sqrt(q.shape[-1]), k)
    if bias is not None:
        logits = logits + np.asarray(bias, np.float64)
    valid = np.broadcast_to(np.ones((), bool) if mask is None else np.asarray(mask, bool), logits.shape)
    heads = logits.shape[1]
    out = np.zeros((heads, 3))
    for b in range(logits.shape[0]):
        for h in range(heads):
            for i in range(logits.shape[2]):
                row = logits[b, h, i][valid[b, h, i]]
                if row.size == 0:
                    continue
                out[h, 0] = max(out[h, 0], np.abs(row).max())
                if row.size < 2:
                    continue
                p = np.exp(row - row.max())
                p /= p.sum()
                out[h, 1] += -(p * np.log(p)).sum() / np.log(row.size)
                out[h, 2] += 1
    return out


# -- the statistics against numpy --------------------------------------------------------------------

def _qkv(seed: int, shape=(3, 6, 2, 4), scale=3.0):
    keys = jax.random.split(jax.random.key(seed), 2)
    return [jax.random.normal(k, shape) * scale for k in keys]


def test_the_hook_statistics_match_numpy_with_a_causal_and_padding_mask():
    q, k = _qkv(0)
    causal = np.tril(np.ones((6, 6), bool))
    padded = np.ones((3, 1, 1, 6), bool)
    padded[1, ..., 4:] = False  # the second example's last two keys are padding
    mask = causal & padded
    logits = jnp.einsum("bqhd,bkhd->bhqk", q / jnp.sqrt(4.0), k)
    np.testing.assert_allclose(logit_stats(logits, mask), reference_stats(q, k, mask), rtol=1e-5, atol=1e-5)

    class Own(nn.Module):  # a model's own attention, through the documented hook
        @nn.compact
        def __call__(self, q, k):
            logits = jnp.einsum("bqhd,bkhd->bhqk", q / jnp.sqrt(q.shape[-1]), k)
            record_attention(self, logits, mask)
            return jax.nn.softmax(jnp.where(mask, logits, -1e9))

    _, sown = Own().apply({}, q, k, mutable=[ATTENTION])
    np.testing.assert_allclose(sown[ATTENTION][SOWN_NAME][0], reference_stats(q, k, mask),
                               rtol=1e-5, atol=1e-5)
    # Not collecting: nothing sown, nothing computed.
    assert Own().apply({}, q, k, mutable=["intermediates"])[1] == {}


def test_linen_multi_head_attention_is_recorded_through_its_attention_fn_unchanged():
    x = jax.random.normal(jax.random.key(1), (2, 6, 8))
    mha = nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=8)
    causal = nn.make_causal_mask(jnp.ones((2, 6)))
    params = mha.init(jax.random.key(2), x, mask=causal)
    plain = mha.apply(params, x, mask=causal)
    with nn.intercept_methods(attention_interceptor):
        out, found = mha.apply(params, x, mask=causal, mutable=[ATTENTION, "intermediates"],
                               capture_intermediates=True)
    np.testing.assert_array_equal(out, plain)  # the attention itself is unchanged
    q, k = found["intermediates"]["query"]["__call__"][0], found["intermediates"]["key"]["__call__"][0]
    np.testing.assert_allclose(found[ATTENTION][SOWN_NAME][0], reference_stats(q, k, causal),
                               rtol=1e-5, atol=1e-5)
    assert mha.attention_fn is nn.dot_product_attention  # put back


def test_nnx_multi_head_attention_is_recorded_with_its_mask_and_is_causal():
    x = jax.random.normal(jax.random.key(3), (2, 6, 8))
    mha = nnx.MultiHeadAttention(num_heads=2, in_features=8, qkv_features=8, decode=False, rngs=nnx.Rngs(0))
    padded = np.ones((2, 1, 1, 6), bool)
    padded[0, ..., 5:] = False
    plain = mha(x, mask=padded, is_causal=True)

    def call(module):
        return _intercepted(type(module).__call__, module, (attention_interceptor,))(x, mask=padded,
                                                                                      is_causal=True)

    out, sown = nnx.capture(call, AttentionStats)(mha)
    np.testing.assert_allclose(out, plain, rtol=1e-6, atol=1e-6)
    expected = reference_stats(mha.query(x), mha.key(x), padded & np.tril(np.ones((6, 6), bool)))
    np.testing.assert_allclose(nnx.to_pure_dict(sown)[SOWN_NAME][0], expected, rtol=1e-5, atol=1e-5)
    assert mha.attention_fn is nnx.dot_product_attention


# -- broken on purpose, and healthy ----------------------------------------------------------------

class TinyTransformer(nn.Module):
    """Embeddings, one pre-LN block of Flax's causal attention and an MLP,
    logits (``logit_bias``: every output logit's initial bias)."""

    logit_bias: float = 0.0
    qk_norm: bool = False

    @nn.compact
    def __call__(self, tokens):
        positions = self.param("positions", nn.initializers.normal(0.02), (LENGTH, WIDTH))
        x = nn.Embed(VOCAB, WIDTH)(tokens) + positions
        mask = nn.make_causal_mask(tokens)
        attention = nn.MultiHeadDotProductAttention(HEADS, normalize_qk=self.qk_norm, name="attention")
        x = x + attention(nn.LayerNorm()(x), mask=mask)
        x = x + nn.Dense(WIDTH)(nn.gelu(nn.Dense(2 * WIDTH)(nn.LayerNorm()(x))))
        bias = nn.initializers.constant(self.logit_bias)
        return nn.Dense(VOCAB, bias_init=bias, name="logits")(nn.LayerNorm()(x))


def copy_batches(steps: int, size: int = 32, seed: int = 0) -> list[dict[str, np.ndarray]]:
    """Random tokens; each target is the token before (a task attention solves)."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, VOCAB, (steps, size, LENGTH), dtype=np.int32)
    return [{"tokens": t, "targets": np.roll(t, 1, axis=-1)} for t in tokens]


def lm_loss(logits, batch):
    return optax.losses.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()


class ScaleQueriesAndKeys(flaxhooks.Callback):
    """Multiplies the initial query and key kernels of the module ``path``
    (Linen parameters) by ``scale``: the attention logits by its square."""

    def __init__(self, scale: float, path: tuple[str, ...] = ("attention",)):
        self.scale, self.path = scale, path

    def on_fit_start(self, loop):
        params = jax.tree.map(lambda x: x, loop.state.params)
        attention = functools.reduce(lambda tree, key: tree[key], self.path, params)
        for name in ("query", "key"):
            attention[name] = {**attention[name], "kernel": attention[name]["kernel"] * self.scale}
        loop.replace_state(loop.state.replace(params=params))


def diagnosed(model, steps=8, lr=1e-3, callbacks=()) -> flaxhooks.Diagnose:
    diagnose = flaxhooks.Diagnose(every=1, window=4, table=False, heatmaps=False)
    trainer = flaxhooks.Trainer(model, optax.adam(lr), lm_loss, input_keys=("tokens",), label_key=None,
                                callbacks=[*callbacks, diagnose])
    trainer.fit(copy_batches(steps), epochs=1)
    return diagnose


class NNXTinyTransformer(nnx.Module):
    """:class:`TinyTransformer` in NNX, with Flax's ``nnx.MultiHeadAttention``."""

    def __init__(self, qk_scale: float = 1.0, rngs: nnx.Rngs | None = None):
        rngs = rngs or nnx.Rngs(0)
        self.embed = nnx.Embed(VOCAB, WIDTH, rngs=rngs)
        self.norm = nnx.LayerNorm(WIDTH, rngs=rngs)
        self.attention = nnx.MultiHeadAttention(HEADS, WIDTH, decode=False, rngs=rngs)
        for projection in (self.attention.query, self.attention.key):
            projection.kernel.set_value(projection.kernel.get_value() * qk_scale)
        self.logits = nnx.Linear(WIDTH, VOCAB, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens)
        x = x + self.attention(self.norm(x), is_causal=True)
        return self.logits(x)


class PreviousToken(nn.Module):
    """Attention written by hand, reported through :func:`record_attention`:
    a bias of ``sharpness`` on the key before each query drives it one-hot."""

    sharpness: float = 0.0

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(VOCAB, WIDTH)(tokens)
        q = nn.DenseGeneral((HEADS, WIDTH // HEADS), name="query")(x)
        k = nn.DenseGeneral((HEADS, WIDTH // HEADS), name="key")(x)
        v = nn.DenseGeneral((HEADS, WIDTH // HEADS), name="value")(x)
        logits = jnp.einsum("bqhd,bkhd->bhqk", q / jnp.sqrt(q.shape[-1]), k)
        logits = logits + self.sharpness * jnp.eye(LENGTH, k=-1)
        causal = nn.make_causal_mask(tokens)
        record_attention(self, logits, causal)
        weights = jax.nn.softmax(jnp.where(causal, logits, -1e9))
        attended = jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(*x.shape[:-1], WIDTH)
        return nn.Dense(VOCAB, name="logits")(x + attended)


def kinds(diagnose: flaxhooks.Diagnose) -> dict[str, list]:
    found: dict[str, list] = {}
    for f in diagnose.findings:
        found.setdefault(f.kind, []).append(f)
    return found


def test_attention_logits_scaled_up_are_found_and_qk_norm_cures_them():
    broken = kinds(diagnosed(TinyTransformer(), callbacks=[ScaleQueriesAndKeys(8.0)]))
    [logits] = broken["attention_logits"]
    assert logits.layer == "attention" and logits.step == 4 and logits.since == 1
    assert logits.values["max_logit"] > 50 and len(logits.values["per_head"]) == HEADS
    assert "normalize_qk=True" in logits.advice
    # Flax's own QK-norm: the same scaled kernels, no finding at all.
    assert kinds(diagnosed(TinyTransformer(qk_norm=True), callbacks=[ScaleQueriesAndKeys(8.0)])) == {}


def test_nnx_attention_with_scaled_kernels_is_found():
    found = kinds(diagnosed(NNXTinyTransformer(qk_scale=8.0)))
    assert [f.layer for f in found["attention_logits"]] == ["attention"]
    assert "output_logit_drift" not in found


def test_attention_collapsed_to_one_hot_is_found_through_the_hook():
    found = kinds(diagnosed(PreviousToken(sharpness=30.0)))
    [entropy] = found["attention_entropy"]
    assert entropy.layer == "model" and entropy.since == 1
    assert entropy.values["entropy"] < 0.05
    assert "attention_logits" not in found  # sharp, but no logit above 50


def test_a_drifting_output_normalizer_is_found_and_nothing_else():
    found = kinds(diagnosed(TinyTransformer(logit_bias=40.0)))
    [drift] = found.pop("output_logit_drift")
    assert drift.layer is None and drift.values["mean"] == pytest.approx(40 + 3, abs=1.5)
    assert "z-loss" in drift.advice
    assert found == {}
