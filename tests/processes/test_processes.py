"""Several JAX processes (gloo on 127.0.0.1, 2 CPU devices each) train as one
process with all their devices would, and agree on every stop and fault.

Every process runs under ``timeout -s KILL``, so a hang fails the test
instead of blocking the suite.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import jax
import numpy as np
import optax
import pytest

import flaxhooks
from tests.helpers import MLP, BatchNormNet, assert_tables_close, cross_entropy, make_arrays, sgd_trainer

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow  # several processes


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Workers:
    """``count`` processes of one scenario of ``tests/multiprocess_worker.py``,
    each killed after ``limit`` seconds; their output is read as it comes."""

    def __init__(self, scenario: str, out: Path, *args: str, count: int = 2, limit: float = 120,
                 env: dict[str, str] | None = None):
        out.mkdir(parents=True, exist_ok=True)
        self.out = out
        env = {**{k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}, **(env or {})}
        port = str(_free_port())
        self.procs = [
            subprocess.Popen(
                ["timeout", "-s", "KILL", str(limit), sys.executable, "-m",
                 "tests.processes.processes_worker", scenario, str(i), str(count), port, str(out), *args],
                cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            )
            for i in range(count)
        ]
        self.lines: list[list[str]] = [[] for _ in self.procs]
        self.exited: list[float | None] = [None] * count
        self._readers = [threading.Thread(target=self._read, args=(i,), daemon=True) for i in range(count)]
        for reader in self._readers:
            reader.start()

    def _read(self, i: int) -> None:
        for line in self.procs[i].stdout:  # type: ignore[union-attr]
            self.lines[i].append(line)
        self.procs[i].wait()
        self.exited[i] = time.monotonic()

    def wait_for(self, i: int, text: str, limit: float = 90) -> None:
        deadline = time.monotonic() + limit
        while not any(text in line for line in self.lines[i]):
            assert time.monotonic() < deadline and self.procs[i].poll() is None, self.output()
            time.sleep(0.02)

    def finish(self) -> list[int]:
        for reader in self._readers:
            reader.join()
        return [p.returncode for p in self.procs]

    def output(self, i: int | None = None) -> str:
        return "".join(self.lines[i]) if i is not None else "\n\n".join("".join(ls) for ls in self.lines)

    def result(self, i: int) -> dict:
        path = self.out / f"p{i}.json"
        assert path.exists(), f"process {i} wrote no result:\n{self.output(i)}"
        with open(path) as file:
            return json.load(file)


def test_every_compiled_step_spans_every_process(tmp_path):
    """Statistics due every step (the instrumented step) change nothing, on 2
    processes as on 1 process with their 4 devices; evaluation is exact; gradient
    accumulation and the weights' moving average split over both processes are those
    of the whole batch's update, replicated."""
    if len(jax.local_devices()) < 4:
        pytest.skip("needs 4 local devices for the reference")
    workers = Workers("equivalence", tmp_path)
    assert workers.finish() == [0, 0], workers.output()
    assert "2 local of 4 devices, step 8" in workers.output(0)

    history = {}

    class Keep(flaxhooks.Callback):
        order = 50

        def on_step_end(self, loop):
            history[loop.step] = {t: loop.published[t].to_dict() for t in ("activations", "activation_grads")}

    loader = flaxhooks.ArrayLoader(make_arrays(64), batch_size=16, seed=1)
    reference = sgd_trainer(BatchNormNet(), devices=jax.local_devices()[:4], callbacks=[
        flaxhooks.ActivationStats(every=1), flaxhooks.ActivationGradStats(every=1), Keep(),
    ]).fit(loader, epochs=2)
    expected = [np.asarray(x, np.float64).ravel() for x in jax.tree.leaves(jax.device_get(reference.params))]
    one = sgd_trainer(BatchNormNet())
    evaluated = one.evaluate(make_arrays(1001, seed=5), batch_size=100, state=reference)
    predicted = one.predict(make_arrays(1001, seed=5), batch_size=100, state=reference)
    predicted_batches = one.predict([{"image": make_arrays(80, seed=6)["image"]}], state=reference)
    plateau = flaxhooks.ReduceLROnPlateau("loss", factor=0.5, patience=1, rtol=0.2)
    plateaued = flaxhooks.Trainer(
        MLP(), plateau.wrap(optax.sgd(0.5)), cross_entropy, devices=jax.local_devices()[:4], callbacks=[
            flaxhooks.Evaluate(make_arrays(48, seed=9), every=2, at_epoch_end=False, batch_size=16), plateau,
        ]).fit(loader, epochs=1)
    for i in range(2):
        got = workers.result(i)
        # FSDP over both processes' devices: the kernel split between them, the same training.
        assert got["fsdp_kernel"] == ["P(None, 'data')", True]
        for with_stats, without, fsdp, ref in zip(got["with_stats"], got["without"], got["fsdp"], expected,
                                                  strict=True):
            np.testing.assert_allclose(with_stats, without, rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(fsdp, without, rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(with_stats, ref, rtol=1e-4, atol=1e-5)
        for dispatched, fsdp in zip(got["dispatched"], got["fsdp"], strict=True):
            np.testing.assert_allclose(dispatched, fsdp, rtol=1e-6, atol=1e-7)
        for auto, lean in zip(got["auto"], got["four_epochs"], strict=True):
            np.testing.assert_allclose(auto, lean, rtol=1e-6, atol=1e-7)
        for accumulated, whole in zip(got["accumulated"], got["whole_batches"], strict=True):
            np.testing.assert_allclose(accumulated, whole, rtol=1e-5, atol=1e-6)
        assert got["ema_split"] and len(got["accumulated"]) == 8  # 4 parameters, 4 averages
        scale, params = got["plateau"]
        assert scale == plateau.scale < 1
        for got_leaf, want in zip(params, jax.tree.leaves(jax.device_get(plateaued.params)), strict=True):
            np.testing.assert_allclose(got_leaf, np.asarray(want, np.float64).ravel(), rtol=1e-4, atol=1e-5)
    assert workers.result(0)["auto_count"] == workers.result(1)["auto_count"] is not None
    for i in range(2):
        got = workers.result(i)
        stats = {int(step): tables for step, tables in got["stats"].items()}
        assert sorted(history) == list(range(1, 9))
        assert_tables_close(stats, history, rel=1e-3, abs=1e-5)
        examples, loss, accuracy = got["eval"]
        assert examples == 1001 and got["tiny"] == 1
        assert loss == pytest.approx(evaluated.metrics["loss"], rel=1e-4)
        assert accuracy == pytest.approx(evaluated.metrics["accuracy"], abs=1e-6)
        assert "BatchError" in got["bad_label"] or "another process" in got["bad_label"]
    # Predictions: each process has the outputs of its share, in order; together every example once.
    shares = [np.asarray(workers.result(i)["predicted"]) for i in range(2)]
    assert [len(share) for share in shares] == [501, 500]
    np.testing.assert_allclose(np.stack([shares[0][:500], shares[1]], 1).reshape(-1, 3), predicted[:1000],
                               rtol=1e-4, atol=1e-5)  # interleaved: every 2nd example each
    np.testing.assert_allclose(shares[0][500], predicted[1000], rtol=1e-4, atol=1e-5)
    batches = [np.asarray(workers.result(i)["predicted_batches"]) for i in range(2)]
    assert [len(share) for share in batches] == [75, 5]
    np.testing.assert_allclose(np.concatenate(batches), predicted_batches, rtol=1e-4, atol=1e-5)
    assert [workers.result(i)["predicted_tiny"] for i in range(2)] == [[1, 3], [0, 3]]


def test_a_state_split_within_or_across_processes_is_saved_and_resumes_on_one_process_bit_exactly(tmp_path):
    """2 processes x 2 devices. FSDP over the "model" axis within each process:
    process 0 saves its parts. FSDP over "data", across the processes: each
    process writes its own part (no process holds a kernel whole), both
    resume from it, and a NaN in process 1's part alone skips that save on
    both. 1 process with 4 devices resumes either, data parallel, bit for bit."""
    if len(jax.local_devices()) < 4:
        pytest.skip("needs 4 local devices")
    run = tmp_path / "run"
    workers = Workers("split_checkpoint", tmp_path, str(run))
    assert workers.finish() == [0, 0], workers.output()
    first = workers.result(0)
    assert first["spec"] == "P(None, 'model')" and first["local_parts"] == 2
    for i in range(2):
        got = workers.result(i)
        assert got["across_spec"] == "P(None, 'data')" and got["across_split"], got
        assert got["across_saved"] == [4, 8] and got["resumed_step"] == 12, got
        # Step 12 has NaN in process 1's part only: no process saved it, each said so.
        assert got["after_nan"] == [4, 8] and got["skipped"] == [12], got
        assert len(got["nan_warnings"]) == 1 and "not saving step 12" in got["nan_warnings"][0], got
        assert got["across_leaves"] == first["across_leaves"]
    # "within" saved on process 0 alone, so orbax's count of saves differs
    # between the processes in "across": every committed step still holds
    # both processes' parts (their directories made between barriers).
    for step in (4, 8):
        state_dir = run / "across" / str(step) / "state"
        for process in range(2):  # orbax wrote from both processes, each its own files
            assert any((state_dir / f"ocdbt.process_{process}" / "d").iterdir()), sorted(state_dir.iterdir())
    assert not [name for name in os.listdir(run / "across") if "tmp" in name], os.listdir(run / "across")
    meta = json.loads((run / "across" / "8" / "meta" / "metadata").read_text())
    assert meta["format"] == 3
    kernel = next(leaf for leaf in meta["leaves"] if leaf["path"] == ".params['Dense_0']['kernel']")
    assert kernel["shape"] == [5, 8] and isinstance(kernel["fingerprint"], int)
    # Each process wrote its own data position.
    assert sorted(os.listdir(run / "across" / "8" / "data")) == [
        "commit_success.txt", "position_0-of-2.json", "position_1-of-2.json"]
    assert not any(name.startswith("12") for name in os.listdir(run / "across"))

    for directory, expected in (("within", first["leaves"]), ("across", first["across_leaves"])):
        restorer = flaxhooks.Checkpoint(run / directory)
        assert restorer.saved_steps()[-1] == 8
        resumed = sgd_trainer(BatchNormNet(), devices=jax.local_devices()[:4], callbacks=[restorer]).fit(
            flaxhooks.ArrayLoader(make_arrays(64), batch_size=16, seed=1), epochs=2, resume=True)
        for got, saved in zip(jax.tree.leaves(resumed), expected, strict=True):
            np.testing.assert_array_equal(np.asarray(got, np.float64).ravel(), saved)


def test_a_process_lost_inside_a_save_of_its_part_leaves_no_checkpoint_that_looks_complete(tmp_path):
    """FSDP across both processes; process 1 dies once it wrote its part of
    step 2's checkpoint, before the commit: process 0's fit raises PeerLost
    naming it within seconds (its wait for the save polls for a lost peer;
    it is not ended by the watcher for being stuck), and step 2 never looks
    complete."""
    run = tmp_path / "run"
    workers = Workers("lost_while_saving", tmp_path, str(run), limit=90)
    workers.wait_for(1, "killing myself")
    killed = time.monotonic()
    codes = workers.finish()
    exited = workers.exited[0] - killed  # type: ignore[operator]
    print(f"process 1 died inside a save: process 0 exited {exited:.1f} s later")
    assert codes[0] == 1 and codes[1] in (-signal.SIGKILL, 128 + signal.SIGKILL), workers.output()
    survivor = workers.result(0)  # written once fit returned: fit itself raised
    assert survivor["error"] == "PeerLost" and survivor["processes"] == [1], workers.output(0)
    assert "process 1 was lost at step" in survivor["message"], survivor
    assert "[0] DONE" in workers.output(0), workers.output(0)
    assert "stuck in a collective" not in workers.output(0), workers.output(0)  # not the watcher's exit
    assert exited < 15, workers.output(0)
    checkpoint = flaxhooks.Checkpoint(run / "checkpoints")
    assert checkpoint.saved_steps() == [] and checkpoint.restore_latest() is None
    assert not (run / "checkpoints" / "2").exists()


def test_stops_and_faults_on_one_process_are_agreed_by_every_process(tmp_path):
    """One fit after another in the same two processes: each ends at the same
    step on both, the same way, and leaves the run healthy for the next."""
    workers = Workers("agreement", tmp_path, limit=240)
    assert workers.finish() == [0, 0], workers.output()
    zero, one = workers.result(0), workers.result(1)
    for name in zero:
        if isinstance(zero[name], dict):
            for field in ("error", "step", "stop_reason", "processes", "error_step"):
                assert zero[name].get(field) == one[name].get(field), (name, field, zero[name], one[name])

    for name in zero:
        if isinstance(zero[name], dict):
            print(f"{name}: step {zero[name].get('step')}, {zero[name]['error'] or 'returned'} on both, "
                  f"fit took {zero[name]['seconds']:.1f} s")
    stopped = zero["stop_on_1"]
    assert stopped["error"] is None and 3 <= stopped["step"] <= 5
    assert stopped["stop_reason"] == "process 1: process 1 had enough"
    assert zero["stoptraining_on_0"]["error"] is None and 2 <= zero["stoptraining_on_0"]["step"] <= 4
    assert zero["stoptraining_on_0"]["stop_reason"] == "process 0: process 0 says stop"

    for name, process, words in (
        ("error_on_1", 1, "ValueError: boom"),
        ("error_at_epoch_end_on_0", 0, "ValueError: boom"),
        ("data_error_on_0", 0, "OSError: disk read failed"),
        ("data_runs_out_on_1", 1, "data ran out"),
    ):
        failed = zero[name]
        assert failed["error"] == "ProcessError" and failed["processes"] == [process], failed
        assert f"process {process}:" in failed["message"] and words in failed["message"]
        assert failed["error_step"] == failed["step"] and failed["seconds"] < 30
    assert zero["error_on_1"]["step"] - 3 <= 2  # within the steps in flight
    # Process 1 may have dispatched up to max_steps_in_flight + 1 steps of the next epoch.
    assert zero["error_at_epoch_end_on_0"]["step"] in (8, 9, 10, 11)

    assert zero["unsized_epochs"]["error"] is None and zero["unsized_epochs"]["step"] == 16
    assert zero["unequal_lengths"]["error"] == "BatchError"
    assert "process 0: 8; process 1: 6" in zero["unequal_lengths"]["message"]
    layout = zero["layout"]
    assert layout["error"] == "BatchError" and layout["compiles"] == [], layout
    assert "process 0: image float32[8, 5]" in layout["message"]
    assert "process 1: image float32[4, 5]" in layout["message"]

    nonfinite = zero["nonfinite"]
    # Every process sees the same global loss and statistics: the same stop, then NonFiniteError on each.
    assert nonfinite["error"] == "NonFiniteError"
    # The stop's reason in a few words (the same on every process), the error in full.
    assert nonfinite["stop_reason"].startswith("every process: the loss is nan; first non-finite: ")
    assert nonfinite["stop_reason"].endswith("; details in the NonFiniteError")
    assert nonfinite["message"].startswith("the loss is nan at step") and "Dense_1" in nonfinite["message"]
    advice = nonfinite["message"].split(". Try: ")[1]  # sgd(1e9): the growth, then the learning rate
    assert " grew " in advice and advice.endswith(": lower the learning rate or add warmup, clip gradients "
                                                  "(optax.clip_by_global_norm), or train in float32")

    # A NaN in process 1's share of step 3's batch: both replay step 3 (process 1
    # has the outcome later) and name the same call, in the same words.
    for got in (zero["nan_on_1"], one["nan_on_1"]):
        assert got["error"] == "NonFiniteError" and 3 <= got["step"] <= 5, got
        assert got["stop_reason"] == ("every process: the loss is nan; first non-finite: the batch "
                                      "(batch['image']); details in the NonFiniteError"), got
        assert got["message"] == (
            "the loss is nan at step 3: the batch of step 3 holds NaN or infinity (in batch['image']): the "
            "data, not training, made it; the first call, in execution order, whose output went non-finite "
            "is 'Dense_0' (found by replaying step 3 instrumented on every process). Try: check the data: "
            "find and drop or repair the examples holding NaN or infinity (np.isfinite where the data is "
            "read); the learning rate is not the cause"), got
        assert [f[:3] for f in got["findings"]] == [["nonfinite", "Dense_0", 3]], got
        # The state from before step 3: that of 2 steps on the same batches.
        assert got["state_step"] == 2 and got["params"] == got["two_steps"]
    assert zero["nan_on_1"]["findings"] == one["nan_on_1"]["findings"]
    assert zero["nan_on_1"]["params"] == one["nan_on_1"]["params"]

    # Diagnose: the same findings on both, through finding events; process 0 alone logs them.
    diagnosed = zero["diagnose"]
    assert diagnosed["error"] is None and diagnosed["step"] == 8, diagnosed
    assert [f[:3] for f in diagnosed["findings"]] == [["dead_units", "killed", 4]], diagnosed
    for got in (diagnosed, one["diagnose"]):
        assert got["findings"] == got["table"] == diagnosed["findings"], got
    assert diagnosed["logged"] == [f[3] for f in diagnosed["findings"]]
    assert one["diagnose"]["logged"] == []
    by_time = zero["eval_by_time"]
    assert by_time["error"] == "ProcessError" and "Every(steps=N)" in by_time["message"]
    assert zero["healthy_after_all"]["error"] is None and zero["healthy_after_all"]["step"] == 16
    assert zero["healthy_params"] == one["healthy_params"]


def test_an_error_on_one_process_at_a_checkpoint_step_stops_every_process_within_2_s(tmp_path):
    """The save at that step goes on on every process (what handlers asked
    for runs even after another handler raised), so no process waits for a
    part that never comes; the agreed stop then ends the fit everywhere."""
    workers = Workers("error_while_saving", tmp_path, str(tmp_path / "run"), limit=90)
    assert workers.finish() == [0, 0], workers.output()
    raised = workers.result(1)["raised"]
    for i in range(2):
        got = workers.result(i)
        assert got["error"] == "ProcessError" and got["processes"] == [1], got
        assert "process 1:" in got["message"] and "boom at a checkpoint step" in got["message"], got
        print(f"process {i}: fit ended {got['ended'] - raised:.2f} s after process 1 raised at step 4")
        assert got["ended"] - raised < 2, got
    assert workers.result(0)["saved"][:2] == [2, 4], workers.result(0)

@pytest.mark.parametrize(
    "signum, target, preemption_service, steps_per_dispatch",
    [(signal.SIGTERM, 1, True, 1), (signal.SIGTERM, 1, False, 1), (signal.SIGINT, 0, True, 1),
     (signal.SIGTERM, 1, True, 4)],
    ids=["SIGTERM-to-1", "SIGTERM-to-1-without-JAX's-preemption-service", "SIGINT-to-0",
         "SIGTERM-to-1-inside-a-dispatch-of-4-steps"])
def test_a_signal_to_one_process_stops_every_process_with_a_checkpoint(tmp_path, signum, target,
                                                                      preemption_service, steps_per_dispatch):
    """SIGTERM goes to JAX's preemption notifier, and every process stops at
    the step its sync point agrees on; with the service off (and for Ctrl-C)
    flaxhooks catches the signal and the processes agree the stop themselves.
    With several steps per dispatch, at the end of a dispatch."""
    env = {} if preemption_service else {"JAX_ENABLE_PREEMPTION_SERVICE": "false"}
    workers = Workers("interrupted", tmp_path, str(tmp_path / "run"), str(steps_per_dispatch), env=env)
    workers.wait_for(target, "step 3")
    sent = time.monotonic()
    # Not through `timeout`, which would pass the signal on to every child.
    worker_pid = int(subprocess.check_output(["pgrep", "-P", str(workers.procs[target].pid)]).split()[0])
    os.kill(worker_pid, signum)
    codes = workers.finish()
    assert codes == [128 + signum] * 2, workers.output()
    print(f"{signal.Signals(signum).name} to process {target}: every process exited "
          f"{max(workers.exited) - sent:.1f} s after the signal")  # type: ignore[operator]
    assert max(workers.exited) - sent < 10, workers.output()  # type: ignore[operator]
    steps = {workers.result(i)["step"] for i in range(2)}
    assert len(steps) == 1, workers.output()
    (step,) = steps
    assert f"INTERRUPTED {step} {signal.Signals(signum).name}" in workers.output(1 - target)
    assert workers.result(0)["saved"] == [step]  # the one final checkpoint
    assert step % steps_per_dispatch == 0  # dispatches of 4 steps: 1-4, 5-8, ...
    by_sync_point = re.compile(rf"every process stops at step {step}, (the end of the dispatch holding step "
                               r"\d+, )?the step JAX's preemption sync point agreed on")
    for i in range(2):
        expected = signum == signal.SIGTERM and preemption_service
        assert bool(by_sync_point.search(workers.output(i))) == expected, workers.output(i)


def test_a_preemption_notice_before_a_resumed_fits_first_step_stops_it_at_its_start(tmp_path):
    """SIGTERM while a resumed run compiles and restores, before its fit
    asks JAX's sync point at all: the sync point falls on the fit's first
    ask, so every process stops where it resumed instead of never."""
    run = str(tmp_path / "run")
    trained = Workers("preempted_before_resuming", tmp_path / "train", run, "train")
    assert trained.finish() == [0, 0], trained.output()
    assert trained.result(0)["saved"] == [4]
    workers = Workers("preempted_before_resuming", tmp_path / "resume", run, "resume")
    assert workers.finish() == [128 + signal.SIGTERM] * 2, workers.output()
    for i in range(2):
        assert workers.result(i)["step"] == 4, workers.output()
        assert "every process stops at step 4, the step JAX's preemption sync point agreed on" in \
            workers.output(i), workers.output(i)


def test_a_killed_process_is_named_and_the_others_exit(tmp_path):
    workers = Workers("lost", tmp_path, limit=90)
    codes = workers.finish()
    assert codes[1] == -signal.SIGKILL or codes[1] == 128 + signal.SIGKILL, workers.output()
    assert codes[0] == 1, workers.output()
    survivor = workers.result(0)
    print(f"kill -9: process 0 raised {survivor['error']} after {survivor['seconds']:.1f} s, exited "
          f"{workers.exited[0] - workers.exited[1]:.1f} s after process 1 died")  # type: ignore[operator]
    # A step number, whichever check noticed the loss first (the step boundary's once named the Loop).
    assert survivor["error"] == "PeerLost", survivor
    assert re.search(r"process 1 was lost at step \d+\b", survivor["message"]), survivor["message"]
    assert survivor["seconds"] < 30
    assert "TensorBoard" not in survivor["message"]


def test_a_killed_coordinator_ends_every_other_process_with_jaxs_own_message(tmp_path):
    """Process 0 hosts JAX's coordination service. When it dies, JAX's client
    in every other process ends that process itself (SIGABRT) before Python
    runs again, with a fatal message that names the lost leader: jaxlib
    offers the hook that could replace this only through its private
    bindings. The README states this; the test checks it still holds."""
    workers = Workers("lost", tmp_path, "0", limit=90)
    codes = workers.finish()
    assert codes[0] in (-signal.SIGKILL, 128 + signal.SIGKILL), workers.output()
    assert codes[1] in (-signal.SIGABRT, 128 + signal.SIGABRT), workers.output()
    print(f"kill -9 of process 0: process 1 was ended by JAX {workers.exited[1] - workers.exited[0]:.1f} s "
          "later")  # type: ignore[operator]
    said = workers.output(1)
    # JAX's client aborts it; or, when it was inside a collective, gloo does first (a torn message).
    by_jax = "Terminating process because the JAX distributed service detected fatal errors" in said
    assert (by_jax and "leader task was preempted/died" in said) or "gloo::EnforceNotMet" in said, said


def _worker_pid(workers: Workers, i: int) -> int:
    """The Python process under process ``i``'s ``timeout`` (which would pass a signal on)."""
    return int(subprocess.check_output(["pgrep", "-P", str(workers.procs[i].pid)]).split()[0])


def test_a_process_killed_mid_run_is_named_within_10_s(tmp_path):
    """SIGKILL to process 1 while both train, evaluate and save: process 0
    raises PeerLost naming it and a step, never XLA's raw error, and exits."""
    workers = Workers("killed", tmp_path, str(tmp_path / "run"), limit=90)
    workers.wait_for(1, "step 5")
    killed = time.monotonic()
    os.kill(_worker_pid(workers, 1), signal.SIGKILL)
    codes = workers.finish()
    exited = workers.exited[0] - killed  # type: ignore[operator]
    print(f"SIGKILL to process 1: process 0 exited {exited:.1f} s later")
    assert codes[0] == 1 and codes[1] in (-signal.SIGKILL, 128 + signal.SIGKILL), workers.output()
    survivor = workers.result(0)  # fit raised PeerLost: no wait on the lost process blocked it
    assert survivor["error"] == "PeerLost", workers.output(0)
    assert survivor["processes"] == [1] and survivor["error_step"] >= 5, survivor
    assert f"process 1 was lost at step {survivor['error_step']}" in survivor["message"]
    assert re.search(r"PeerLost: process 1 was lost at step \d+", workers.output(0)), workers.output(0)
    for raw in ("JaxRuntimeError", "INTERNAL", "Traceback"):
        assert raw not in workers.output(0), workers.output(0)
    assert exited < 10, workers.output(0)


@pytest.mark.parametrize("first", [0, 1], ids=["0-then-1", "1-then-0"])
def test_sigterm_to_every_process_a_moment_apart_exits_cleanly_everywhere(tmp_path, first):
    """The later SIGTERM may reach a process after they agreed to stop (even
    after fit returned): the same stop, so every process exits with 128 +
    SIGTERM, as the worker maps TrainingInterrupted, and none aborts."""
    workers = Workers("interrupted", tmp_path, str(tmp_path / "run"))
    for i in range(2):
        workers.wait_for(i, "step 3")
    os.kill(_worker_pid(workers, first), signal.SIGTERM)
    time.sleep(0.2)
    os.kill(_worker_pid(workers, 1 - first), signal.SIGTERM)
    codes = workers.finish()
    assert codes == [128 + signal.SIGTERM] * 2, workers.output()
    for bad in ("SIGABRT", "Aborted", "Check failed", "Traceback"):
        assert bad not in workers.output(), workers.output()
    steps = {workers.result(i)["step"] for i in range(2)}
    assert len(steps) == 1, workers.output()
    (step,) = steps
    for i in range(2):
        assert f"INTERRUPTED {step} SIGTERM" in workers.output(i)
    assert workers.result(0)["saved"] == [step]
    assert os.listdir(tmp_path / "run" / "checkpoints") == [str(step)]


def test_a_late_process_delays_a_resume_without_harm_and_a_timeout_names_it(tmp_path):
    run = str(tmp_path / "run")
    first = Workers("resume", tmp_path / "first", run, "-1", "600")
    assert first.finish() == [0, 0], first.output()
    saved = sorted(os.listdir(os.path.join(run, "checkpoints")))

    late = Workers("resume", tmp_path / "late", run, "6", "600")
    assert late.finish() == [0, 0], late.output()
    assert "process 0 is waiting for process 1 to reach the start of fit" in late.output(0)
    for i in range(2):
        resumed = late.result(i)
        assert resumed["error"] is None, resumed
        assert not any(entry.startswith("unreadable") for entry in resumed["entries"]), resumed
    assert saved == ["2", "4", "6"]

    timeout = Workers("resume", tmp_path / "timeout", run, "3", "1")
    codes = timeout.finish()
    waited = timeout.result(0)
    assert waited["error"] == "PeerTimeout", timeout.output()
    assert "waited 1 s for process 1 to reach the start of fit" in waited["message"]
    assert codes[0] == 1 and codes[1] != 0, timeout.output()
    assert not any(entry.startswith("unreadable") for entry in os.listdir(os.path.join(run, "checkpoints")))


def test_run_directories_and_refusals_are_the_same_on_every_process(tmp_path):
    """Process 0 names the run's directory for all (their clocks would name
    two); a fit refused before anything is written is refused on every
    process, and the first run's files stay as they were. Process 0 alone
    writes the metrics file."""
    root = tmp_path / "runs"
    workers = Workers("run_directories", tmp_path / "out", str(root), limit=180)
    assert workers.finish() == [0, 0], workers.output()
    results = [workers.result(i) for i in range(2)]
    assert results[0]["new"] == results[1]["new"] == results[0]["latest"] == results[1]["latest"]
    assert [p.name for p in root.iterdir()] == [Path(results[0]["new"]).name]
    for result in results:
        refused = result["refused"]
        assert (refused["error"], refused["cause"]) == ("ProcessError", "CheckpointConflictError"), refused
        assert "holds checkpoints of another run" in refused["message"], refused
        assert result["unchanged"] and result["files"] > 3, result  # checkpoint and event files, as they were
        assert result["losses"] == [1, 2], result  # the metrics file: process 0's records alone
