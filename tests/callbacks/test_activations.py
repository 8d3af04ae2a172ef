"""Activation and activation-gradient statistics, checked against numpy and
hand-written gradients, on 1 and 8 devices."""

from __future__ import annotations

import threading
import warnings
from pathlib import Path

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import Diverging, HostReads, cross_entropy, make_arrays, make_batches, sgd_trainer
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import flaxhooks
from flaxhooks import AXIS
from flaxhooks.step import ACTIVATION_STATS, GRADIENT_STATS, tap_stats


def numpy_stats(x, l2=False) -> list[float]:
    """The reference: float64 numpy over the whole array."""
    x = np.asarray(x, np.float64).ravel()
    row = [x.mean(), x.std(), np.sqrt(np.mean(x * x)), x.min(), x.max(), np.mean(x == 0), 0.0]
    return [*row, np.sqrt(np.sum(x * x))] if l2 else row


def assert_rows(got: dict[str, float], want: list[float], columns, name=""):
    np.testing.assert_allclose(
        [got[c] for c in columns], want, rtol=2e-4, atol=2e-6, err_msg=f"{name}: {columns}"
    )


class Tapped(nn.Module):
    """Captured outputs, a sown value and a module called twice."""

    @nn.compact
    def __call__(self, x):
        a = nn.relu(nn.Dense(8, name="hidden")(x))
        self.sow("intermediates", "relu", a)
        shared = nn.Dense(8, name="shared")
        a = shared(a) + shared(2 * a)
        return nn.Dense(3, name="head")(a)


class ExplicitlyPerturbed(nn.Module):
    """Tapped with the perturb calls written by hand, as in Flax's guide."""

    @nn.compact
    def __call__(self, x):
        h = self.perturb("hidden_out", nn.Dense(8, name="hidden")(x))
        a = nn.relu(h)
        shared = nn.Dense(8, name="shared")
        a = self.perturb("shared_out0", shared(a)) + self.perturb("shared_out1", shared(2 * a))
        return self.perturb("head_out", nn.Dense(3, name="head")(a))


def _two_steps_then_one(model, callback, devices, batches):
    """Trains 2 steps, then the third (due) step; returns the params before it."""
    callbacks = callback if isinstance(callback, list) else [callback]
    trainer = sgd_trainer(model, callbacks=callbacks, devices=devices)
    before = trainer.fit(batches, steps=2)
    trainer.fit(batches, steps=3)
    return before.params, trainer


# -- the statistics themselves ------------------------------------------------


@pytest.mark.parametrize("shards", [1, 4])
def test_tap_stats_match_numpy_however_the_values_are_split(shards):
    rng = np.random.default_rng(0)
    values = [rng.normal(2.0, 3.0, (8, 6, 5)).astype(np.float32),
              np.maximum(rng.normal(size=(8, 40)), 0).astype(np.float32)]
    split = [v.reshape(shards, -1, *v.shape[1:]) for v in values]
    table, counts = jax.vmap(lambda *xs: tap_stats(list(xs), l2=True, bins=7), axis_name=AXIS)(*split)
    assert table.shape == (shards, 2, len(GRADIENT_STATS))
    for row, value in zip(np.asarray(table[0]), values, strict=True):
        np.testing.assert_allclose(row, numpy_stats(value, l2=True), rtol=1e-5, atol=1e-6)
        assert (np.asarray(table) == row).all(axis=-1).any()  # the same on every device
    for got, value in zip(np.asarray(counts[0]), values, strict=True):
        want, _ = np.histogram(value.astype(np.float64), bins=7, range=(value.min(), value.max()))
        np.testing.assert_array_equal(got, want)


def test_non_finite_values_are_flagged_or_counted_and_left_out():
    x = np.arange(12, dtype=np.float32).reshape(4, 3)
    x[1, 1], x[2, 0] = np.nan, np.inf
    fast, _ = jax.vmap(lambda v: tap_stats([v]), axis_name=AXIS)(x.reshape(2, 2, 3))
    assert np.isnan(fast[0, 0, ACTIVATION_STATS.index("nonfinite")])
    exact, counts = jax.vmap(lambda v: tap_stats([v], count_nonfinite=True, bins=4), axis_name=AXIS)(
        x.reshape(2, 2, 3)
    )
    finite = x[np.isfinite(x)]
    want = numpy_stats(finite)
    want[ACTIVATION_STATS.index("zero_fraction")] = 1 / 12  # of every entry
    want[ACTIVATION_STATS.index("nonfinite")] = 2
    np.testing.assert_allclose(exact[0, 0], want, rtol=1e-5)
    assert counts[0, 0].sum() == 10  # non-finite entries are not binned


# -- activations --------------------------------------------------------------


def test_activation_stats_match_numpy_on_the_captured_arrays(devices):
    batches = make_batches(4, batch_size=16)
    stats = flaxhooks.ActivationStats(every=3, stats="all")
    params, trainer = _two_steps_then_one(Tapped(), stats, devices, batches)
    _, captured = Tapped().apply(
        {"params": params}, batches[2]["image"], capture_intermediates=True, mutable=["intermediates"]
    )
    captured = captured["intermediates"]
    want = {
        "hidden": captured["hidden"]["__call__"][0],
        "relu": captured["relu"][0],
        "shared/0": captured["shared"]["__call__"][0],
        "shared/1": captured["shared"]["__call__"][1],
        "head": captured["head"]["__call__"][0],
        "output": captured["__call__"][0],
    }
    latest = stats.latest
    assert latest is not None and latest.step == 3
    # Execution order: the model's own output (and what it sows) come last.
    assert list(latest.names) == ["hidden", "shared/0", "shared/1",
                                  "head", "relu", "output"]
    got = latest.to_dict()
    for name, value in want.items():
        assert_rows(got[name], numpy_stats(value), ACTIVATION_STATS, name)
    assert trainer.runner.traces == {"train_step": 1, "instrumented_step": 1}


def test_default_statistics_are_mean_std_and_the_zero_fraction_of_relu_like_values(devices):
    batches = make_batches(4, batch_size=16)
    stats = flaxhooks.ActivationStats(every=3)
    params, trainer = _two_steps_then_one(Tapped(), stats, devices, batches)
    _, captured = Tapped().apply(
        {"params": params}, batches[2]["image"], capture_intermediates=True, mutable=["intermediates"]
    )
    captured = captured["intermediates"]
    want = {
        "hidden": captured["hidden"]["__call__"][0],
        "shared/0": captured["shared"]["__call__"][0],
        "shared/1": captured["shared"]["__call__"][1],
        "head": captured["head"]["__call__"][0],
        "relu": captured["relu"][0],
    }
    # The model returns head's output unchanged: it is found, but logged once.
    assert stats.names[-1] == "output" and stats.latest.names == tuple(want)
    got = stats.latest.to_dict()
    for name, value in want.items():
        columns = ("mean", "std", "zero_fraction") if name == "relu" else ("mean", "std")  # Dense: affine
        assert tuple(got[name]) == columns
        reference = numpy_stats(value)
        assert_rows(got[name], [reference[ACTIVATION_STATS.index(c)] for c in columns], columns, name)
    assert trainer.runner.traces == {"train_step": 1, "instrumented_step": 1}


class Relus(nn.Module):
    """A custom module (not known to be affine), a Dense, and a sown value."""

    @nn.compact
    def __call__(self, x):
        x = Rectified(name="block")(x)
        self.sow("intermediates", "sown", x * 2)
        return nn.Dense(3, name="head")(x) + 1.0  # transformed: not head's output


class Rectified(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.relu(nn.Dense(8, name="dense")(x))


def test_zero_fraction_only_where_a_relu_can_zero_entries_unless_asked_for():
    batches = make_batches(2, batch_size=8)
    default = flaxhooks.ActivationStats(every=1)
    listed = flaxhooks.ActivationStats(every=1, stats=("zero_fraction",), prefix="listed")
    sgd_trainer(Relus(), callbacks=[default, listed]).fit(batches, steps=1)
    has_zero_fraction = {name: "zero_fraction" in row for name, row in default.latest.to_dict().items()}
    assert has_zero_fraction == {"block/dense": False, "block": True, "head": False, "output": True,
                                 "sown": True}
    assert all(tuple(row) == ("zero_fraction",) for row in listed.latest.to_dict().values())
    assert listed.latest.names == default.latest.names  # the model's output is its own: kept
    assert default.latest.to_dict()["block"]["zero_fraction"] > 0.2


def test_stats_all_or_a_list_choose_the_columns_and_bad_names_fail_at_once(compiles):
    with pytest.raises(ValueError, match=r"unknown statistics \['median'\]: choose among \['mean', 'std', "
                                         r"'rms', 'min', 'max', 'zero_fraction', 'nonfinite'\]"):
        flaxhooks.ActivationStats(stats=("mean", "median"))
    with pytest.raises(ValueError, match="'l2'"):
        flaxhooks.ActivationStats(stats=["l2"])  # a gradient statistic only
    with pytest.raises(ValueError, match="'all'"):
        flaxhooks.ActivationGradStats(stats="everything")
    assert compiles == []  # refused before anything was traced or compiled
    assert flaxhooks.ActivationGradStats(stats="l2").stats == ("l2",)

    batches = make_batches(2, batch_size=8)
    every = flaxhooks.ActivationStats(every=1, stats="all")
    grads = flaxhooks.ActivationGradStats(every=1, stats="all")
    chosen = flaxhooks.ActivationGradStats(every=1, stats=["max", "l2"], prefix="chosen")
    sgd_trainer(Tapped(), callbacks=[every, grads, chosen]).fit(batches, steps=1)
    assert every.latest.names[-1] == "output" and grads.latest.names[-1] == "output"  # every value
    assert all(tuple(row) == ACTIVATION_STATS for row in every.latest.to_dict().values())
    assert all(tuple(row) == GRADIENT_STATS for row in grads.latest.to_dict().values())
    assert all(tuple(row) == ("max", "l2") for row in chosen.latest.to_dict().values())
    assert "output" not in chosen.latest.names
    got, full = chosen.latest.to_dict(), grads.latest.to_dict()
    for name, row in got.items():
        assert row == pytest.approx({c: full[name][c] for c in ("max", "l2")}, rel=1e-6)


def test_capture_filters_select_by_type_name_and_method():
    batches = make_batches(2, batch_size=8)
    by_type = flaxhooks.ActivationStats(every=1, collections=(), capture=nn.Dense)
    by_name = flaxhooks.ActivationStats(every=1, collections=(), capture="sha*", prefix="named")
    sown_only = flaxhooks.ActivationStats(every=1, capture=None, prefix="sown")
    sgd_trainer(Tapped(), callbacks=[by_type, by_name, sown_only]).fit(batches, steps=1)
    assert by_type.names == ("hidden", "shared/0", "shared/1", "head")
    assert by_name.names == ("shared/0", "shared/1")
    assert sown_only.names == ("relu",)


# -- gradients of intermediates ----------------------------------------------


def test_gradient_stats_match_jax_grad_with_explicit_perturbations(devices):
    batches = make_batches(4, batch_size=16)
    intercepted = flaxhooks.ActivationGradStats(every=3, perturb=nn.Dense, model_perturbations=False,
                                                stats="all")
    default = flaxhooks.ActivationGradStats(every=3, perturb=nn.Dense, model_perturbations=False,
                                            prefix="default")
    params, _ = _two_steps_then_one(Tapped(), [intercepted, default], devices, batches)
    written = flaxhooks.ActivationGradStats(every=3, perturb=None, stats="all")
    params_written, _ = _two_steps_then_one(ExplicitlyPerturbed(), written, devices, batches)

    # By hand, as in Flax's guide: the gradient of the batch's mean loss with
    # respect to zero perturbations added where the model calls perturb.
    batch = batches[2]
    perturbations = ExplicitlyPerturbed().init(jax.random.PRNGKey(0), batch["image"])["perturbations"]

    def loss(perturbations, params):
        variables = {"params": params, "perturbations": perturbations}
        logits = ExplicitlyPerturbed().apply(variables, batch["image"])
        return cross_entropy(logits, batch)

    by_hand = jax.grad(loss)(perturbations, params)
    np.testing.assert_allclose(  # both runs trained the same parameters
        params["hidden"]["kernel"], params_written["hidden"]["kernel"], rtol=1e-5, atol=1e-6
    )
    names = {"hidden_out": "hidden", "shared_out0": "shared/0",
             "shared_out1": "shared/1", "head_out": "head"}
    assert list(intercepted.names) == list(names.values())
    got = intercepted.latest.to_dict()
    got_written = written.latest.to_dict()
    got_default = default.latest.to_dict()
    for site, name in names.items():
        want = numpy_stats(by_hand[site], l2=True)
        assert_rows(got[name], want, GRADIENT_STATS, name)
        assert_rows(got_written[site], want, GRADIENT_STATS, site)
        assert_rows(got_default[name], [want[GRADIENT_STATS.index("rms")]], ("rms",), name)
        assert tuple(got_default[name]) == ("rms",)


def test_perturbations_follow_the_batch_size():
    """Perturbations are built in the step: other batch sizes just work."""
    arrays = make_arrays(96)
    grads = flaxhooks.ActivationGradStats(every=1)
    trainer = sgd_trainer(ExplicitlyPerturbed(), callbacks=[grads])
    trainer.fit(flaxhooks.ArrayLoader(arrays, batch_size=16), steps=2)
    state = trainer.fit(flaxhooks.ArrayLoader(arrays, batch_size=8 * 3), steps=4)
    assert int(state.step) == 4 and grads.latest.step == 4
    assert all(np.isfinite(list(row.values())).all() for row in grads.latest.to_dict().values())


# -- the two steps ------------------------------------------------------------


class ProbeSteps(flaxhooks.callbacks.InstrumentedCallback):
    """Records the steps whose results it got, and the parameter-gradient norm."""

    def __init__(self, every):
        self.every = flaxhooks.Every(steps=every)
        self.seen: list[tuple[int, float]] = []

    def inside_step(self, tapped):
        return optax.tree.norm(tapped.grads)

    def take(self, loop, result):
        self.seen.append((loop.step, float(flaxhooks.placement.first_replica(result))))


def test_a_contributor_of_07s_shape_still_contributes_with_a_deprecation_warning():
    """A callback with ``taps``, ``due``, ``inside_step`` and ``take`` that does
    not subclass StepContributor (0.7's protocol) is found by its methods
    until 0.9, with a warning naming the base class; its results are the
    same as a subclass's."""

    class OldStyle(flaxhooks.Callback):
        taps = flaxhooks.step.Taps()

        def __init__(self):
            self.seen: list[tuple[int, float]] = []

        def due(self, step):
            return step % 4 == 0

        def inside_step(self, tapped):
            return optax.tree.norm(tapped.grads)

        def take(self, loop, result):
            self.seen.append((loop.step, float(flaxhooks.placement.first_replica(result))))

    batches = make_batches(12, batch_size=16)
    old, new = OldStyle(), ProbeSteps(every=4)
    with pytest.warns(DeprecationWarning, match=r"OldStyle .* flaxhooks\.step\.StepContributor; subclass it"):
        sgd_trainer(Tapped(), callbacks=[old]).fit(batches, epochs=1)
    sgd_trainer(Tapped(), callbacks=[new]).fit(batches, epochs=1)
    assert [step for step, _ in old.seen] == [4, 8, 12]
    np.testing.assert_allclose([n for _, n in old.seen], [n for _, n in new.seen], rtol=1e-6)


def test_instrumented_step_runs_only_when_due_and_updates_like_the_lean_one(compiles):
    batches = make_batches(12, batch_size=16)
    probe = ProbeSteps(every=4)
    stats = flaxhooks.ActivationStats(every=6)
    instrumented = sgd_trainer(Tapped(), callbacks=[probe, stats])
    final = instrumented.fit(batches, epochs=2)
    lean = sgd_trainer(Tapped())
    reference = lean.fit(batches, epochs=2)
    # Same updates: the perturbations are zeros and the gradients the same.
    for a, b in zip(jax.tree.leaves(final.params), jax.tree.leaves(reference.params), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert [step for step, _ in probe.seen] == [4, 8, 12, 16, 20, 24]
    assert [stats.latest.step] == [24]
    # One variant per set of due callbacks, each compiled once: {probe} at
    # 4, 8, 16, 20; {stats} at 6, 18; {probe, stats} at 12 and 24.
    assert instrumented.runner.traces == {"train_step": 1, "instrumented_step": 3}
    compiles.clear()
    instrumented.fit(batches, epochs=3)  # every step runs again: nothing compiles
    assert compiles == [] and instrumented.runner.traces == {"train_step": 1, "instrumented_step": 3}
    # The reported gradient norm is that of the parameters before the step.
    params = sgd_trainer(Tapped()).fit(batches, steps=3).params
    batch = batches[3]
    grads = jax.grad(lambda p: cross_entropy(Tapped().apply({"params": p}, batch["image"]), batch))(params)
    np.testing.assert_allclose(probe.seen[0][1], optax.tree.norm(grads), rtol=1e-5)


def test_lean_steps_read_nothing_and_nothing_waits(monkeypatch):
    reads = HostReads(monkeypatch)
    stats = flaxhooks.ActivationStats(every=5)
    sgd_trainer(Tapped(), callbacks=[reads, stats]).fit(make_batches(22, batch_size=16), epochs=1)
    # The guard reads every step's loss and gradient norm once the loop has
    # waited for the step anyway (two steps later): none of these reads waits,
    # but for the epoch's last two steps, checked at its end before any
    # epoch-end handler. The statistics are read by no one but a writer.
    assert reads.count == 2 * 22 and reads.unready <= 2 * 2


def test_sown_values_do_not_accumulate_or_reach_the_state():
    class Sower(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.Dense(4)(x)
            self.sow("intermediates", "x", x)
            self.sow("custom", "x", x)
            return nn.Dense(3)(self.perturb("p", x))

    stats = flaxhooks.ActivationStats(every=1, collections=("intermediates", "custom"), capture=None)
    trainer = sgd_trainer(Sower(), callbacks=[stats])
    state = trainer.fit(make_batches(6, batch_size=8), epochs=2)
    assert set(state.model_state) == set()  # no intermediates, custom or perturbations
    assert set(state.params) == {"Dense_0", "Dense_1"}
    assert jax.tree.structure(state.opt_state) == jax.tree.structure(
        optax.sgd(0.1, 0.9).init(state.params)
    )
    assert stats.names == ("x[intermediates]", "x[custom]")
    assert trainer.runner.traces == {"instrumented_step": 1}


# -- nn.scan ------------------------------------------------------------------


class Block(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        y = nn.relu(nn.Dense(5)(x))
        self.sow("intermediates", "out", y)
        return y, None


def scanned(variable_axes):
    class Scanned(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.Dense(5, name="embed")(x)
            x, _ = nn.scan(Block, variable_axes=variable_axes, split_rngs={"params": True}, length=3)(
                name="layers"
            )(x, None)
            return nn.Dense(3, name="head")(x)

    return Scanned()


def test_scanned_layers_are_logged_per_layer():
    stats = flaxhooks.ActivationStats(every=2, capture=None, stats="all")
    grads = flaxhooks.ActivationGradStats(every=2, perturb=nn.Dense)
    batches = make_batches(2, batch_size=8)
    model = scanned({"params": 0, "intermediates": 0, "perturbations": 0})
    trainer = sgd_trainer(model, callbacks=[stats, grads])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        before = trainer.fit(batches, steps=1)
        trainer.fit(batches, steps=2)
    assert stats.names == ("layers/0/out", "layers/1/out", "layers/2/out")
    assert grads.names == ("embed", "layers/0/Dense_0", "layers/1/Dense_0",
                           "layers/2/Dense_0", "head")
    _, sown = model.apply({"params": before.params}, batches[1]["image"], mutable=["intermediates"])
    stacked = sown["intermediates"]["layers"]["out"][0]
    got = stats.latest.to_dict()
    for layer in range(3):
        assert_rows(got[f"layers/{layer}/out"], numpy_stats(stacked[layer]), ACTIVATION_STATS)


def test_a_scan_that_drops_the_collection_warns_how_to_fix_it():
    stats = flaxhooks.ActivationStats(every=1, capture=None)
    trainer = sgd_trainer(scanned({"params": 0}), callbacks=[stats])
    with pytest.warns(UserWarning, match=r"nn.scan module 'layers' drops .*'intermediates'.*"
                                         r"variable_axes=\{'params': 0, 'intermediates': 0\}"):
        trainer.fit(make_batches(1, batch_size=8), steps=1)
    assert stats.names == ()


# -- non-finite values (the guard every Trainer has: tests/loop/test_guard.py) --


@pytest.mark.parametrize("count_nonfinite", [False, True])
def test_statistics_count_the_non_finite_values_of_the_step_the_guard_stops_at(tmp_path, count_nonfinite):
    tensorboard = flaxhooks.TensorBoard(tmp_path, every=1)
    stats = flaxhooks.ActivationStats(every=1, count_nonfinite=count_nonfinite)
    grads = flaxhooks.ActivationGradStats(every=1, count_nonfinite=count_nonfinite)
    trainer = sgd_trainer(Diverging(), callbacks=[tensorboard, stats, grads])
    with pytest.raises(flaxhooks.NonFiniteError, match="'root'") as error:
        trainer.fit(make_batches(10, batch_size=8), epochs=3)
    assert error.value.step == 1
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    # Flushed at the stop: how many values (entries, when counted) went non-finite at step 1.
    counter = events.Scalars("stats/activations/nonfinite")[0]
    assert counter.step == 1 and counter.value >= (1 if not count_nonfinite else 8)
    assert events.Scalars("stats/activation_grads/nonfinite")[0].value >= 1
    assert not [t for t in events.Tags()["scalars"] if t.endswith("/nonfinite") and t.count("/") > 2]


@pytest.mark.parametrize("mode", ["raise", "stop", "warn"])
def test_if_nonfinite_is_deprecated_and_still_sets_the_guard(mode):
    with pytest.warns(DeprecationWarning, match="Trainer\\(if_nonfinite="):
        stats = flaxhooks.ActivationStats(every=1, if_nonfinite=mode)
    trainer = sgd_trainer(Diverging(), callbacks=[stats])
    if mode == "warn":  # the guard warns and training goes on
        trainer.fit(make_batches(6, batch_size=8), epochs=1)
        assert int(trainer.state.step) == 6
    else:
        with pytest.raises(flaxhooks.NonFiniteError):
            trainer.fit(make_batches(6, batch_size=8), epochs=1)


# -- TensorBoard --------------------------------------------------------------


def read_runs(logdir) -> dict[str, EventAccumulator]:
    """Every run under ``logdir`` (``.`` the main one), read."""
    runs = {}
    for path in sorted({Path(p).parent for p in Path(logdir).rglob("*tfevents*")}):
        events = EventAccumulator(str(path), size_guidance={"scalars": 0, "histograms": 0})
        events.Reload()
        runs[str(path.relative_to(logdir))] = events
    return runs


def test_each_layer_is_a_run_with_a_tag_per_statistic_scales_as_log10(tmp_path):
    callbacks = [
        flaxhooks.TensorBoard(tmp_path, every=100),
        flaxhooks.ActivationStats(every=2, histograms=True, bins=10),
        flaxhooks.ActivationGradStats(every=3, histograms=True),
    ]
    sgd_trainer(Tapped(), callbacks=callbacks).fit(make_batches(6, batch_size=8), epochs=1)
    runs = read_runs(tmp_path)
    values = ("hidden", "shared/0", "shared/1", "head")
    # (train: the fit's end writes its 6 steps' scalars.)
    assert set(runs) == {".", "train", *(f"layers/{v}" for v in (*values, "relu"))}
    for value in values:
        assert set(runs[f"layers/{value}"].Tags()["scalars"]) == {
            "stats/activations/mean", "stats/activations/log10_std", "stats/activation_grads/log10_rms"}
    relu = runs["layers/relu"]
    assert set(relu.Tags()["scalars"]) == {
        "stats/activations/mean", "stats/activations/log10_std", "stats/activations/zero_fraction"}
    assert [e.step for e in relu.Scalars("stats/activations/zero_fraction")] == [2, 4, 6]
    assert [e.step for e in runs["layers/head"].Scalars("stats/activation_grads/log10_rms")] == [3, 6]
    main = runs["."]
    assert set(main.Tags()["scalars"]) == {"stats/activations/nonfinite", "stats/activation_grads/nonfinite"}
    assert [e.value for e in main.Scalars("stats/activations/nonfinite")] == [0, 0, 0]
    # Histograms stay in the main run, one tag per value (TensorBoard draws one histogram per run and tag).
    histograms = {f"stats/activations/{v}/histogram" for v in (*values, "relu")}
    histograms |= {f"stats/activation_grads/{v}/histogram" for v in values}
    assert set(main.Tags()["histograms"]) == histograms
    histogram = main.Histograms("stats/activations/relu/histogram")[-1].histogram_value
    assert histogram.num == 8 * 8 and len(histogram.bucket) == 10


def test_the_scale_statistics_are_written_as_their_log10_and_the_rest_as_they_are(tmp_path):
    stats = flaxhooks.ActivationStats(every=2, stats=("mean", "std", "rms", "zero_fraction"))
    grads, params = flaxhooks.ActivationGradStats(every=2, stats="all"), flaxhooks.ParamStats(every=2)
    sgd_trainer(Tapped(), callbacks=[flaxhooks.TensorBoard(tmp_path, every=100), stats, grads, params]).fit(
        make_batches(2, batch_size=8), epochs=1)
    runs = read_runs(tmp_path)
    for callback, scale, linear in ((stats, ("std", "rms"), ("mean", "zero_fraction")),
                                    (grads, ("std", "rms", "l2"), ("mean", "min", "max")),
                                    (params, ("grad_norm", "update_ratio"), ())):
        for name, row in callback.latest.to_dict().items():
            run = runs[f"layers/{name}"]
            for stat in scale:
                got = run.Scalars(f"stats/{callback.prefix}/log10_{stat}")[-1].value
                np.testing.assert_allclose(got, np.log10(row[stat]), rtol=1e-5, err_msg=f"{name} {stat}")
            for stat in linear:
                got = run.Scalars(f"stats/{callback.prefix}/{stat}")[-1].value
                np.testing.assert_allclose(got, row[stat], rtol=1e-6, err_msg=f"{name} {stat}")


def test_the_0_5_per_layer_tags_are_gone_from_the_main_run(tmp_path):
    """0.6 deprecated ``legacy_tags``; 0.7 removed it: per-layer statistics
    live in the ``layers/<layer>`` runs only."""
    with pytest.raises(TypeError, match="legacy_tags"):
        flaxhooks.ActivationStats(every=2, legacy_tags=True)
    stats, params = flaxhooks.ActivationStats(every=2), flaxhooks.ParamStats(every=2)
    sgd_trainer(Tapped(), callbacks=[flaxhooks.TensorBoard(tmp_path, every=100), stats, params]).fit(
        make_batches(2, batch_size=8), epochs=1)
    runs = read_runs(tmp_path)
    layers = set(stats.latest.to_dict())
    assert {f"layers/{name}" for name in layers} <= set(runs)
    per_layer = [tag for tag in runs["."].Tags()["scalars"]
                 if any(tag.startswith(f"stats/{prefix}/{name}/") for prefix in ("activations", "params")
                        for name in layers)]
    assert per_layer == []


class OneRunWriter(flaxhooks.Callback, flaxhooks.writers.Writer):
    """The fit's writer (a ``WriterCallback``) that keeps the scalars (read at
    once) and the charts it is given, and knows no ``run_scalars``."""

    def __init__(self):
        self.written: dict[int, dict[str, dict[str, float]]] = {}  # step -> run -> tag -> value
        self.declared: dict[str, dict[str, list[str]]] = {}

    def open_writer(self, loop):
        return self

    def close_writer(self, loop):
        pass

    def scalars(self, values, step, prefix="", run=""):
        values = values() if callable(values) else values
        written = self.written.setdefault(step, {}).setdefault(run, {})
        written.update({prefix + k: float(v) for k, v in values.items()})

    def charts(self, category, charts, step):
        self.declared.setdefault(category, {}).update(charts)

    def text(self, tag, text, step=0):
        pass

    def histograms(self, values, step):
        pass

    def images(self, values, step):
        pass

    def sync_point(self):
        done = threading.Event()
        done.set()
        return done


class RecordingWriter(OneRunWriter):
    """``OneRunWriter`` that writes several runs at once."""

    def run_scalars(self, values, step):
        for run, tags in (values() if callable(values) else values).items():
            self.scalars(tags, step, run=run)


def test_charts_draw_each_statistic_with_a_line_per_layer_in_execution_order():
    writer = RecordingWriter()
    callbacks = [writer, flaxhooks.ActivationStats(every=2), flaxhooks.ActivationGradStats(every=2),
                 flaxhooks.ActivationStats(every=2, stats=["max"], prefix="extremes"),
                 flaxhooks.ParamStats(every=2)]
    sgd_trainer(Tapped(), callbacks=callbacks).fit(make_batches(4, batch_size=8), epochs=1)
    order = ("hidden", "shared/0", "shared/1", "head", "relu")
    assert writer.declared["activations"] == {
        "mean": ["stats/activations/mean"],
        "std (log10)": ["stats/activations/log10_std"],
        "zero fraction (ReLU outputs)": ["stats/activations/zero_fraction"],
    }
    assert writer.declared["activation gradients"] == {
        "gradient rms (log10)": ["stats/activation_grads/log10_rms"]}
    assert writer.declared["activations (extremes)"] == {"max": ["stats/extremes/max"]}
    assert writer.declared["parameters"] == {
        "gradient norm (log10)": ["stats/params/log10_grad_norm"],
        "update ratio (log10)": ["stats/params/log10_update_ratio"],
    }
    # A run per layer (first written in execution order): each a line of its own on each tag's chart.
    runs = writer.written[4]
    assert [run for run in runs if run] == [f"layers/{v}" for v in order] + ["layers/shared"]
    assert set(runs["layers/hidden"]) == {"stats/activations/mean", "stats/activations/log10_std",
                                          "stats/activation_grads/log10_rms", "stats/extremes/max",
                                          "stats/params/log10_grad_norm", "stats/params/log10_update_ratio"}
    every_tag = {tag for charts in writer.declared.values() for tags in charts.values() for tag in tags}
    assert every_tag <= {tag for tags in runs.values() for tag in tags}  # every charted tag is written


def test_a_writer_without_runs_gets_the_layers_run_in_each_tag():
    writer = OneRunWriter()  # a writer of its own, written before writers had runs
    sgd_trainer(Tapped(), callbacks=[writer, flaxhooks.ActivationStats(every=2)]).fit(
        make_batches(2, batch_size=8), epochs=1)
    written = writer.written[2][""]
    assert {"layers/head/stats/activations/mean", "layers/relu/stats/activations/zero_fraction",
            "stats/activations/nonfinite"} <= set(written)


def test_the_recipes_cnn_writes_fewer_than_30_tags(tmp_path):
    from recipes.models import CNN, cross_entropy_loss

    rng = np.random.default_rng(0)
    data = [{"image": rng.random((8, 28, 28, 1), dtype=np.float32), "label": rng.integers(0, 10, 8)}
            for _ in range(2)]
    callbacks = [flaxhooks.TensorBoard(tmp_path, every=1),
                 flaxhooks.ActivationStats(every=2, histograms=True),
                 flaxhooks.ActivationGradStats(every=2, histograms=True), flaxhooks.ParamStats(every=2)]
    trainer = flaxhooks.Trainer(CNN(), optax.sgd(0.1, momentum=0.9), cross_entropy_loss, callbacks=callbacks)
    trainer.fit(data, epochs=1)
    tags: set[str] = set()
    for events in read_runs(tmp_path).values():
        tags |= set(events.Tags()["scalars"]) | set(events.Tags()["histograms"])
    stats = {t for t in tags if t.startswith("stats/")}
    layers, relus = ("Conv_0", "Conv_1", "Dense_0", "Dense_1"), ("Conv_0_relu", "Conv_1_relu", "Dense_0_relu")
    want = {"stats/activations/mean", "stats/activations/log10_std", "stats/activations/zero_fraction",
            "stats/activation_grads/log10_rms", "stats/params/log10_grad_norm",
            "stats/params/log10_update_ratio", "stats/activations/nonfinite",
            "stats/activation_grads/nonfinite"}
    want |= {f"stats/activations/{v}/histogram" for v in layers + relus}
    want |= {f"stats/activation_grads/{v}/histogram" for v in layers}
    assert stats == want and len(stats) == 19
    assert len(tags) <= 30, sorted(tags - stats)  # with the training scalars
    assert trainer.runner.traces == {"train_step": 1, "instrumented_step": 1}


# -- the model's output, when it is a module's ----------------------------------------------


class ReturnsItsHead(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(3, name="head")(nn.relu(nn.Dense(8, name="hidden")(x)))


class Residual(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.Dense(3, name="embed")(x)
        return nn.Dense(3, name="head")(x) + x


class NNXReturnsItsHead(nnx.Module):
    def __init__(self, rngs):
        self.hidden, self.head = nnx.Linear(5, 8, rngs=rngs), nnx.Linear(8, 3, rngs=rngs)

    def __call__(self, x):
        return self.head(nnx.relu(self.hidden(x)))


class NNXResidual(nnx.Module):
    def __init__(self, rngs):
        self.embed, self.head = nnx.Linear(5, 3, rngs=rngs), nnx.Linear(3, 3, rngs=rngs)

    def __call__(self, x):
        x = self.embed(x)
        return self.head(x) + x


@pytest.mark.parametrize("model, repeated", [
    (ReturnsItsHead(), True), (Residual(), False),
    (NNXReturnsItsHead(nnx.Rngs(0)), True), (NNXResidual(nnx.Rngs(0)), False),
], ids=["linen-returns-head", "linen-residual", "nnx-returns-head", "nnx-residual"])
def test_the_models_output_is_logged_once(model, repeated):
    stats, grads = flaxhooks.ActivationStats(every=1), flaxhooks.ActivationGradStats(every=1)
    every = flaxhooks.ActivationStats(every=1, stats="all", prefix="every")
    every_grad = flaxhooks.ActivationGradStats(every=1, stats="all", prefix="every_grad")
    trainer = sgd_trainer(model, callbacks=[stats, grads, every, every_grad])
    trainer.fit(make_batches(2, batch_size=8), steps=1)
    for callback in (stats, grads, every, every_grad):
        assert callback.names[-1] == "output"  # found, whatever is logged
    assert ("output" in stats.latest.names) is not repeated
    assert ("output" in grads.latest.names) is not repeated
    assert every.latest.names[-1] == every_grad.latest.names[-1] == "output"  # stats="all": every value
    if repeated:  # the very same values: the same figures
        table = every.latest.to_dict()
        assert table["output"] == table["head"]
        gradients = every_grad.latest.to_dict()
        assert gradients["output"] == gradients["head"]
    assert trainer.runner.traces == {"instrumented_step": 1}


# -- per-module parameter figures ---------------------------------------------------------------


def test_param_stats_match_a_hand_computed_update(devices):
    batches = make_batches(4, batch_size=16)
    params_stats = flaxhooks.ParamStats(every=3)
    trainer = sgd_trainer(Tapped(), callbacks=[params_stats], devices=devices)
    before = jax.device_get(trainer.fit(batches, steps=2))
    trainer.fit(batches, steps=3)

    batch = batches[2]
    loss = lambda p: cross_entropy(Tapped().apply({"params": p}, batch["image"]), batch)  # noqa: E731
    grads = jax.grad(loss)(before.params)
    updates, _ = optax.sgd(0.1, 0.9).update(grads, before.opt_state, before.params)
    latest = params_stats.latest
    assert latest.step == 3 and latest.names == ("head", "hidden", "shared")
    got = latest.to_dict()
    for module in latest.names:
        norm = float(optax.tree.norm(grads[module]))
        ratio = float(optax.tree.norm(updates[module]) / optax.tree.norm(before.params[module]))
        assert got[module] == pytest.approx({"grad_norm": norm, "update_ratio": ratio}, rel=2e-4)
    assert trainer.runner.traces == {"train_step": 1, "instrumented_step": 1}


def test_param_stats_name_nnx_modules_and_write_their_tags(tmp_path):
    model = NNXResidual(nnx.Rngs(0))
    params_stats = flaxhooks.ParamStats(every=1)
    trainer = flaxhooks.Trainer(model, optax.adam(0.01), cross_entropy,
                                callbacks=[flaxhooks.TensorBoard(tmp_path, every=10), params_stats])
    trainer.fit(make_batches(2, batch_size=8), epochs=1)
    assert params_stats.latest.names == ("embed", "head")
    runs = read_runs(tmp_path)
    assert {"layers/embed", "layers/head"} <= set(runs)
    ratio = runs["layers/head"].Scalars("stats/params/log10_update_ratio")
    assert [e.step for e in ratio] == [1, 2] and all(e.value < 0 for e in ratio)  # ratios below 1
