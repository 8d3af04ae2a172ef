"""Exact resume in the middle of an epoch, for every kind of data ``fit``
takes: a run killed (SIGKILL) and resumed takes exactly the batches, and ends
with exactly the parameters, of a run never stopped; on one process and on
two (gloo, every process under ``timeout -s KILL``). And the data a resume
refuses, before anything compiles, with the checkpoint left as it was."""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
from pathlib import Path

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest

import flaxhooks
from flaxhooks.data import DataResumeError, fingerprint
from tests.helpers import cross_entropy, make_arrays

grain = pytest.importorskip("grain")  # the [grain] extra; Python >= 3.11

ROOT = Path(__file__).resolve().parents[2]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(kind: str, mode: str, out: Path, count: int = 1, limit: int = 150) -> list[subprocess.Popen]:
    """``count`` processes of ``tests/data/resume_worker.py``, each killed after ``limit`` s."""
    out.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    port = str(_port())
    return [subprocess.Popen(
        ["timeout", "-s", "KILL", str(limit), sys.executable, "-m", "tests.data.resume_worker",
         kind, mode, str(out), str(i), str(count), port],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(count)]


def _finish(procs: list[subprocess.Popen]) -> list[subprocess.CompletedProcess]:
    return [subprocess.CompletedProcess(p.args, p.wait(), p.communicate()[0], None) for p in procs]


def _run(kind: str, mode: str, out: Path, count: int = 1, limit: int = 150):
    return _finish(_start(kind, mode, out, count, limit))


def _taken(out: Path, mode: str, index: int) -> dict[int, str]:
    with open(out / f"{mode}-p{index}.json") as file:
        return {int(step): print_ for step, print_ in json.load(file).items()}


def _check_kill_and_resume(tmp_path: Path, kind: str, count: int) -> None:
    whole, broken = tmp_path / "whole", tmp_path / "broken"
    # The run never stopped and the one killed share nothing: they run side by
    # side (mostly waiting on process and loader start-up).
    started = {"whole": _start(kind, "whole", whole, count), "killed": _start(kind, "killed", broken, count)}
    for mode, out, killed in (("whole", whole, False), ("killed", broken, True), ("resumed", broken, False)):
        for proc in _finish(started.pop(mode, None) or _start(kind, mode, out, count)):
            expected = (-9, 128 + 9) if killed else (0,)
            assert proc.returncode in expected, f"{mode}: exit {proc.returncode}\n{proc.stdout[-4000:]}"
            if count > 1:  # each process its own share: no note that they took the same batches
                assert "every process took" not in proc.stdout, proc.stdout[-4000:]
    for index in range(count):
        uninterrupted, resumed = _taken(whole, "whole", index), _taken(broken, "resumed", index)
        # Killed at step 8 with the checkpoint of step 6 (mid-epoch) the latest: steps 7 and 8 run again.
        assert min(resumed) == 7 and max(resumed) == max(uninterrupted)
        assert resumed == {step: uninterrupted[step] for step in resumed}
        assert _taken(broken, "killed", index) == {s: uninterrupted[s] for s in range(1, 9)}
    final, again = np.load(whole / "whole-params.npz"), np.load(broken / "resumed-params.npz")
    for name in final:
        np.testing.assert_array_equal(final[name], again[name])  # bit for bit


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["grain_map", "grain_iter", "torch", "array"])
def test_a_killed_run_resumes_exactly_mid_epoch_on_any_data(tmp_path, kind):
    _check_kill_and_resume(tmp_path, kind, 1)


@pytest.mark.parametrize("kind", ["grain_loader", "torch"])  # a grain DataLoader with workers; torch's
def test_a_killed_run_on_two_processes_resumes_exactly_mid_epoch(tmp_path, kind):
    _check_kill_and_resume(tmp_path, kind, 2)
    if kind == "grain_loader":
        _check_a_two_process_run_is_not_resumed_on_one(tmp_path / "broken")


def _check_a_two_process_run_is_not_resumed_on_one(out: Path) -> None:
    """The loader states saved by two processes are refused on one, naming both counts."""
    listed = sorted(os.listdir(out / "ckpt"))
    (proc,) = _run("grain_loader", "resumed", out, 1)
    assert proc.returncode == 1
    assert "DataResumeError" in proc.stdout and "saved by 2 processes" in proc.stdout, proc.stdout[-4000:]
    assert "this run has 1" in proc.stdout
    assert sorted(os.listdir(out / "ckpt")) == listed  # nothing written, nothing set aside


@pytest.mark.slow
def test_processes_that_all_take_the_same_batches_are_told_to_shard_by_process(tmp_path):
    first, second = _run("grain_unsharded", "whole", tmp_path, 2)
    assert first.returncode == second.returncode == 0, first.stdout[-4000:]
    assert "every process took the same first batch" in first.stdout
    assert "ShardByJaxProcess" in first.stdout and "every process took" not in second.stdout
    # Data sharded by process gets no such note: checked on every run of
    # test_a_killed_run_on_two_processes_resumes_exactly_mid_epoch.


# -- in this process ----------------------------------------------------------


def _records(n: int = 40, seed: int = 5) -> list[dict[str, np.ndarray]]:
    arrays = make_arrays(n, seed=seed)
    return [{key: value[i] for key, value in arrays.items()} for i in range(n)]


def _trainer(directory: Path, every: int = 3, callbacks=(), **options) -> flaxhooks.Trainer:
    model = nn.Sequential([nn.Dense(8), nn.relu, nn.Dense(3)])
    checkpoint = flaxhooks.Checkpoint(directory, every=every, at_epoch_end=False)
    return flaxhooks.Trainer(model, optax.sgd(0.1), cross_entropy, callbacks=[checkpoint, *callbacks],
                             **options)


def _grain_iter(seed: int = 3, records=None):
    source = grain.MapDataset.source(records or _records()).seed(seed).shuffle()
    return source.to_iter_dataset(grain.ReadOptions(num_threads=1)).batch(8, drop_remainder=True)


def _contents(directory: Path) -> dict[str, bytes]:
    files = sorted(p for p in directory.rglob("*") if p.is_file())
    return {str(p.relative_to(directory)): p.read_bytes() for p in files}


def test_a_resume_on_other_data_is_refused_before_training_and_leaves_the_checkpoint(tmp_path):
    _trainer(tmp_path).fit(_grain_iter(seed=3), steps=4)  # saves 3 and 4 (its end)
    saved = _contents(tmp_path)
    trainer = _trainer(tmp_path)
    with pytest.raises(DataResumeError, match=r"batch 4 of epoch 1.*another batch here.*another dataset"):
        trainer.fit(_grain_iter(seed=4), steps=8, resume=True)
    assert trainer.runner.traces == {}  # refused before anything compiled
    assert _contents(tmp_path) == saved
    # The run's own data goes on.
    state = _trainer(tmp_path).fit(_grain_iter(seed=3), steps=8, resume=True)
    assert int(state.step) == 8


def test_a_grain_dataloader_checkpoint_of_another_sampler_is_refused_naming_grains_reason(tmp_path):
    def loader(seed):
        sampler = grain.samplers.IndexSampler(40, shuffle=True, seed=seed, num_epochs=1)
        return grain.DataLoader(data_source=_records(), sampler=sampler,
                                operations=[grain.transforms.Batch(8, drop_remainder=True)])

    _trainer(tmp_path).fit(loader(3), steps=4)
    saved = _contents(tmp_path)
    with pytest.raises(DataResumeError, match=r"cannot take the state saved.*Sampler in checkpoint does not"):
        _trainer(tmp_path).fit(loader(4), steps=8, resume=True)
    assert _contents(tmp_path) == saved


def test_a_resume_past_the_end_of_shorter_data_is_refused_naming_both_lengths(tmp_path):
    arrays = make_arrays(64, seed=5)
    _trainer(tmp_path, every=6).fit(flaxhooks.ArrayLoader(arrays, 8), steps=6)  # saves step 6: 6 batches in
    shorter = flaxhooks.ArrayLoader({k: v[:40] for k, v in arrays.items()}, 8)
    with pytest.raises(DataResumeError, match="6 batches into epoch 1, but the data has 5 batches per epoch"):
        _trainer(tmp_path, every=6).fit(shorter, steps=10, resume=True)
    # Without a length: it runs out while reading up to the position.
    with pytest.raises(DataResumeError, match="ran out after 5 batches of epoch 1; the checkpoint is 6"):
        _trainer(tmp_path, every=6).fit(_Unsized(shorter), steps=10, resume=True)


class _Unsized:
    """An iterable without a length, start or state (a generator, tfds.as_numpy)."""

    def __init__(self, loader):
        self.loader = loader

    def __iter__(self):
        return iter(self.loader(0))


def test_a_resume_of_data_without_start_or_state_reads_up_to_its_place_and_says_how_long(tmp_path, caplog):
    data = _Unsized(flaxhooks.ArrayLoader(make_arrays(64, seed=5), 8))
    whole = _trainer(tmp_path / "whole", every=100).fit(data, steps=8)
    _trainer(tmp_path / "run", every=5).fit(data, steps=6)  # saves step 6 (its end), 6 batches into epoch 1
    with caplog.at_level(logging.INFO, logger="flaxhooks"):
        state = _trainer(tmp_path / "run", every=5).fit(data, steps=8, resume=True)
    (line,) = [r.getMessage() for r in caplog.records if "read and dropped" in r.getMessage()]
    assert line.startswith("resuming 6 batches into epoch 1: read and dropped them in ")
    for got, expected in zip(jax.tree.leaves(state.params), jax.tree.leaves(whole.params), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(expected))


def test_a_grain_iterator_given_as_it_is_goes_on_where_the_last_fit_stopped(tmp_path):
    """A one-shot iterator with a state is put back after the batches the
    input thread read ahead: the next fit takes exactly the next batch."""
    seen: list[str] = []

    class Seen(flaxhooks.Callback):
        def on_step_end(self, loop):
            seen.append(fingerprint({k: np.asarray(v) for k, v in loop.batch.items()}))

    model = nn.Sequential([nn.Dense(8), nn.relu, nn.Dense(3)])
    trainer = flaxhooks.Trainer(model, optax.sgd(0.1), cross_entropy, callbacks=[Seen()],
                                pipeline=flaxhooks.DevicePrefetch(size=3))
    iterator = iter(_grain_iter())
    trainer.fit(iterator, steps=2)
    trainer.fit(iterator, steps=4)
    expected = [fingerprint(batch) for batch in list(_grain_iter())[:4]]
    assert seen == expected


def test_grains_own_handler_reads_the_loader_state_of_a_flaxhooks_checkpoint(tmp_path):
    _trainer(tmp_path).fit(_grain_iter(), steps=4)  # saves step 3
    iterator = iter(_grain_iter())
    grain.checkpoint.CheckpointHandler().restore(tmp_path / "3" / "data",
                                                 args=grain.checkpoint.CheckpointRestore(iterator))
    assert fingerprint(next(iterator)) == fingerprint(list(_grain_iter())[3])


def test_a_batch_of_another_structure_mid_epoch_fails_at_that_batch(tmp_path):
    batches = [{"image": np.zeros((8, 5), np.float32), "label": np.zeros(8, np.int32)} for _ in range(5)]
    batches[3] = {"image": batches[3]["image"]}
    steps = []

    class Steps(flaxhooks.Callback):
        def on_step_end(self, loop):
            steps.append(loop.step)

    model = nn.Sequential([nn.Dense(3)])
    trainer = flaxhooks.Trainer(model, optax.sgd(0.1), cross_entropy, callbacks=[Steps()])
    with pytest.raises(flaxhooks.BatchError, match=r"batch keys changed: missing \['label'\]"):
        trainer.fit(batches, epochs=1)
    assert steps == [1, 2, 3]  # the input thread read ahead; the error came at its batch


def test_grain_data_resumes_exactly_across_dispatches_of_several_steps(tmp_path):
    """Written with 4 steps a dispatch, resumed with 1 (and a one-shot iterator put back after the
    batches read ahead): each step takes the batch an uninterrupted run takes."""
    seen: dict[int, str] = {}

    class Seen(flaxhooks.Callback):
        def on_step_end(self, loop):
            seen[loop.step] = fingerprint({k: np.asarray(v) for k, v in loop.batch.items()})

    class Crash(flaxhooks.Callback):
        def on_step_end(self, loop):
            if loop.step == 6:  # inside the dispatch of steps 5-8
                raise RuntimeError("crash")

    whole = _trainer(tmp_path / "whole", every=4, callbacks=[Seen()]).fit(_grain_iter(), steps=10)
    expected = dict(seen)
    seen.clear()
    crashing = _trainer(tmp_path / "run", every=4, callbacks=[Seen(), Crash()], steps_per_dispatch=4)
    with pytest.raises(flaxhooks.CallbackError, match="crash"):
        crashing.fit(_grain_iter(), steps=10)
    assert seen == {s: expected[s] for s in range(1, 7)}
    seen.clear()
    state = _trainer(tmp_path / "run", every=4, callbacks=[Seen()]).fit(_grain_iter(), steps=10, resume=True)
    assert seen == {s: expected[s] for s in range(5, 11)}  # from the checkpoint of step 4
    for got, want in zip(jax.tree.leaves(state.params), jax.tree.leaves(whole.params), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-7)
    iterator = iter(_grain_iter())
    seen.clear()
    one_shot = flaxhooks.Trainer(nn.Sequential([nn.Dense(8), nn.relu, nn.Dense(3)]), optax.sgd(0.1),
                                 cross_entropy, callbacks=[Seen()], steps_per_dispatch=4)
    one_shot.fit(iterator, steps=2)
    one_shot.fit(iterator, steps=10)  # its 5 batches run out at step 5
    assert seen == {s: expected[s] for s in range(1, 6)}
