"""Checkpoints: exact resume with callback state, graceful interruption, and faults
(kill -9 mid-save, corruption, unwritable directory, disk full), several in
real processes."""

import io
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from rich.console import Console
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import flaxhooks
from flaxhooks import Callback, Checkpoint, CheckpointError, CheckpointWarning
from flaxhooks.callbacks import CheckpointConflictError, CheckpointMismatchError
from tests.helpers import (
    Recorder,
    ResumeNet,
    assert_same_records,
    cross_entropy,
    jsonl_records,
    make_arrays,
    resume_data,
    resume_trainer,
)

ROOT = Path(__file__).resolve().parents[2]
EPOCHS = 3  # six steps each


def logged(logdir) -> dict[str, list[tuple[int, float]]]:
    """Every scalar TensorBoard reads from ``logdir`` and its sub-runs:
    (step, value) per ``run/tag``, duplicates and all."""
    found = {}
    for run in [Path(logdir), *(p for p in Path(logdir).iterdir() if p.is_dir())]:
        accumulator = EventAccumulator(str(run), size_guidance={"scalars": 0})
        accumulator.Reload()
        for tag in accumulator.Tags()["scalars"]:
            name = tag if run == Path(logdir) else f"{run.relative_to(logdir)}/{tag}"
            found[name] = [(e.step, e.value) for e in accumulator.Scalars(tag)]
    return found


def assert_same_logs(got: dict, expected: dict) -> None:
    assert sorted(got) == sorted(expected)
    for tag, points in expected.items():
        steps = [step for step, _ in got[tag]]
        if tag == "train/throughput/steps_per_s" or tag.startswith("train/train/"):  # timings
            assert steps == sorted(set(steps)), steps
            continue
        assert steps == [step for step, _ in points], tag  # none missing, none twice
        np.testing.assert_allclose([v for _, v in got[tag]], [v for _, v in points], rtol=1e-5, err_msg=tag)


def assert_same_params(got, expected) -> None:
    for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted run: final state, callback states, TensorBoard scalars, the metrics file."""
    workdir = tmp_path_factory.mktemp("reference")
    trainer = resume_trainer(workdir)
    state = trainer.fit(resume_data(), epochs=EPOCHS)
    return {
        "state": state,
        "callbacks": {type(cb).__name__: cb.state_dict() for cb in trainer.callbacks if cb.state_dict()},
        "logs": logged(workdir / "tensorboard"),
        "metrics": jsonl_records(workdir / "metrics.jsonl"),
        "workdir": workdir,
    }


class FailAt(Callback):
    """Raises ``error`` (or sends this process ``error``, a signal number) at
    the end of ``step``."""

    def __init__(self, step: int, error: BaseException | int):
        self.step, self.error = step, error

    def on_step_end(self, loop):
        if loop.step == self.step:
            if isinstance(self.error, int):
                signal.raise_signal(self.error)
            else:
                raise self.error


def callback_states(trainer) -> dict:
    return {type(cb).__name__: cb.state_dict() for cb in trainer.callbacks if cb.state_dict()}


@pytest.mark.parametrize(
    ("error", "failed_at", "resumed_from"),
    [
        (signal.SIGINT, 7, 7),
        (signal.SIGTERM, 6, 6),
        (KeyboardInterrupt(), 8, 6),
        (RuntimeError("crash"), 8, 6),
    ],
    ids=[
        "ctrl-c-at-step-7-saves-it",
        "sigterm-on-an-epochs-last-step-finishes-the-epoch",
        "keyboard-interrupt-inside-step-8-events-keeps-step-6",
        "crash-at-step-8-resumes-from-6",
    ],
)
def test_interrupted_and_resumed_run_equals_the_uninterrupted_one(
    tmp_path, reference, error, failed_at, resumed_from
):
    # Six steps an epoch. A signal stops at the step boundary and saves it;
    # on an epoch's last step, the epoch's end (its evaluation) runs first.
    # A KeyboardInterrupt raised inside a step's handlers, or a crash, saves
    # nothing: the points logged after step 6 must not appear twice.
    interrupted = resume_trainer(tmp_path, [FailAt(failed_at, error)])
    with pytest.raises((KeyboardInterrupt, flaxhooks.CallbackError)) as raised:
        interrupted.fit(resume_data(), epochs=EPOCHS)
    if isinstance(error, int):
        assert raised.type is flaxhooks.TrainingInterrupted and raised.value.step == failed_at
    checkpoint = interrupted.bus.of(Checkpoint)[0]
    assert checkpoint.saved_steps()[-1] == resumed_from
    assert logged(tmp_path / "tensorboard")["train/loss"][-1][0] == failed_at

    resumed = resume_trainer(tmp_path)
    state = resumed.fit(resume_data(), epochs=EPOCHS, resume=True)

    assert int(state.step) == 3 * 6
    assert_same_params(state.params, reference["state"].params)
    assert_same_params(state.model_state, reference["state"].model_state)  # BatchNorm statistics
    assert_same_params(state.opt_state, reference["state"].opt_state)
    states = callback_states(resumed)
    assert states["EarlyStopping"]["best_step"] == reference["callbacks"]["EarlyStopping"]["best_step"]
    assert states["EarlyStopping"]["waited"] == reference["callbacks"]["EarlyStopping"]["waited"]
    assert states["Evaluate"]["result"]["metrics"] == pytest.approx(
        reference["callbacks"]["Evaluate"]["result"]["metrics"], rel=1e-5)
    assert_same_logs(logged(tmp_path / "tensorboard"), reference["logs"])
    assert_same_records(jsonl_records(tmp_path / "metrics.jsonl"), reference["metrics"])  # its records too


@pytest.mark.parametrize(("error", "resumed_from"), [(signal.SIGINT, 7), (RuntimeError("crash"), 8)],
                         ids=["ctrl-c-at-step-7", "crash-at-step-9-resumes-from-8"])
def test_a_resumed_run_logs_the_same_window_means(tmp_path, error, resumed_from):
    # Training scalars are means over the 4 steps since the last log; the
    # checkpoints (every 2 steps) fall inside those windows.
    expected = resume_trainer(tmp_path / "reference", log_every=4)
    expected.fit(resume_data(), epochs=EPOCHS)
    fail = FailAt(9 if resumed_from == 8 else 7, error)
    interrupted = resume_trainer(tmp_path / "run", [fail], log_every=4)
    with pytest.raises((KeyboardInterrupt, flaxhooks.CallbackError)):
        interrupted.fit(resume_data(), epochs=EPOCHS)
    assert interrupted.bus.of(Checkpoint)[0].saved_steps()[-1] == resumed_from
    resume_trainer(tmp_path / "run", log_every=4).fit(resume_data(), epochs=EPOCHS, resume=True)
    got = logged(tmp_path / "run" / "tensorboard")
    reference_logs = logged(tmp_path / "reference" / "tensorboard")
    assert [s for s, _ in got["train/loss"]] == [4, 8, 12, 16, 18]  # 18: the fit's end wrote 17-18
    assert_same_logs(got, reference_logs)
    assert_same_records(jsonl_records(tmp_path / "run" / "metrics.jsonl"),
                        jsonl_records(tmp_path / "reference" / "metrics.jsonl"))


def test_a_finished_run_continued_with_more_epochs_logs_as_one_run_of_them_all(tmp_path):
    """The end of a 1-epoch run writes its last, partial window (steps 5-6) and saves it in the
    checkpoint; a run resumed from there drops that point and logs steps 5-8 at step 8, as the
    3-epoch run does."""
    expected = resume_trainer(tmp_path / "reference", log_every=4)
    expected.fit(resume_data(), epochs=EPOCHS)
    resume_trainer(tmp_path / "run", log_every=4).fit(resume_data(), epochs=1)
    assert [s for s, _ in logged(tmp_path / "run" / "tensorboard")["train/loss"]] == [4, 6]
    resume_trainer(tmp_path / "run", log_every=4).fit(resume_data(), epochs=EPOCHS, resume=True)
    got = logged(tmp_path / "run" / "tensorboard")
    assert [s for s, _ in got["train/loss"]] == [4, 8, 12, 16, 18]
    assert_same_logs(got, logged(tmp_path / "reference" / "tensorboard"))
    # The metrics file too: the step-6 train record dropped, the evaluation at step 6 kept.
    assert_same_records(jsonl_records(tmp_path / "run" / "metrics.jsonl"),
                        jsonl_records(tmp_path / "reference" / "metrics.jsonl"))


def every_record(logdir) -> dict[tuple[str, str], list[tuple[int, object]]]:
    """Every summary value in every run under ``logdir`` (the main run ".",
    ``train``, evaluations, ``layers/*``), as TensorBoard reads them from the
    files in order: ``{(run, tag): [(step, value)]}``, duplicates and all.
    A scalar's value is its float; any other (text, layout, HParams
    records) is its serialized tensor and plugin data, compared exactly."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    found: dict[tuple[str, str], list[tuple[int, object]]] = {}
    for root, _, names in os.walk(logdir):
        run = os.path.relpath(root, logdir)
        for name in sorted(n for n in names if "tfevents" in n):  # named in the order they were written
            for event in EventFileLoader(os.path.join(root, name)).Load():
                for value in event.summary.value:
                    point = value.simple_value if value.WhichOneof("value") == "simple_value" else (
                        value.tensor.SerializeToString(), value.metadata.plugin_data.content)
                    found.setdefault((run, value.tag), []).append((event.step, point))
    return found


def resume_trainer_with_everything(workdir, callbacks=()) -> flaxhooks.Trainer:
    """Checkpoints every 5 steps only, evaluations every 3 steps and each epoch,
    TensorBoard every 2 steps with an HParams session, and per-layer runs."""
    return flaxhooks.Trainer(
        ResumeNet(), optax.adam(0.01), cross_entropy,
        callbacks=[
            Checkpoint(workdir / "checkpoints", every=5, at_epoch_end=False),
            flaxhooks.Evaluate(make_arrays(40, seed=9), batch_size=16, every=3),
            flaxhooks.TensorBoard(workdir / "tensorboard", every=2, hparams={"learning_rate": 0.01}),
            flaxhooks.ActivationStats(every=4),
            *callbacks,
        ],
    )


@pytest.fixture(scope="module")
def reference_records(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("reference-records")
    resume_trainer_with_everything(workdir).fit(resume_data(), epochs=EPOCHS)
    return every_record(workdir / "tensorboard")


@pytest.mark.parametrize(
    ("error", "resumed_from"),
    [(signal.SIGINT, 13), (KeyboardInterrupt(), 10), (RuntimeError("crash"), 10)],
    ids=["ctrl-c-saves-step-13", "keyboard-interrupt-resumes-from-10", "crash-resumes-from-10"],
)
def test_every_run_and_tag_of_a_resumed_run_reads_like_the_uninterrupted_one(
    tmp_path, reference_records, error, resumed_from
):
    # Stopped at step 13, after the evaluation at step 12 and the checkpoint
    # at step 10: the first fit's end wrote the HParams results and session
    # at step 13, and Ctrl-C saved a checkpoint there.
    interrupted = resume_trainer_with_everything(tmp_path, [FailAt(13, error)])
    with pytest.raises((KeyboardInterrupt, flaxhooks.CallbackError)):
        interrupted.fit(resume_data(), epochs=EPOCHS)
    assert interrupted.bus.of(Checkpoint)[0].saved_steps()[-1] == resumed_from
    first_half = every_record(tmp_path / "tensorboard")
    assert [step for step, _ in first_half[".", "results/eval/loss"]] == [13]
    assert [step for step, _ in first_half["eval", "loss"]][-1] == 12

    resume_trainer_with_everything(tmp_path).fit(resume_data(), epochs=EPOCHS, resume=True)

    got = every_record(tmp_path / "tensorboard")
    assert sorted(got) == sorted(reference_records)
    runs = {run for run, _ in got}
    assert runs >= {".", "train", "eval"} and any(run.startswith("layers/") for run in runs)
    for key, expected in reference_records.items():
        steps = [step for step, _ in got[key]]
        if key == ("train", "throughput/steps_per_s") or key[1].startswith("train/"):  # timings
            assert steps == sorted(set(steps)), steps
            continue
        assert steps == [step for step, _ in expected], key  # none left over, none twice, in order
        for (_, value), (_, wanted) in zip(got[key], expected, strict=True):
            if isinstance(wanted, float):
                assert value == pytest.approx(wanted, rel=1e-5), key
            else:
                assert value == wanted, key
    assert [step for step, _ in got[".", "results/eval/loss"]] == [18]  # the resumed run's final results


def test_resume_before_any_checkpoint_starts_afresh_without_doubling_the_logs(tmp_path, reference):
    crashed = resume_trainer(tmp_path, [FailAt(4, RuntimeError("crash"))], every=100)
    with pytest.raises(flaxhooks.CallbackError):
        crashed.fit(resume_data(), epochs=EPOCHS)
    assert Checkpoint(tmp_path / "checkpoints").saved_steps() == []
    state = resume_trainer(tmp_path, every=100).fit(resume_data(), epochs=EPOCHS, resume=True)
    assert_same_params(state.params, reference["state"].params)
    assert_same_logs(logged(tmp_path / "tensorboard"), reference["logs"])
    assert_same_records(jsonl_records(tmp_path / "metrics.jsonl"), reference["metrics"])  # its records too


def test_a_run_that_stopped_early_stays_stopped_on_resume(tmp_path):
    def trainer():
        return flaxhooks.Trainer(nn.Dense(3), optax.sgd(0.0), cross_entropy, callbacks=[
            Checkpoint(tmp_path), flaxhooks.Evaluate(make_arrays(40, seed=9)),
            flaxhooks.EarlyStopping(patience=1)])

    stopped = trainer().fit(resume_data(), epochs=5)  # a zero learning rate never improves
    assert int(stopped.step) == 12
    again = trainer()
    state = again.fit(resume_data(), epochs=5, resume=True)
    assert int(state.step) == 12 and again.runner.traces["train_step"] == 0


def test_resume_restores_callback_state_before_fit_start(tmp_path):
    seen = {}

    class Counter(Callback):
        def __init__(self):
            self.steps = 0

        def on_fit_start(self, loop):
            seen["at_fit_start"] = (self.steps, loop.step)

        def on_step_end(self, loop):
            self.steps += 1

        def state_dict(self):
            return {"steps": self.steps}

        def load_state_dict(self, state):
            self.steps = state["steps"]

    resume_trainer(tmp_path, [Counter()]).fit(resume_data(), steps=5)
    counter = Counter()
    resume_trainer(tmp_path, [counter]).fit(resume_data(), steps=9, resume=True)
    assert seen["at_fit_start"] == (5, 5)
    assert counter.steps == 9


def test_resume_without_checkpoint_starts_afresh_and_needs_one_checkpoint_callback(tmp_path, reference):
    state = resume_trainer(tmp_path).fit(resume_data(), epochs=EPOCHS, resume=True)
    assert_same_params(state.params, reference["state"].params)
    bare = flaxhooks.Trainer(nn.Dense(3), optax.sgd(0.1), cross_entropy)
    with pytest.raises(ValueError, match="exactly one Checkpoint"):
        bare.fit(resume_data(), epochs=1, resume=True)


def test_keeps_the_last_k_and_saves_only_the_train_state(tmp_path):
    class Sows(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = nn.Dense(4)(x)
            self.sow("intermediates", "hidden", h)
            h = self.perturb("hidden_grad", h)
            return nn.Dense(3)(nn.relu(h))

    checkpoint = Checkpoint(tmp_path, every=2, keep=2)
    trainer = flaxhooks.Trainer(
        Sows(), optax.adam(0.01), cross_entropy,
        callbacks=[checkpoint, flaxhooks.ActivationGradStats(every=1)],
    )
    trainer.fit(resume_data(), steps=7)
    assert checkpoint.saved_steps() == [6, 7]  # every 2 steps, and at the end
    restored = checkpoint.restore_latest()
    assert restored.step == 7 and restored.position == (1, 1)
    # model_state is empty here: it holds no leaves.
    assert {path.split("[")[0].split(".")[1] for path in restored.leaves} == {
        "step", "params", "opt_state", "rng"}
    assert not [p for p in restored.leaves if "perturbations" in p or "intermediates" in p or "hidden" in p]
    assert restored.leaves[".params['Dense_0']['kernel']"] == jax.ShapeDtypeStruct((5, 4), np.float32)
    state = restored.train_state(trainer.state)  # read onto the shardings of the state given
    assert_same_params(state.params, trainer.state.params)
    for got, like in zip(jax.tree.leaves(state), jax.tree.leaves(trainer.state), strict=True):
        assert got.sharding == like.sharding


def test_a_state_is_read_in_groups_of_at_most_the_largest_leaf_and_arrives_whole(tmp_path, monkeypatch):
    """orbax reads a restore's leaves at once, so a state is read group by
    group (here one leaf per group, the floor lowered): every leaf arrives
    as saved, on its sharding."""
    from flaxhooks.callbacks import _checkpoint

    checkpoint = Checkpoint(tmp_path, every=2)
    trainer = flaxhooks.Trainer(ResumeNet(), optax.adam(0.01), cross_entropy, callbacks=[checkpoint])
    trainer.fit(resume_data(), steps=2)
    wanted = {str(i): jax.ShapeDtypeStruct(np.shape(x), x.dtype)
              for i, x in enumerate(jax.tree.leaves(trainer.state))}
    monkeypatch.setattr(_checkpoint, "READ_GROUP_BYTES", 1)
    largest = max(np.prod(x.shape) * x.dtype.itemsize for x in wanted.values())
    groups = _checkpoint._read_groups(wanted)
    assert [k for g in groups for k in g] == list(wanted)  # each leaf once, in order
    assert all(len(g) == 1 or sum(np.prod(x.shape) * x.dtype.itemsize for x in g.values()) <= largest
               for g in groups) and len(groups) > 2
    state = checkpoint.restore_latest().train_state(trainer.state)
    for got, saved in zip(jax.tree.leaves(state), jax.tree.leaves(trainer.state), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(saved))
        assert got.sharding == saved.sharding


@pytest.mark.parametrize("slice_floor", ["default", "lowered"])
def test_a_replicated_state_is_written_whole_per_leaf_unless_its_slices_are_large(
        tmp_path, monkeypatch, slice_floor):
    """orbax splits each replicated array between its replicas, a dispatch
    per slice: Checkpoint lets it only for slices of REPLICA_SLICE_BYTES and
    more. With the floor lowered, the same leaves are split 8 ways (8
    devices, data parallel). Either way the state reads back as saved."""
    from flaxhooks.callbacks import _checkpoint

    if slice_floor == "lowered":
        monkeypatch.setattr(_checkpoint, "REPLICA_SLICE_BYTES", 1)
    checkpoint = Checkpoint(tmp_path, every=2)
    trainer = flaxhooks.Trainer(ResumeNet(), optax.adam(0.01), cross_entropy, callbacks=[checkpoint])
    trainer.fit(resume_data(), steps=2)
    checkpoint.wait()
    devices = len(jax.devices())
    with open(tmp_path / "2" / "state" / "array_metadatas" / "process_0") as file:
        written = {a["array_metadata"]["param_name"]: a["array_metadata"]["write_shape"]
                   for a in json.load(file)["array_metadatas"]}
    leaves = jax.tree.leaves(trainer.state)
    split = 0
    for i, leaf in enumerate(leaves):
        whole = list(np.shape(leaf))
        divisible = [axis for axis, size in enumerate(whole) if size % devices == 0]
        expected = list(whole)
        if slice_floor == "lowered" and divisible:  # split along the first dimension that divides
            expected[divisible[0]] //= devices
            split += 1
        assert written[str(i)] == expected, (i, written[str(i)])
    assert slice_floor == "default" or split >= 1
    state = checkpoint.restore_latest().train_state(trainer.state)
    for got, saved in zip(jax.tree.leaves(state), leaves, strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(saved))


def test_a_nonfinite_state_never_replaces_a_good_checkpoint(tmp_path):
    arrays = make_arrays(96, seed=3)
    arrays["image"][4 * 16] = np.nan  # the fifth batch poisons the parameters
    checkpoint = Checkpoint(tmp_path / "unguarded", every=2, keep=3)
    # With the guard off, the checkpoint's own check refuses the NaN state.
    trainer = flaxhooks.Trainer(nn.Dense(3), optax.sgd(0.1), cross_entropy, callbacks=[checkpoint],
                                if_nonfinite="off")
    with pytest.warns(CheckpointWarning, match="not saving step 6: .*NaN or inf"):
        trainer.fit(flaxhooks.ArrayLoader(arrays, 16, shuffle=False), steps=6)
    assert checkpoint.saved_steps() == [2, 4]
    assert checkpoint.skipped_steps == [6]
    assert checkpoint.restore_latest().step == 4
    # With it (the default), training stops at step 5 and nothing after step 4 is saved.
    guarded = Checkpoint(tmp_path / "guarded", every=2, keep=3)
    trainer = flaxhooks.Trainer(nn.Dense(3), optax.sgd(0.1), cross_entropy, callbacks=[guarded])
    with pytest.raises(flaxhooks.NonFiniteError, match="at step 5"):
        trainer.fit(flaxhooks.ArrayLoader(arrays, 16, shuffle=False), steps=6)
    assert guarded.saved_steps() == [2, 4]


def _corrupt(directory: Path) -> None:
    """Overwrites the middle of every array file orbax wrote for a checkpoint."""
    files = [p for p in directory.rglob("*") if p.is_file() and p.parent.name == "d"]
    assert files
    for path in files:
        data = bytearray(path.read_bytes())
        data[len(data) // 2:] = b"\x5a" * (len(data) - len(data) // 2)
        path.write_bytes(bytes(data))


# orbax, failing to open the corrupted arrays, leaves a callback for an event loop it closed.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_corrupted_latest_checkpoint_falls_back_to_the_one_before(tmp_path, reference):
    resume_trainer(tmp_path).fit(resume_data(), steps=10)
    checkpoints = tmp_path / "checkpoints"
    assert Checkpoint(checkpoints).saved_steps() == [6, 8, 10]
    _corrupt(checkpoints / "10")
    with pytest.warns(CheckpointWarning, match="step 10 .* cannot be restored"):
        state = resume_trainer(tmp_path).fit(resume_data(), epochs=EPOCHS, resume=True)
    assert_same_params(state.params, reference["state"].params)
    assert_same_logs(logged(tmp_path / "tensorboard"), reference["logs"])
    assert_same_records(jsonl_records(tmp_path / "metrics.jsonl"), reference["metrics"])  # its records too
    # The unreadable one was set aside, not deleted, and replaced by a good one.
    assert [p.name.split("-")[:2] for p in checkpoints.iterdir() if not p.name.isdigit()] == [
        ["unreadable", "10"]]
    assert Checkpoint(checkpoints).saved_steps() == [14, 16, 18]


def files(directory: Path) -> dict[str, bytes]:
    """Every file under ``directory`` with its bytes."""
    return {str(path.relative_to(directory)): path.read_bytes() for path in sorted(directory.rglob("*"))
            if path.is_file()}


def writing_at_fit_start():
    """Callbacks that write when a fit starts (besides TensorBoard's layout): the model table, charts."""
    return [flaxhooks.Summary(console=Console(file=io.StringIO())), flaxhooks.ActivationStats(every=2)]


def test_a_refused_run_writes_nothing_and_leaves_the_first_runs_files_as_they_were(tmp_path):
    first = resume_trainer(tmp_path, writing_at_fit_start())
    first.fit(resume_data(), steps=4)
    before = files(tmp_path)
    assert any("tfevents" in name for name in before) and "checkpoints/4/meta/metadata" in before
    trainer = resume_trainer(tmp_path, writing_at_fit_start())
    events = Recorder()
    trainer.add(events)
    with pytest.raises(CheckpointConflictError, match=r"another run \(steps \[2, 4\]\).*resume=True") as no:
        trainer.fit(resume_data(), steps=4)
    assert (no.value.steps, no.value.start) == ([2, 4], 0)
    assert files(tmp_path) == before  # no event file, summary, hparams or checkpoint written
    assert events.log == [] and trainer.runner.traces == {}  # refused before any event or compilation


def test_every_checkpoint_corrupted_is_an_error_not_a_fresh_start(tmp_path):
    resume_trainer(tmp_path, keep=2).fit(resume_data(), steps=4)
    for step in ("2", "4"):
        (tmp_path / "checkpoints" / step / "meta" / "metadata").write_text("{not json")
    with (pytest.warns(CheckpointWarning),
          pytest.raises(CheckpointError, match="no checkpoint .* can be restored")):
        resume_trainer(tmp_path).fit(resume_data(), epochs=1, resume=True)


def test_a_checkpoint_of_another_model_is_refused_clearly(tmp_path):
    checkpoint = Checkpoint(tmp_path)
    flaxhooks.Trainer(nn.Dense(3), optax.sgd(0.1), cross_entropy, callbacks=[checkpoint]).fit(
        resume_data(), steps=2)
    other = flaxhooks.Trainer(nn.Dense(3), optax.adam(0.1), cross_entropy, callbacks=[Checkpoint(tmp_path)])
    with pytest.raises(CheckpointMismatchError, match="does not fit this model and optimizer: .*"
                       "The model or the optimizer changed since it was saved: train this one in another "
                       "directory") as refused:
        other.fit(resume_data(), steps=4, resume=True)
    assert refused.value.difference == (
        "this train state has .opt_state[0].count, .opt_state[0].mu['bias'], .opt_state[0].mu['kernel'] "
        "and 2 more, which it lacks")
    wider = flaxhooks.Trainer(nn.Dense(4), optax.sgd(0.1), cross_entropy, callbacks=[Checkpoint(tmp_path)])
    with pytest.raises(CheckpointMismatchError) as refused:
        wider.fit(resume_data(), steps=4, resume=True)
    assert refused.value.difference == ".params['bias'] is float32[3] there and float32[4] here"


def test_an_unwritable_directory_fails_before_training(tmp_path, compiles):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(CheckpointError, match="cannot write checkpoints to .*a-file"):
        Checkpoint(blocker / "checkpoints")
    # Writable when made, gone by the time training starts.
    directory = tmp_path / "gone"
    checkpoint = Checkpoint(directory)
    directory.rmdir()
    directory.write_text("")
    trainer = flaxhooks.Trainer(nn.Dense(3), optax.sgd(0.1), cross_entropy, callbacks=[checkpoint])
    with pytest.raises(CheckpointError, match="cannot write checkpoints to .*gone"):
        trainer.fit(resume_data(), steps=4)
    assert trainer.runner.traces["train_step"] == 0 and not [c for c in compiles if "train_step" in str(c)]


def test_state_dict_that_is_not_json_fails_clearly(tmp_path):
    class Bad(Callback):
        def state_dict(self):
            return {"array": np.zeros(2)}

        def load_state_dict(self, state):
            pass

    trainer = flaxhooks.Trainer(nn.Dense(3), optax.sgd(0.1), cross_entropy,
                                callbacks=[Checkpoint(tmp_path), Bad()])
    with pytest.raises(flaxhooks.CallbackError, match=r"Bad\(\).state_dict\(\) is not JSON-serializable"):
        trainer.fit(resume_data(), steps=2)


# -- real processes ------------------------------------------------------------


def start_worker(workdir, *args):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    return subprocess.Popen(
        [sys.executable, "-m", "tests.callbacks.checkpoint_worker", str(workdir), *map(str, args)],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )


def run_worker(workdir, *args, until: str | None = None, send: int = signal.SIGKILL) -> tuple[int, str]:
    """Runs the worker; when a line starts with ``until``, sends it ``send``."""
    worker = start_worker(workdir, *args)
    lines = []
    try:
        for line in worker.stdout:
            lines.append(line)
            if until is not None and line.startswith(until):
                worker.send_signal(send)
                until = None
        worker.wait(timeout=120)
    finally:
        worker.kill()
    return worker.returncode, "".join(lines)


@pytest.fixture(scope="module")
def process_reference(tmp_path_factory):
    """An uninterrupted run in a worker process (2 devices)."""
    workdir = tmp_path_factory.mktemp("process-reference")
    code, output = run_worker(workdir)
    assert code == 0 and "DONE 18" in output, output
    with np.load(workdir / "params.npz") as params:
        return [params[key] for key in sorted(params, key=lambda k: int(k.split("_")[1]))], logged(
            workdir / "tensorboard")


def assert_resumes_to_reference(workdir, process_reference):
    code, output = run_worker(workdir)
    assert code == 0 and "DONE 18" in output, output
    with np.load(workdir / "params.npz") as params:
        for j, expected in enumerate(process_reference[0]):
            np.testing.assert_allclose(params[f"arr_{j}"], expected, rtol=1e-5, atol=1e-6)
    assert_same_logs(logged(workdir / "tensorboard"), process_reference[1])


@pytest.mark.slow
def test_kill_9_during_a_save_leaves_the_last_good_checkpoint(tmp_path, process_reference):
    code, output = run_worker(tmp_path, "--stall-save", 8, until="STALLED 8")
    assert code == -signal.SIGKILL, output
    checkpoints = tmp_path / "checkpoints"
    leftovers = [p.name for p in checkpoints.iterdir() if "tmp" in p.name]
    assert leftovers and leftovers[0].startswith("8.")  # the save that never completed
    assert Checkpoint(checkpoints).saved_steps() == [2, 4, 6]  # none deleted for it
    assert_resumes_to_reference(tmp_path, process_reference)
    assert not [p for p in checkpoints.iterdir() if "tmp" in p.name]  # cleaned up by the next run


# SIGTERM takes the same path end to end in tests/recipes (the recipe saves, says how to resume, resumes).
@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGINT], ids=["SIGINT"])
def test_a_signal_stops_at_a_step_boundary_with_a_final_checkpoint(tmp_path, process_reference, signum):
    code, output = run_worker(tmp_path, "--seconds-per-step", 0.2, until="step 9", send=signum)
    assert code == 128 + signum, output
    stopped = int(output.split("INTERRUPTED ")[1].split()[0])
    assert 9 <= stopped < 18
    assert Checkpoint(tmp_path / "checkpoints").saved_steps()[-1] == stopped  # the final checkpoint
    assert logged(tmp_path / "tensorboard")["train/loss"][-1][0] == stopped  # logs flushed
    assert_resumes_to_reference(tmp_path, process_reference)


def test_a_disk_that_fills_up_stops_training_and_keeps_earlier_checkpoints(tmp_path):
    code, output = run_worker(tmp_path, "--limit-after", 5, "--limit-bytes", 64)
    # Both writers hit the full disk; the first to notice stops training.
    assert code == 1, output
    assert "[Errno 27] File too large" in output and "DONE" not in output, output
    assert "CheckpointError: saving a checkpoint to" in output, output
    assert "failed: OSError: [Errno 27] File too large; the earlier checkpoints [2, 4] are intact" in output
    last_step = max(int(line.split()[1]) for line in output.splitlines() if line.startswith("step "))
    assert last_step <= 8  # stopped at once
    checkpoint = Checkpoint(tmp_path / "checkpoints")
    assert checkpoint.saved_steps() == [2, 4]
    assert checkpoint.restore_latest().step == 4


def test_truncating_event_files_drops_later_steps_and_a_half_written_record(tmp_path):
    from flaxhooks.writers import AsyncWriter, TensorBoardWriter, truncate_events

    writer = AsyncWriter(TensorBoardWriter(str(tmp_path)))
    for step in range(1, 7):
        writer.scalars({"x": float(step)}, step)
    writer.close()
    (path,) = [p for p in tmp_path.iterdir() if "tfevents" in p.name]
    path.write_bytes(path.read_bytes() + b"\x20\x00\x00\x00\x00\x00\x00\x00\x01")  # killed mid-record
    assert truncate_events(str(tmp_path), 4) == 2
    assert [step for step, _ in logged(tmp_path)["x"]] == [1, 2, 3, 4]
    assert truncate_events(str(tmp_path), 4) == 0  # nothing left to drop; the file is not rewritten


def test_truncating_drops_the_values_a_fit_end_wrote_at_the_checkpoints_step_and_keeps_the_rest(tmp_path):
    from flaxhooks.writers import AsyncWriter, TensorBoardWriter, truncate_events

    writer = AsyncWriter(TensorBoardWriter(str(tmp_path)))
    writer.scalars({"x": 3.0, "final/x": 3.0}, 3)  # one event: cut to the value it keeps
    writer.scalars({"final/x": 2.0}, 2)  # before the checkpoint's step: kept
    writer.scalars({"x": 4.0}, 4)
    writer.scalars({"x": 3.5}, 3, run="sub")  # a sub-run's values at the step stay
    writer.close()

    def final(value) -> bool:
        return value.tag.startswith("final/")

    assert truncate_events(str(tmp_path), 3, written_after_saves=final) == 2
    assert logged(tmp_path) == {"x": [(3, 3.0)], "final/x": [(2, 2.0)], "sub/x": [(3, 3.5)]}


def test_array_loader_skips_to_a_batch_without_making_the_ones_before():
    loader = flaxhooks.ArrayLoader(make_arrays(96, seed=3), 16, seed=3)
    whole, tail = list(loader(2)), list(loader(2, start=4))
    assert len(tail) == 2
    for got, expected in zip(tail, whole[4:], strict=True):
        np.testing.assert_array_equal(got["image"], expected["image"])


def test_device_step_of_a_restored_state_matches(tmp_path):
    checkpoint = Checkpoint(tmp_path)
    trainer = flaxhooks.Trainer(nn.Dense(3), optax.sgd(0.1), cross_entropy, callbacks=[checkpoint])
    trainer.fit(resume_data(), steps=3)
    restored = checkpoint.restore_latest()
    state = restored.train_state(trainer.state)
    assert int(state.step) == 3 and state.tx is trainer.optimizer
    assert jnp.array_equal(state.rng, trainer.state.rng)



def _replace_saved_array(checkpoint_dir: Path, leaf: int, change) -> None:
    """Writes the checkpoint's arrays again, one of them changed, in place of
    its ``state`` item: files that changed on disk after the save."""
    import shutil

    import orbax.checkpoint as ocp

    state_dir = checkpoint_dir / "state"
    with ocp.StandardCheckpointer() as checkpointer:
        arrays = checkpointer.restore(state_dir)
        arrays[str(leaf)] = change(np.asarray(arrays[str(leaf)]))
        checkpointer.save(checkpoint_dir.parent / "rewritten", arrays)
    shutil.rmtree(state_dir)
    (checkpoint_dir.parent / "rewritten").rename(state_dir)


def test_an_array_changed_on_disk_is_refused_on_resume_naming_it_and_nothing_is_changed(tmp_path):
    """orbax reads back a changed array without complaint (a bit flipped in a
    chunk file reads as another number): each leaf's fingerprint, computed on
    the devices when saved, is checked when the run resumes."""
    resume_trainer(tmp_path).fit(resume_data(), steps=4)
    checkpoints = tmp_path / "checkpoints"
    meta = json.loads((checkpoints / "4" / "meta" / "metadata").read_text())
    kernel = next(i for i, leaf in enumerate(meta["leaves"]) if leaf["path"].startswith(".params")
                  and leaf["path"].endswith("['kernel']"))

    def flipped(array):
        array = array.copy()
        array.reshape(-1)[3] = np.nextafter(array.reshape(-1)[3], np.inf)
        return array

    _replace_saved_array(checkpoints / "4", kernel, flipped)
    before = files(checkpoints)
    trainer = resume_trainer(tmp_path)
    with pytest.raises(flaxhooks.CallbackError) as refused:  # at the fit's start, every process alike
        trainer.fit(resume_data(), epochs=EPOCHS, resume=True)
    assert isinstance(refused.value.__cause__, CheckpointError)
    assert str(refused.value.__cause__) == (
        f"the checkpoint at step 4 in {str(checkpoints)!r} reads back other than it was saved in "
        f"{meta['leaves'][kernel]['path']} (its files changed on disk): move {str(checkpoints / '4')!r} "
        "aside to resume from step 2")
    assert files(checkpoints) == before
    assert trainer.runner.traces == {}  # refused before the train step compiled


def test_the_best_checkpoints_by_an_evaluation_metric_are_kept_beside_the_latest(tmp_path):
    evaluated = {}

    class Keep(Callback):
        def on_eval_end(self, loop):
            evaluated[loop.step] = (loop.payload.metrics["loss"], jax.device_get(loop.state.params))

    checkpoint = Checkpoint(tmp_path, at_epoch_end=False, keep=1, best=("eval/loss", "min"), keep_best=2)
    trainer = flaxhooks.Trainer(nn.Dense(3), optax.sgd(0.3), cross_entropy, callbacks=[
        checkpoint, flaxhooks.Evaluate(make_arrays(40, seed=9), every=1, at_epoch_end=False), Keep()])
    trainer.fit(resume_data(), steps=12)
    checkpoint.wait()
    losses = {step: loss for step, (loss, _) in evaluated.items()}
    best_two = sorted(losses, key=losses.get)[:2]
    assert checkpoint.saved_steps() == sorted({12, *best_two})
    assert checkpoint.best_step() == best_two[0]
    assert checkpoint.restore_latest().step == 12
    best = checkpoint.restore(best=True)
    assert best.step == best_two[0]
    assert_same_params(best.train_state(trainer.state).params, evaluated[best_two[0]][1])
    with pytest.raises(ValueError, match="best is"):
        Checkpoint(tmp_path, best=("accuracy", "max"))


LEGACY = Path(__file__).parent / "legacy_checkpoints"


def test_a_checkpoint_written_by_0_8_resumes_to_the_same_run(tmp_path, reference):
    """Format 1 (0.7, 0.8): each leaf whole with its CRC32, read as before."""
    import shutil

    shutil.copytree(LEGACY / "format-1", tmp_path / "checkpoints")
    state = resume_trainer(tmp_path).fit(resume_data(), epochs=EPOCHS, resume=True)
    assert_same_params(state.params, reference["state"].params)


def test_a_checkpoint_split_across_processes_by_0_8_reads_onto_any_mesh(tmp_path):
    """Format 2 (0.8): each process's parts with their CRC32s, written by 2
    processes under FSDP; read on this process's devices."""
    from tests.helpers import BatchNormNet, make_arrays, sgd_trainer

    restorer = Checkpoint(LEGACY / "format-2")
    expected = np.load(LEGACY / "format-2" / "expected.npz")
    resumed = sgd_trainer(BatchNormNet(), devices=jax.local_devices()[:4], callbacks=[restorer]).fit(
        flaxhooks.ArrayLoader(make_arrays(64), batch_size=16, seed=1), epochs=2, resume=True)
    for got, saved in zip(jax.tree.leaves(resumed), expected.values(), strict=True):
        np.testing.assert_array_equal(np.asarray(got, np.float64).ravel(), saved)


_PLAIN_SCRIPT = """
import logging, sys
import flax.linen as nn, numpy as np, optax
import flaxhooks

workdir, logs = sys.argv[1], sys.argv[2]
if logs == "root-info":
    logging.basicConfig(level=logging.INFO)
if logs == "flaxhooks-warning":
    logging.getLogger("flaxhooks").setLevel(logging.WARNING)
rng = np.random.default_rng(0)
data = {"image": rng.normal(size=(64, 5)).astype(np.float32),
        "label": rng.integers(0, 3, 64).astype(np.int32)}

def loss(logits, batch):
    return optax.losses.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()

def fit(**options):
    trainer = flaxhooks.Trainer(nn.Dense(3), optax.sgd(0.1), loss,
                                callbacks=[flaxhooks.Checkpoint(workdir, every=2)])
    trainer.fit(flaxhooks.ArrayLoader(data, 16, seed=0), **options)

fit(epochs=1, resume=True)
fit(epochs=2, resume=True)
"""


@pytest.mark.parametrize("logs", ["unset", "root-info", "flaxhooks-warning"])
def test_a_plain_script_says_each_save_and_resume_in_one_line_and_logging_can_take_them(tmp_path, logs):
    result = subprocess.run(["timeout", "-s", "KILL", "120", sys.executable, "-c", _PLAIN_SCRIPT,
                             str(tmp_path / "ckpt"), logs],
                            cwd=ROOT, capture_output=True, text=True, timeout=150)
    assert result.returncode == 0, result.stderr[-3000:]
    where = str(tmp_path / "ckpt")
    notes = ["nothing to resume from yet: starting afresh",
             f"saved checkpoint at step 2 to {where}", f"saved checkpoint at step 4 to {where}",
             f"resuming from step 4 ({where}/4)", f"saved checkpoint at step 6 to {where}",
             f"saved checkpoint at step 8 to {where}"]
    prefix = {"unset": "", "root-info": "INFO:flaxhooks:"}.get(logs)
    said = [line for line in result.stderr.splitlines() if any(line.endswith(n) for n in notes)]
    # Once each: on stderr as they are where logging is not set up, as logging says where it is.
    assert said == ([] if prefix is None else [prefix + n for n in notes]), result.stderr[-3000:]
