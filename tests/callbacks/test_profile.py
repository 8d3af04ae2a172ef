"""Profile: a jax.profiler trace of exactly the chosen steps, always stopped."""

import glob
import gzip
import json
import logging
import os
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import jax
import pytest

import flaxhooks
from flaxhooks import CallbackError, LogdirError, Profile, TensorBoard
from tests.helpers import RaiseAt, Recorder, make_batches, sgd_trainer


@pytest.fixture
def profiler(monkeypatch):
    """Replaces jax.profiler's start and stop, and jax.block_until_ready, with
    recorders writing into one log that a Recorder shares: the log then shows
    between which handlers each was called."""
    log = []
    monkeypatch.setattr(jax.profiler, "start_trace", lambda logdir, **kw: log.append(("jax", "start_trace")))
    monkeypatch.setattr(jax.profiler, "stop_trace", lambda: log.append(("jax", "stop_trace")))
    wait = jax.block_until_ready

    def block_until_ready(values):
        log.append(("jax", "block_until_ready"))
        return wait(values)

    monkeypatch.setattr(jax, "block_until_ready", block_until_ready)
    return log


def calls(log):
    """The profiler calls, each with the (event, step) of the handler before it."""
    seen, last = [], None
    for entry in log:
        if entry[0] == "jax":
            seen.append((entry[1], last))
        else:
            last = entry[1:]
    return seen


def trainer_of(*callbacks, **kwargs):
    """A small trainer on one device: what these tests check does not depend
    on the device count (the first test's does, and it runs on 1 and 8)."""
    return sgd_trainer(callbacks=callbacks, devices=jax.local_devices()[:1], **kwargs)


def xplanes(logdir):
    return glob.glob(os.path.join(logdir, "plugins", "profile", "*", "*.xplane.pb"))


def test_a_fit_writes_a_trace_where_tensorboards_profile_tab_reads_it(tmp_path, devices, caplog):
    logdir = str(tmp_path / "tensorboard")
    profile = Profile(steps=(3, 4))  # into the TensorBoard callback's directory
    trainer = sgd_trainer(callbacks=[TensorBoard(logdir), profile], devices=devices)
    with caplog.at_level(logging.INFO, logger="flaxhooks"):
        trainer.fit(make_batches(6), steps=6)
    [xplane] = xplanes(logdir)
    assert profile.trace_dirs == [os.path.dirname(xplane)]
    assert glob.glob(os.path.join(logdir, "**", "*tfevents*"), recursive=True)  # TensorBoard's, beside it
    [line] = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Profile:")]
    assert "steps 3 to 4" in line and os.path.dirname(xplane) in line
    assert "pip install tensorboard-plugin-profile" in line and f"tensorboard --logdir {logdir}" in line


def test_the_trace_covers_the_chosen_steps_waits_only_after_the_last_and_compiles_nothing(tmp_path, profiler):
    trainer = trainer_of(Profile(tmp_path, steps=(3, 5)), Recorder(log=profiler))
    trainer.fit(make_batches(4), steps=8)
    assert calls(profiler) == [
        ("start_trace", ("step_end", 2)),  # first of step 3's step_start handlers
        ("block_until_ready", ("step_end", 5)),  # after every step_end handler of step 5
        ("stop_trace", ("step_end", 5)),
    ]
    assert trainer.runner.traces == {"train_step": 1}  # the one step, compiled once, as without Profile


def test_a_number_of_steps_is_traced_after_each_fits_warmup(tmp_path, profiler):
    trainer = trainer_of(Profile(tmp_path, steps=2, warmup=1), Recorder(log=profiler))
    trainer.fit(make_batches(4), steps=5)
    trainer.fit(make_batches(4), steps=10)  # goes on from step 5
    starts_stops = [(name, at) for name, at in calls(profiler) if name != "block_until_ready"]
    assert starts_stops == [
        ("start_trace", ("step_end", 1)), ("stop_trace", ("step_end", 3)),
        ("start_trace", ("step_end", 6)), ("stop_trace", ("step_end", 8)),
    ]


def test_the_default_traces_steps_10_to_12(tmp_path, profiler):
    trainer = trainer_of(Profile(tmp_path), Recorder(log=profiler))
    trainer.fit(make_batches(4), steps=14)
    assert [(name, at[1]) for name, at in calls(profiler)] == [
        ("start_trace", 9), ("block_until_ready", 12), ("stop_trace", 12)
    ]


def test_a_fit_that_ends_before_the_last_chosen_step_stops_the_trace(tmp_path, profiler, caplog):
    trainer = trainer_of(Profile(tmp_path, steps=(3, 10)), Recorder(log=profiler))
    with caplog.at_level(logging.INFO, logger="flaxhooks"):
        trainer.fit(make_batches(4), steps=5)
    assert calls(profiler) == [
        ("start_trace", ("step_end", 2)),
        ("block_until_ready", ("epoch_end", 5)),  # at fit_end, before the other fit_end handlers
        ("stop_trace", ("epoch_end", 5)),
    ]
    assert any("training ended before step 10" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("error", [RuntimeError("boom"), KeyboardInterrupt()], ids=["error", "ctrl-c"])
def test_a_failing_fit_stops_the_trace_so_the_next_one_can_start(tmp_path, error):
    profile = Profile(tmp_path / "run", steps=(2, 10))
    trainer = trainer_of(profile, RaiseAt(3, error))
    with pytest.raises((CallbackError, KeyboardInterrupt)):
        trainer.fit(make_batches(4), steps=8)
    assert len(profile.trace_dirs) == 1 and xplanes(tmp_path / "run")
    jax.profiler.start_trace(tmp_path / "next")  # raises if a trace were still running
    jax.profiler.stop_trace()


def test_another_running_trace_is_named_and_training_goes_on(tmp_path, caplog):
    profile = Profile(tmp_path / "run", steps=(2, 3))
    trainer = trainer_of(profile)
    jax.profiler.start_trace(tmp_path / "other")
    try:
        with caplog.at_level(logging.WARNING, logger="flaxhooks"):
            trainer.fit(make_batches(4), steps=4)
    finally:
        jax.profiler.stop_trace()
    assert int(trainer.state.step) == 4 and profile.trace_dirs == []
    [warning] = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "steps 2 to 3 are not traced" in warning
    assert "another jax.profiler trace is already running" in warning


def test_steps_behind_a_resumed_run_warn_once_and_trace_nothing(tmp_path, profiler, caplog):
    trainer = trainer_of()
    trainer.fit(make_batches(4), steps=4)
    profile = Profile(tmp_path, steps=(2, 3))
    trainer.add(profile)
    with caplog.at_level(logging.WARNING, logger="flaxhooks"):
        trainer.fit(make_batches(4), steps=6)
        trainer.fit(make_batches(4), steps=8)
    assert calls(profiler) == [] and profile.trace_dirs == []
    [warning] = [r.getMessage() for r in caplog.records]
    assert "steps 2 to 3 are behind this fit, which starts after step 4" in warning


@pytest.mark.parametrize("steps, message", [
    ((5, 3), "stop comes before start"),
    ((0, 2), "numbered from 1"),
    (0, "positive number of steps"),
    (-2, "positive number of steps"),
    (True, "must be \\(start, stop\\) or a number"),
    ((1, 2, 3), "must be \\(start, stop\\) or a number"),
    ("10", "must be \\(start, stop\\) or a number"),
])
def test_bad_steps_are_refused_when_made(tmp_path, steps, message):
    with pytest.raises(ValueError, match=message):
        Profile(tmp_path, steps=steps)


def test_bad_warmup_and_logdir_are_refused(tmp_path):
    with pytest.raises(ValueError, match="0 or more"):
        Profile(tmp_path, steps=3, warmup=-1)
    with pytest.raises(ValueError, match="warmup applies to a number of steps only"):
        Profile(tmp_path, steps=(10, 12), warmup=2)
    (tmp_path / "file").write_text("")
    with pytest.raises(LogdirError, match="profiler traces"):
        Profile(tmp_path / "file" / "run")
    trainer = trainer_of(Profile())
    with pytest.raises(flaxhooks.CallbackError, match="on_fit_start.*no writer of this Trainer writes one"):
        trainer.fit(make_batches(2), steps=2)
    assert trainer.runner.traces == {}  # refused at fit_start: no step compiled


def test_it_traces_on_process_zero_only():
    assert Profile.process_zero_only and flaxhooks.Profile is Profile


def _get_json(url: str):
    with urllib.request.urlopen(url, timeout=10) as response:
        body = response.read()
        # The profile plugin gzips its answers whatever the request accepts.
        gzipped = response.headers.get("Content-Encoding") == "gzip"
        return json.loads(gzip.decompress(body) if gzipped else body)


def test_tensorboard_with_the_profile_plugin_lists_the_trace(tmp_path):
    pytest.importorskip("xprof", reason="needs pip install tensorboard-plugin-profile")
    profile = Profile(tmp_path / "x" / "tensorboard", steps=(2, 3))
    trainer_of(TensorBoard(tmp_path / "x" / "tensorboard"), profile).fit(make_batches(4), steps=4)
    run = "x/tensorboard/" + os.path.basename(profile.trace_dirs[0])
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    tensorboard = Path(sys.executable).with_name("tensorboard")
    command = [str(tensorboard)] if tensorboard.exists() else [sys.executable, "-m", "tensorboard.main"]
    server = subprocess.Popen(
        [*command, "--logdir", str(tmp_path), "--host", "127.0.0.1", "--port", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    base = f"http://127.0.0.1:{port}/data"
    try:
        runs, deadline = None, time.monotonic() + 90
        while time.monotonic() < deadline:
            try:
                runs = _get_json(f"{base}/plugin/profile/runs")
                if runs == [run]:
                    break
            except OSError:
                if server.poll() is not None:
                    pytest.fail(f"tensorboard exited: {server.stderr.read()[-2000:]}")
            time.sleep(0.5)
        assert runs == [run]
        assert _get_json(f"{base}/plugins_listing")["profile"]["enabled"]
        tools = _get_json(f"{base}/plugin/profile/run_tools?run={urllib.parse.quote(run)}")
        assert "overview_page" in tools and any(tool.startswith("trace_viewer") for tool in tools)
    finally:
        server.terminate()
        server.wait(timeout=30)
