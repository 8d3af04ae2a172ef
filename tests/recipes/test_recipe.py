"""The MNIST recipe: its command line, a one-epoch smoke test, and its accuracy target."""

import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path

from recipes import mnist

ROOT = Path(__file__).resolve().parents[2]


def _run_recipe(*args, timeout=300):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["FLAXHOOKS_CACHE"] = str(ROOT / ".no-cache-for-tests")  # never a real download cache
    return subprocess.run(
        [sys.executable, "-m", "recipes.mnist", *args], cwd=ROOT, env=env,
        capture_output=True, text=True, timeout=timeout,
    )


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
    assert "(default: runs/mnist)" in text and "(default: 10)" in text
    assert "(default: --download)" in text and "(default: --no-resume)" in text
    assert not re.search(r"\(default:\s*\n", text)  # a default stays on its value's line
    assert not re.search(r"\w-\n", text)  # no name broken at a hyphen (--num-\nprocesses)


def test_parse_config_reads_every_option():
    config, workdir = mnist.parse_config(
        ["--epochs", "2", "--batch-size", "64", "--learning-rate", "0.05", "--no-download",
         "--cpu-devices", "2", "--workdir", "/tmp/x", "--data-dir", "/d"]
    )
    assert (config.epochs, config.batch_size, config.learning_rate) == (2, 64, 0.05)
    assert (config.download, config.cpu_devices, config.data_dir, workdir) == (False, 2, "/d", "/tmp/x")


def test_one_epoch_smoke(tmp_path, capsys):
    config = mnist.Config(epochs=1, download=False, log_every=10, stats_every=10)
    result = mnist.train_and_evaluate(config, tmp_path)
    assert re.search(r"training on .*, 1 epoch of 31 steps, ", capsys.readouterr().out)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    def read(run):
        events = EventAccumulator(str(tmp_path / "tensorboard" / run))
        events.Reload()
        return events

    assert {"loss", "accuracy"} <= set(read("train").Tags()["scalars"])
    assert {"loss", "accuracy"} <= set(read("eval").Tags()["scalars"])
    events = read(".")
    assert "model_summary/text_summary" in events.Tags()["tensors"]
    # Per-layer curves of the three kinds, every 10 steps.
    for tag in ("stats/activations/Conv_0/std", "stats/activations/Conv_1_relu/zero_fraction",
                "stats/activation_grads/Dense_1/rms", "stats/params/Conv_0/update_ratio"):
        assert [e.step for e in events.Scalars(tag)] == [10, 20, 30], tag
    assert "stats/activations/Dense_0_relu/histogram" in events.Tags()["histograms"]
    assert result["examples"] == 1000  # every held-out digit of the bundled sample
    assert result["steps"] == 4000 // 128
    assert result["accuracy"] > 0.6  # one epoch; the 96% target is checked below


def test_default_run_reaches_96_percent_on_the_bundled_sample(tmp_path):
    """The README's main command, as a user runs it (one CPU device per core)."""
    result = _run_recipe("--workdir", str(tmp_path), "--no-download")
    assert result.returncode == 0, result.stderr[-2000:]
    output = result.stdout + result.stderr
    assert "bundled MNIST sample" in output
    assert "\x1b" not in result.stdout  # not a terminal: plain lines, no control characters
    assert f"tensorboard --logdir {tmp_path}/tensorboard" in output
    assert "Total Parameters: 824,458" in output
    accuracy = float(re.search(r"held-out accuracy (\d\.\d+)", output).group(1))
    assert accuracy >= 0.96, output[-2000:]


def test_resume_goes_on_from_the_checkpoint_and_ends_as_an_uninterrupted_run(tmp_path):
    config = mnist.Config(epochs=2, download=False, stats_every=0, batch_size=256, checkpoint_every=5)
    straight = mnist.train_and_evaluate(config, tmp_path / "straight")
    first = mnist.train_and_evaluate(dataclasses.replace(config, epochs=1), tmp_path / "resumed")
    assert first["steps"] == 4000 // 256
    resumed = mnist.train_and_evaluate(dataclasses.replace(config, resume=True), tmp_path / "resumed")
    assert resumed["steps"] == straight["steps"] == 2 * (4000 // 256)
    assert resumed["accuracy"] == straight["accuracy"]
    assert abs(resumed["loss"] - straight["loss"]) < 1e-5
    steps = sorted(int(p.name) for p in (tmp_path / "resumed" / "checkpoints").iterdir() if p.name.isdigit())
    assert steps == [20, 25, 30]  # every 5 steps (epoch ends at 15 and 30), the last 3 kept


def test_sigterm_saves_and_says_how_to_resume(tmp_path):
    import signal

    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["FLAXHOOKS_CACHE"] = str(ROOT / ".no-cache-for-tests")
    args = ["--workdir", str(tmp_path), "--no-download", "--epochs", "2", "--stats-every", "0",
            "--log-every", "5"]
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
    assert "checkpoint saved: continue with" in output and "--resume" in output
    stopped = int(re.search(r"stopped by SIGTERM at step (\d+)", output).group(1))
    assert str(stopped) in os.listdir(tmp_path / "checkpoints")
    result = _run_recipe(*args, "--resume")
    assert result.returncode == 0, result.stderr[-2000:]
    assert f"resuming from step {stopped}" in result.stdout + result.stderr
    assert "held-out accuracy" in result.stdout
