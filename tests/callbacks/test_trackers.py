"""Weights & Biases and MLflow, for real and offline: a W&B offline run read back from its own
transaction log (wandb's protocol buffers), an MLflow local store read back with MlflowClient;
both compared with the metrics file written beside them. Skipped where the extras are not installed."""

import json
import os
import shutil
import struct
import sys
import time
import urllib.parse
import zlib
from pathlib import Path

import numpy as np
import pytest

import flaxhooks
from flaxhooks import Callback, MetricsFile, MLflow, Wandb
from flaxhooks.writers import WandbWriter, mlflow_key, read_metrics, tracker_key
from tests.helpers import TIMINGS, RaiseAt, make_arrays, make_batches, sgd_trainer

HPARAMS = {"learning_rate": 0.1, "model": "mlp"}
PARAMETERS = 5 * 8 + 8 + 8 * 3 + 3  # MLP: Dense(8), Dense(3) on 5 features


class Notes(Callback):
    """Writes text when a fit starts and a histogram at step 2, through the fit's writers."""

    def on_fit_start(self, loop):
        loop.writers.text("notes", f"| fit | at step {loop.step} |", loop.step)

    def on_step_end(self, loop):
        if loop.step == 2:
            loop.writers.histogram("values", np.array([1.0, 2.0, 2.5, np.nan]), loop.step, bins=3)


def logging_trainer(tmp_path, logger):
    """A logger beside a metrics file (every 2 steps), an evaluation, per-layer statistics, and text
    and a histogram."""
    return sgd_trainer(callbacks=[logger, MetricsFile(tmp_path / "metrics.jsonl", every=2),
                                  flaxhooks.Evaluate(make_arrays(40), batch_size=16),
                                  flaxhooks.ActivationStats(every=2), Notes()])


def expected_points(tmp_path, key=tracker_key) -> dict[str, list[tuple[int, float]]]:
    """The metrics file's records as a tracker names them: ``{name: [(step, value)]}``."""
    found: dict[str, list[tuple[int, float]]] = {}
    for step, run, tag, value in read_metrics(tmp_path / "metrics.jsonl"):
        found.setdefault(key(run, tag), []).append((step, value))
    return found


def assert_same_points(got: dict, expected: dict) -> None:
    assert sorted(got) == sorted(expected)
    for name, points in expected.items():
        assert [s for s, _ in got[name]] == [s for s, _ in points], name
        if not name.endswith(TIMINGS):
            np.testing.assert_allclose([v for _, v in got[name]], [v for _, v in points], rtol=1e-6,
                                       err_msg=name)


def test_a_missing_extra_is_one_line_naming_it_and_touches_nothing(tmp_path, monkeypatch):
    for module in ("wandb", "mlflow"):
        monkeypatch.setitem(sys.modules, module, None)  # as if not installed
    with pytest.raises(ImportError) as missing:
        Wandb("project", dir=str(tmp_path / "wandb"), mode="offline")
    assert str(missing.value) == 'Wandb needs wandb, which is not installed: pip install "flaxhooks[wandb]"'
    with pytest.raises(ImportError, match=r'^MLflow needs mlflow.*: pip install "flaxhooks\[mlflow\]"$'):
        MLflow(tmp_path / "mlflow")
    assert list(tmp_path.iterdir()) == []


# Weights & Biases, offline.


def wandb_payloads(data: bytes):
    """Each record's bytes in a ``.wandb`` file: a 7-byte header, then LevelDB's log format (32 KiB
    blocks of chunks ``crc32, length, type, data``; a record split over blocks as first, middle,
    last). A torn tail (still being written) ends it."""
    block, header = 32768, 7
    assert data[:4] == b":W&B", data[:8]
    position, pending = header, b""
    while position + header <= len(data):
        left = block - position % block
        if left < header:  # a block's trailer
            position += left
            continue
        checksum, length, kind = struct.unpack_from("<IHB", data, position)
        if (checksum, length, kind) == (0, 0, 0):  # the zeros of a block's end
            position += left
            continue
        chunk = data[position + header:position + header + length]
        if len(chunk) < length:
            return
        assert zlib.crc32(chunk, zlib.crc32(bytes([kind]))) == checksum, position
        position += header + length
        pending += chunk
        if kind in (1, 4):  # whole, or a split record's last chunk
            yield pending
            pending = b""


def read_wandb_run(path, wait=15.0) -> dict:
    """A run's config, history rows (nested keys as dicts) and exit code, read from its ``.wandb``
    file with wandb's own protocol buffers; waits for the exit record (written after the rows)."""
    from wandb.proto import wandb_internal_pb2

    deadline = time.monotonic() + wait
    while True:
        found = {"config": {}, "rows": [], "exit_code": None}
        for payload in wandb_payloads(Path(path).read_bytes()):
            record = wandb_internal_pb2.Record.FromString(payload)
            kind = record.WhichOneof("record_type")
            if kind == "run":
                found["id"] = record.run.run_id
                found["config"].update({item.key: json.loads(item.value_json)
                                        for item in record.run.config.update if not item.key.startswith("_")})
            elif kind == "exit":
                found["exit_code"] = record.exit.exit_code
            elif kind == "history":
                row: dict = {}
                for item in record.history.item:
                    *parents, leaf = list(item.nested_key) or [item.key]
                    node = row
                    for parent in parents:
                        node = node.setdefault(parent, {})
                    node[leaf] = json.loads(item.value_json)
                found["rows"].append(row)
        if found["exit_code"] is not None or time.monotonic() > deadline:
            return found
        time.sleep(0.1)


def wandb_runs(directory, run_id) -> list[dict]:
    """Every offline run of ``run_id`` under ``directory`` (one per fit), in the order they started."""
    paths = (directory / "wandb").glob(f"offline-run-*-{run_id}*/run-{run_id}.wandb")
    return [read_wandb_run(path) for path in sorted(paths, key=os.path.getmtime)]


def wandb_points(runs) -> dict[str, list[tuple[int, float]]]:
    """``{name: [(step, value)]}`` of the numbers in the runs' rows, in order."""
    found: dict[str, list[tuple[int, float]]] = {}
    for run in runs:
        for row in run["rows"]:
            for name, value in row.items():
                number = isinstance(value, (int, float))
                if number and not name.startswith("_") and name != WandbWriter.STEP_KEY:
                    found.setdefault(name, []).append((row[WandbWriter.STEP_KEY], value))
    return found


@pytest.fixture(scope="module")
def wandb(tmp_path_factory):
    """wandb, offline and silent, its settings, cache and logs under a temporary directory (not $HOME)."""
    wandb = pytest.importorskip("wandb", reason='optional: pip install "flaxhooks[wandb]"')
    home = tmp_path_factory.mktemp("wandb-home")
    with pytest.MonkeyPatch.context() as patch:
        for name, value in {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_CONSOLE": "off",
                            "WANDB_DIR": str(home), "WANDB_CONFIG_DIR": str(home / "config"),
                            "WANDB_CACHE_DIR": str(home / "cache"), "WANDB_DATA_DIR": str(home / "data"),
                            "WANDB_ARTIFACT_DIR": str(home / "artifacts"), "WANDB_ERROR_REPORTING": "false",
                            "WANDB_DISABLE_GIT": "true", "WANDB_DISABLE_CODE": "true"}.items():
            patch.setenv(name, value)
        yield wandb
        wandb.teardown()  # its service process ends with the tests


def offline_wandb(wandb, directory, **kwargs) -> Wandb:
    settings = wandb.Settings(x_disable_stats=True, x_disable_machine_info=True, x_save_requirements=False)
    return Wandb("flaxhooks-tests", mode="offline", dir=str(directory), settings=settings, **kwargs)


def test_a_wandb_offline_run_holds_the_metrics_files_scalars_and_later_fits_go_on_with_it(tmp_path, wandb):
    logger = offline_wandb(wandb, tmp_path, every=2, hparams=HPARAMS)
    trainer = logging_trainer(tmp_path, logger)
    trainer.fit(make_batches(4), epochs=1)
    trainer.fit(make_batches(4), epochs=2)  # the same run goes on
    runs = wandb_runs(tmp_path, logger.run_id)
    assert [(run["id"], run["exit_code"]) for run in runs] == [(logger.run_id, 0)] * 2
    assert runs[0]["config"] == {**HPARAMS, "parameters": PARAMETERS}
    expected = expected_points(tmp_path)
    assert {"train/loss", "train/optimizer/grad_norm", "eval/accuracy"} <= set(expected)
    assert any(name.startswith("layers/") for name in expected)  # per-layer statistics reach it
    assert_same_points(wandb_points(runs), expected)
    rows = [row for run in runs for row in run["rows"]]
    (histogram,) = [(row[WandbWriter.STEP_KEY], row["values"]) for row in rows if "values" in row]
    counts, edges = np.histogram([1.0, 2.0, 2.5], bins=3)  # the finite values
    assert histogram == (2, {"_type": "histogram", "values": counts.tolist(), "bins": pytest.approx(edges)})
    notes = [(row[WandbWriter.STEP_KEY], row["notes"]) for row in rows if "notes" in row]
    assert notes == [(0, "| fit | at step 0 |"), (4, "| fit | at step 4 |")]  # text, as it is


def test_a_failed_wandb_run_exits_1_and_its_resume_goes_on_with_the_same_run(tmp_path, wandb):
    checkpoints = tmp_path / "checkpoints"
    logger = offline_wandb(wandb, tmp_path, every=2)
    crash = RaiseAt(7, RuntimeError("crash"))
    crashed = sgd_trainer(callbacks=[logger, flaxhooks.Checkpoint(checkpoints), crash])
    with pytest.raises(flaxhooks.CallbackError):
        crashed.fit(make_batches(4), epochs=2)  # checkpoints at each epoch's end: step 4
    resumed = offline_wandb(wandb, tmp_path, every=2)  # a new process's: the id comes from the checkpoint
    sgd_trainer(callbacks=[resumed, flaxhooks.Checkpoint(checkpoints)]).fit(
        make_batches(4), epochs=2, resume=True)
    assert resumed.run_id == logger.run_id
    runs = wandb_runs(tmp_path, logger.run_id)
    assert [run["exit_code"] for run in runs] == [1, 0]
    # W&B keeps every row: step 6, logged after the checkpoint at step 4, is there twice.
    assert [step for step, _ in wandb_points(runs)["train/loss"]] == [2, 4, 6, 6, 8]


# MLflow, a local store.


@pytest.fixture(scope="module")
def mlflow_database(tmp_path_factory):
    """An empty MLflow store, its tables made once (each new SQLite store migrates its schema: seconds)."""
    mlflow = pytest.importorskip("mlflow", reason='optional: pip install "flaxhooks[mlflow]"')
    pytest.importorskip("sqlalchemy", reason='optional: pip install "flaxhooks[mlflow]"')
    path = tmp_path_factory.mktemp("mlflow-template") / "mlflow.db"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
        mlflow.MlflowClient(f"sqlite:///{path}").search_experiments()
    return path


@pytest.fixture
def mlflow(mlflow_database, monkeypatch, tmp_path):
    """MLflow, a copy of the empty store in ``tmp_path/mlflow``, working in ``tmp_path``."""
    import mlflow

    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    monkeypatch.chdir(tmp_path)  # anything written to the working directory would show
    (tmp_path / "mlflow").mkdir()
    shutil.copy(mlflow_database, tmp_path / "mlflow" / "mlflow.db")
    return mlflow


def mlflow_points(client, run_id) -> dict[str, list[tuple[int, float]]]:
    """``{name: [(step, value)]}`` of every metric of the run, by step (points of one step in order)."""
    history = {name: client.get_metric_history(run_id, name) for name in client.get_run(run_id).data.metrics}
    return {name: [(m.step, m.value) for m in sorted(points, key=lambda m: (m.step, m.timestamp))]
            for name, points in history.items()}


def test_an_mlflow_local_run_holds_the_metrics_files_scalars_and_later_fits_go_on_with_it(tmp_path, mlflow):
    logger = MLflow(tmp_path / "mlflow", every=2, hparams=HPARAMS, run_name="first")
    trainer = logging_trainer(tmp_path, logger)
    trainer.fit(make_batches(4), epochs=1)
    trainer.fit(make_batches(4), epochs=2)  # the same run goes on
    client = mlflow.MlflowClient(f"sqlite:///{tmp_path}/mlflow/mlflow.db")
    (run,) = client.search_runs([client.get_experiment_by_name("flaxhooks").experiment_id])
    assert (run.info.run_id, run.info.run_name, run.info.status) == (logger.run_id, "first", "FINISHED")
    assert run.data.params == {"learning_rate": "0.1", "model": "mlp", "parameters": str(PARAMETERS)}
    expected = expected_points(tmp_path, mlflow_key)
    assert any(name.startswith("layers/") for name in expected)  # per-layer statistics reach it
    assert_same_points(mlflow_points(client, run.info.run_id), expected)
    texts = client.list_artifacts(run.info.run_id, "text/notes")
    assert [text.path for text in texts] == ["text/notes/step_0.md", "text/notes/step_4.md"]
    artifacts = Path(urllib.parse.urlparse(run.info.artifact_uri).path)
    assert artifacts.is_relative_to(tmp_path / "mlflow" / "artifacts")
    assert (artifacts / texts[1].path).read_text() == "| fit | at step 4 |"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl", "mlflow"]  # nothing in the cwd


def test_a_failed_mlflow_run_is_marked_failed_and_its_resume_goes_on_with_the_same_run(tmp_path, mlflow):
    checkpoints = tmp_path / "checkpoints"
    logger = MLflow(tmp_path / "mlflow", every=2)
    crash = RaiseAt(7, RuntimeError("crash"))
    crashed = sgd_trainer(callbacks=[logger, flaxhooks.Checkpoint(checkpoints), crash])
    with pytest.raises(flaxhooks.CallbackError):
        crashed.fit(make_batches(4), epochs=2)  # checkpoints at each epoch's end: step 4
    client = mlflow.MlflowClient(f"sqlite:///{tmp_path}/mlflow/mlflow.db")
    assert client.get_run(logger.run_id).info.status == "FAILED"
    resumed = MLflow(tmp_path / "mlflow", every=2)  # a new process's: the id comes from the checkpoint
    sgd_trainer(callbacks=[resumed, flaxhooks.Checkpoint(checkpoints)]).fit(
        make_batches(4), epochs=2, resume=True)
    assert resumed.run_id == logger.run_id
    assert client.get_run(logger.run_id).info.status == "FINISHED"
    # MLflow keeps every point: step 6, logged after the checkpoint at step 4, is there twice.
    assert [step for step, _ in mlflow_points(client, logger.run_id)["train/loss"]] == [2, 4, 6, 6, 8]
