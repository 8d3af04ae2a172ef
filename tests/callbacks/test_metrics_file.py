"""The metrics file: TensorBoard's scalars as records (JSON lines, CSV), with or without TensorBoard,
read back with json and csv and compared with TensorBoard's own reader and a hand computation.
A resumed run's file is compared with an uninterrupted run's in test_checkpoint.py."""

import csv
import logging
import os

import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import flaxhooks
from flaxhooks import Callback, Every, LogdirError, MetricsFile, TensorBoard
from flaxhooks.writers import MetricsFileWriter, read_metrics
from tests.helpers import (
    KeepMetrics,
    assert_same_records,
    by_key,
    jsonl_records,
    make_arrays,
    make_batches,
    sgd_trainer,
)

# A resumed run's file against an uninterrupted run's: tests/callbacks/test_checkpoint.py (its
# trainers write one beside TensorBoard).


def csv_records(path) -> list[tuple[int, str, str, float]]:
    """The same, read with ``csv`` alone."""
    with open(path, newline="") as file:
        rows = list(csv.reader(file))
    assert rows[0] == ["step", "run", "tag", "value", "time"]
    return [(int(step), run, tag, float(value)) for step, run, tag, value, _ in rows[1:]]


def tensorboard_records(logdir) -> list[tuple[int, str, str, float]]:
    """Every scalar TensorBoard reads under ``logdir``, as the same records (run "" is the main run)."""
    found = []
    for root, _, names in os.walk(logdir):
        if not any("tfevents" in name for name in names):
            continue
        run = os.path.relpath(root, logdir)
        accumulator = EventAccumulator(root, size_guidance={"scalars": 0})
        accumulator.Reload()
        for tag in accumulator.Tags()["scalars"]:
            found += [(e.step, "" if run == "." else run, tag, e.value) for e in accumulator.Scalars(tag)]
    return found


def test_beside_tensorboard_the_file_holds_the_same_scalars_per_layer_statistics_included(tmp_path):
    keep = KeepMetrics()
    evaluate = flaxhooks.Evaluate(make_arrays(40), at_epoch_end=True, batch_size=16)
    metrics = MetricsFile(tmp_path / "metrics.jsonl", every=3)
    callbacks = [TensorBoard(tmp_path / "tb", every=3), metrics, evaluate, keep,
                 flaxhooks.ActivationStats(every=4)]
    sgd_trainer(callbacks=callbacks).fit(make_batches(4), epochs=2)
    records = jsonl_records(tmp_path / "metrics.jsonl")
    assert_same_records(records, tensorboard_records(tmp_path / "tb"))
    assert {run for _, run, _, _ in records} >= {"train", "eval"}
    assert any(run.startswith("layers/") for _, run, _, _ in records)  # what others write reaches it
    # Each training point is the mean over the steps since the one before (the fit's end wrote 7-8).
    loss = by_key(records)["train", "loss"]
    assert [step for step, _ in loss] == [3, 6, 8]
    for (step, value), first in zip(loss, (1, 4, 7), strict=True):
        assert value == pytest.approx(np.mean([keep.metrics[s]["loss"] for s in range(first, step + 1)]),
                                      rel=1e-6)
    final = evaluate.result.metrics["loss"]
    assert by_key(records)["eval", "loss"][-1] == (8, pytest.approx(final, rel=1e-6))


def test_without_tensorboard_a_csv_file_gets_the_training_and_evaluation_scalars(tmp_path):
    class Diverge(Callback):
        def on_step_end(self, loop):
            loop.writers.scalars({"nan": float("nan"), "inf": float("inf")}, loop.step, "x/")

    keep = KeepMetrics()
    path = tmp_path / "logs" / "metrics.csv"  # its directory is made
    sgd_trainer(callbacks=[MetricsFile(path, every=Every(steps=2)), keep, Diverge(),
                           flaxhooks.Evaluate(make_arrays(40), batch_size=16)]).fit(make_batches(4), epochs=1)
    records = by_key(csv_records(path))
    means = [np.mean([keep.metrics[s]["loss"] for s in steps]) for steps in ((1, 2), (3, 4))]
    assert records["train", "loss"] == [(2, pytest.approx(means[0])), (4, pytest.approx(means[1]))]
    assert [step for step, _ in records["train", "optimizer/grad_norm"]] == [2, 4]
    assert [step for step, _ in records["eval", "accuracy"]] == [4]
    assert [np.isnan(v) for _, v in records["", "x/nan"]] == [True] * 4
    assert [v for _, v in records["", "x/inf"]] == [np.inf] * 4
    np.testing.assert_equal(read_metrics(path), csv_records(path))  # the package's reader reads what csv does


@pytest.mark.parametrize("suffix", ["jsonl", "csv"])
def test_truncating_drops_later_steps_a_partial_window_and_a_half_written_line(tmp_path, suffix):
    from flaxhooks.writers import AsyncWriter, truncate_metrics

    path = tmp_path / f"metrics.{suffix}"
    writer = AsyncWriter(MetricsFileWriter(path))
    for step in (2, 4, 6):
        writer.scalars({"loss": step / 10}, step, run="train")
        writer.run_scalars({"eval": {"loss": step}, "layers/a": {"mean": -step}}, step)
    writer.close()
    with open(path, "a") as file:
        file.write('{"step": 8, "run": "tr' if suffix == "jsonl" else "8,train,lo")  # killed mid-write
    # Dropped: step 4's train line, step 6's three, the half line.
    assert truncate_metrics(path, 4, whole_runs=("train",)) == 5
    assert read_metrics(path) == [(2, "train", "loss", 0.2), (2, "eval", "loss", 2.0),
                                  (2, "layers/a", "mean", -2.0), (4, "eval", "loss", 4.0),
                                  (4, "layers/a", "mean", -4.0)]
    assert not list(tmp_path.glob("*.truncating"))


def test_a_file_another_run_wrote_is_warned_of_and_a_later_fit_appends_to_it(tmp_path, caplog):
    path = tmp_path / "metrics.jsonl"
    sgd_trainer(callbacks=[MetricsFile(path, every=1)]).fit(make_batches(2), epochs=1)
    with caplog.at_level(logging.WARNING, logger="flaxhooks"):
        trainer = sgd_trainer(callbacks=[MetricsFile(path, every=1)])
        trainer.fit(make_batches(2), epochs=1)
        assert [r.message for r in caplog.records] == [
            f"MetricsFile: {path} already holds another run's records, and this run's are added after them: "
            "give each run a directory of its own (flaxhooks.run_directory)"]
        trainer.fit(make_batches(2), epochs=2)  # the same run going on: no warning
        assert len(caplog.records) == 1
    steps = [s for s, run, tag, _ in read_metrics(path) if (run, tag) == ("train", "loss")]
    assert steps == [1, 2, 1, 2, 3, 4]


def test_bad_paths_are_clear_errors_that_write_nothing(tmp_path):
    with pytest.raises(LogdirError, match="it is a directory"):
        MetricsFile(tmp_path)
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    with pytest.raises(LogdirError, match="cannot write a metrics file to"):
        MetricsFile(blocked / "metrics.jsonl")
    with pytest.raises(ValueError, match="format is one of"):
        MetricsFile(tmp_path / "metrics.txt", format="parquet")
    assert [p.name for p in tmp_path.iterdir()] == ["file"]
    same = [MetricsFile(tmp_path / "m.jsonl"), MetricsFile(str(tmp_path / "m.jsonl"))]
    trainer = sgd_trainer(callbacks=same)
    with pytest.raises(ValueError, match="both would write every record into one file"):
        trainer.fit(make_batches(2), epochs=1)
    assert [p.name for p in tmp_path.iterdir()] == ["file"]
