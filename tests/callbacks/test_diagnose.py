"""Diagnose: each finding from a model broken on purpose names the right
layer and kind within a bounded number of steps, once; healthy models give
none (the end-to-end runs are in tests/recipes/test_diagnose_healthy.py)."""

from __future__ import annotations

import dataclasses
import io
import logging

import flax.linen as nn
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from rich.console import Console
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import flaxhooks
from flaxhooks.diagnose import LossThresholds, Thresholds
from tests.helpers import cross_entropy


class Findings(flaxhooks.Callback):
    """What the bus says: every ``finding`` event's payload."""

    def __init__(self):
        self.seen = []

    def on_finding(self, loop):
        self.seen.append(loop.payload)


def data(n=512, features=8, seed=0, scale=1.0, batch_size=32):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, features)).astype(np.float32) * scale
    w = rng.normal(size=(features, 3))
    label = np.argmax(x @ w, axis=1).astype(np.int32)  # learnable
    return flaxhooks.ArrayLoader({"image": x, "label": label}, batch_size, seed=seed)


def fit(model, optimizer=None, steps=40, window=10, every=1, train=None, **kwargs):
    findings = Findings()
    diagnose = flaxhooks.Diagnose(every=every, window=window, table=False, **kwargs)
    trainer = flaxhooks.Trainer(model, optimizer or optax.adam(1e-2), cross_entropy,
                                callbacks=[diagnose, findings])
    trainer.fit(train or data(), steps=steps)
    assert findings.seen == diagnose.findings  # every finding is an event, and in the table
    return diagnose.findings, trainer


def kinds(findings):
    return [(f.kind, f.layer) for f in findings]


class Killed(nn.Module):
    """A ReLU layer killed from the start by a large negative bias."""

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(32)(x))
        x = nn.relu(nn.Dense(32, bias_init=nn.initializers.constant(-20.0), name="killed")(x))
        x = nn.relu(nn.Dense(32, name="after")(x))
        return nn.Dense(3)(x)


def test_a_layer_killed_by_its_bias_is_named_once_at_the_first_window(caplog):
    with caplog.at_level(logging.WARNING, logger="flaxhooks"):
        found, _ = fit(Killed())
    dead = [f for f in found if f.kind == "dead_units"]
    assert [(f.layer, f.step, f.since) for f in dead] == [("killed", 10, 1)]  # said once, at its first window
    assert "100% of its units were never positive and got no gradient" in dead[0].evidence
    assert "bias init" in dead[0].advice
    # Its consequences are named in its finding, not in their own: the layer before it
    # gets no gradient, the one after it a constant input.
    assert "so 'Dense_0', 'after' get no gradient or a constant input" in dead[0].evidence
    assert [f for f in found if f.kind == "frozen_params"] == []
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and said[0] == dead[0].message()


class Healthy(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.gelu(nn.Dense(32)(x))
        x = nn.gelu(nn.Dense(32)(x))
        return nn.Dense(3)(x)


def test_a_healthy_model_gives_no_finding():
    found, trainer = fit(Healthy(), steps=60)
    assert found == []
    # Due at every step: only the diagnosed step, compiled once (the guard compiles nothing).
    assert trainer.runner.traces == {"instrumented_step": 1}


def test_every_n_steps_runs_the_lean_step_between_and_compiles_each_once():
    _, trainer = fit(Healthy(), steps=40, every=4)
    assert trainer.runner.traces == {"train_step": 1, "instrumented_step": 1}


def test_sampling_every_step_spreads_a_windows_budget_over_its_steps():
    from flaxhooks.diagnose import chosen_rows, step_entries

    # 512 examples a step: all of them read while a window samples 10 steps, fewer when it samples 40.
    read = {}
    for every in (4, 1):
        diagnose = flaxhooks.Diagnose(every=every, window=40, table=False, heatmaps=False)
        trainer = flaxhooks.Trainer(Healthy(), optax.adam(1e-2), cross_entropy, callbacks=[diagnose])
        trainer.fit(data(batch_size=512), steps=8)
        window = diagnose.sums_of(diagnose.carry)
        assert float(window.steps) == 8 // every
        units = np.array(diagnose.carry.layout.units)
        read[every] = np.asarray(window.layers[:, 0]) / float(window.steps) / units  # rows a step
    np.testing.assert_array_equal(read[4], [512, 512, 512])
    assert step_entries(10) == step_entries(None) and step_entries(40) < step_entries(10)
    expected = [len(chosen_rows(512, 1, units, step_entries(40))) for units in (32, 32, 3)]
    np.testing.assert_array_equal(read[1], expected)
    assert read[1][0] == 256  # 327,680 entries over 40 steps: 256 rows of 32, every other example


class Sigmoids(nn.Module):
    depth: int = 10

    @nn.compact
    def __call__(self, x):
        for _ in range(self.depth):
            x = nn.sigmoid(nn.Dense(32)(x))
        return nn.Dense(3)(x)


def test_a_deep_sigmoid_stack_has_vanishing_gradients_named_where_they_begin():
    found, _ = fit(Sigmoids(), optax.sgd(0.1), steps=20)
    vanishing = [f for f in found if f.kind == "vanishing_gradients"]
    assert len(vanishing) == 1 and vanishing[0].step == 10
    # Each sigmoid divides the gradient by 4 or more: the first layers, far below the last one's.
    assert vanishing[0].layer in {f"Dense_{i}" for i in range(2, 8)}
    assert vanishing[0].values["ratio"] < 1e-4


class Saturated(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = jnp.tanh(nn.Dense(64, kernel_init=nn.initializers.normal(3.0), name="wide")(x))
        return nn.Dense(3)(x)


def test_tanh_units_driven_into_their_flat_region_are_saturated():
    found, _ = fit(Saturated(), optax.sgd(0.01), steps=20)
    assert kinds(found) == [("saturation", "wide")]
    assert float(found[0].values["saturated"]) > 0.5


def test_parameters_masked_out_of_the_optimizer_are_frozen():
    model = nn.Sequential([nn.Dense(16, name="frozen"), nn.relu, nn.Dense(3)])
    labels = lambda params: {k: "freeze" if k == "layers_0" else "train" for k in params}  # noqa: E731
    optimizer = optax.multi_transform({"train": optax.adam(1e-2), "freeze": optax.set_to_zero()}, labels)
    found, _ = fit(model, optimizer, steps=20)
    frozen = [f for f in found if f.kind == "frozen_params"]
    assert [f.layer for f in frozen] == ["layers_0"]
    assert "while a gradient reaches its outputs" in frozen[0].evidence


def test_a_learning_rate_far_too_high_is_named():
    found, _ = fit(Healthy(), optax.adam(3.0), steps=20)
    high = [f for f in found if f.kind == "update_ratio_high"]
    assert high and high[0].step == 10 and "learning rate" in high[0].advice


def test_a_learning_rate_far_too_low_is_named():
    found, _ = fit(Healthy(), optax.sgd(1e-7), steps=20)
    assert [f.kind for f in found] == ["update_ratio_low"]


class Confident(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(32)(x))
        return nn.Dense(3, kernel_init=nn.initializers.normal(20.0), name="head")(x)


def test_an_initial_loss_far_above_log_classes_is_said_at_the_first_step():
    found, _ = fit(Confident(), steps=12)
    initial = [f for f in found if f.kind == "initial_loss"]
    assert len(initial) == 1 and initial[0].step == 1
    assert "log(3)" in initial[0].evidence or "1.10" in initial[0].evidence


def test_a_loss_spike_is_named_with_the_steps_it_began():
    rng = np.random.default_rng(0)
    batches = [{"image": rng.normal(size=(32, 8)).astype(np.float32),
                "label": rng.integers(0, 3, 32).astype(np.int32)} for _ in range(80)]
    for batch in batches[60:66]:  # six batches of garbage, 100 times the scale
        batch["image"] *= 100.0
    loss = LossThresholds(spike_history=20, outlier_history=20)
    found, _ = fit(Healthy(), optax.sgd(0.01), steps=80, window=1000, train=batches, loss=loss)
    spikes = [f for f in found if f.kind == "loss_spike"]
    assert len(spikes) == 1 and spikes[0].since == 61


@dataclasses.dataclass(frozen=True)
class Config:
    deterministic: bool = False
    rate: float = 0.5


class ConfigMode(nn.Module):
    """Like Flax's lm1b TransformerLM: the mode sits in the config."""

    config: Config

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(32)(x))
        x = nn.Dropout(self.config.rate, deterministic=self.config.deterministic)(x)
        return nn.Dense(3)(x)


def test_dropout_left_on_in_evaluation_is_said_before_training_and_on_every_eval_line():
    held_out = {"image": np.ones((16, 8), np.float32), "label": np.zeros(16, np.int32)}
    for eval_model, said in ((None, [("dropout_in_eval", 0)]), (ConfigMode(Config(deterministic=True)), [])):
        findings, printed, bar = Findings(), io.StringIO(), io.StringIO()
        trainer = flaxhooks.Trainer(
            flaxhooks.as_model(ConfigMode(Config()), eval_model=eval_model), optax.adam(1e-2), cross_entropy,
            callbacks=[flaxhooks.Diagnose(window=1000, table=False), findings,
                       flaxhooks.Evaluate(held_out, every=1, batch_size=8),
                       flaxhooks.ConsoleLog(100, stream=printed),
                       flaxhooks.Progress(console=Console(file=bar, width=300))])
        trainer.fit(data(), steps=2)
        assert [(f.kind, f.step) for f in findings.seen] == said  # given the eval-mode twin, nothing
        if said:
            assert "eval_model=" in findings.seen[0].advice
        # Every evaluation's numbers were measured with dropout on: each line says so after them.
        caveat = "  (dropout on: see finding dropout_in_eval)" if said else ""
        for output in (printed.getvalue(), bar.getvalue()):
            lines = [line for line in output.splitlines() if line.startswith("eval at step")]
            assert len(lines) == 2, output
            assert all(line.endswith(f"accuracy {float(line.split('accuracy ')[1].split()[0]):.4g}{caveat}")
                       for line in lines), lines
        summary = bar.getvalue().splitlines()[-1]  # its last field: "| eval loss ... accuracy ..."
        assert summary.endswith(caveat) and summary.count("dropout on") == bool(said)


class NNXKilled(nnx.Module):
    def __init__(self, rngs):
        self.first = nnx.Linear(8, 32, rngs=rngs)
        self.killed = nnx.Linear(32, 32, bias_init=nnx.initializers.constant(-20.0), rngs=rngs)
        self.head = nnx.Linear(32, 3, rngs=rngs)

    def __call__(self, x):
        return self.head(nnx.relu(self.killed(nnx.relu(self.first(x)))))


def test_an_nnx_model_is_diagnosed_by_the_same_paths():
    found, _ = fit(NNXKilled(nnx.Rngs(0)))
    assert ("dead_units", "killed") in kinds(found)


def test_findings_reach_tensorboard_the_report_and_the_table(tmp_path, capsys):
    tensorboard = flaxhooks.TensorBoard(tmp_path / "tb", every=5)
    diagnose = flaxhooks.Diagnose(every=1, window=10, report_dir=tmp_path / "report")
    trainer = flaxhooks.Trainer(Killed(), optax.adam(1e-2), cross_entropy, callbacks=[tensorboard, diagnose])
    trainer.fit(data(), steps=30)
    events = EventAccumulator(str(tmp_path / "tb"), size_guidance={"images": 0, "tensors": 0})
    events.Reload()
    assert [e.value for e in events.Scalars("health/dead_units")] == [1.0, 1.0, 1.0]
    # A counter only for the kinds that were found.
    assert [t for t in events.Tags()["scalars"] if t.startswith("health/")] == ["health/dead_units"]
    texts = [t for t in events.Tags()["tensors"] if t.startswith("health/findings")]
    assert texts
    images = events.Images("stats/heatmaps/gradient_rms")
    # The first window's, then at most one a minute (HEATMAP_SECONDS), and the last at the fit's end.
    assert [i.step for i in images] == [10, 30] and images[-1].width > 0
    # The last one is the report's file: the figure of every window so far, as a PNG file.
    png = (tmp_path / "report" / "gradient_rms.png").read_bytes()
    assert images[-1].encoded_image_string == png
    figure = diagnose.figures()["gradient_rms"]
    width, height = figure.get_size_inches() * figure.dpi
    assert (images[-1].height, images[-1].width) == (round(height), round(width))
    assert diagnose.pictures()["gradient_rms"].shape == (round(height), round(width), 3)
    axes = figure.axes[0]
    assert [t.get_text() for t in axes.get_yticklabels()] == ["Dense_0", "killed", "after", "Dense_1"]
    assert [t.get_text() for t in axes.get_xticklabels()] == ["10", "20", "30"]
    assert axes.get_title() == "gradient rms" and axes.images[0].get_array().shape == (4, 3)
    # TensorBoard keeps one kind of data per tag: a heatmap under a scalar's tag would never show.
    assert sorted(events.Tags()["images"]) == [f"stats/heatmaps/{name}" for name in
                                               ("dead_units", "gradient_rms", "update_ratio")]
    assert not set(events.Tags()["images"]) & set(events.Tags()["scalars"])
    assert sorted(p.name for p in (tmp_path / "report").iterdir()) == [
        "dead_units.png", "findings.md", "gradient_rms.png", "update_ratio.png"]
    report = (tmp_path / "report" / "findings.md").read_text()
    assert report.startswith("# Diagnose") and "**dead_units** at step 10: `killed`" in report
    table = capsys.readouterr().err
    assert "Diagnose" in table and "dead_units" in table and "killed" in table


def test_heatmaps_are_on_where_matplotlib_is_and_asked_for_without_it_name_the_extra(monkeypatch, caplog):
    import importlib.util
    import sys

    assert flaxhooks.Diagnose().heatmaps is (importlib.util.find_spec("matplotlib") is not None)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # what an import finds where it is not installed
    with pytest.raises(ImportError, match=r"pip install 'flaxhooks\[figures\]'"):
        flaxhooks.Diagnose(heatmaps=True)
    assert not flaxhooks.Diagnose(heatmaps=False).heatmaps
    diagnose = flaxhooks.Diagnose(every=1, window=10, table=False)
    assert not diagnose.heatmaps
    trainer = flaxhooks.Trainer(Killed(), optax.adam(1e-2), cross_entropy, callbacks=[diagnose])
    with caplog.at_level(logging.INFO, logger="flaxhooks"):
        trainer.fit(data(), steps=10)
        trainer.fit(data(), steps=10)
    said = [r.getMessage() for r in caplog.records if "heatmaps" in r.getMessage()]
    assert said == ["Diagnose draws no heatmaps: matplotlib is not installed "
                    "(pip install 'flaxhooks[figures]')"]
    assert diagnose.figures() == {}


def test_the_table_goes_to_the_console_given(capsys):
    console = Console(file=io.StringIO(), width=200, record=True)
    diagnose = flaxhooks.Diagnose(every=1, window=10, console=console)
    trainer = flaxhooks.Trainer(Killed(), optax.adam(1e-2), cross_entropy, callbacks=[diagnose])
    trainer.fit(data(), steps=10)
    table = console.export_text()
    assert "Diagnose: what was found" in table and "dead_units" in table and "killed" in table
    assert "Diagnose" not in capsys.readouterr().err  # not on stderr as well


def test_the_guards_finding_is_in_the_table_too():
    class Diverging(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(3)(jnp.sqrt(nn.Dense(4, name="encoder")(x)))

    diagnose = flaxhooks.Diagnose(window=1000, table=False)
    trainer = flaxhooks.Trainer(Diverging(), optax.sgd(0.1), cross_entropy, callbacks=[diagnose])
    with pytest.raises(flaxhooks.NonFiniteError):
        trainer.fit(data(), steps=10)
    assert [f.kind for f in diagnose.findings] == ["nonfinite"]


def test_thresholds_are_checked_and_configurable():
    with pytest.raises(ValueError, match="window"):
        flaxhooks.Diagnose(window=0)
    strict = Thresholds(dead_fraction=0.1)  # keras-contrib's
    assert flaxhooks.Diagnose(thresholds=strict).thresholds.dead_fraction == 0.1


class Amplifying(nn.Module):
    """A deep linear stack whose weights grow the gradient at every layer back from the loss."""

    @nn.compact
    def __call__(self, x):
        for _ in range(7):
            x = nn.Dense(32, kernel_init=nn.initializers.normal(1.0))(x)
        return nn.Dense(3, kernel_init=nn.initializers.normal(1e-3))(x)


def test_gradients_that_grow_toward_the_input_are_exploding():
    found, _ = fit(Amplifying(), optax.sgd(1e-9), steps=10)
    exploding = [f for f in found if f.kind == "exploding_gradients"]
    assert len(exploding) == 1 and exploding[0].step == 10
    assert exploding[0].values["ratio"] > 1e4 and "clip" in exploding[0].advice


class Dormant(nn.Module):
    """A ReLU layer most of whose units barely ever output anything (ReDo's dormant units)."""

    @nn.compact
    def __call__(self, x):
        def init(key, shape, dtype):
            kernel = nn.initializers.lecun_normal()(key, shape, dtype)
            return kernel.at[:, : 3 * shape[1] // 4].multiply(1e-4)  # three quarters nearly silent

        x = nn.relu(nn.Dense(64, kernel_init=init, name="sleepy")(x))
        return nn.Dense(3)(x)


def test_units_that_barely_fire_are_dormant_not_dead():
    found, _ = fit(Dormant(), optax.sgd(1e-4), steps=10)
    assert kinds(found) == [("dormant_units", "sleepy")]
    assert found[0].values["dormant"] >= 0.7


def test_gradient_accumulation_is_not_frozen_parameters():
    # optax.MultiSteps updates every 32nd step only: no step sampled here changes anything.
    found, _ = fit(Healthy(), optax.MultiSteps(optax.adam(1e-2), every_k_schedule=32), steps=40, every=10,
                   window=40)
    assert [f for f in found if f.kind == "frozen_params"] == []


def test_a_nan_let_through_by_the_guard_is_no_dead_layer():
    rng = np.random.default_rng(0)
    batches = [{"image": rng.normal(size=(32, 8)).astype(np.float32),
                "label": rng.integers(0, 3, 32).astype(np.int32)} for _ in range(20)]
    batches[3]["image"][0, 0] = np.nan
    findings = Findings()
    diagnose = flaxhooks.Diagnose(every=1, window=10, table=False)
    trainer = flaxhooks.Trainer(Healthy(), optax.adam(1e-2), cross_entropy, callbacks=[diagnose, findings],
                                if_nonfinite="warn")
    trainer.fit(batches, steps=20)
    assert [f.kind for f in findings.seen if f.kind in ("dead_units", "frozen_params")] == []
