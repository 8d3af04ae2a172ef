"""Several steps per dispatch (``Trainer(steps_per_dispatch=k)``): the same training and the same record
of every callback as one step per dispatch, stops and faults at the dispatch's end, compile counts."""

from __future__ import annotations

import io
import re

import jax
import numpy as np
import pytest

import flaxhooks
from flaxhooks import Every
from tests.callbacks.test_activations import read_runs
from tests.helpers import Recorder, make_batches, resume_data, resume_trainer, sgd_trainer, tree_allclose


class LossesRead(flaxhooks.Callback):
    def __init__(self):
        self.read = []

    def on_loss_read(self, loop):
        self.read.append((loop.payload.step, loop.payload.loss, loop.payload.grad_norm))


def _record(tmp_path, k: int, epochs: int = 2, **options):
    """One run of the resume Trainer (checkpoints every 5 steps, evaluation each epoch, TensorBoard at
    every step) with activation statistics every 3 steps, a console log every 4 and an event recorder."""
    workdir = tmp_path / f"k{k}"
    console = io.StringIO()
    recorder, losses = Recorder(), LossesRead()
    trainer = resume_trainer(str(workdir), every=5, callbacks=[
        flaxhooks.ActivationStats(every=3), flaxhooks.ConsoleLog(4, stream=console), recorder, losses],
        steps_per_dispatch=k, **options)
    state = trainer.fit(resume_data(), epochs=epochs)
    checkpoint = next(cb for cb in trainer.callbacks if isinstance(cb, flaxhooks.Checkpoint))
    checkpoint.wait()
    scalars = {run: {tag: [(e.step, e.value) for e in events.Scalars(tag)]
                     for tag in events.Tags()["scalars"] if not tag.startswith("throughput")
                     and not tag.startswith("train/") or tag in ("train/loss",)}
               for run, events in read_runs(workdir / "tensorboard").items()}
    lines = [re.sub(r"\d+(\.\d+)? ?(steps/s|s\b|ms\b)", "<time>", line)
             for line in console.getvalue().splitlines()]
    return {"state": jax.device_get(jax.tree.leaves(state)), "events": recorder.log, "losses": losses.read,
            "scalars": scalars, "console": lines,
            "saved": checkpoint.saved_steps(), "traces": dict(trainer.runner.traces)}


def test_every_step_and_every_callbacks_record_are_the_same_with_several_steps_per_dispatch(tmp_path):
    one, four, seven = (_record(tmp_path, k) for k in (1, 4, 7))
    for other in (four, seven):
        # The same steps unrolled into one program (on CPU): XLA fuses them a little differently.
        for a, b in zip(one["state"], other["state"], strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
        # Losses are read where the host waits anyway: later in a dispatch of several, the same ones in order.
        assert [e for e in other["events"] if e[1] != "loss_read"] == \
            [e for e in one["events"] if e[1] != "loss_read"]
        assert other["losses"] == one["losses"]
        assert other["saved"] == one["saved"]
        assert other["console"] == one["console"]
        assert other["scalars"].keys() == one["scalars"].keys()
        for run, tags in one["scalars"].items():
            assert other["scalars"][run].keys() == tags.keys(), run
            for tag, points in tags.items():
                got = other["scalars"][run][tag]
                assert [s for s, _ in got] == [s for s, _ in points], (run, tag)
                np.testing.assert_allclose([v for _, v in got], [v for _, v in points], rtol=1e-6,
                                           err_msg=f"{run} {tag}")
    # 12 steps, 6 an epoch: statistics at 3, 6, 9, 12 (alone, instrumented); saves after 5 and 10.
    assert one["traces"] == {"train_step": 1, "instrumented_step": 1}
    assert four["traces"]["instrumented_step"] == 1 and four["traces"]["train_steps"] <= 2
    print(one["traces"], four["traces"], seven["traces"])


def test_a_tail_shorter_than_k_runs_in_powers_of_two_compiled_once_for_every_epoch(compiles):
    batches = make_batches(13, batch_size=8)  # 13 steps an epoch: 7 + 4 + 2 with k = 7
    trainer = sgd_trainer(steps_per_dispatch=7)
    trainer.fit(batches, epochs=1)
    assert dict(trainer.runner.traces) == {"train_steps": 3}
    compiled = len(compiles)
    state = trainer.fit(batches, epochs=3)
    assert len(compiles) == compiled and dict(trainer.runner.traces) == {"train_steps": 3}
    assert int(state.step) == 3 * 13  # no batch dropped
    one = sgd_trainer().fit(batches, epochs=3)
    assert tree_allclose(state.params, one.params, rtol=1e-6, atol=1e-7)


class Planned(flaxhooks.Callback):
    """Records each step's dispatch end; ends a dispatch where ``ends`` says."""

    def __init__(self, ends=()):
        self.ends, self.seen = set(ends), []

    def dispatch_ends_at(self, step):
        return step in self.ends

    def on_step_end(self, loop):
        self.seen.append((loop.step, loop.dispatch_end))


def test_dispatches_end_where_a_callback_a_contributor_an_epoch_or_the_fit_says():
    planned = Planned(ends={3})
    stats = flaxhooks.ActivationStats(every=Every(steps=6))
    trainer = sgd_trainer(callbacks=[planned, stats], steps_per_dispatch=4)
    trainer.fit(make_batches(8, batch_size=8), steps=11)  # 8 steps an epoch
    ends = dict(planned.seen)
    # 1-3 as 2 + 1 (ended as asked); 4-5 (before the statistics' step 6, alone); 7-8 (the epoch's end);
    # 9-11 as 2 + 1 (the fit's end): lengths k or a power of two below it.
    assert [ends[s] for s in range(1, 12)] == [2, 2, 3, 5, 5, 6, 8, 8, 10, 10, 11]


class ReadsState(flaxhooks.Callback):
    def __init__(self, declared: bool):
        self.declared, self.steps = declared, []

    def dispatch_ends_at(self, step):
        return self.declared and step == 3

    def on_step_end(self, loop):
        if loop.step == 3:
            self.steps.append(int(loop.state.step))


def test_the_state_inside_a_dispatch_is_refused_naming_the_fix_and_given_where_a_dispatch_ends():
    with pytest.raises(flaxhooks.CallbackError, match=re.escape(
            "ReadsState: loop.state at step 3, inside a dispatch of several steps (Trainer(steps_per_dispatch"
            "=...)) that keeps only the state after its last step, 4: define dispatch_ends_at(step) on the "
            "callback, True for step 3, so a dispatch ends there")) as raised:
        sgd_trainer(callbacks=[ReadsState(False)], steps_per_dispatch=4).fit(make_batches(8, 8), epochs=1)
    assert isinstance(raised.value.__cause__, flaxhooks.MidDispatchError)
    reads = ReadsState(True)
    sgd_trainer(callbacks=[reads], steps_per_dispatch=4).fit(make_batches(8, 8), epochs=1)
    assert reads.steps == [3]


@pytest.mark.parametrize("k", [0, -1, True, 2.0, "auto4"])
def test_steps_per_dispatch_must_be_a_whole_number_of_at_least_1(k):
    with pytest.raises(ValueError, match="steps_per_dispatch must be"):
        sgd_trainer(steps_per_dispatch=k)


def test_a_nan_inside_a_dispatch_is_named_at_its_step_keeps_the_state_before_it_and_saves_nothing_after(
        tmp_path):
    from tests.loop.test_guard import LogOfData, log_data

    said = {}
    for k in (1, 4):
        checkpoint = flaxhooks.Checkpoint(tmp_path / f"k{k}", every=4)
        trainer = sgd_trainer(LogOfData(), callbacks=[checkpoint], steps_per_dispatch=k)
        with pytest.raises(flaxhooks.NonFiniteError) as raised:
            trainer.fit(log_data(12, bad_step=6), epochs=1)  # steps 5-8 in one dispatch with k = 4
        checkpoint.wait()
        assert raised.value.step == 6
        assert int(trainer.state.step) == 5  # the state from before it
        assert checkpoint.saved_steps() == [4]
        said[k] = re.sub(r", in [\d.]+ s\)", ")", str(raised.value))
    assert said[4] == said[1]
    assert "'head' (a Dense)" in said[4]


def test_sigterm_inside_a_dispatch_stops_at_its_end_and_resumes_under_another_k_as_if_uninterrupted(tmp_path):
    import signal

    from tests.callbacks.test_checkpoint import FailAt, assert_same_logs, logged

    reference = resume_trainer(tmp_path / "reference", every=9).fit(resume_data(), epochs=3)
    # Six steps an epoch, saves after 9 and 18: with k = 4, steps 7 and 8 are one dispatch.
    interrupted = resume_trainer(tmp_path / "run", [FailAt(7, signal.SIGTERM)], every=9, steps_per_dispatch=4)
    with pytest.raises(flaxhooks.TrainingInterrupted) as raised:
        interrupted.fit(resume_data(), epochs=3)
    assert raised.value.step == 8
    checkpoint = interrupted.bus.of(flaxhooks.Checkpoint)[0]
    assert checkpoint.saved_steps()[-1] == 8  # the final checkpoint, at the dispatch's end
    assert logged(tmp_path / "run" / "tensorboard")["train/loss"][-1][0] == 8
    # Written with k = 4, resumed with k = 1 to the second epoch's end, then with k = 4 again.
    assert int(resume_trainer(tmp_path / "run", every=9).fit(resume_data(), epochs=2, resume=True).step) == 12
    state = resume_trainer(tmp_path / "run", every=9, steps_per_dispatch=4).fit(
        resume_data(), epochs=3, resume=True)
    for got, expected in zip(jax.tree.leaves(state), jax.tree.leaves(reference), strict=True):
        np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-7)
    assert_same_logs(logged(tmp_path / "run" / "tensorboard"), logged(tmp_path / "reference" / "tensorboard"))


@pytest.mark.parametrize("where", ["1 device", "8 devices FSDP"])
def test_several_steps_per_dispatch_train_as_one_step_per_dispatch_on_one_device_and_with_fsdp(where):
    if where == "1 device":
        options = {"devices": jax.local_devices()[:1]}
    else:
        if len(jax.local_devices()) < 8:
            pytest.skip("needs 8 devices")
        options = {"shard": flaxhooks.FSDP(min_size=16)}
    batches = make_batches(7, batch_size=16)
    states = {k: sgd_trainer(steps_per_dispatch=k, **options).fit(batches, epochs=2) for k in (1, 4, 7)}
    for k in (4, 7):
        for got, expected in zip(jax.tree.leaves(states[k]), jax.tree.leaves(states[1]), strict=True):
            assert got.sharding == expected.sharding
            np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-7)


def test_diagnose_finds_the_same_spike_at_the_same_step_and_layer_with_several_steps_per_dispatch():
    import optax

    from flaxhooks.diagnose import LossThresholds, SpikeThresholds
    from tests.callbacks.test_diagnose_spikes import MLP, batches
    from tests.helpers import cross_entropy

    data = batches(spike_at=41)
    found = {}
    for k in (1, 4):
        diagnose = flaxhooks.Diagnose(every=10, window=1000, table=False, heatmaps=False,
                                      spikes=SpikeThresholds(history=20),
                                      loss=LossThresholds(spike_history=20, outlier_history=20))
        flaxhooks.Trainer(MLP(), optax.sgd(0.05), cross_entropy, callbacks=[diagnose],
                          steps_per_dispatch=k).fit(data, steps=60)
        # Replayed where the loss was read: at another step with k = 4, the same layer found.
        found[k] = [(f.kind, f.step, f.since, f.layer, f.values.get("batch")) for f in diagnose.findings]
    assert ("grad_norm_spike", 41, 41, "Dense_1", {"epoch": 0, "index": 40}) in found[1]
    assert found[4] == found[1]


@pytest.mark.parametrize(("overhead", "chosen"), [(4.0, 8), (0.15, 2), (0.0, 1)])
def test_auto_doubles_the_steps_a_dispatch_holds_while_each_step_takes_5_percent_less_time(overhead, chosen):
    from flaxhooks.contract import Reading
    from flaxhooks.loop import AutoSteps

    class Timed:  # each dispatch of k steps takes ``overhead + k`` seconds
        step, now = 0, 0.0

        @property
        def clock(self):
            return self

        def read(self):
            return Reading(self.now, self.step)

    auto, loop = AutoSteps("cpu"), Timed()
    while not auto.done:
        count = auto.most(loop)
        loop.step, loop.now = loop.step + count, loop.now + overhead + count
    # Per step 1 + overhead / k: 4.0 gains at every doubling up to CPU's 8; 0.15 gains 7% at 2, 3.6% at 4.
    assert auto.count == chosen


def test_auto_keeps_no_count_that_was_faster_in_one_window_only():
    """A busy host's lucky window: the first 40 steps at 2 a dispatch run 10% faster, later
    ones as fast as 1 a dispatch; the windows beside it, 1 2 1 2, keep 1."""
    from flaxhooks.contract import Reading
    from flaxhooks.loop import AutoSteps

    class Timed:
        step, now, lucky = 0, 0.0, 40

        @property
        def clock(self):
            return self

        def read(self):
            return Reading(self.now, self.step)

    auto, loop, counts = AutoSteps("cpu"), Timed(), []
    while not auto.done:
        count = auto.most(loop)
        counts.append(count)
        seconds_a_step = 0.9 if count == 2 and loop.lucky > 0 else 1.0
        loop.lucky -= count if count == 2 else 0
        loop.step, loop.now = loop.step + count, loop.now + count * seconds_a_step
    assert auto.count == 1
    assert [c for i, c in enumerate(counts) if i == 0 or c != counts[i - 1]] == [1, 2, 1, 2, 1]


def test_auto_chooses_once_tells_which_and_trains_as_one_step_per_dispatch(caplog):
    batches = make_batches(16, batch_size=8)
    trainer = sgd_trainer(steps_per_dispatch="auto")
    with caplog.at_level("INFO", logger="flaxhooks"):
        state = trainer.fit(batches, epochs=30)  # up to 10 windows of 32 steps and more
    chosen = trainer.chosen_steps_per_dispatch
    assert chosen in (1, 2, 4, 8)
    assert [r.getMessage() for r in caplog.records if "auto" in r.getMessage()][0].startswith(
        f"steps_per_dispatch='auto': {chosen} step(s) a dispatch from step ")
    one = sgd_trainer().fit(batches, epochs=30)
    # 480 steps of programs fused differently (unrolled on CPU): float32 rounding drifts a little.
    assert tree_allclose(state.params, one.params, rtol=5e-5, atol=1e-5)
