"""The MNIST recipe: its command line, a one-epoch smoke test, and its accuracy target."""

import dataclasses
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from recipes import mnist

ROOT = Path(__file__).resolve().parents[2]


def _run_recipe(*args, timeout=300, cwd=ROOT):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["FLAXHOOKS_CACHE"] = str(ROOT / ".no-cache-for-tests")  # never a real download cache
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])  # from any directory
    return subprocess.run(
        [sys.executable, "-m", "recipes.mnist", *args], cwd=cwd, env=env,
        capture_output=True, text=True, timeout=timeout,
    )


#: A short run: one epoch of 7 steps, no statistics, no Diagnose (the run's tests need neither).
QUICK = ("--no-download", "--epochs", "1", "--batch-size", "512", "--stats-every", "0",
         "--diagnose-every", "0", "--cpu-devices", "2")


def _files(directory: Path) -> dict[str, bytes]:
    paths = [path for path in sorted(directory.rglob("*")) if path.is_file()]
    return {str(path.relative_to(directory)): path.read_bytes() for path in paths}


ERROR = "python -m recipes.mnist: error: "


def _one_line_refusal(result: subprocess.CompletedProcess) -> str:
    """The refusal's line; asserts it is the only thing on stderr, with exit status 2."""
    assert result.returncode == 2, (result.returncode, result.stderr[-3000:])
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(ERROR), result.stderr[-3000:]
    assert "Traceback" not in result.stdout + result.stderr
    return lines[0].removeprefix(ERROR)


@pytest.fixture(scope="module")
def two_quick_runs(tmp_path_factory) -> tuple[Path, list[subprocess.CompletedProcess]]:
    """Two short runs started one after the other in one directory, read by
    the tests below (launched once: each launch is most of a test's time).
    Only a resume into the latest run changes what they wrote."""
    cwd = tmp_path_factory.mktemp("quick")
    return cwd, [_run_recipe(*QUICK, cwd=cwd) for _ in range(2)]


@pytest.mark.slow
def test_every_run_has_a_directory_of_its_own_and_resume_goes_on_with_the_latest(two_quick_runs):
    tmp_path, (first, second) = two_quick_runs
    assert first.returncode == 0, first.stderr[-3000:]
    assert second.returncode == 0, second.stderr[-3000:]
    runs = sorted((tmp_path / "runs" / "mnist").iterdir())
    assert len(runs) == 2
    assert all(re.fullmatch(r"\d{4}-\d\d-\d\d_\d\d-\d\d-\d\d(-\d+)?", run.name) for run in runs)
    for run, result in zip(runs, (first, second), strict=True):
        assert f"run directory: runs/mnist/{run.name}" in result.stdout
        assert f"tensorboard --logdir runs/mnist/{run.name}/tensorboard" in result.stdout
        assert "tensorboard --logdir runs/mnist\n" in result.stdout  # every run side by side
        assert [p.name for p in (run / "checkpoints").iterdir() if p.name.isdigit()] == ["7"]
        assert json.loads((run / "options.json").read_text())["epochs"] == 1
        assert f"its scalars, a JSON object per write: runs/mnist/{run.name}/metrics.jsonl" in result.stdout
    older = _files(runs[0])
    # The latest run, with the options it was started with but the epochs asked for.
    resumed = _run_recipe("--resume", "--epochs", "2", "--cpu-devices", "2", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    said = resumed.stdout + resumed.stderr
    assert f"resuming from step 7 ({tmp_path}/runs/mnist/{runs[1].name}/checkpoints/7)" in said
    assert "held-out accuracy" in resumed.stdout and "step 14)" in resumed.stdout
    assert sorted((tmp_path / "runs" / "mnist").iterdir()) == runs and _files(runs[0]) == older
    # The first run's end wrote its steps 1-7 at step 7; the resumed run dropped that point and
    # wrote steps 1-14 at its end. Each evaluation stays.
    records = [json.loads(line) for line in (runs[1] / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["run"]) for r in records] == [(7, "eval"), (14, "eval"), (14, "train")]
    assert {"loss", "accuracy", "optimizer/grad_norm"} <= set(records[2]["values"])


@pytest.mark.slow
def test_a_run_into_another_runs_workdir_is_refused_in_one_line_and_writes_nothing(two_quick_runs):
    tmp_path, (first, _) = two_quick_runs
    assert first.returncode == 0, first.stderr[-3000:]
    runs = sorted((tmp_path / "runs" / "mnist").iterdir())
    workdir = runs[0]  # the earlier run: the test above resumes the latest
    before = _files(workdir)
    assert any("tfevents" in name for name in before) and "checkpoints/7/meta/metadata" in before
    for args in ((), ("--api", "nnx", "--epochs", "2")):
        line = _one_line_refusal(_run_recipe(*QUICK, "--workdir", str(workdir), *args, cwd=tmp_path))
        assert line == (f"{workdir} holds another run (checkpoints up to step 7): add --resume to go on with "
                        "it, or leave --workdir out to start a new run in a directory of its own"), line
        assert _files(workdir) == before  # event files, summary, hparams, checkpoints: byte for byte
    # Going on with it under another model is refused too, naming the option to leave out.
    refused = _run_recipe(*QUICK, "--workdir", str(workdir), "--resume", "--api", "nnx", cwd=tmp_path)
    line = _one_line_refusal(refused)
    assert line == (f"the run in {workdir} was started with --api linen: leave --api out to go on with it, "
                    "or leave --resume out to start a new run"), line
    assert _files(workdir) == before
    assert sorted((tmp_path / "runs" / "mnist").iterdir()) == runs  # no directory made for a refused run


def test_the_closing_command_installs_tensorboard_when_it_is_missing(monkeypatch):
    import importlib.util

    logdir = str(mnist.RUNS / "2026-11-25_18-42-53" / "tensorboard")
    assert mnist._viewing(logdir) == (f"view this run: tensorboard --logdir {logdir}\n"
                                      "or every run side by side: tensorboard --logdir runs/mnist")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert mnist._viewing("elsewhere/tensorboard") == (
        'view this run: pip install "flaxhooks[tensorboard]" && tensorboard --logdir elsewhere/tensorboard')


def test_usage_errors_are_argparse_errors():
    for args, message in ((("--api", "torch"), "invalid choice: 'torch' (choose from 'linen', 'nnx')"),
                          (("--precision", "fp16"), "invalid choice: 'fp16' (choose from 'float32', 'bf16')"),
                          (("--epochs", "0"), "must be at least 1, got 0"),
                          (("--accumulate", "0"), "must be at least 1, got 0"),
                          (("--ema", "1"), "must be less than 1, got 1")):
        result = _run_recipe(*args)
        assert result.returncode == 2 and result.stderr.splitlines() == [
            "usage: python -m recipes.mnist [options] (see --help)", f"{ERROR}argument {args[0]}: {message}"]


def test_a_start_that_fails_leaves_no_run_directory_behind(tmp_path, monkeypatch, capsys):
    import importlib.util

    monkeypatch.chdir(tmp_path)
    find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "grain" else find(name))
    # grain missing: a usage error, before any directory is made.
    with pytest.raises(SystemExit) as exited:
        mnist.main(["--loader", "grain", "--no-download"])
    assert exited.value.code == 2
    assert "--loader grain needs grain: pip install 'flaxhooks[grain]'" in capsys.readouterr().err
    assert not (tmp_path / mnist.RUNS).exists()

    # A fault once the run's directory holds its options: raised as it is, the directory removed.
    def fails(config, workdir):
        (Path(workdir) / "options.json").write_text("{}")
        raise RuntimeError("out of memory while compiling")

    monkeypatch.setattr(mnist, "train_and_evaluate", fails)
    with pytest.raises(RuntimeError, match="out of memory"):
        mnist.main(["--no-download"])  # in this process: its devices as they are
    assert list((tmp_path / mnist.RUNS).iterdir()) == []


def test_help_lists_every_option():
    result = _run_recipe("--help")
    assert result.returncode == 0, result.stderr
    for field in dataclasses.fields(mnist.Config):
        assert "--" + field.name.replace("_", "-") in result.stdout
    assert "--workdir" in result.stdout


def test_help_gives_each_default_once_and_never_breaks_a_name_or_a_default():
    result = _run_recipe("--help")
    assert result.returncode == 0, result.stderr
    text = result.stdout
    options = re.split(r"\n(?=  -)", text.split("\noptions:\n")[1])
    assert len(options) == len(dataclasses.fields(mnist.Config)) + 2  # with --help and --workdir
    for option in options:
        assert option.count("(default") <= 1, option
    assert "(default: None)" not in text
    words = " ".join(text.split())
    assert "(default: a new directory under runs/mnist named by the time the run starts" in words
    assert "(default: 10)" in text
    assert "(default: --download)" in text and "(default: --no-resume)" in text
    assert not re.search(r"\(default:\s*\n", text)  # a default stays on its value's line
    assert not re.search(r"\w-\n", text)  # no name broken at a hyphen (--num-\nprocesses)


def test_parse_config_reads_every_option():
    config, workdir = mnist.parse_config(
        ["--epochs", "2", "--batch-size", "64", "--learning-rate", "0.05", "--no-download",
         "--cpu-devices", "2", "--workdir", "/tmp/x", "--data-dir", "/d", "--loader", "grain"]
    )
    assert config.loader == "grain"
    assert (config.epochs, config.batch_size, config.learning_rate) == (2, 64, 0.05)
    assert (config.download, config.cpu_devices, config.data_dir, workdir) == (False, 2, "/d", "/tmp/x")


@pytest.mark.slow
def test_one_epoch_smoke(tmp_path, capsys):
    config = mnist.Config(epochs=1, download=False, log_every=10, stats_every=10)
    result = mnist.train_and_evaluate(config, tmp_path)
    assert re.search(r"training the Flax linen CNN on 4000 sample MNIST digits: 1 epoch of 31 steps\n",
                     capsys.readouterr().out)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    def read(run):
        events = EventAccumulator(str(tmp_path / "tensorboard" / run))
        events.Reload()
        return events

    assert {"loss", "accuracy"} <= set(read("train").Tags()["scalars"])
    assert {"loss", "accuracy"} <= set(read("eval").Tags()["scalars"])
    events = read(".")
    assert "model_summary/text_summary" in events.Tags()["tensors"]
    # Per-layer curves of the three kinds, every 10 steps, each layer a run of its own.
    for run, tag in (("Conv_0", "stats/activations/log10_std"),
                     ("Conv_1_relu", "stats/activations/zero_fraction"),
                     ("Dense_1", "stats/activation_grads/log10_rms"),
                     ("Conv_0", "stats/params/log10_update_ratio")):
        assert [e.step for e in read(f"layers/{run}").Scalars(tag)] == [10, 20, 30], (run, tag)
    assert "stats/activations/Dense_0_relu/histogram" in events.Tags()["histograms"]
    assert result["examples"] == 1000  # every held-out digit of the bundled sample
    assert result["steps"] == 4000 // 128
    assert result["accuracy"] > 0.6  # one epoch; the 96% target is checked below


@pytest.mark.slow
def test_a_bf16_run_with_accumulation_and_ema_learns_and_says_both_accuracies(tmp_path, capsys):
    config = mnist.Config(epochs=1, precision="bf16", accumulate=2, ema=0.9, download=False, stats_every=0,
                          diagnose_every=0)
    result = mnist.train_and_evaluate(config, tmp_path)
    # As the float32 run of one epoch (test_one_epoch_smoke).
    assert result["accuracy"] > 0.6 and result["ema_accuracy"] > 0.6, result
    said = capsys.readouterr().out
    assert (f"the weights' moving average (--ema 0.9): held-out accuracy {result['ema_accuracy']:.4f}  "
            f"loss {result['ema_loss']:.4f}") in said
    options = json.loads((tmp_path / "options.json").read_text())
    assert (options["precision"], options["accumulate"], options["ema"]) == ("bf16", 2, 0.9)


@pytest.mark.slow
def test_default_run_reaches_96_percent_on_the_bundled_sample(tmp_path):
    """The README's main command, as a user runs it (one CPU device per core),
    and the accuracy the docs state for it."""
    result = _run_recipe("--workdir", str(tmp_path), "--no-download")
    assert result.returncode == 0, result.stderr[-2000:]
    output = result.stdout + result.stderr
    fallback = "full MNIST unavailable (not found locally, and downloading is off); using the bundled sample"
    assert fallback + "\n" in output
    assert "\x1b" not in result.stdout  # not a terminal: plain lines, no control characters
    assert f"tensorboard --logdir {tmp_path}/tensorboard" in output
    assert "Total Parameters: 824,458" in output
    accuracy = float(re.search(r"held-out accuracy (\d\.\d+)", output).group(1))
    assert accuracy >= 0.96, output[-2000:]
    # The figure the docs state, within half a point: XLA's CPU code (and so
    # the last digit) differs between processors.
    stated = re.search(r"\| `python -m recipes.mnist` \| (\d+\.\d)% held-out accuracy",
                       (ROOT / "docs" / "getting-started.md").read_text())
    assert stated and abs(float(stated[1]) - 100 * accuracy) <= 0.5, (stated, accuracy)
    # A healthy model: Diagnose (on by default) finds nothing over the whole run.
    report = (tmp_path / "diagnose" / "findings.md").read_text()
    assert report == "# Diagnose\n\nNo finding: nothing looked wrong.\n"
    assert "Diagnose: what was found" not in output
    assert {p.name for p in (tmp_path / "diagnose").iterdir()} >= {"gradient_rms.png", "dead_units.png"}


@pytest.mark.slow
@pytest.mark.parametrize("loader", ["array", "grain"])
def test_resume_goes_on_from_the_checkpoint_and_ends_as_an_uninterrupted_run(tmp_path, loader):
    if loader == "grain":
        pytest.importorskip("grain")
    config = mnist.Config(epochs=2, download=False, stats_every=0, diagnose_every=0, batch_size=256,
                          checkpoint_every=5, loader=loader)
    straight = mnist.train_and_evaluate(config, tmp_path / "straight")
    first = mnist.train_and_evaluate(dataclasses.replace(config, epochs=1), tmp_path / "resumed")
    assert first["steps"] == 4000 // 256
    resumed = mnist.train_and_evaluate(dataclasses.replace(config, resume=True), tmp_path / "resumed")
    assert resumed["steps"] == straight["steps"] == 2 * (4000 // 256)
    assert resumed["accuracy"] == straight["accuracy"]
    assert abs(resumed["loss"] - straight["loss"]) < 1e-5
    steps = sorted(int(p.name) for p in (tmp_path / "resumed" / "checkpoints").iterdir() if p.name.isdigit())
    assert steps == [20, 25, 30]  # every 5 steps (epoch ends at 15 and 30), the last 3 kept


@pytest.mark.slow
def test_sigterm_saves_and_says_how_to_resume(tmp_path):
    import signal

    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["FLAXHOOKS_CACHE"] = str(ROOT / ".no-cache-for-tests")
    args = ["--workdir", str(tmp_path), "--no-download", "--epochs", "2", "--stats-every", "0",
            "--diagnose-every", "0", "--log-every", "5"]
    recipe = subprocess.Popen(
        [sys.executable, "-m", "recipes.mnist", *args], cwd=ROOT, env=env,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    lines = []
    try:
        for line in recipe.stdout:
            lines.append(line)
            if line.startswith("step 10"):
                recipe.send_signal(signal.SIGTERM)
        recipe.wait(timeout=120)
    finally:
        recipe.kill()
    output = "".join(lines)
    assert recipe.returncode == 128 + signal.SIGTERM, output
    stopped = int(re.search(r"stopped \(interrupted by SIGTERM\) at step (\d+)", output).group(1))
    resume = f"python -m recipes.mnist --workdir {tmp_path} --resume"
    assert f"to go on from step {stopped}:\n  {resume}\n" in output
    assert str(stopped) in os.listdir(tmp_path / "checkpoints")
    result = _run_recipe(*args, "--resume")
    assert result.returncode == 0, result.stderr[-2000:]
    assert f"resuming from step {stopped}" in result.stdout + result.stderr
    assert "held-out accuracy" in result.stdout


def _two_processes(tmp_path, args, process):
    """Runs the recipe as 2 processes of 1 CPU device each, each under a hard
    kill (``process(i)``: process i's own arguments and variables); their outputs."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["FLAXHOOKS_CACHE"] = str(ROOT / ".no-cache-for-tests")
    logs = [tmp_path / f"p{i}.txt" for i in range(2)]
    processes = []
    for i, log in enumerate(logs):  # into files: a full pipe would stall a process, and so both
        own_args, own_env = process(i)
        with open(log, "w") as out:
            processes.append(subprocess.Popen(
                ["timeout", "-s", "KILL", "240", sys.executable, "-m", "recipes.mnist", *QUICK[:-1], "1",
                 *args, *own_args], cwd=ROOT, env={**env, **own_env}, stdout=out, stderr=subprocess.STDOUT))
    for process in processes:
        process.wait()
    outputs = [log.read_text() for log in logs]
    assert [p.returncode for p in processes] == [0, 0], outputs[0][-3000:] + outputs[1][-3000:]
    return outputs


@pytest.mark.slow
def test_a_preempted_srun_job_saves_where_every_process_agrees_and_its_restart_resumes(tmp_path):
    """A 2-process FSDP job launched as srun launches it (only the variables
    srun sets: JAX's cluster detection joins the processes), with --resume from
    the first start, as a job a cluster may restart. SIGTERM to one process:
    JAX's preemption sync point stops both at one step, each saves its part of
    the checkpoint there, both exit with 128 + SIGTERM, and the same command
    started again goes on from that step to the end."""
    import signal

    workdir = tmp_path / "run"
    command = [sys.executable, "-m", "recipes.mnist", "--no-download", "--epochs", "1", "--batch-size", "64",
               "--stats-every", "0", "--diagnose-every", "0", "--log-every", "5", "--workdir", str(workdir),
               "--resume", "--fsdp"]
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["FLAXHOOKS_CACHE"] = str(ROOT / ".no-cache-for-tests")

    def launch(attempt):
        logs = [tmp_path / f"{attempt}-p{i}.txt" for i in range(2)]
        processes = []
        job = _free_port(61440, 65535) - 61440  # JAX's SLURM coordinator port: 61440 + the job id
        for i, log in enumerate(logs):
            srun = {"SLURM_JOB_ID": str(job), "SLURM_STEP_NODELIST": "127.0.0.1", "SLURM_NTASKS": "2",
                    "SLURM_PROCID": str(i), "SLURM_LOCALID": str(i)}
            with open(log, "w") as out:
                processes.append(subprocess.Popen(command, cwd=ROOT, env={**env, **srun}, stdout=out,
                                                  stderr=subprocess.STDOUT))
        return processes, logs

    processes, logs = launch(0)
    try:
        deadline = time.monotonic() + 180
        while not re.search(r"^step 10\b", logs[0].read_text(), re.M):
            assert time.monotonic() < deadline and processes[0].poll() is None, logs[0].read_text()[-3000:]
            time.sleep(0.05)
        processes[1].send_signal(signal.SIGTERM)
        codes = [p.wait(timeout=120) for p in processes]
    finally:
        for p in processes:
            p.kill()
    outputs = [log.read_text() for log in logs]
    assert codes == [128 + signal.SIGTERM] * 2, outputs[0][-3000:] + outputs[1][-3000:]
    stopped = {int(m) for out in outputs for m in re.findall(r"to go on from step (\d+):", out)}
    assert len(stopped) == 1, outputs
    (step,) = stopped
    assert f"every process stops at step {step}, the step JAX's preemption sync point agreed on" in outputs[0]
    assert os.listdir(workdir / "checkpoints") == [str(step)]
    assert "P('data', None)" in outputs[0]  # Dense_0's kernel split over both processes' devices
    _each_process_wrote_its_part(workdir, step)

    processes, logs = launch(1)
    codes = [p.wait(timeout=240) for p in processes]
    outputs = [log.read_text() for log in logs]
    assert codes == [0, 0], outputs[0][-3000:] + outputs[1][-3000:]
    assert f"resuming from step {step}" in outputs[0] and "held-out accuracy" in outputs[0], outputs[0]


def _each_process_wrote_its_part(workdir, step=7):
    import flaxhooks

    state = workdir / "checkpoints" / str(step) / "state"
    assert all(any((state / f"ocdbt.process_{i}" / "d").iterdir()) for i in range(2))
    restored = flaxhooks.Checkpoint(workdir / "checkpoints").restore_latest()
    assert restored is not None and restored.step == step
    assert json.loads((workdir / "checkpoints" / str(step) / "meta" / "metadata").read_text())["format"] == 3
    positions = {"position_0-of-2.json", "position_1-of-2.json"}  # each process wrote its own
    assert positions <= set(os.listdir(workdir / "checkpoints" / str(step) / "data"))


def _free_port(low=0, high=0):
    import socket

    for port in range(low, high + 1) if low else [0]:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return s.getsockname()[1]
    raise AssertionError(f"no free port in {low}-{high}")


@pytest.mark.slow
def test_fsdp_on_two_processes_saves_each_process_part(tmp_path):
    """--fsdp on 2 processes of 1 CPU device each splits the state across
    them: each writes its part of the checkpoint, which reads back whole."""
    workdir = tmp_path / "run"
    args = ["--fsdp", "--coordinator", f"127.0.0.1:{_free_port()}", "--num-processes", "2",
            "--workdir", str(workdir)]
    outputs = _two_processes(tmp_path, args, lambda i: (["--process-id", str(i)], {}))
    assert "P('data', None)" in outputs[0]  # Dense_0's kernel split over both processes' devices
    _each_process_wrote_its_part(workdir)
