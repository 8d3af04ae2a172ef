"""The MNIST recipe end to end: accuracy and wall time, one device vs one per core.

Runs ``python -m recipes.mnist`` with its defaults as a user would (fresh
processes, bundled sample when full MNIST cannot be had), alternating
``--cpu-devices 1`` with the default (one XLA device per core), and reports
the held-out accuracy and wall time of each. Targets: >= 96% held-out accuracy
on the bundled sample in under 2 minutes with the defaults.

    python -m benchmarks.bench_mnist_recipe [--rounds 2] [--epochs 10]

Ends with one JSON line of its figures.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_recipe(extra: list[str], epochs: int) -> tuple[float, float, str]:
    """Returns (seconds, held-out accuracy, data source) of one recipe run."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    with tempfile.TemporaryDirectory() as workdir:
        start = time.perf_counter()
        result = subprocess.run(
            [sys.executable, "-m", "recipes.mnist", "--workdir", workdir, "--epochs", str(epochs), *extra],
            cwd=ROOT, env=env, capture_output=True, text=True, check=True,
        )
        seconds = time.perf_counter() - start
    output = result.stdout + result.stderr
    found = re.search(r"held-out accuracy (\d\.\d+) .*\((\d+) (\w+) MNIST", output)
    if not found:
        raise RuntimeError(f"no accuracy line in the recipe's output:\n{output[-2000:]}")
    return seconds, float(found.group(1)), found.group(3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=10)
    args = parser.parse_args()
    cores = len(os.sched_getaffinity(0))
    figures: dict[str, list[tuple[float, float]]] = {"one_device": [], "per_core": []}
    source = ""
    for round_index in range(args.rounds):
        order = [("one_device", ["--cpu-devices", "1"]), ("per_core", [])]
        for name, extra in order if round_index % 2 == 0 else order[::-1]:
            seconds, accuracy, source = run_recipe(extra, args.epochs)
            figures[name].append((seconds, accuracy))
            print(f"round {round_index}: {name:10s} {seconds:6.1f} s  held-out accuracy {accuracy:.4f}",
                  flush=True)
    seconds = {k: statistics.median(s for s, _ in v) for k, v in figures.items()}
    accuracy = {k: min(a for _, a in v) for k, v in figures.items()}
    speedup = seconds["one_device"] / seconds["per_core"]
    ok = accuracy["per_core"] >= 0.96 and seconds["per_core"] < 120
    print(f"default ({cores} devices): {seconds['per_core']:.1f} s, accuracy {accuracy['per_core']:.4f}; "
          f"1 device: {seconds['one_device']:.1f} s; speed-up {speedup:.2f}x")
    print(f"target (>= 96% in < 120 s on the {source} data): {'PASS' if ok else 'FAIL'}")
    print(json.dumps({
        "benchmark": "mnist_recipe", "data": source, "epochs": args.epochs, "rounds": args.rounds,
        "cores": cores, "seconds_per_core_devices": round(seconds["per_core"], 2),
        "seconds_one_device": round(seconds["one_device"], 2), "speedup": round(speedup, 3),
        "accuracy_per_core_devices": accuracy["per_core"], "accuracy_one_device": accuracy["one_device"],
        "target_accuracy": 0.96, "target_seconds": 120, "pass": ok,
    }))


if __name__ == "__main__":
    main()
