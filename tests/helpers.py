"""Small models, data and callbacks shared by the tests."""

from __future__ import annotations

import json

import flax.linen as nn
import jax.numpy as jnp
import numpy as np
import optax

import flaxhooks
from flaxhooks import EVENTS


class MLP(nn.Module):
    """Deterministic two-layer net."""

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(8)(x))
        return nn.Dense(3)(x)


class SquareRoot(nn.Module):
    @nn.compact
    def __call__(self, x):
        return jnp.sqrt(x)


class Diverging(nn.Module):
    """Finite until ``sqrt`` meets a negative input (at the first step)."""

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(4, name="encoder")(x)
        x = SquareRoot(name="root")(x)
        return nn.Dense(3, name="head")(x)


class BatchNormNet(nn.Module):
    """Dense → BatchNorm (statistics reduced over the device axis) → Dense."""

    axis_name: str | None = flaxhooks.AXIS

    @nn.compact
    def __call__(self, x, train: bool):
        x = nn.Dense(8)(x)
        x = nn.BatchNorm(use_running_average=not train, momentum=0.5, axis_name=self.axis_name)(x)
        return nn.Dense(3)(nn.relu(x))


class ResumeNet(nn.Module):
    """Dense → BatchNorm → dropout → Dense: carried state and per-step RNG,
    everything an exact resume must restore."""

    @nn.compact
    def __call__(self, x, train: bool):
        x = nn.Dense(8)(x)
        x = nn.BatchNorm(use_running_average=not train, momentum=0.5, axis_name=flaxhooks.AXIS)(x)
        x = nn.Dropout(0.3, deterministic=not train)(nn.relu(x))
        return nn.Dense(3)(x)


def resume_trainer(workdir, callbacks=(), every=2, keep=3, log_every=1, **kwargs) -> flaxhooks.Trainer:
    """A Trainer with the callbacks whose state a resume restores: checkpoints
    every ``every`` steps, evaluation each epoch, early stopping (never
    triggered) and TensorBoard and a metrics file every ``log_every`` steps."""
    import os

    return flaxhooks.Trainer(
        ResumeNet(), optax.adam(0.01), cross_entropy,
        callbacks=[
            flaxhooks.Checkpoint(os.path.join(workdir, "checkpoints"), every=every, keep=keep),
            flaxhooks.Evaluate(make_arrays(40, seed=9), batch_size=16),
            flaxhooks.EarlyStopping("accuracy", patience=100, mode="max"),
            flaxhooks.TensorBoard(os.path.join(workdir, "tensorboard"), every=log_every),
            flaxhooks.MetricsFile(os.path.join(workdir, "metrics.jsonl"), every=log_every),
            *callbacks,
        ],
        **kwargs,
    )


def resume_data() -> flaxhooks.ArrayLoader:
    """Six shuffled batches of 16 per epoch."""
    return flaxhooks.ArrayLoader(make_arrays(96, seed=3), 16, seed=3)


def cross_entropy(logits, batch):
    return optax.losses.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()


def make_arrays(n: int = 64, features: int = 5, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "image": rng.normal(size=(n, features)).astype(np.float32),
        "label": rng.integers(0, 3, n).astype(np.int32),
    }


def make_batches(count: int, batch_size: int = 16, seed: int = 0) -> list[dict[str, np.ndarray]]:
    arrays = make_arrays(count * batch_size, seed=seed)
    return [{k: v[i * batch_size:(i + 1) * batch_size] for k, v in arrays.items()} for i in range(count)]


def split_batches(arrays: dict[str, np.ndarray], sizes: list[int]) -> list[dict[str, np.ndarray]]:
    """Consecutive batches of the given sizes."""
    starts = np.cumsum([0, *sizes])
    return [{k: v[a:b] for k, v in arrays.items()} for a, b in zip(starts[:-1], starts[1:], strict=True)]


class Recorder(flaxhooks.Callback):
    """Records every event it sees, with the loop's step."""

    def __init__(self, name: str = "rec", order: int = 0, log: list | None = None):
        self.name = name
        self.order = order
        self.log = [] if log is None else log

    def __repr__(self):
        return f"Recorder({self.name!r})"


def _recording(event):
    def handler(self, loop):
        self.log.append((self.name, event, loop.step))

    return handler


for _event in EVENTS:
    setattr(Recorder, f"on_{_event}", _recording(_event))


class HostReads(flaxhooks.Callback):
    """Counts device-to-host reads of arrays between fit_start and fit_end, and
    whether each array was already computed when it was read.

    (JAX's transfer guard does not see CPU-to-host copies,
    so the property every host read goes through is wrapped instead.)
    """

    order = -1000

    def __init__(self, monkeypatch):
        from jax._src import array

        self.count = 0
        self.unready = 0
        self.active = False
        value = array.ArrayImpl._value

        def counted(arr):
            if self.active:
                self.count += 1
                self.unready += not arr.is_ready()
            return value.fget(arr)

        monkeypatch.setattr(array.ArrayImpl, "_value", property(counted))

    def on_fit_start(self, loop):
        self.active = True

    def on_fit_end(self, loop):
        self.active = False


#: Tags whose values are wall-clock readings: compared by their steps only.
TIMINGS = ("throughput/steps_per_s", "train/data_wait", "train/device_wait", "train/examples_per_sec",
           "train/flops_per_sec")


def jsonl_records(path) -> list[tuple[int, str, str, float]]:
    """``(step, run, tag, value)`` of every record of a JSON-lines metrics file, read with ``json`` alone."""
    found = []
    for line in open(path).read().splitlines():
        record = json.loads(line)
        assert set(record) == {"step", "run", "time", "values"}, record
        found += [(record["step"], record["run"], tag, value) for tag, value in record["values"].items()]
    return found


def by_key(records) -> dict[tuple[str, str], list[tuple[int, float]]]:
    """``{(run, tag): [(step, value)]}`` in the order written."""
    found: dict[tuple[str, str], list[tuple[int, float]]] = {}
    for step, run, tag, value in records:
        found.setdefault((run, tag), []).append((step, value))
    return found


def assert_same_records(got, expected) -> None:
    """The same records by run and tag, at the same steps, with the same values (rtol 1e-5); a
    timing's steps only in order, none twice (a resumed run's first interval may have none)."""
    got, expected = by_key(got), by_key(expected)
    assert sorted(got) == sorted(expected)
    for key, points in expected.items():
        steps = [s for s, _ in got[key]]
        if key[1] in TIMINGS:
            assert steps == sorted(set(steps)), (key, steps)
            continue
        assert steps == [s for s, _ in points], key  # none missing, none twice
        np.testing.assert_allclose([v for _, v in got[key]], [v for _, v in points], rtol=1e-5,
                                   err_msg=str(key))


class KeepMetrics(flaxhooks.Callback):
    """Keeps each step's metrics, read on the host: ``metrics[step]``."""

    def __init__(self):
        self.metrics = {}

    def on_step_end(self, loop):
        self.metrics[loop.step] = loop.host_metrics()


class RaiseAt(flaxhooks.Callback):
    """Raises ``error`` at the end of step ``at``."""

    def __init__(self, at, error):
        self.at, self.error = at, error

    def on_step_end(self, loop):
        if loop.step == self.at:
            raise self.error


def sgd_trainer(model=None, callbacks=(), devices=None, **kwargs) -> flaxhooks.Trainer:
    return flaxhooks.Trainer(
        model or MLP(), optax.sgd(0.1, 0.9), cross_entropy,
        callbacks=callbacks, devices=devices, **kwargs,
    )


def tree_allclose(a, b, rtol=1e-5, atol=1e-6) -> bool:
    import jax

    return all(
        np.allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


def assert_tables_close(got, expected, rel: float, abs: float) -> None:
    """Published statistics ``{step: {topic: {layer: {column: value}}}}``:
    the same steps, topics and layers, each value within tolerance."""
    import pytest

    assert sorted(got) == sorted(expected)
    for step, tables in expected.items():
        for topic, table in tables.items():
            assert got[step][topic].keys() == table.keys()
            for layer, row in table.items():
                for column, value in row.items():
                    assert got[step][topic][layer][column] == pytest.approx(value, rel=rel, abs=abs), (
                        step, topic, layer, column)


__all__ = [
    "MLP", "BatchNormNet", "HostReads", "Recorder", "ResumeNet", "assert_tables_close", "cross_entropy",
    "jnp", "make_arrays", "make_batches", "resume_data", "resume_trainer", "sgd_trainer", "split_batches",
    "tree_allclose",
]
