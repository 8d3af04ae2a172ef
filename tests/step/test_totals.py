"""Running totals of the step metrics: window means against numpy in float64."""

import jax
import numpy as np
import pytest

from flaxhooks.step import add_to_totals, combine_windows, window_means, window_sums, zero_totals


def _run(values: np.ndarray) -> dict:
    """The totals after adding each of ``values`` as one step's ``loss``, every step kept."""

    def step(totals, value):
        totals = add_to_totals(totals, {"loss": value})
        return totals, totals

    _, every = jax.jit(lambda v: jax.lax.scan(step, zero_totals(["loss"]), v))(values)
    return jax.device_get(every)


def _at(every: dict, index: int) -> dict:
    return jax.tree.map(lambda x: x[index], every)


def test_a_window_after_a_million_steps_keeps_float32_precision():
    rng = np.random.default_rng(0)
    values = (2.0 + rng.normal(size=1_000_000)).astype(np.float32)  # a loss near 2
    every = _run(values)
    start, end = _at(every, 999_949), _at(every, 999_999)  # the last 50 steps
    got = window_means(window_sums(start, end))["loss"]
    expected = values[999_950:].astype(np.float64).mean()
    assert got == pytest.approx(expected, rel=1e-6)
    # A plain float32 running sum loses the window in the rounding of a sum near 2e6.
    running = np.cumsum(values, dtype=np.float32)
    assert abs((running[-1] - running[-51]) / 50 - expected) > 1e-3


def test_a_non_finite_step_marks_its_window_only():
    values = np.array([1.0, 2.0, np.nan, 4.0, 5.0, 6.0], np.float32)
    every = _run(values)
    first = window_sums(None, _at(every, 2))  # steps 1-3, one of them NaN
    second = window_sums(_at(every, 2), _at(every, 5))
    assert np.isnan(window_means(first)["loss"])
    assert window_means(second)["loss"] == pytest.approx(5.0)
    assert (first["steps"], first["finite"]["loss"]) == (3, 2)


def test_windows_combine_across_a_resume():
    values = np.arange(1, 9, dtype=np.float32)
    every = _run(values)
    before = window_sums(_at(every, 1), _at(every, 4))  # steps 3-5, saved with a checkpoint
    after = window_sums(None, _at(every, 1))  # a resumed run's first steps, from zero
    assert window_means(combine_windows(before, after))["loss"] == pytest.approx(np.mean([3, 4, 5, 1, 2]))
    assert combine_windows(None, after) == after


def test_totals_are_two_arrays_and_still_read_in_0_6s_layout():
    every = _run(np.array([1.0, np.inf, 3.0], np.float32))
    last = _at(every, 2)
    assert last.names == ("loss",) and [np.shape(x) for x in jax.tree.leaves(last)] == [(2, 1), (3, 1)]
    assert float(last["sum"]["loss"]) + float(last["error"]["loss"]) == 4.0
    assert (int(last["finite"]["loss"]), int(last["taken"]["loss"]), int(last["steps"])) == (2, 3, 3)
    with pytest.raises(KeyError, match="'sum', 'error'"):
        last["mean"]
