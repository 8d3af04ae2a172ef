"""Input: checks before anything compiles, sharding, prefetching, loaders, schedules."""

import logging
import os
import platform
import subprocess
import sys
import time

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest

import flaxhooks
from flaxhooks import ArrayLoader, BatchError, EmptyDataError, Every
from flaxhooks.data import BatchSpec
from tests.helpers import make_batches, sgd_trainer


def eight_device_trainer():
    if len(jax.local_devices()) < 8:
        pytest.skip("needs 8 devices")
    return sgd_trainer(devices=jax.local_devices()[:8])


def test_a_batch_that_does_not_divide_over_the_devices(compiles):
    trainer = eight_device_trainer()
    batch = make_batches(1, batch_size=12)[0]
    with pytest.raises(BatchError) as info:
        trainer.fit([batch], epochs=1)
    message = str(info.value)
    assert "12 examples" in message and "'image'" in message and "(12, 5)" in message
    assert "8 devices" in message
    assert compiles == [] and trainer.runner.traces["train_step"] == 0


def test_a_missing_model_input_key(compiles):
    trainer = sgd_trainer()
    batch = {"pixels": np.zeros((16, 5), np.float32), "label": np.zeros(16, np.int32)}
    with pytest.raises(BatchError, match=r"no key 'image', the model's input by default "
                       r"\(input_keys=\('image',\)\); its keys are \['label', 'pixels'\]: "
                       r"give the Trainer flaxhooks.as_model\(model, input_keys=\('pixels',\)\)"):
        trainer.fit([batch], epochs=1)
    assert compiles == []


def test_a_key_the_loss_reads_but_the_batch_lacks(compiles):
    trainer = sgd_trainer()
    batch = {"image": np.zeros((16, 5), np.float32)}
    with pytest.raises(BatchError, match=r"reads batch key 'label', which the batch lacks"):
        trainer.fit([batch], epochs=1)
    assert compiles == []


def test_a_loss_per_example_is_told_to_take_its_mean_without_jaxs_frames(compiles):
    def per_example(logits, batch):
        return optax.losses.softmax_cross_entropy_with_integer_labels(logits, batch["label"])

    trainer = flaxhooks.Trainer(nn.Dense(3), optax.sgd(0.1), per_example)
    with pytest.raises(flaxhooks.LossError) as info:
        trainer.fit(make_batches(1, batch_size=16), epochs=1)
    assert str(info.value) == ("loss_fn must return a scalar loss, got shape (16,) (one per example?): "
                               "return their mean, e.g. `.mean()`")
    assert not getattr(info.value, "__notes__", None)  # JAX's note on filtered frames: noise here
    assert info.value.__cause__ is None and info.value.__suppress_context__  # one error, not a chain
    assert compiles == []


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda b: {**b, "image": b["image"].astype(np.float64)},
         r"'image' has dtype float64, expected float32"),
        (lambda b: {**b, "image": b["image"][..., None]},
         r"'image' has shape \(16, 5, 1\) \(rank 3\), expected \(16, 5\) \(rank 2\)"),
        (lambda b: {"image": b["image"]}, r"missing \['label'\]"),
        (lambda b: {**b, "label": b["label"][:8]}, r"batch sizes \[8, 16\]"),
        (lambda b: {"image": np.zeros((32, 5), np.float32), "label": np.zeros(32, np.int32)},
         r"do not match the first batch's 16"),
    ],
    ids=["dtype", "rank", "missing-key", "unequal-lengths", "larger"],
)
def test_a_later_batch_that_changes_layout(change, message):
    first, second = make_batches(2)
    with pytest.raises(BatchError, match=message):
        sgd_trainer().fit([first, change(second)], epochs=1)


def test_bad_values_in_the_first_batch():
    trainer = sgd_trainer()
    with pytest.raises(BatchError, match="dict of arrays"):
        trainer.fit([np.zeros((16, 5))], epochs=1)
    with pytest.raises(BatchError, match="'name' has dtype <U1"):
        trainer.fit([{**make_batches(1)[0], "name": np.array(["a"] * 16)}], epochs=1)
    with pytest.raises(BatchError, match="'label' has 8 examples"):
        trainer.fit([{**make_batches(1)[0], "label": np.zeros(8, np.int32)}], epochs=1)


def test_an_empty_dataset(compiles):
    with pytest.raises(EmptyDataError, match="yielded no batch"):
        sgd_trainer().fit([], epochs=1)
    assert compiles == []


def test_an_epoch_that_yields_nothing_is_an_error_for_reiterable_data():
    batches = make_batches(2)

    def data(epoch):
        return batches if epoch == 0 else []

    with pytest.raises(EmptyDataError, match="epoch 2 of the training data"):  # counted from 1
        sgd_trainer().fit(data, epochs=2)


def test_a_ragged_last_batch_is_dropped_with_one_warning_or_refused(caplog):
    batches = make_batches(3, batch_size=16)
    ragged = {k: v[:8] for k, v in batches[2].items()}
    with caplog.at_level(logging.WARNING, logger="flaxhooks"):
        trainer = sgd_trainer()
        state = trainer.fit(batches[:2] + [ragged], epochs=2)
    assert int(state.step) == 4
    assert caplog.text.count("dropping a batch of 8 examples") == 1
    assert trainer.pipeline.dropped == 2
    assert trainer.runner.traces["train_step"] == 1
    strict = sgd_trainer(pipeline=flaxhooks.DevicePrefetch(ragged="error"))
    with pytest.raises(BatchError, match="a batch of 8 examples"):
        strict.fit(batches[:2] + [ragged], epochs=1)


def test_batches_are_sharded_over_devices_and_prefetched(devices):
    seen = []

    class Peek(flaxhooks.Callback):
        def on_step_start(self, loop):
            seen.append(loop.batch["image"])

    batches = make_batches(3, batch_size=16)
    trainer = sgd_trainer(devices=devices, callbacks=[Peek()], pipeline=flaxhooks.DevicePrefetch(size=3))
    trainer.fit(batches, epochs=1)
    share = 16 // len(devices)
    for device_batch, host in zip(seen, batches, strict=True):
        # One global array, each device holding its block of rows.
        assert device_batch.shape == (16, 5)
        assert {s.device for s in device_batch.addressable_shards} == set(devices)
        for shard in device_batch.addressable_shards:
            assert shard.data.shape == (share, 5)
            np.testing.assert_array_equal(shard.data, host["image"][shard.index])
        np.testing.assert_array_equal(np.asarray(device_batch), host["image"])


def test_prefetch_runs_ahead_by_its_size():
    pulled = []

    def data():
        for i, batch in enumerate(make_batches(6)):
            pulled.append(i)
            yield batch

    at_step = {}

    class Watch(flaxhooks.Callback):
        def on_step_start(self, loop):
            time.sleep(0.2)  # a slow step: the input thread reads as far ahead as it may meanwhile
            at_step[loop.step] = len(pulled)

    sgd_trainer(callbacks=[Watch()], pipeline=flaxhooks.DevicePrefetch(size=3)).fit(data(), steps=6)
    # Step k has taken batch k; three more wait on the devices, and the thread holds one more, read
    # and waiting for room: never more.
    assert at_step == {0: 5, 1: 6, 2: 6, 3: 6, 4: 6, 5: 6}


def test_spec_shards_without_copying():
    spec = BatchSpec.of(make_batches(1)[0], 4, ["image"])
    arrays = spec.conform(make_batches(1)[0])
    sharded = spec.shard(arrays)
    assert sharded["image"].shape == (4, 4, 5)
    assert np.shares_memory(sharded["image"], arrays["image"])


def test_array_loader_is_reproducible_per_epoch_and_covers_every_example():
    arrays = {"x": np.arange(10), "y": np.arange(10) * 10}
    loader = ArrayLoader(arrays, batch_size=3, seed=7)
    assert len(loader) == 3
    epoch0 = [b["x"] for b in loader(0)]
    assert [b.tolist() for b in epoch0] == [b["x"].tolist() for b in loader(0)]
    assert [b.tolist() for b in epoch0] != [b["x"].tolist() for b in loader(1)]
    assert all(np.array_equal(b["y"], b["x"] * 10) for b in loader(0))
    everything = ArrayLoader(arrays, batch_size=3, drop_remainder=False, shuffle=False)
    assert len(everything) == 4
    assert np.concatenate([b["x"] for b in everything(5)]).tolist() == list(range(10))


def test_array_loader_rejects_bad_arrays():
    with pytest.raises(BatchError, match="different lengths"):
        ArrayLoader({"x": np.zeros(3), "y": np.zeros(4)}, 2)
    with pytest.raises(BatchError, match="batch_size must be positive"):
        ArrayLoader({"x": np.zeros(3)}, 0)


def test_every_by_steps_and_by_seconds():
    every = Every(steps=3)
    assert [s for s in range(1, 10) if every(s)] == [3, 6, 9]
    now = [0.0]
    timed = Every(seconds=5, clock=lambda: now[0])
    due = []
    for step in range(1, 8):
        now[0] += 2.0
        due.append(timed(step))
    # Due at t=6 (6 s since construction), then at t=12 (6 s since t=6).
    assert due == [False, False, True, False, False, True, False]
    with pytest.raises(ValueError):
        Every()


def _devices_in_subprocess(code, env):
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return int(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(
    "xla_flags, count, expected",
    [
        (None, None, len(os.sched_getaffinity(0))),
        ("--xla_force_host_platform_device_count=3", None, 3),
        ("--xla_force_host_platform_device_count=3", 5, 5),
        (None, 4, 4),
    ],
    ids=["one-per-core", "xla-flags-win", "flag-beats-xla-flags", "flag"],
)
def test_cpu_devices_precedence(xla_flags, count, expected):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    if xla_flags:
        env["XLA_FLAGS"] = xla_flags
    code = f"import flaxhooks, jax; flaxhooks.use_cpu_devices({count}); print(len(jax.devices()))"
    assert _devices_in_subprocess(code, env) == expected


@pytest.mark.parametrize("given", [None, "3"], ids=["sized", "the-environment-wins"])
def test_cpu_devices_across_processes_size_xlas_cpu_pool_for_their_collectives(given):
    """Two devices per process on two cores: XLA:CPU's pool of one thread per core is too small for
    collectives across processes (a step deadlocked about one run in three), so PJRT_NPROC is set."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "PJRT_NPROC", "NPROC")}
    if given:
        env["PJRT_NPROC"] = given
    code = ("import os, flaxhooks, jax; flaxhooks.use_cpu_devices(2, across_processes=True); "
            "print(os.environ['PJRT_NPROC'])")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    cores = len(os.sched_getaffinity(0))
    assert int(out.stdout.split()[-1]) == (int(given) if given else max(cores, 5))
    if not given:  # one process: nothing set (more threads than cores only slow XLA:CPU down)
        code = "import os, flaxhooks; flaxhooks.use_cpu_devices(2); print(os.environ.get('PJRT_NPROC'))"
        alone = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                               check=True)
        assert alone.stdout.split()[-1] == "None"


def test_xlas_cpu_pool_size_is_read_as_xla_reads_it(monkeypatch):
    from flaxhooks.placement import cpu_pool_size, cpu_threads_needed

    for name in ("PJRT_NPROC", "NPROC"):
        monkeypatch.delenv(name, raising=False)
    assert cpu_pool_size(1) == len(os.sched_getaffinity(0))
    assert cpu_pool_size(64) == 64  # one per device at least
    monkeypatch.setenv("NPROC", "7")
    assert cpu_pool_size(2) == 7
    monkeypatch.setenv("PJRT_NPROC", "9")  # read first
    assert cpu_pool_size(2) == 9 and cpu_threads_needed(2) == 5


def test_a_given_state_is_checked_against_the_batch_before_compiling(compiles):
    trainer = sgd_trainer()
    initial = trainer.init(make_batches(1)[0])
    compiles.clear()
    with pytest.raises(BatchError, match="reads batch key 'label'"):
        trainer.fit([{"image": make_batches(1)[0]["image"]}], epochs=1, state=initial)
    assert compiles == [] and trainer.runner.traces["train_step"] == 0


_FAULTS_CODE = """
import resource, numpy as np, optax, flaxhooks
from recipes.models import CNN, cross_entropy_loss
flaxhooks.use_cpu_devices(1)
rng = np.random.default_rng(0)
batches = [{"image": rng.random((4, 28, 28, 1), dtype=np.float32),
            "label": rng.integers(0, 10, 4, dtype=np.int32)} for _ in range(60)]
trainer = flaxhooks.Trainer(CNN(), optax.sgd(0.1, momentum=0.9), cross_entropy_loss)
state = trainer.fit(batches[:10], epochs=1)  # compiled
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
trainer.fit(batches, epochs=1, state=state)
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
print(faults / len(batches), flaxhooks.placement.keep_freed_host_memory())
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the allocator kept is glibc's")
@pytest.mark.parametrize("variable", [None, "FLAXHOOKS_DEFAULT_MALLOC=1", "MALLOC_MMAP_THRESHOLD_=131072"],
                         ids=["kept", "opted-out", "the-users-malloc-settings-stand"])
def test_a_cpu_trainer_keeps_freed_host_memory_so_steps_do_not_fault_their_pages_in_anew(variable):
    """glibc hands freed blocks of over 128 KiB back to the system, so each step of
    XLA:CPU faulted its buffers' pages in again (recipe CNN, batch 4, one device);
    a Trainer on CPU devices keeps them, unless told not to."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"
           and k != flaxhooks.placement.DEFAULT_MALLOC_VARIABLE}
    if variable:
        name, value = variable.split("=")
        env[name] = value
    out = subprocess.run([sys.executable, "-c", _FAULTS_CODE], env=env, capture_output=True, text=True,
                         check=True, timeout=300)
    faults_per_step, kept = out.stdout.split()[-2:]
    kernel_pages = 3136 * 256 * 4 // 4096  # the first Dense kernel, one of the step's buffers
    if variable is None:
        assert kept == "True" and float(faults_per_step) < kernel_pages / 4
        return
    assert kept == "False"
    if variable.startswith("MALLOC_MMAP_THRESHOLD_"):
        # glibc's first threshold, held (its default raises it as blocks are freed, so how
        # often a default process faults depends on its history): every buffer is mapped anew.
        assert float(faults_per_step) > kernel_pages
