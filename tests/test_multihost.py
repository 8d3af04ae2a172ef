"""Several JAX processes (gloo on 127.0.0.1) train like one process with all their devices."""

import os
import socket
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

import flaxhooks
from tests.helpers import make_arrays, sgd_trainer

ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_match_one_process_with_four_devices(tmp_path):
    if len(jax.local_devices()) < 4:
        pytest.skip("needs 4 local devices for the reference")
    port = str(_free_port())
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    workers = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.multihost_worker", str(i), "2", port, str(tmp_path / f"p{i}.npz")],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for i in range(2)
    ]
    outputs = []
    try:
        for worker in workers:
            outputs.append(worker.communicate(timeout=240)[0])
    finally:
        for worker in workers:
            worker.kill()
    assert [w.returncode for w in workers] == [0, 0], "\n".join(outputs)
    assert "2 local of 4 devices, step 8" in outputs[0] and "2 local of 4 devices, step 8" in outputs[1]
    # Only process 0 prints progress (ConsoleLog is process_zero_only).
    assert "step 4/" in outputs[0] or "step 4 " in outputs[0]
    assert "step 4" not in outputs[1].replace("step 8", "")

    loader = flaxhooks.ArrayLoader(make_arrays(64), batch_size=16, seed=1)
    reference = sgd_trainer(devices=jax.local_devices()[:4]).fit(loader, epochs=2)
    expected = [np.asarray(x) for x in jax.tree.leaves(jax.device_get(reference.params))]
    evaluated = trainer_eval(reference)
    for i in range(2):
        with np.load(tmp_path / f"p{i}.npz") as got:
            for j, leaf in enumerate(expected):
                np.testing.assert_allclose(got[f"arr_{j}"], leaf, rtol=1e-4, atol=1e-5)
            examples, loss, accuracy, tiny, failed = got["eval"]
            assert examples == 1001 and tiny == 1 and failed == 1
            assert loss == pytest.approx(evaluated.metrics["loss"], rel=1e-4)
            assert accuracy == pytest.approx(evaluated.metrics["accuracy"], abs=1e-6)


def trainer_eval(state):
    """The same evaluation in this process, on all 8 local devices."""
    return sgd_trainer().evaluate(make_arrays(1001, seed=5), batch_size=100, state=state)
