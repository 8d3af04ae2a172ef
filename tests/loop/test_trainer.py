"""Training itself: a hand-written reference, devices, state collections, rngs,
compilations and host syncs."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import flaxhooks
from flaxhooks import Callback
from flaxhooks.step import OPTIMIZER_METRICS
from tests.helpers import (
    MLP,
    BatchNormNet,
    HostReads,
    cross_entropy,
    make_arrays,
    make_batches,
    sgd_trainer,
    tree_allclose,
)


def reference_params(model, params, batches, steps):
    """A hand-written single-device jit loop over the same global batches."""
    tx = optax.sgd(0.1, 0.9)
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state, batch):
        grads = jax.grad(lambda p: cross_entropy(model.apply({"params": p}, batch["image"]), batch))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    for i in range(steps):
        params, opt_state = step(params, opt_state, batches[i % len(batches)])
    return params


def test_matches_a_hand_written_loop_on_1_and_8_devices(devices):
    batches = make_batches(4, batch_size=16)
    trainer = sgd_trainer(devices=devices)
    initial = trainer.init(batches[0])
    state = trainer.fit(batches, epochs=3, state=initial)
    assert int(state.step) == 12
    expected = reference_params(MLP(), initial.params, batches, 12)
    assert tree_allclose(state.params, expected, rtol=1e-4, atol=1e-5)


def test_8_devices_give_the_parameters_of_1_device():
    if len(jax.local_devices()) < 8:
        pytest.skip("needs 8 devices")
    batches = make_batches(3, batch_size=32)
    one = sgd_trainer(devices=jax.local_devices()[:1]).fit(batches, epochs=2)
    eight = sgd_trainer(devices=jax.local_devices()[:8]).fit(batches, epochs=2)
    assert tree_allclose(one.params, eight.params, rtol=1e-4, atol=1e-5)
    assert tree_allclose(one.opt_state, eight.opt_state, rtol=1e-4, atol=1e-5)


def test_batch_norm_statistics_are_carried_and_kept_in_sync(devices):
    batches = make_batches(3, batch_size=16)
    state = sgd_trainer(BatchNormNet(), devices=devices).fit(batches, epochs=2)
    assert set(state.model_state) == {"batch_stats"}
    for leaf in jax.tree.leaves(state.model_state):  # one value, whole on every device
        assert leaf.sharding.is_fully_replicated
        for shard in leaf.addressable_shards:
            np.testing.assert_array_equal(shard.data, leaf.addressable_shards[0].data)
    # The running mean moved away from its initial zeros, towards the data.
    mean = state.model_state["batch_stats"]["BatchNorm_0"]["mean"]
    assert np.abs(np.asarray(mean)).max() > 1e-3


def test_batch_norm_over_the_device_axis_matches_one_device():
    if len(jax.local_devices()) < 8:
        pytest.skip("needs 8 devices")
    batches = make_batches(2, batch_size=32)
    one = sgd_trainer(BatchNormNet(), devices=jax.local_devices()[:1]).fit(batches, epochs=2)
    eight = sgd_trainer(BatchNormNet(), devices=jax.local_devices()[:8]).fit(batches, epochs=2)
    assert tree_allclose(one.params, eight.params, rtol=1e-4, atol=1e-5)
    assert tree_allclose(one.model_state, eight.model_state, rtol=1e-4, atol=1e-5)


def test_batch_norm_matches_a_hand_written_loop():
    model = BatchNormNet(axis_name=None)
    batches = make_batches(3, batch_size=16)
    tx = optax.sgd(0.1, 0.9)
    trainer = sgd_trainer(model, devices=jax.local_devices()[:1])
    initial = trainer.init(batches[0])
    params, batch_stats = initial.params, initial.model_state["batch_stats"]
    opt_state = tx.init(params)

    @jax.jit
    def step(params, batch_stats, opt_state, batch):
        def loss(p):
            logits, new = model.apply({"params": p, "batch_stats": batch_stats}, batch["image"], train=True,
                                      mutable=["batch_stats"])
            return cross_entropy(logits, batch), new["batch_stats"]
        grads, batch_stats = jax.grad(loss, has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), batch_stats, opt_state

    for i in range(6):
        params, batch_stats, opt_state = step(params, batch_stats, opt_state, batches[i % 3])
    state = trainer.fit(batches, epochs=2, state=initial)
    assert tree_allclose(state.params, params, rtol=1e-4, atol=1e-5)
    assert tree_allclose(state.model_state["batch_stats"], batch_stats, rtol=1e-4, atol=1e-5)


class DropoutProbe(nn.Module):
    """Applies dropout to ones; the mask shows which keys and mode were used."""

    @nn.compact
    def __call__(self, x, train: bool):
        scale = self.param("scale", nn.initializers.ones, ())
        return scale * nn.Dropout(0.5, deterministic=not train)(jnp.ones_like(x))


def test_dropout_draws_a_different_mask_per_step_and_per_example_over_the_devices():
    devices = jax.local_devices()[:8]
    if len(devices) < 2:
        pytest.skip("needs several devices")

    def loss_fn(outputs, batch):
        kept = (outputs != 0).astype(jnp.float32)
        # The batch is whole in the step: each device's share is a block of rows.
        blocks = kept.reshape(len(devices), -1)
        same_as_all = jnp.all(blocks == blocks[0])
        fingerprint = jnp.sum(kept * jnp.arange(kept.size).reshape(kept.shape))
        return jnp.mean(outputs), {"kept": kept.mean(), "same": same_as_all.astype(jnp.float32),
                                   "fingerprint": fingerprint}

    class Collect(Callback):
        def __init__(self):
            self.metrics = []

        def on_step_end(self, loop):
            self.metrics.append(loop.host_metrics())

    collect = Collect()
    trainer = flaxhooks.Trainer(DropoutProbe(), optax.sgd(0.0), loss_fn, devices=devices, callbacks=[collect])
    batches = [{"image": np.zeros((8 * len(devices), 32), np.float32)}] * 4
    trainer.fit(batches, epochs=1)
    kept = [m["kept"] for m in collect.metrics]
    assert all(0.3 < k < 0.7 for k in kept)  # train=True reached the model
    assert all(m["same"] == 0.0 for m in collect.metrics)  # devices differ
    assert len({m["fingerprint"] for m in collect.metrics}) == 4  # steps differ


def test_train_flag_is_false_at_init_and_true_in_the_step():
    seen = []

    class Spy(nn.Module):
        @nn.compact
        def __call__(self, x, train: bool):
            seen.append(train)
            return nn.Dense(3)(x)

    sgd_trainer(Spy()).fit(make_batches(2), epochs=1)
    assert False in seen and seen[-1] is True


def test_models_without_a_train_flag_are_called_without_one():
    state = sgd_trainer(MLP()).fit(make_batches(2), epochs=1)
    assert int(state.step) == 2


def test_sown_and_perturbation_collections_never_reach_the_optimizer():
    class Instrumented(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = nn.Dense(4)(x)
            self.sow("activations", "hidden", h)
            h = self.perturb("hidden", h)
            return nn.Dense(3)(h)

    trainer = sgd_trainer(Instrumented())
    state = trainer.fit(make_batches(3), epochs=2)
    assert set(state.model_state) == set()
    assert set(jax.tree_util.tree_map(lambda x: 0, state.params)) == {"Dense_0", "Dense_1"}
    momentum = state.opt_state[0].trace
    assert jax.tree.structure(momentum) == jax.tree.structure(state.params)
    assert trainer.runner.traces["train_step"] == 1


def test_the_step_compiles_once_over_a_multi_epoch_run():
    compiles = []

    class NoteCompiles(Callback):
        def __init__(self):
            self.step = None

        def on_step_start(self, loop):
            self.step = loop.step

        def on_fit_end(self, loop):
            self.step = "after fit"  # returning the state takes device 0's copy

    note = NoteCompiles()

    def listener(name, duration, **kwargs):
        if name == "/jax/core/compile/backend_compile_duration":
            compiles.append(note.step)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        trainer = sgd_trainer(BatchNormNet(), callbacks=[note])
        trainer.fit(make_batches(4), epochs=3)
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert trainer.runner.traces == {"train_step": 1}
    # Everything compiled before the second step; nothing during the loop after.
    assert compiles and all(step in (None, 0, "after fit") for step in compiles)
    assert 0 in compiles


def test_callbacks_that_are_not_due_cause_no_host_sync(monkeypatch):
    reads = HostReads(monkeypatch)
    log = flaxhooks.ConsoleLog(flaxhooks.Every(steps=1000))
    # Guard the counter itself: a due logger is seen reading.
    state = sgd_trainer(callbacks=[reads, flaxhooks.ConsoleLog(flaxhooks.Every(steps=2))]).fit(
        make_batches(4), epochs=1)
    assert reads.count >= 2
    reads.count = 0
    # The guard off: its own reads, two settled scalars a step, are counted in tests/loop/test_guard.py.
    state = sgd_trainer(callbacks=[reads, log], if_nonfinite="off").fit(make_batches(4), epochs=3)
    assert int(state.step) == 12
    # Only the epoch-end summary lines read metrics: three epochs, three reads
    # of each metric array (the loss and the optimizer's).
    assert reads.count == 3 * (1 + len(OPTIMIZER_METRICS))


def test_a_due_callback_reads_the_latest_metrics(capsys):
    class Keep(Callback):
        order = 200

        def __init__(self):
            self.losses = {}

        def on_step_end(self, loop):
            self.losses[loop.step] = loop.host_metrics()["loss"]

    keep = Keep()
    trainer = sgd_trainer(callbacks=[flaxhooks.ConsoleLog(flaxhooks.Every(steps=2)), keep])
    trainer.fit(make_batches(4), epochs=1)
    printed = capsys.readouterr().out.splitlines()
    lines = [line for line in printed if line.startswith("step")]
    assert [line.split()[1] for line in lines] == ["2", "4"]
    for line in lines:
        step = int(line.split()[1])
        logged = float(line.split("loss ")[1].split()[0])
        assert logged == pytest.approx(keep.losses[step], rel=1e-3)
    assert printed[-1].startswith(f"epoch 1 done at step 4: last batch loss {keep.losses[4]:.4g}  ")
    trainer.fit(make_batches(4), steps=5)  # a step limit inside epoch 2: that epoch is not done
    last = capsys.readouterr().out.splitlines()[-1]
    assert last.startswith(f"epoch 2 stopped at step 5: last batch loss {keep.losses[5]:.4g}  ")


def test_fit_continues_from_the_last_state_and_by_total_steps():
    batches = make_batches(4)
    trainer = sgd_trainer()
    first = trainer.fit(batches, steps=3)
    second = trainer.fit(batches, steps=10)
    assert (int(first.step), int(second.step)) == (3, 10)
    assert int(trainer.state.step) == 10


def test_a_one_shot_iterator_ends_training_when_exhausted():
    state = sgd_trainer().fit(iter(make_batches(5)), steps=100)
    assert int(state.step) == 5


def test_a_callable_gets_the_epoch_index():
    asked = []

    def data(epoch):
        asked.append(epoch)
        return make_batches(2, seed=epoch)

    sgd_trainer().fit(data, epochs=3)
    assert asked == [0, 1, 2]


def test_loss_must_be_scalar():
    def vector_loss(logits, batch):
        return jnp.mean(logits, axis=0)

    trainer = flaxhooks.Trainer(MLP(), optax.sgd(0.1), vector_loss)
    with pytest.raises(ValueError, match="scalar"):
        trainer.fit(make_batches(2), epochs=1)
    assert trainer.runner.traces["train_step"] == 0


def test_fit_needs_a_length():
    with pytest.raises(ValueError, match="epochs, steps or both"):
        sgd_trainer().fit(make_batches(2))


@pytest.mark.parametrize("kind", ["loader", "list"])
def test_a_run_continued_in_several_fits_equals_one_run(kind):
    arrays = make_arrays(96)
    data = (flaxhooks.ArrayLoader(arrays, 16, seed=3) if kind == "loader"
            else make_batches(6, batch_size=16))
    whole = sgd_trainer()
    initial = whole.init(next(iter(data(0) if callable(data) else data)))
    expected = whole.fit(data, steps=14, state=initial)  # 2 epochs and 2 batches

    parts = sgd_trainer()
    parts.fit(data, steps=4, state=initial)
    parts.fit(data, steps=9)          # continues mid-epoch 0, into epoch 1
    got = parts.fit(data, steps=14)
    assert int(got.step) == 14
    assert tree_allclose(got.params, expected.params, rtol=1e-5, atol=1e-6)

    # A given state resumes at its own position too.
    halfway = sgd_trainer().fit(data, steps=7, state=initial)
    resumed = sgd_trainer().fit(data, steps=14, state=halfway)
    assert tree_allclose(resumed.params, expected.params, rtol=1e-5, atol=1e-6)


def test_a_resumed_fit_asks_for_the_right_epochs():
    asked = []
    loader = flaxhooks.ArrayLoader(make_arrays(64), 16)

    def data(epoch):
        asked.append(epoch)
        return loader(epoch)

    class Sized:
        def __len__(self):
            return len(loader)

        def __call__(self, epoch):
            return data(epoch)

    trainer = sgd_trainer()
    trainer.fit(Sized(), epochs=2)
    asked.clear()
    trainer.fit(Sized(), epochs=4)
    assert asked == [2, 3]


def test_a_one_shot_iterator_loses_no_batch_between_fits():
    batches = make_batches(6)
    initial = sgd_trainer().init(batches[0])
    expected = sgd_trainer().fit(batches, steps=5, state=initial)
    stream = iter(batches)
    trainer = sgd_trainer(pipeline=flaxhooks.DevicePrefetch(size=3))
    trainer.fit(stream, steps=3, state=initial)
    got = trainer.fit(stream, steps=5)
    assert tree_allclose(got.params, expected.params, rtol=1e-5, atol=1e-6)
    assert next(stream) is batches[5]  # read no further than needed


def test_integer_and_bool_metrics_are_computed_on_the_whole_batch_as_floats(devices):
    def loss_fn(logits, batch):
        loss = cross_entropy(logits, batch)
        return loss, {"examples": batch["label"].shape[0], "positive": jnp.all(batch["label"] >= 0)}

    class Keep(Callback):
        def on_step_end(self, loop):
            self.metrics = loop.host_metrics()

    keep = Keep()
    flaxhooks.Trainer(MLP(), optax.sgd(0.1), loss_fn, devices=devices, callbacks=[keep]).fit(
        make_batches(1, batch_size=16), steps=1)
    # The step sees the whole batch, however many devices it is split over.
    assert keep.metrics["examples"] == 16
    assert keep.metrics["positive"] == 1.0


def test_callbacks_due_at_the_same_step_share_one_transfer(monkeypatch):
    reads = HostReads(monkeypatch)

    class ReadEveryStep(Callback):
        def on_step_end(self, loop):
            loop.host_metrics()

    sgd_trainer(callbacks=[reads, ReadEveryStep(), ReadEveryStep()], if_nonfinite="off").fit(
        make_batches(4), epochs=1)
    assert reads.count == 4 * (1 + len(OPTIMIZER_METRICS))  # each metric array per step, read once


def test_settled_metrics_are_from_a_finished_older_step():
    seen = []

    class Watch(Callback):
        def on_step_end(self, loop):
            if loop.settled_step is not None:
                seen.append((loop.step, loop.settled_step, loop.settled_metrics["loss"].is_ready()))

    sgd_trainer(callbacks=[Watch()], max_steps_in_flight=2).fit(make_batches(5), epochs=1)
    assert [(step, settled) for step, settled, _ in seen] == [(3, 1), (4, 2), (5, 3)]
    assert all(ready for _, _, ready in seen)


def test_state_collections_can_be_chosen():
    class OverwritingSow(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = nn.Dense(4)(x)
            # Keeps only the latest value: same shape each step, so it looks like state.
            self.sow("debug", "hidden", h, reduce_fn=lambda old, new: new, init_fn=lambda: jnp.zeros(()))
            return nn.Dense(3)(h)

    auto = sgd_trainer(OverwritingSow()).fit(make_batches(2), epochs=1)
    assert set(auto.model_state) == {"debug"}
    chosen = sgd_trainer(flaxhooks.as_model(OverwritingSow(), state_collections=())).fit(
        make_batches(2), epochs=1)
    assert chosen.model_state == {}
    with pytest.raises(ValueError, match=r"state_collections \['batch_stats'\]"):
        sgd_trainer(flaxhooks.as_model(OverwritingSow(), state_collections=("batch_stats",))).fit(
            make_batches(2), epochs=1)


def test_a_first_batch_the_model_cannot_take_is_a_clear_error_before_compiling():
    class NeedsChannels(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(3)(nn.Conv(4, (3, 3))(x).reshape(x.shape[0], -1))

    trainer = sgd_trainer(NeedsChannels())
    batch = {"image": np.zeros((16, 5), np.float32), "label": np.zeros(16, np.int32)}
    with pytest.raises(flaxhooks.BatchError, match=r"image float32\[16, 5\].*8 devices \(2 examples each\)"
                       if len(jax.local_devices()) == 8 else r"image float32\[16, 5\]"):
        trainer.fit([batch], epochs=1)
    assert trainer.runner.traces["train_step"] == 0


def test_the_model_options_0_7_gave_the_trainer_still_work_with_a_warning_naming_as_model():
    batch = {"x": np.ones((16, 5), np.float32), "label": np.zeros(16, np.int32)}
    with pytest.warns(DeprecationWarning, match=r"as_model\(model, input_keys=..., rng_names=...\)"):
        old = sgd_trainer(nn.Dense(3), input_keys=("x",), rng_names=())
    new = sgd_trainer(flaxhooks.as_model(nn.Dense(3), input_keys=("x",), rng_names=()))
    options = [(trainer.model.input_keys, trainer.model.rng_names) for trainer in (old, new)]
    assert options == [(("x",), ()), (("x",), ())]
    assert tree_allclose(old.fit([batch], epochs=1).params, new.fit([batch], epochs=1).params, rtol=0)
    with pytest.raises(ValueError, match="carries its own options"):
        sgd_trainer(new.model, input_keys=("x",))
    with pytest.raises(TypeError, match="unexpected keyword argument 'input_key'"):
        sgd_trainer(nn.Dense(3), input_key=("x",))
