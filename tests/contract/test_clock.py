"""Where the time goes (``loop.clock``): the data-wait share against a loader
slowed on purpose, the step's FLOPs against a hand count, no host sync and
no compilation for any of it, and what Progress and TensorBoard show."""

from __future__ import annotations

import io
import re
import time

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest
from rich.console import Console
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import flaxhooks
from flaxhooks.contract import FitClock, Interval
from tests.helpers import HostReads, cross_entropy, make_batches, sgd_trainer

SLEEP = 0.02  # seconds the slowed loader takes per batch


def slowed(batches, seconds=SLEEP):
    """Data whose every batch takes ``seconds`` to come (a loader slowed on purpose)."""

    def epoch(index):
        for batch in batches:
            time.sleep(seconds)
            yield batch

    return epoch


def loader_pace(steps: int, ahead: int = 1) -> float:
    """The most examples per second an interval of ``steps`` steps can show on
    data slowed to one batch of 16 per ``SLEEP``: the input thread may have begun
    reading the interval's first batch up to ``ahead`` batches' time before it."""
    return 16 / SLEEP * steps / (steps - ahead)


class Probe(flaxhooks.Callback):
    """Reads the loop's clock at step ``first`` and at every later step end
    up to ``last``, with the host's own clock beside it; keeps the interval from ``first``.

    (The input thread reads ahead while the first step compiles: the first
    steps of a slowed loader's data wait little, their batches came earlier.)"""

    def __init__(self, first=4, last=None):
        self.first, self.last = first, last
        self.interval: Interval | None = None
        self.clock: FitClock | None = None
        self.steps = 0

    def on_step_end(self, loop):
        if loop.step == self.first:
            self.start, self.started = loop.clock.read(), time.perf_counter()
        elif loop.step > self.first and (self.last is None or loop.step <= self.last):
            self.interval, self.wall = loop.clock.interval(self.start), time.perf_counter() - self.started
            self.steps = loop.step - self.first
        self.clock = loop.clock


def test_the_data_wait_is_the_share_the_slowed_loaders_sleeps_imply():
    batches = make_batches(24)
    slow, fast = Probe(4, last=20), Probe(4, last=20)
    sgd_trainer(callbacks=[slow], devices=jax.local_devices()[:1]).fit(slowed(batches), epochs=1)
    sgd_trainer(callbacks=[fast], devices=jax.local_devices()[:1]).fit(batches, epochs=1)
    interval = slow.interval
    assert interval is not None and interval.steps == slow.steps == 16
    # The loader's sleeps set the pace (the input thread overlaps them with the steps): the loop
    # waits for its batches nearly all the time, less the little work of the steps.
    implied = min(1.0, interval.steps * SLEEP / slow.wall)
    assert implied - 0.1 <= interval.data_wait <= 1.0, (interval, implied)
    assert interval.data_wait > 0.5 and interval.input_bound
    # The loader sets the pace: no faster than it hands out batches. Steps this short may not
    # have used up, when the interval begins, the batches read ahead while the step compiled:
    # as many as the prefetch holds, and the one its thread holds until there is room.
    ahead = flaxhooks.DevicePrefetch().size + 1
    assert 0.3 * 16 / SLEEP < interval.examples_per_sec < loader_pace(interval.steps, ahead)
    # In-memory batches keep the loop waiting far less, and go far faster. (This model's steps
    # take about 0.3 ms, as long as the input thread's work on a batch: the loop may wait for it
    # half the time. A loader faster than the step hides entirely: the slow test below.)
    assert fast.interval is not None and fast.interval.data_wait < interval.data_wait - 0.3
    assert fast.interval.examples_per_sec > 2 * interval.examples_per_sec


class Wide(nn.Module):
    """Three wide layers: a step the CPU takes tens of milliseconds over."""

    @nn.compact
    def __call__(self, x):
        for _ in range(3):
            x = nn.relu(nn.Dense(1024)(x))
        return nn.Dense(4)(x)


@pytest.mark.slow
def test_a_loader_slower_than_the_step_is_input_bound_and_one_faster_is_not():
    rng = np.random.default_rng(0)
    batches = [{"image": rng.normal(size=(512, 1024)).astype(np.float32),
                "label": rng.integers(0, 4, 512).astype(np.int32)} for _ in range(16)]

    def fit(data) -> Interval:
        probe = Probe(first=4)
        flaxhooks.Trainer(Wide(), optax.sgd(0.1), cross_entropy, devices=jax.local_devices()[:1],
                          callbacks=[probe]).fit(data, epochs=1)
        assert probe.interval is not None
        return probe.interval

    alone = fit(batches)
    step = alone.seconds / alone.steps  # what the devices take per step, the data in memory
    # Batches that come 4x faster than the steps: the input thread reads them while the devices
    # run the steps in flight, so the loop hardly waits, and the devices set the pace.
    hidden = fit(slowed(batches, step / 4))
    assert hidden.data_wait < 0.05 and not hidden.input_bound, (alone, hidden)
    assert hidden.examples_per_sec > 0.8 * alone.examples_per_sec
    # Batches that take twice the step: the devices idle, waiting for them.
    held = fit(slowed(batches, 2 * step))
    assert held.input_bound and held.data_wait > 0.5 and held.device_wait < held.data_wait / 4, (alone, held)
    assert held.examples_per_sec < 0.7 * alone.examples_per_sec


B, IN, HIDDEN, OUT = 256, 64, 256, 16


class TwoDense(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(OUT)(nn.relu(nn.Dense(HIDDEN)(x)))


def _dense_batches(count=6):
    rng = np.random.default_rng(0)
    return [{"image": rng.normal(size=(B, IN)).astype(np.float32),
             "label": rng.integers(0, OUT, B).astype(np.int32)} for _ in range(count)]


def _flops(devices: int) -> tuple[float, float | None]:
    """(the clock's FLOPs per step, the runner's per device) of a fit on ``devices``."""
    probe = Probe(first=2)
    trainer = flaxhooks.Trainer(TwoDense(), optax.sgd(0.1), cross_entropy,
                                devices=jax.local_devices()[:devices], callbacks=[probe])
    trainer.fit(_dense_batches(), steps=4)
    assert probe.clock is not None and probe.clock.devices == devices
    return probe.clock.flops_per_step, trainer.runner.step_flops()


def test_the_steps_flops_are_xlas_count_near_a_hand_count(devices):
    flops, per_device = _flops(len(devices))
    # By hand, the matrix products: forward 2·B·in·out per layer; backward the same for the
    # weights' gradient of each layer and for the input's of the second (the first's is not needed).
    forward = 2 * B * (IN * HIDDEN + HIDDEN * OUT)
    hand = forward + forward + 2 * B * HIDDEN * OUT
    # XLA counts the rest too (the activation, the loss, the optimizer and the norms on the
    # parameters, which each device updates whole): a few percent.
    assert hand <= flops <= 1.15 * hand, (flops, hand)
    # One device's count, times the devices of the mesh.
    assert flops == per_device * len(devices)


def test_on_several_devices_each_does_its_share_of_the_flops():
    if len(jax.local_devices()) < 8:
        pytest.skip("needs 8 devices")
    one, _ = _flops(1)
    eight, per_device = _flops(8)
    assert per_device is not None and eight == 8 * per_device
    assert one <= eight <= 1.1 * one  # the same work, but for what every device repeats
    assert per_device == pytest.approx(one / 8, rel=0.1)


def test_no_host_read_and_no_compilation_for_the_figures(monkeypatch, compiles):
    reads = HostReads(monkeypatch)

    class Every(Probe):  # an interval at every step: the clock's figures, FLOPs included
        def on_step_end(self, loop):
            super().on_step_end(loop)
            if self.interval is not None:
                assert self.interval.flops_per_sec is not None

    console = Console(file=io.StringIO(), force_terminal=True, width=160)
    bar = flaxhooks.Progress(console=console, every=flaxhooks.Every(steps=1), clock=lambda: 0.0)
    trainer = sgd_trainer(callbacks=[reads, Every(first=1), bar], if_nonfinite="off")
    trainer.fit(make_batches(4), epochs=3)
    assert reads.count == 0
    assert dict(trainer.runner.traces) == {"train_step": 1}
    assert compiles.count("jit(train_step)") == 1
    # The data share is measured: past its threshold the line adds "(input-bound)".
    assert re.search(r"ex/s  data \d+%(?: \(input-bound\))?  [\d.]+ [kMG]?FLOP/s", console.file.getvalue())


def test_evaluations_are_left_out_of_the_interval():
    class SlowEvaluation(flaxhooks.Callback):
        def on_eval_end(self, loop):
            time.sleep(0.3)  # inside loop.evaluate: left out

    probe = Probe(first=2)
    trainer = sgd_trainer(callbacks=[probe, SlowEvaluation()], devices=jax.local_devices()[:1])
    trainer.add(flaxhooks.Evaluate(make_batches(1)[0], every=flaxhooks.Every(steps=4), batch_size=16))
    trainer.fit(make_batches(8), epochs=1)
    interval = probe.interval
    assert interval is not None and interval.steps == 6
    assert probe.wall > 0.3 and interval.seconds < probe.wall - 0.3  # the evaluation at step 4


def test_an_interval_holding_the_first_step_leaves_its_compilation_out():
    seen = []

    class FromStart(flaxhooks.Callback):
        def on_fit_start(self, loop):
            self.start = loop.clock.read()

        def on_step_end(self, loop):
            seen.append(loop.clock.interval(self.start))

    sgd_trainer(callbacks=[FromStart()]).fit(make_batches(4), epochs=1)
    # At the first step's end the compilation cannot be told apart: no figures yet.
    assert seen[0] is None
    assert [w.steps for w in seen[1:]] == [1, 2, 3]


def test_tensorboard_writes_where_the_time_went(tmp_path, monkeypatch):
    monkeypatch.setitem(flaxhooks.PEAK_FLOPS, "cpu", 1e12)  # a peak for the CPU: MFU is written too
    probe = Probe(first=1)
    trainer = sgd_trainer(callbacks=[flaxhooks.TensorBoard(tmp_path, every=4), probe],
                          devices=jax.local_devices()[:1])
    trainer.fit(slowed(make_batches(12)), epochs=1)
    events = EventAccumulator(str(tmp_path / "train"))
    events.Reload()

    def values(tag):
        return {event.step: event.value for event in events.Scalars(tag)}

    wait, examples = values("train/data_wait"), values("train/examples_per_sec")
    assert sorted(wait) == sorted(examples) == [4, 8, 12]
    # The input thread read batches ahead while the first step compiled: the first interval took
    # those. From then on every batch is waited for, and training goes no faster than the loader.
    assert all(0.5 < wait[step] <= 1.0 for step in (8, 12)), wait
    device_wait = values("train/device_wait")
    assert all(0.0 <= device_wait[step] < 0.5 for step in (8, 12)), device_wait
    assert all(0 < examples[step] < loader_pace(4) for step in (8, 12)), examples
    flops, mfu = values("train/flops_per_sec"), values("train/mfu")
    per_step = probe.clock.flops_per_step
    for step in (8, 12):  # the FLOP rate is the step's FLOPs at the examples' rate
        assert flops[step] == pytest.approx(per_step * examples[step] / 16, rel=1e-4)
        assert mfu[step] == pytest.approx(flops[step] / 1e12, rel=1e-4)


def test_progress_says_a_run_is_input_bound(monkeypatch):
    monkeypatch.setitem(flaxhooks.PEAK_FLOPS, "cpu", 1e9)
    console = Console(file=io.StringIO(), force_terminal=False, width=80)
    progress = flaxhooks.Progress(console=console, every=flaxhooks.Every(steps=4))
    sgd_trainer(callbacks=[progress], devices=jax.local_devices()[:1]).fit(
        slowed(make_batches(12)), epochs=1)
    lines = console.file.getvalue().splitlines()
    periodic = [line for line in lines if line.startswith("step ")]
    assert len(periodic) == 3
    for line in periodic[1:]:  # the first interval's batches were read while the first step compiled
        match = re.search(r"  ([\d,.]+) ex/s  data (\d+)% \(input-bound\)  [\d.]+ [kMG]?FLOP/s  MFU [\d.]+%$",
                          line)
        assert match and int(match.group(2)) > 50, line
        assert float(match.group(1).replace(",", "")) < loader_pace(4), line
    assert re.search(r"ex/s  data \d+% \(input-bound\)", lines[-1])  # the summary, over the whole fit


def test_a_peak_is_found_by_the_start_of_the_device_kind(monkeypatch):
    monkeypatch.setitem(flaxhooks.PEAK_FLOPS, "Made Up", 1.0)
    monkeypatch.setitem(flaxhooks.PEAK_FLOPS, "Made Up X", 2.0)
    clock = FitClock(lambda: 0, 8, devices=4, device_kind="Made Up X 80GB")
    assert clock.peak_flops == 8.0  # the longest start that matches, for each of the 4 devices
    assert FitClock(lambda: 0, 8, devices=4, device_kind="cpu").peak_flops is None
    assert flaxhooks.PEAK_FLOPS["NVIDIA H100"] == 989e12  # dense bf16, without sparsity
