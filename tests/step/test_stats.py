"""In-step statistics: only the asked-for columns are computed, exactly over
devices; per-module parameter figures."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from flaxhooks import AXIS
from flaxhooks.step import GRADIENT_STATS, check_stats, param_modules, param_stats, tap_stats


def _mapped(fn, *values, shards=4):
    """``fn`` of each value split over ``shards`` mapped devices; device 0's result."""
    split = [v.reshape(shards, -1, *v.shape[1:]) for v in values]
    return jax.tree.map(lambda x: x[0], jax.vmap(fn, axis_name=AXIS)(*split))


def _primitives(fn, *values, shards=4) -> set[str]:
    """The primitives of ``fn``'s mapped jaxpr (sub-jaxprs included)."""
    split = [v.reshape(shards, -1, *v.shape[1:]) for v in values]
    text = str(jax.make_jaxpr(jax.vmap(fn, axis_name=AXIS))(*split))
    return set(re.findall(r"= ([a-z_]+)\b", text)) | set(re.findall(r"\b([a-z_]+)\[", text))


VALUES = [
    np.random.default_rng(0).normal(1.0, 2.0, (8, 6)).astype(np.float32),
    np.maximum(np.random.default_rng(1).normal(size=(8, 10)), 0).astype(np.float32),
]


def test_columns_and_per_value_choices_compute_only_those():
    columns = ("mean", "std", "zero_fraction", "nonfinite")
    wanted = [{"mean", "std", "nonfinite"}, {"mean", "std", "zero_fraction", "nonfinite"}]
    table, counts = _mapped(lambda a, b: tap_stats([a, b], columns=columns, wanted=wanted), *VALUES)
    assert counts is None and table.shape == (2, 4)
    for row, value, want in zip(np.asarray(table), VALUES, wanted, strict=True):
        x = value.astype(np.float64)
        reference = {"mean": x.mean(), "std": x.std(), "zero_fraction": (x == 0).mean(), "nonfinite": 0.0}
        for column, got in zip(columns, row, strict=True):
            if column in want:
                np.testing.assert_allclose(got, reference[column], rtol=1e-5, atol=1e-6)
            else:
                assert np.isnan(got)  # not computed


@pytest.mark.parametrize("columns, absent", [
    (("mean", "std", "nonfinite"), {"pmax", "sign"}),  # no extremes, no non-zero count
    (("rms",), {"pmax", "sign"}),
    (("mean", "zero_fraction"), {"pmax"}),
    (("max",), {"sign"}),
])
def test_no_pass_or_collective_a_statistic_does_not_need(columns, absent):
    primitives = _primitives(lambda a, b: tap_stats([a, b], columns=columns), *VALUES)
    assert not absent & primitives
    assert ("pmax" in primitives) == bool({"min", "max"} & set(columns))


def test_zero_fraction_only_of_some_values_counts_only_theirs():
    wanted = [{"mean"}, {"mean", "zero_fraction"}]
    columns = ("mean", "zero_fraction")
    assert "sign" in _primitives(lambda a, b: tap_stats([a, b], columns=columns, wanted=wanted), *VALUES)
    neither = [{"mean"}] * 2
    assert "sign" not in _primitives(lambda a, b: tap_stats([a, b], columns=columns, wanted=neither), *VALUES)


def test_the_default_pass_flags_non_finite_values_and_the_masked_one_counts_them():
    x = np.arange(16, dtype=np.float32).reshape(8, 2)
    x[3, 1] = np.nan
    columns = ("mean", "nonfinite")
    flagged, _ = _mapped(lambda v: tap_stats([v], columns=columns), x)
    assert np.isnan(flagged[0]).all()  # present, not counted
    assert "is_finite" not in _primitives(lambda v: tap_stats([v], columns=("mean",)), x)  # fused: no compare
    counted, _ = _mapped(lambda v: tap_stats([v], columns=columns, count_nonfinite=True), x)
    np.testing.assert_allclose(counted[0], [np.nanmean(x), 1.0], rtol=1e-6)


def test_histograms_need_only_the_extremes():
    table, counts = _mapped(lambda a: tap_stats([a], columns=("mean",), bins=5), VALUES[0])
    want, _ = np.histogram(VALUES[0].astype(np.float64), bins=5)
    np.testing.assert_array_equal(counts[0], want)
    np.testing.assert_allclose(table[0, 0], VALUES[0].mean(), rtol=1e-5)


def test_bad_statistics_are_named_with_the_valid_ones():
    assert check_stats(("l2", "mean")) == ("mean", "l2")
    with pytest.raises(ValueError, match=r"unknown statistics \['median'\]: choose among"):
        check_stats(["mean", "median"])
    with pytest.raises(ValueError, match="'l2'"):
        tap_stats([jnp.ones(3)], columns=("l2", "norm"))
    assert GRADIENT_STATS[-1] == "l2"


def test_param_modules_group_leaves_by_their_module():
    params = {
        "encoder": {"layers_10": {"kernel": np.ones(2)},
                    "layers_2": {"kernel": np.ones(2), "bias": np.ones(1)}},
        "scale": np.ones(()),
    }
    names = [name for name, _ in param_modules(params)]
    assert names == ["(model)", "encoder/layers_2", "encoder/layers_10"]
    leaves = jax.tree.leaves(params)
    assert {name: len(indices) for name, indices in param_modules(params)} == {
        "(model)": 1, "encoder/layers_2": 2, "encoder/layers_10": 1}
    assert sum(len(indices) for _, indices in param_modules(params)) == len(leaves)


def test_param_stats_are_per_module_norms_and_update_ratios():
    rng = np.random.default_rng(0)
    params = {"a": {"kernel": rng.normal(size=(3, 4)), "bias": rng.normal(size=4)},
              "b": {"kernel": rng.normal(size=(4, 2)), "bias": np.zeros(2)}}
    params = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), params)
    grads = jax.tree.map(lambda x: 0.1 * x + 0.01, params)
    optimizer = optax.adam(1e-2)
    updates, _ = optimizer.update(grads, optimizer.init(params), params)
    names, _ = param_stats(params, grads, updates)
    table = jax.jit(lambda *trees: param_stats(*trees)[1])(params, grads, updates)  # traceable
    assert names == ("a", "b")
    for row, name in zip(np.asarray(table), names, strict=True):
        np.testing.assert_allclose(row[0], optax.tree.norm(grads[name]), rtol=1e-6)
        np.testing.assert_allclose(row[1], optax.tree.norm(updates[name]) / optax.tree.norm(params[name]),
                                   rtol=1e-5)
    zeros = jax.tree.map(jnp.zeros_like, params)
    _, none = param_stats(zeros, grads, updates)
    assert (np.asarray(none[:, 1]) == 0).all()  # no parameters yet: a ratio of 0, not inf
