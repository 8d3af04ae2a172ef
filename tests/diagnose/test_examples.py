"""Small worked cases of Diagnose's own helpers (once their docstrings' examples)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flaxhooks.diagnose import (
    CallSources,
    GradNormWatch,
    Heatmaps,
    LossWatch,
    SpikeThresholds,
    call_sources,
    chosen_rows,
    dropout_in_eval,
    entropy_queries,
    first_spiked_layer,
    heatmap_figure,
    layer_sums,
    log_z_stats,
    logit_stats,
    output_sources,
    rng_streams,
    rows_read,
    setup_findings,
    step_entries,
    update_ratios,
)
from flaxhooks.step import as_model


def test_loss_watch_says_a_bad_first_loss_and_one_spike():
    watch = LossWatch()
    assert [f.kind for f in watch.initial(0, 30.0, num_classes=10)] == ["initial_loss"]
    losses = [1.0 + 0.01 * (step % 3) for step in range(300)]
    losses[250] = 9.0
    found = [f for step, loss in enumerate(losses) for f in watch.add(step, loss)]
    assert [(f.kind, f.since) for f in found] == [("loss_spike", 250)]
    assert found[0].evidence == ("the loss rose to 9.00 at step 250, 971.0 standard deviations above its "
                                 "mean of 1.01 over steps 122-249")
    assert LossWatch().add(0, float("nan")) == []
    assert LossWatch().initial(0, 2.35, num_classes=10) == []


def test_loss_watch_resumes_from_its_state():
    watch = LossWatch()
    for step in range(60):
        watch.add(step, 2.3)
    resumed = LossWatch(fresh=False)
    resumed.load_state_dict(watch.state_dict())
    assert resumed.fresh and resumed.retained == watch.retained


def test_grad_norm_watch_says_a_spike_once_and_resumes():
    watch = GradNormWatch(SpikeThresholds(history=20))
    norms = [1.0 + 0.05 * (step % 4) for step in range(60)]
    norms[40] = 30.0
    assert [(f.kind, f.since) for step, norm in enumerate(norms) for f in watch.add(step, norm)] == [
        ("grad_norm_spike", 40)]
    watch = GradNormWatch()
    for step in range(200):
        watch.add(step, 1.0)
    resumed = GradNormWatch()
    resumed.load_state_dict(watch.state_dict())
    assert [f.since for f in resumed.add(200, 50.0)] == [200]


def test_first_spiked_layer_is_the_first_in_call_order():
    ratios = ("b", [1.0, 20.0, 30.0])
    assert first_spiked_layer(["a", "b", "c"], [1.0, 40.0, 90.0], [1.0, 2.0, 3.0], 3.0) == ratios


def test_output_sources_follow_each_input():
    closed = jax.make_jaxpr(lambda x, y: (x * 2, y + x, 3.0))(1.0, 2.0)
    found = output_sources(closed, [frozenset("x"), frozenset("y")])
    assert [sorted(s) for s in found] == [["x"], ["x", "y"], []]


def test_set_up_helpers_on_small_models():
    model = as_model(nn.Dropout(0.5), "x", train_arg="deterministic")
    batch = {"x": jax.ShapeDtypeStruct((4, 3), jnp.float32)}
    assert sorted(call_sources(model, {}, {}, batch, train=True).outputs) == [("dropout", None)]
    seen = CallSources(frozenset({("dropout", None)}), frozenset())
    assert [f.kind for f in dropout_in_eval(as_model(nn.Dense(2)), seen, seen)] == ["dropout_in_eval"]
    nothing = CallSources(frozenset(), frozenset())
    assert rng_streams(as_model(nn.Dense(2)), nothing) == []
    noise = as_model(nn.Dense(2), rng_names=("noise",))
    assert [f.kind for f in rng_streams(noise, nothing)] == ["rng_streams"]
    model = as_model(nn.Dense(2), "x")
    batch = {"x": jax.ShapeDtypeStruct((8, 3), jnp.float32)}
    variables = jax.eval_shape(model.init, jax.eval_shape(jax.random.PRNGKey, 0), batch)
    assert setup_findings(model, variables["params"], {}, batch) == []


def test_attention_statistics_of_small_logits():
    logits = jnp.arange(64 * 4 * 11 * 11, dtype=jnp.float32).reshape(64, 4, 11, 11)
    assert entropy_queries(logits, logits > 0)[0].shape == (64, 4, 1, 11)  # one query of each example
    logits = jnp.array([[[[0.0, 9.0], [1.0, 1.0]]]])  # one head, two queries
    causal = jnp.tril(jnp.ones((2, 2), bool))  # 9.0 is masked out: the 2nd query is uniform
    assert [round(float(v), 3) for v in logit_stats(logits, causal)[0]] == [1.0, 1.0, 1.0]
    assert [round(float(v), 3) for v in log_z_stats(jnp.zeros((2, 4)))] == [2.0, 2.773, 2.773, 1.386]


def test_how_much_of_a_layer_a_step_reads():
    assert (step_entries(None), step_entries(20), step_entries(200)) == (16384, 16384, 1638)
    assert (rows_read(704, 128), rows_read(704, 512), rows_read(50176, 8), rows_read(32, 4096)) == (
        128, 64, 1024, 32)
    assert rows_read(704, 128, step_entries(200)) == 64  # every step of a 200-step window
    rows = chosen_rows(8, 16, 2048)  # 8 of 16 positions of each of 8 examples
    assert (len(rows), rows[:8].tolist(), rows[8:16].tolist()) == (
        64, [0, 2, 4, 6, 8, 10, 12, 14], [17, 19, 21, 23, 25, 27, 29, 31])


def test_layer_sums_and_update_ratios_of_small_arrays():
    row, reached, fired, mass = layer_sums(jnp.array([[1.0, -2.0], [3.0, -1.0]]),
                                           jnp.array([[0.5, 0.0], [0.5, 0.0]]))
    assert ([float(v) for v in row[:6]], reached.tolist(), fired.tolist(), mass.tolist()) == (
        [4.0, 1.0, 15.0, 0.5, 2.0, 0.0], [1.0, 0.0], [1.0, 0.0], [4.0, 0.0])
    params = {"Dense_0": {"kernel": jnp.full(4, 2.0)}}
    names, ratios = update_ratios(params, {"Dense_0": {"kernel": jnp.full(4, 0.02)}})
    assert names == ("Dense_0",) and ratios.dtype == jnp.float32
    np.testing.assert_allclose(ratios, [0.01], rtol=1e-6)


def test_heatmaps_merge_columns_to_fit():
    pytest.importorskip("matplotlib")
    figure = heatmap_figure(np.array([[1e-3, 1e-2, 1e-1], [1.0, np.nan, 1.0]]))
    assert figure.axes[0].images[0].get_array().shape == (2, 3)
    maps = Heatmaps(columns=4)
    for step in range(1, 11):
        maps.add(step, {"dense_0": 1.0, "dense_1": 10.0 ** -step})
    assert (maps.steps, maps.layers) == ([1, 5, 9], ["dense_0", "dense_1"])
    assert maps.arrays()[0].shape == (2, 3)
