"""TensorBoard logging, read back with TensorBoard's own reader and server."""

import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
import optax
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import flaxhooks
from flaxhooks import Callback, Every, LogdirError, TensorBoard
from tests.helpers import MLP, KeepMetrics, cross_entropy, make_arrays, make_batches, sgd_trainer


def read(logdir) -> EventAccumulator:
    accumulator = EventAccumulator(str(logdir))
    accumulator.Reload()
    return accumulator


def scalars(logdir, tag, run="."):
    """``(step, value)`` of ``tag`` in ``run``: ``train``, an evaluation's name, or the main run."""
    return [(event.step, event.value) for event in read(Path(logdir) / run).Scalars(tag)]


def records(logdir, plugin):
    """``(step, tag, summary value)`` of every summary of ``plugin`` in the main run's files."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    found = []
    for path in sorted(Path(logdir).glob("events.out.tfevents.*")):
        for event in EventFileLoader(str(path)).Load():
            for value in event.summary.value:
                if value.metadata.plugin_data.plugin_name == plugin:
                    found.append((event.step, value.tag, value))
    return found


def layout(logdir):
    """The latest Custom Scalars layout of the main run: ``[(category, [(title, [tag regex])])]``."""
    from tensorboard.plugins.custom_scalar import layout_pb2

    latest = layout_pb2.Layout.FromString(records(logdir, "custom_scalars")[-1][2].tensor.string_val[0])
    return [(category.title, [(chart.title, list(chart.multiline.tag)) for chart in category.chart])
            for category in latest.category]


class KeepLosses(Callback):
    def __init__(self):
        self.losses = {}

    def on_step_end(self, loop):
        self.losses[loop.step] = loop.host_metrics()["loss"]


def test_train_and_eval_are_sub_runs_with_the_same_tags_and_train_logs_window_means(tmp_path):
    keep = KeepMetrics()
    test = make_arrays(40)
    evaluate = flaxhooks.Evaluate(test, at_epoch_end=True, batch_size=16)
    trainer = sgd_trainer(callbacks=[TensorBoard(tmp_path, every=Every(steps=3)), evaluate, keep])
    trainer.fit(make_batches(4), epochs=2)
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["eval", "train"]  # no stray run
    train = set(read(tmp_path / "train").Tags()["scalars"])
    assert train == {"loss", "optimizer/grad_norm", "optimizer/update_ratio", "throughput/steps_per_s",
                     # Where the time went (no MFU: the peak of a CPU is not known).
                     "train/data_wait", "train/device_wait", "train/examples_per_sec", "train/flops_per_sec"}
    assert set(read(tmp_path / "eval").Tags()["scalars"]) == {"loss", "accuracy"}
    assert read(tmp_path).Tags()["scalars"] == []
    # Each point is the mean over the steps since the previous one (steps 1-3, 4-6, and the
    # fit's end writes 7-8).
    for tag, name in (("loss", "loss"), ("optimizer/grad_norm", "grad_norm")):
        logged = scalars(tmp_path, tag, "train")
        assert [step for step, _ in logged] == [3, 6, 8]
        for (step, value), first in zip(logged, (1, 4, 7), strict=True):
            expected = np.mean([keep.metrics[s][name] for s in range(first, step + 1)])
            assert value == pytest.approx(expected, rel=1e-6), tag
    assert [step for step, _ in scalars(tmp_path, "accuracy", "eval")] == [4, 8]
    final = evaluate.result.metrics["loss"]
    assert scalars(tmp_path, "loss", "eval")[-1][1] == pytest.approx(final, rel=1e-6)


def test_a_run_shorter_than_the_log_interval_leaves_its_curve_and_a_later_fit_starts_a_new_window(tmp_path):
    keep = KeepMetrics()
    trainer = sgd_trainer(callbacks=[TensorBoard(tmp_path, every=50), keep])
    trainer.fit(make_batches(4), epochs=2)  # 8 steps, no log due: the fit's end writes them
    trainer.fit(make_batches(4), epochs=3)  # steps 9-12: their own window, not steps 1-12 again

    def mean(name, first, last):
        return np.mean([keep.metrics[s][name] for s in range(first, last + 1)])

    for tag, name in (("loss", "loss"), ("optimizer/grad_norm", "grad_norm")):
        logged = scalars(tmp_path, tag, "train")
        assert [step for step, _ in logged] == [8, 12]
        assert logged[0][1] == pytest.approx(mean(name, 1, 8), rel=1e-6), tag
        assert logged[1][1] == pytest.approx(mean(name, 9, 12), rel=1e-6), tag
    tags = set(read(tmp_path / "train").Tags()["scalars"])
    assert {"throughput/steps_per_s", "train/examples_per_sec"} <= tags


def test_a_fit_ending_on_a_log_step_writes_no_second_point(tmp_path):
    trainer = sgd_trainer(callbacks=[TensorBoard(tmp_path, every=4)])
    trainer.fit(make_batches(4), epochs=2)
    assert [step for step, _ in scalars(tmp_path, "loss", "train")] == [4, 8]


def test_the_layout_opens_on_train_and_eval_charts(tmp_path):
    trainer = sgd_trainer(callbacks=[TensorBoard(tmp_path, every=2),
                                     flaxhooks.Evaluate(make_arrays(40), batch_size=16)])
    trainer.fit(make_batches(4), epochs=1)
    (category, charts), *_ = layout(tmp_path)
    assert category == "training"
    assert charts[:2] == [("loss", ["^loss$"]), ("accuracy", ["^accuracy$"])]  # train and eval runs alike
    assert [title for title, _ in charts[2:]] == ["optimizer/grad_norm", "optimizer/update_ratio"]


def test_the_optimizer_metrics_match_a_hand_computation(tmp_path):
    import jax

    batches = make_batches(3)
    keep = KeepMetrics()
    trainer = flaxhooks.Trainer(MLP(), optax.adam(0.01), cross_entropy, callbacks=[keep],
                                devices=jax.local_devices()[:1])
    params = trainer.init(batches[0]).params
    optimizer = optax.adam(0.01)
    opt_state = optimizer.init(params)
    trainer.fit(batches, epochs=1)
    for step, batch in enumerate(batches, start=1):
        grads = jax.grad(lambda p, b=batch: cross_entropy(MLP().apply({"params": p}, b["image"]), b))(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        def norm(tree):
            return np.sqrt(sum((np.asarray(x, np.float64) ** 2).sum() for x in jax.tree.leaves(tree)))

        assert keep.metrics[step]["grad_norm"] == pytest.approx(norm(grads), rel=1e-5)
        assert keep.metrics[step]["update_ratio"] == pytest.approx(norm(updates) / norm(params), rel=1e-5)
        params = optax.apply_updates(params, updates)


def test_a_metric_named_like_the_optimizers_is_a_clear_error():
    def clashing(logits, batch):
        return cross_entropy(logits, batch), {"grad_norm": logits.mean()}

    with pytest.raises(flaxhooks.LossError, match="grad_norm"):
        flaxhooks.Trainer(MLP(), optax.sgd(0.1), clashing).init(make_batches(1)[0])


def test_the_learning_rate_of_a_schedule_or_injected_hyperparameters(tmp_path):
    schedule = optax.linear_schedule(0.1, 0.0, 8)
    injected = optax.inject_hyperparams(optax.sgd)(learning_rate=schedule)
    flaxhooks.Trainer(MLP(), injected, cross_entropy,
                      callbacks=[TensorBoard(tmp_path / "injected", every=Every(steps=2))]).fit(
        make_batches(4), epochs=2)
    # The injected value is the one the latest update used: schedule(step - 1).
    got = scalars(tmp_path / "injected", "optimizer/learning_rate", "train")
    assert [s for s, _ in got] == [2, 4, 6, 8]
    np.testing.assert_allclose([v for _, v in got], [float(schedule(s - 1)) for s, _ in got], rtol=1e-6)

    given = TensorBoard(tmp_path / "given", every=Every(steps=4), learning_rate=schedule)
    flaxhooks.Trainer(MLP(), optax.sgd(schedule), cross_entropy, callbacks=[given]).fit(
        make_batches(4), epochs=2)
    got = scalars(tmp_path / "given", "optimizer/learning_rate", "train")
    np.testing.assert_allclose([v for _, v in got], [float(schedule(4)), float(schedule(8))], rtol=1e-6)


def test_hyperparameters_are_the_main_runs_hparams_session_linked_to_the_eval_metrics(tmp_path):
    from tensorboard.plugins.hparams import api_pb2, metadata

    hparams = {"learning_rate": 0.1, "model": "mlp", "nesterov": True, "widths": (8, 3), "unset": None,
               "seed": 10**30}
    trainer = sgd_trainer(callbacks=[TensorBoard(tmp_path, hparams=hparams),
                                     flaxhooks.Evaluate(make_arrays(20), batch_size=8)])
    trainer.fit(make_batches(2), epochs=1)
    trainer.fit(make_batches(2), epochs=2)  # written once: TensorBoard reads a run's first record
    text = read(tmp_path).Tensors("hparams/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "| learning_rate | 0.1 |" in text and "| model | mlp |" in text
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["eval", "train"]  # no HParams run
    found = {tag: value for _, tag, value in records(tmp_path, "hparams")}
    assert len(records(tmp_path, "hparams")) == 3
    start = metadata.parse_session_start_info_plugin_data(
        found[metadata.SESSION_START_INFO_TAG].metadata.plugin_data.content)
    parameters = 5 * 8 + 8 + 8 * 3 + 3  # MLP: Dense(8), Dense(3) on 5 features
    # A value that is not a number, string or boolean is its string; None is left out.
    assert {k: getattr(v, v.WhichOneof("kind")) for k, v in start.hparams.items()} == {
        "learning_rate": 0.1, "model": "mlp", "nesterov": True, "widths": "(8, 3)", "seed": 1e30,
        "parameters": parameters}
    experiment = metadata.parse_experiment_plugin_data(
        found[metadata.EXPERIMENT_TAG].metadata.plugin_data.content)
    kinds = {info.name: api_pb2.DataType.Name(info.type) for info in experiment.hparam_infos}
    number, string = "DATA_TYPE_FLOAT64", "DATA_TYPE_STRING"
    assert kinds == {"learning_rate": number, "model": string, "nesterov": "DATA_TYPE_BOOL", "widths": string,
                     "seed": number, "parameters": number}
    metrics = ["results/eval/loss", "results/eval/accuracy"]
    assert [(m.name.group, m.name.tag) for m in experiment.metric_infos] == [("", tag) for tag in metrics]
    # The HParams table's column names: the evaluation and its metric.
    assert [m.display_name for m in experiment.metric_infos] == ["eval loss", "eval accuracy"]
    end = metadata.parse_session_end_info_plugin_data(
        found[metadata.SESSION_END_INFO_TAG].metadata.plugin_data.content)
    assert api_pb2.Status.Name(end.status) == "STATUS_SUCCESS"
    final = trainer.evaluate(make_arrays(20), batch_size=8).metrics  # the state both fits ended with
    for tag in metrics:  # the latest evaluation, in the session's own run, where HParams reads it
        assert scalars(tmp_path, tag)[-1] == (4, pytest.approx(final[tag.split("/")[-1]], rel=1e-6))


def test_an_unwritable_logdir_is_a_clear_error_before_training(tmp_path):
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    with pytest.raises(LogdirError, match="cannot write TensorBoard logs to"):
        TensorBoard(blocked / "run")
    if os.geteuid() != 0:  # root can write anywhere
        read_only = tmp_path / "ro"
        read_only.mkdir(mode=0o500)
        with pytest.raises(LogdirError):
            TensorBoard(read_only)


def test_logs_are_flushed_when_training_fails(tmp_path):
    class Interrupt(Callback):
        def on_step_end(self, loop):
            if loop.step == 3:
                raise KeyboardInterrupt

    trainer = sgd_trainer(callbacks=[TensorBoard(tmp_path, every=Every(steps=1)), Interrupt()])
    with pytest.raises(KeyboardInterrupt):
        trainer.fit(make_batches(5), epochs=1)
    # Read at once, with no close: fit_end flushed the file.
    assert [step for step, _ in scalars(tmp_path, "loss", "train")] == [1, 2, 3]


def test_a_failing_writer_stops_training_with_a_clear_error(tmp_path, monkeypatch):
    tensorboard = TensorBoard(tmp_path, every=Every(steps=1))
    trainer = sgd_trainer(callbacks=[tensorboard])
    trainer.fit(make_batches(1), steps=1)

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    from tensorboardX.writer import FileWriter

    monkeypatch.setattr(FileWriter, "add_summary", disk_full)
    with pytest.raises(flaxhooks.CallbackError, match="No space left on device"):
        trainer.fit(make_batches(5), steps=6)


def test_other_callbacks_write_through_the_loops_writers_whatever_their_order(tmp_path):
    class Custom(Callback):
        def on_fit_start(self, loop):
            loop.writers.text("custom/notes", "first", loop.step)

        def on_step_end(self, loop):
            loop.writers.scalars({"double_step": 2.0 * loop.step}, loop.step, "custom/")
            loop.writers.histogram("custom/values", np.array([1.0, np.nan, 2.0, np.inf]), loop.step)

    sgd_trainer(callbacks=[Custom(), TensorBoard(tmp_path)]).fit(make_batches(2), epochs=1)
    assert scalars(tmp_path, "custom/double_step") == [(1, 2.0), (2, 4.0)]
    histogram = read(tmp_path).Histograms("custom/values")[-1].histogram_value
    assert histogram.num == 2  # non-finite values dropped
    assert "custom/notes/text_summary" in read(tmp_path).Tags()["tensors"]


def test_callbacks_write_images_through_the_loops_writers(tmp_path):
    import io

    pytest.importorskip("matplotlib")
    from PIL import Image

    from flaxhooks.diagnose import figure_pixels, heatmap_figure, heatmap_png

    values = np.array([[1e-3, 1e-2, np.nan], [1.0, 0.5, 0.1]])
    png = heatmap_png(values, rows=["dense_0", "head"], steps=[1, 2, 3])
    picture = figure_pixels(heatmap_figure(values, rows=["dense_0", "head"], steps=[1, 2, 3]))

    class Pictures(Callback):
        def on_step_end(self, loop):
            if loop.step == 2:
                loop.writers.images({"diagnose/png": png}, loop.step)
                loop.writers.images(lambda: {"diagnose/pixels": picture}, loop.step)  # encoded off the thread

    sgd_trainer(callbacks=[Pictures(), TensorBoard(tmp_path)]).fit(make_batches(3), epochs=1)
    (written,) = read(tmp_path).Images("diagnose/png")
    assert written.step == 2 and written.encoded_image_string == png
    (encoded,) = read(tmp_path).Images("diagnose/pixels")
    assert (encoded.step, encoded.height, encoded.width) == (2, *picture.shape[:2])
    np.testing.assert_array_equal(np.asarray(Image.open(io.BytesIO(encoded.encoded_image_string))), picture)
    # The PNG file and the pixels are the same picture.
    assert (written.height, written.width) == (encoded.height, encoded.width)


def test_no_host_read_of_metrics_on_the_training_thread(tmp_path, monkeypatch):
    import threading

    from jax._src import array

    value = array.ArrayImpl._value
    training_thread_reads = []

    def counted(arr):
        if threading.current_thread() is threading.main_thread():
            training_thread_reads.append(arr.shape)
        return value.fget(arr)

    class CountReads(Callback):
        order = -1000

        def on_fit_start(self, loop):
            monkeypatch.setattr(array.ArrayImpl, "_value", property(counted))

        def on_fit_end(self, loop):
            monkeypatch.setattr(array.ArrayImpl, "_value", value)

    tensorboard = TensorBoard(tmp_path, every=Every(steps=1))
    sgd_trainer(callbacks=[CountReads(), tensorboard], if_nonfinite="off").fit(make_batches(4), epochs=2)
    assert training_thread_reads == []  # the guard's reads: tests/loop/test_guard.py
    assert len(scalars(tmp_path, "loss", "train")) == 8


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _get_json(url: str):
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.load(response)


def test_the_real_tensorboard_server_serves_the_scalars(tmp_path):
    keep = KeepLosses()
    sgd_trainer(callbacks=[TensorBoard(tmp_path, every=Every(steps=1)), keep]).fit(make_batches(3), epochs=1)
    port = _free_port()
    tensorboard = Path(sys.executable).with_name("tensorboard")
    command = [str(tensorboard)] if tensorboard.exists() else [sys.executable, "-m", "tensorboard.main"]
    server = subprocess.Popen(
        [*command, "--logdir", str(tmp_path), "--host", "127.0.0.1", "--port", str(port),
         "--load_fast", "false"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    try:
        base = f"http://127.0.0.1:{port}/data/plugin/scalars"
        deadline = time.monotonic() + 90
        tags = None
        while time.monotonic() < deadline:
            try:
                tags = _get_json(f"{base}/tags")
                if tags.get("train", {}).get("loss"):
                    points = _get_json(f"{base}/scalars?tag=loss&run=train")
                    if len(points) == 3:  # it may serve a partly loaded run first
                        break
            except OSError:
                pass
            if server.poll() is not None:
                pytest.fail(f"tensorboard exited: {server.stderr.read()[-2000:]}")
            time.sleep(0.5)
        assert tags is not None and "loss" in tags["train"], tags
        points = _get_json(f"{base}/scalars?tag=loss&run=train")
        assert [p[1] for p in points] == [1, 2, 3]
        np.testing.assert_allclose([p[2] for p in points], [keep.losses[s] for s in (1, 2, 3)], rtol=1e-6)
    finally:
        server.terminate()
        server.wait(timeout=30)


def test_a_constant_injected_learning_rate_survives_donation(tmp_path):
    injected = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)
    flaxhooks.Trainer(MLP(), injected, cross_entropy,
                      callbacks=[TensorBoard(tmp_path, every=Every(steps=1))]).fit(make_batches(4), epochs=2)
    logged = scalars(tmp_path, "optimizer/learning_rate", "train")
    assert logged == [(s, pytest.approx(0.1)) for s in range(1, 9)]


def test_several_fits_read_back_in_order(tmp_path):
    tensorboard = TensorBoard(tmp_path, every=Every(steps=1))
    trainer = sgd_trainer(callbacks=[tensorboard])
    for epochs in (1, 2, 3):  # each fit closes its file; quick fits share a second
        trainer.fit(make_batches(2), epochs=epochs)
    assert [step for step, _ in scalars(tmp_path, "loss", "train")] == [1, 2, 3, 4, 5, 6]


def test_non_finite_scalars_are_written(tmp_path):
    class Diverge(Callback):
        def on_step_end(self, loop):
            loop.writers.scalars({"nan": float("nan"), "inf": float("inf")}, loop.step, "x/")

    sgd_trainer(callbacks=[TensorBoard(tmp_path), Diverge()]).fit(make_batches(1), steps=1)
    assert np.isnan(scalars(tmp_path, "x/nan")[0][1]) and np.isinf(scalars(tmp_path, "x/inf")[0][1])


def test_many_fits_leave_no_threads_or_open_files_behind(tmp_path):
    """A sweep or a notebook fits many Trainers in one process: each fit's
    writers, their threads and their files are closed when it ends."""

    def fit(i):
        trainer = sgd_trainer(callbacks=[
            TensorBoard(tmp_path / f"tensorboard-{i}", every=1, hparams={"run": i}),
            flaxhooks.Checkpoint(tmp_path / f"checkpoints-{i}", every=1),
        ])
        trainer.fit(make_batches(3), epochs=1)
        trainer.evaluate(make_arrays(16), batch_size=8)  # outside fit: a writer just for it

    fit(0)  # the first fit starts what lives as long as the process (JAX's and orbax's pools)
    threads = {t.name for t in threading.enumerate()}
    files = len(os.listdir("/proc/self/fd"))
    for i in range(1, 6):
        fit(i)
    assert {t.name for t in threading.enumerate()} <= threads
    assert len(os.listdir("/proc/self/fd")) <= files
    assert scalars(tmp_path / "tensorboard-5", "loss", "eval")[0][0] == 3


def test_a_second_tensorboard_is_refused_before_anything_is_written(tmp_path):
    """Both would write every curve through the fit's writers into both directories."""
    first, second = TensorBoard(str(tmp_path / "a")), TensorBoard(str(tmp_path / "b"))
    trainer = sgd_trainer(callbacks=[first, second])
    with pytest.raises(ValueError, match="are in one Trainer.*every curve twice; keep one"):
        trainer.fit(make_batches(2), epochs=1)
    assert trainer.state is None
    assert not any(path.is_file() for path in tmp_path.rglob("*"))
