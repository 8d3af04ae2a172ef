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
from tests.helpers import MLP, cross_entropy, make_arrays, make_batches, sgd_trainer


def read(logdir) -> EventAccumulator:
    accumulator = EventAccumulator(str(logdir))
    accumulator.Reload()
    return accumulator


def scalars(logdir, tag):
    return [(event.step, event.value) for event in read(logdir).Scalars(tag)]


class KeepLosses(Callback):
    def __init__(self):
        self.losses = {}

    def on_step_end(self, loop):
        self.losses[loop.step] = loop.host_metrics()["loss"]


def test_training_and_eval_scalars_land_with_the_right_steps_and_values(tmp_path):
    keep = KeepLosses()
    test = make_arrays(40)
    evaluate = flaxhooks.Evaluate(test, at_epoch_end=True, batch_size=16)
    trainer = sgd_trainer(callbacks=[TensorBoard(tmp_path, every=Every(steps=2)), evaluate, keep])
    trainer.fit(make_batches(4), epochs=2)
    tags = read(tmp_path).Tags()["scalars"]
    assert {"train/loss", "train/steps_per_s", "eval/loss", "eval/accuracy"} <= set(tags)
    logged = scalars(tmp_path, "train/loss")
    assert [step for step, _ in logged] == [2, 4, 6, 8]
    for step, value in logged:
        assert value == pytest.approx(keep.losses[step], rel=1e-6)
    assert [step for step, _ in scalars(tmp_path, "eval/accuracy")] == [4, 8]
    assert scalars(tmp_path, "eval/loss")[-1][1] == pytest.approx(evaluate.result.metrics["loss"], rel=1e-6)


def test_the_learning_rate_of_a_schedule_or_injected_hyperparameters(tmp_path):
    schedule = optax.linear_schedule(0.1, 0.0, 8)
    injected = optax.inject_hyperparams(optax.sgd)(learning_rate=schedule)
    flaxhooks.Trainer(MLP(), injected, cross_entropy,
                      callbacks=[TensorBoard(tmp_path / "injected", every=Every(steps=2))]).fit(
        make_batches(4), epochs=2)
    # The injected value is the one the latest update used: schedule(step - 1).
    got = scalars(tmp_path / "injected", "train/learning_rate")
    assert [s for s, _ in got] == [2, 4, 6, 8]
    np.testing.assert_allclose([v for _, v in got], [float(schedule(s - 1)) for s, _ in got], rtol=1e-6)

    given = TensorBoard(tmp_path / "given", every=Every(steps=4), learning_rate=schedule)
    flaxhooks.Trainer(MLP(), optax.sgd(schedule), cross_entropy, callbacks=[given]).fit(
        make_batches(4), epochs=2)
    got = scalars(tmp_path / "given", "train/learning_rate")
    np.testing.assert_allclose([v for _, v in got], [float(schedule(4)), float(schedule(8))], rtol=1e-6)


def test_hyperparameters_are_written_as_text_and_hparams(tmp_path):
    trainer = sgd_trainer(callbacks=[TensorBoard(tmp_path, hparams={"learning_rate": 0.1, "model": "mlp"}),
                                     flaxhooks.Evaluate(make_arrays(20), batch_size=8)])
    trainer.fit(make_batches(2), epochs=1)
    text = read(tmp_path).Tensors("hparams/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "| learning_rate | 0.1 |" in text and "| model | mlp |" in text
    runs = list((tmp_path / "hparams").iterdir())  # the HParams plugin's run, with the final eval metrics
    assert len(runs) == 1
    assert "eval/accuracy" in read(runs[0]).Tags()["scalars"]


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
    assert [step for step, _ in scalars(tmp_path, "train/loss")] == [1, 2, 3]


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


def test_no_host_read_of_metrics_on_the_training_thread(tmp_path, monkeypatch):
    import threading

    from jax._src import array

    value = array.ArrayImpl._value
    training_thread_reads = []

    def counted(arr):
        if threading.current_thread() is threading.main_thread():
            training_thread_reads.append(arr.shape)
        return value.fget(arr)

    class Window(Callback):
        order = -1000

        def on_fit_start(self, loop):
            monkeypatch.setattr(array.ArrayImpl, "_value", property(counted))

        def on_fit_end(self, loop):
            monkeypatch.setattr(array.ArrayImpl, "_value", value)

    tensorboard = TensorBoard(tmp_path, every=Every(steps=1))
    sgd_trainer(callbacks=[Window(), tensorboard]).fit(make_batches(4), epochs=2)
    assert training_thread_reads == []
    assert len(scalars(tmp_path, "train/loss")) == 8


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
                if tags.get(".", {}).get("train/loss"):
                    points = _get_json(f"{base}/scalars?tag=train/loss&run=.")
                    if len(points) == 3:  # it may serve a partly loaded run first
                        break
            except OSError:
                pass
            if server.poll() is not None:
                pytest.fail(f"tensorboard exited: {server.stderr.read()[-2000:]}")
            time.sleep(0.5)
        assert tags is not None and "train/loss" in tags["."], tags
        points = _get_json(f"{base}/scalars?tag=train/loss&run=.")
        assert [p[1] for p in points] == [1, 2, 3]
        np.testing.assert_allclose([p[2] for p in points], [keep.losses[s] for s in (1, 2, 3)], rtol=1e-6)
    finally:
        server.terminate()
        server.wait(timeout=30)


def test_a_constant_injected_learning_rate_survives_donation(tmp_path):
    injected = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)
    flaxhooks.Trainer(MLP(), injected, cross_entropy,
                      callbacks=[TensorBoard(tmp_path, every=Every(steps=1))]).fit(make_batches(4), epochs=2)
    assert scalars(tmp_path, "train/learning_rate") == [(s, pytest.approx(0.1)) for s in range(1, 9)]


def test_several_fits_read_back_in_order(tmp_path):
    tensorboard = TensorBoard(tmp_path, every=Every(steps=1))
    trainer = sgd_trainer(callbacks=[tensorboard])
    for epochs in (1, 2, 3):  # each fit closes its file; quick fits share a second
        trainer.fit(make_batches(2), epochs=epochs)
    assert [step for step, _ in scalars(tmp_path, "train/loss")] == [1, 2, 3, 4, 5, 6]


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
    assert scalars(tmp_path / "tensorboard-5", "eval/loss")[0][0] == 3
