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
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import flaxhooks
from flaxhooks.diagnose import (
    ATTENTION,
    MAX_ENTROPY_LOGITS,
    SOWN_NAME,
    AttentionFigures,
    AttentionThresholds,
    attention_findings,
    attention_interceptor,
    chosen_rows,
    log_z_figures,
    log_z_findings,
    logit_stats,
    record_attention,
)
from flaxhooks.step import NNXModel, Taps

VOCAB, LENGTH, WIDTH, HEADS = 16, 8, 32, 2


def reference_stats(q: np.ndarray, k: np.ndarray, mask: np.ndarray | None, bias=None,
                    rows=None) -> np.ndarray:
    """Per head: largest |logit| over valid keys, summed entropy / log(valid keys) over
    queries with two or more (among ``rows``, flat ``example * queries + query``
    indices, if given), and their count; numpy float64, by loops over rows."""
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
                if row.size < 2 or (rows is not None and b * logits.shape[2] + i not in rows):
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


def test_a_large_batchs_entropy_is_read_at_chosen_queries_and_its_largest_logit_everywhere():
    # 64 examples of 11 queries, 4 heads: above MAX_ENTROPY_LOGITS, so a query of each example.
    q, k = _qkv(3, shape=(64, 11, 4, 8))
    padded = np.ones((64, 1, 1, 11), bool)
    padded[::3, ..., 7:] = False
    mask = np.tril(np.ones((11, 11), bool)) & padded
    logits = jnp.einsum("bqhd,bkhd->bhqk", q / jnp.sqrt(8.0), k)
    rows = chosen_rows(64, 11, 4 * 11, MAX_ENTROPY_LOGITS)
    assert len(rows) == 64 and len(np.unique(rows % 11)) == 11, "every query position is read"
    expected = reference_stats(q, k, mask, rows=set(rows.tolist()))
    np.testing.assert_allclose(logit_stats(logits, mask), expected, rtol=1e-5, atol=1e-5)
    assert expected[:, 2].max() < 64 < 64 * 10, "entropy over the queries chosen, not all"
    if jax.local_device_count() >= 8:  # the batch sharded: the same figures, gathered on each device
        mesh = Mesh(np.array(jax.local_devices()[:8]), ("data",))

        def stats(values):
            with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
                return logit_stats(values, mask)

        sharded = jax.device_put(logits, NamedSharding(mesh, P("data")))
        text = jax.jit(stats).lower(sharded).compile().as_text()
        assert "all-gather(" not in text and "all-to-all(" not in text
        np.testing.assert_allclose(jax.jit(stats)(sharded), expected, rtol=1e-5, atol=1e-5)


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
    padded = np.ones((2, 1, 1, 6), bool)
    padded[0, ..., 5:] = False

    class Model(nnx.Module):
        def __init__(self):
            self.mha = nnx.MultiHeadAttention(num_heads=2, in_features=8, qkv_features=8, decode=False,
                                              keep_rngs=False, rngs=nnx.Rngs(0))

        def __call__(self, x):
            return self.mha(x, mask=padded, is_causal=True)

    module = Model()
    model = NNXModel(module, input_keys=("x",))
    variables = model.init(jax.random.key(0), {"x": x})
    params = variables.pop("params")
    # The instrumented call as Diagnose asks for it.
    taps = Taps(optional_collections=(ATTENTION,), intercept=(attention_interceptor,))
    out, _, found = model.tap(variables, {"x": x}, rngs={}, taps=taps)(params, {})
    np.testing.assert_allclose(out, module(x), rtol=1e-6, atol=1e-6)
    [tap] = found
    assert tap.name == f"mha/{SOWN_NAME}" and tap.collection == ATTENTION
    causal = np.tril(np.ones((6, 6), bool))
    expected = reference_stats(module.mha.query(x), module.mha.key(x), padded & causal)
    np.testing.assert_allclose(tap.value, expected, rtol=1e-5, atol=1e-5)
    assert module.mha.attention_fn is nnx.dot_product_attention


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
    trainer = flaxhooks.Trainer(flaxhooks.as_model(model, input_keys=("tokens",)), optax.adam(lr), lm_loss,
                                label_key=None,
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
    import json

    diagnose = diagnosed(TinyTransformer(logit_bias=40.0))
    found = kinds(diagnose)
    [drift] = found.pop("output_logit_drift")
    assert drift.layer is None and drift.values["mean"] == pytest.approx(40 + 3, abs=1.5)
    assert "z-loss" in drift.advice
    assert found == {}
    # The trends' baselines go into a checkpoint (as Checkpoint keeps a callback's state) and back.
    state = diagnose.state_dict()
    assert state["first_attention"] and state["first_log_z"]
    text = json.dumps(state)
    resumed = flaxhooks.Diagnose()
    resumed.load_state_dict(json.loads(text))
    resumed._restore(resumed._restored)  # what the next fit's start does
    assert json.dumps(resumed.state_dict()) == text


# -- the judgments, from figures -------------------------------------------------------------------

def _figures(name, max_logit, entropy):
    return AttentionFigures(name, tuple(max_logit), tuple(entropy))


@pytest.mark.parametrize(("first", "now", "found"), [
    ((8.0, 6.0), (19.0, 15.0), False),  # the addition recipe's healthy run: 8.4 -> 19 over 400 steps
    ((8.0, 6.0), (51.0, 15.0), True),  # above the cap
    ((3.0, 2.0), (31.0, 4.0), True),  # grown more than 10x, above 20
    ((1.0, 1.0), (15.0, 4.0), False),  # grown 15x, but small
])
def test_attention_logits_are_judged_by_their_size_and_growth(first, now, found):
    thresholds = AttentionThresholds()
    base = {"a": _figures("a", first, (0.8, 0.8))}
    result = attention_findings([_figures("a", now, (0.8, 0.8))], base, (51, 100), thresholds)
    assert [f.kind for f in result] == (["attention_logits"] if found else [])
    if found:
        assert result[0].values["max_logit"] == max(now) and result[0].since == 51


@pytest.mark.parametrize(("first", "now", "found"), [
    ((0.74, 0.74), (0.31, 0.31), False),  # the recipe's healthy run: sharper, far from one-hot
    ((0.74, 0.74), (0.03, 0.04), True),  # collapsed since the first window
    ((0.03, 0.03), (0.03, 0.03), True),  # one-hot from the start
    ((0.74, 0.74), (0.01, 0.6), False),  # one head one-hot, the layer not
])
def test_attention_entropy_is_judged_against_uniform_and_the_first_window(first, now, found):
    base = {"a": _figures("a", (5.0, 5.0), first)}
    result = attention_findings([_figures("a", (5.0, 5.0), now)], base, (51, 100), AttentionThresholds())
    assert [f.kind for f in result] == (["attention_entropy"] if found else [])


def test_log_z_is_judged_by_its_mean_absolute_value():
    # [positions, sum, sum |log Z|, max |log Z|]
    healthy, drifted = log_z_figures([100, 900.0, 900.0, 13.7]), log_z_figures([100, -3000.0, 3000.0, 31.0])
    assert healthy == {"mean": 9.0, "mean_abs": 9.0, "max_abs": 13.7}
    assert log_z_findings(healthy, None, (1, 50), AttentionThresholds()) == []
    [drift] = log_z_findings(drifted, healthy, (51, 100), AttentionThresholds())
    assert drift.values["mean"] == -30.0 and drift.values["first_mean"] == 9.0 and drift.layer is None


# -- the addition recipe: diagnosed through the hook, numerics unchanged, healthy -----------------------

class DotProductAttention(nn.Module):
    """The recipe's attention as it was, through ``nn.dot_product_attention``: the reference."""

    heads: int

    @nn.compact
    def __call__(self, x):
        from recipes.transformer import _dense_init, _zeros

        width = x.shape[-1]

        def projection(name):
            joint = nn.Dense(width, name=name,
                             kernel_init=nn.with_logical_partitioning(_dense_init, ("embed", "heads")),
                             bias_init=nn.with_logical_partitioning(_zeros, ("heads",)))(x)
            return joint.reshape(*joint.shape[:-1], self.heads, width // self.heads)

        query, key, value = (projection(name) for name in ("query", "key", "value"))
        causal = nn.make_causal_mask(jnp.ones(x.shape[:2], jnp.bool_))
        attended = nn.dot_product_attention(query, key, value, mask=causal)
        out = nn.Dense(width, name="out",
                       kernel_init=nn.with_logical_partitioning(_dense_init, ("heads", "embed")),
                       bias_init=nn.with_logical_partitioning(_zeros, ("embed",)))
        return out(attended.reshape(*attended.shape[:-2], width))


def _recipe_losses(steps: int, window: int = 10, one_device: bool = False,
                   **kwargs) -> tuple[list[float], flaxhooks.Diagnose]:
    """Trains the addition recipe's Transformer (``kwargs``: its config), on
    every device as the recipe lays them out, or on one."""
    from recipes import addition, addition_data
    from recipes.transformer import AXIS_RULES, Transformer, batch_loss

    config = addition.Config(train_examples=2000, eval_examples=10, **kwargs)
    sums = addition_data.make_sums(config.digits, config.train_examples, config.eval_examples, 0)
    if one_device:
        placed = {"devices": jax.devices()[:1], "axis_rules": tuple((name, None) for name, _ in AXIS_RULES)}
    else:
        placed = addition.sharding_arguments(config, addition.check_options(config, jax.device_count()))
    diagnose = flaxhooks.Diagnose(every=1, window=window, table=False, heatmaps=False)  # one variant compiled
    losses = []

    class Losses(flaxhooks.Callback):
        def on_step_end(self, loop):
            losses.append(loop.metrics["loss"])

    length = addition_data.sequence_length(config.digits) - 1
    model = Transformer(vocab_size=addition.VOCAB_SIZE, length=length, width=config.width, depth=config.depth,
                        heads=config.heads)
    trainer = flaxhooks.Trainer(
        flaxhooks.as_model(model, input_keys=("tokens",)), optax.adamw(config.learning_rate),
        functools.partial(batch_loss, pad=addition_data.PAD), label_key=None, seed=0,
        callbacks=[diagnose, Losses()], **placed)
    trainer.fit(flaxhooks.ArrayLoader(sums.train(), 64, seed=0), steps=steps)
    return [float(v) for v in losses], diagnose


def test_the_recipe_attention_computes_what_nn_dot_product_attention_does(monkeypatch):
    from recipes import transformer

    hooked, diagnose = _recipe_losses(4, window=4, one_device=True, digits=2, width=32)
    assert [f.name for f in diagnose.attention_figures] == ["block_0/attention", "block_1/attention"]
    monkeypatch.setattr(transformer, "CausalSelfAttention", DotProductAttention)
    reference, diagnose = _recipe_losses(4, window=4, one_device=True, digits=2, width=32)
    np.testing.assert_allclose(hooked, reference, rtol=1e-6)
    assert diagnose.attention_figures == []  # no attention to see: nothing recorded


@pytest.mark.slow
def test_the_addition_recipe_trains_with_no_transformer_finding_on_a_data_model_mesh():
    """(On the recipe's default mesh, test_addition.py trains it to 90% with no finding.)"""
    _, diagnose = _recipe_losses(20, mesh="data=4,model=2")  # the default-size model: two windows
    assert diagnose.findings == []
    assert [(f.name, len(f.max_logit)) for f in diagnose.attention_figures] == [
        ("block_0/attention", 4), ("block_1/attention", 4)]
    assert all(0 < m < 50 for f in diagnose.attention_figures for m in f.max_logit)
    assert all(0.05 < e <= 1 for f in diagnose.attention_figures for e in f.entropy)
    assert 0 < diagnose.output_log_z["mean_abs"] < 25


def _docs_snippet(marker: str) -> str:
    """The ```python block of docs/guides/diagnose.md that contains ``marker``."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "guides" / "diagnose.md").read_text()
    blocks = [block.split("```", 1)[0] for block in text.split("```python\n")[1:]]
    found = [block for block in blocks if marker in block]
    assert len(found) == 1, f"the page has {len(found)} python blocks with {marker!r}"
    return found[0]


def test_the_docs_own_attention_example_is_recorded_as_numpy_computes_it():
    namespace: dict = {}
    exec(compile(_docs_snippet("class MyAttention"), "docs/guides/diagnose.md", "exec"), namespace)
    q, k = _qkv(3)
    v = jax.random.normal(jax.random.key(4), q.shape)
    mask = np.tril(np.ones((6, 6), bool))[None, None]
    module = namespace["MyAttention"]()
    out, sown = module.apply({}, q, k, v, mask, mutable=[ATTENTION])
    np.testing.assert_allclose(sown[ATTENTION][SOWN_NAME][0], reference_stats(q, k, mask),
                               rtol=1e-5, atol=1e-5)
    expected = nn.dot_product_attention(q, k, v, mask=mask)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-6)

