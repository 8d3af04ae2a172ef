"""Exact full-dataset evaluation, metrics on the bus, early stopping."""

import os
import subprocess
import sys
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from clu import metrics as clu_metrics

import flaxhooks
from flaxhooks import BatchError, Callback, EarlyStopping, EmptyDataError, EvalResult, Evaluate, Every
from tests.helpers import (
    MLP,
    BatchNormNet,
    Recorder,
    cross_entropy,
    make_arrays,
    make_batches,
    sgd_trainer,
    split_batches,
)

ROOT = Path(__file__).resolve().parents[2]


def numpy_loss_accuracy(logits, labels):
    """Mean cross-entropy and accuracy in float64: the independent reference."""
    logits = np.asarray(logits, np.float64)
    shifted = logits - logits.max(-1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    return -log_probs[np.arange(len(labels)), labels].mean(), (logits.argmax(-1) == labels).mean()


@pytest.fixture(scope="module")
def trained():
    trainer = sgd_trainer()
    state = trainer.fit(make_batches(4), epochs=1)
    return trainer, state


@pytest.mark.parametrize("batch_size", [96, 1000, 333, 10001])
def test_every_one_of_10001_examples_counts_exactly_once(trained, batch_size):
    trainer, state = trained
    test = make_arrays(10001, seed=5)
    result = trainer.evaluate(test, batch_size=batch_size)
    logits = MLP().apply({"params": state.params}, test["image"])
    loss, accuracy = numpy_loss_accuracy(logits, test["label"])
    assert result.examples == 10001
    assert result.metrics["accuracy"] == pytest.approx(accuracy, abs=1e-12)
    assert result.metrics["loss"] == pytest.approx(loss, rel=1e-5)
    assert len(jax.local_devices()) == 8  # the 8 fake devices of conftest


def test_exact_on_three_devices_in_a_fresh_process():
    code = (
        "import flaxhooks, jax, numpy as np\n"
        "from tests.helpers import MLP, make_arrays, make_batches, sgd_trainer\n"
        "from tests.eval.test_eval import numpy_loss_accuracy\n"
        "trainer = sgd_trainer(); state = trainer.fit(make_batches(2, batch_size=24), epochs=1)\n"
        "test = make_arrays(10001, seed=5)\n"
        "r = trainer.evaluate(test, batch_size=100)\n"
        "logits = MLP().apply({'params': state.params}, test['image'])\n"
        "loss, acc = numpy_loss_accuracy(logits, test['label'])\n"
        "assert r.examples == 10001 and abs(r.metrics['accuracy'] - acc) < 1e-12, (r, acc)\n"
        "assert abs(r.metrics['loss'] - loss) < 1e-5 * loss, (r, loss)\n"
        "print(len(jax.devices()), 'devices ok')\n"
    )
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=3"}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "3 devices ok" in out.stdout


def test_one_compilation_per_eval_batch_size_over_a_run(compiles):
    test = make_arrays(100, seed=1)  # 100 = 3 batches of 32 and a ragged 4

    class NoteSteps(Callback):
        def __init__(self):
            self.step = None

        def on_step_start(self, loop):
            self.step = loop.step

    note = NoteSteps()
    trainer = sgd_trainer(callbacks=[note, Evaluate(test, every=Every(steps=2), batch_size=32)])
    trainer.fit(make_batches(4), epochs=3)
    assert trainer.runner.traces == {"train_step": 1} and trainer.evaluations.traces == 1
    compiles.clear()
    trainer.evaluate(test, batch_size=32)  # the ragged last batch reused the compiled step
    assert compiles == []
    trainer.evaluate(test, batch_size=50)  # a second batch size: one more
    assert trainer.evaluations.traces == 2
    trainer.evaluate(test, batch_size=50)
    assert trainer.evaluations.traces == 2


def test_iterable_batches_of_any_size_give_the_arrays_result(trained):
    trainer, _ = trained
    test = make_arrays(203, seed=2)
    batches = split_batches(test, [64, 64, 40, 35])
    before = trainer.evaluations.traces
    from_batches = trainer.evaluate(batches)
    from_arrays = trainer.evaluate(test, batch_size=64)
    assert from_batches.examples == from_arrays.examples == 203
    assert from_batches.metrics == pytest.approx(from_arrays.metrics, rel=1e-6)
    assert trainer.evaluations.traces - before <= 1  # every batch fits the first's shape


def test_user_metrics_are_masked_like_the_defaults(trained):
    trainer, _ = trained
    test = make_arrays(1001, seed=3)
    test["label"] = (test["label"] + 1).astype(np.int32) % 3
    metrics = {
        "mean_label": clu_metrics.Average.from_fun(lambda labels, **_: labels.astype(jnp.float32)),
        # (clu's Std calls jnp.clip(a_min=...), which this jax no longer takes.)
        "label_square": clu_metrics.Average.from_fun(lambda labels, **_: (labels**2).astype(jnp.float32)),
    }
    result = trainer.evaluate(test, batch_size=96, metrics=metrics)
    assert result.metrics["mean_label"] == pytest.approx(test["label"].mean(), rel=1e-6)
    assert result.metrics["label_square"] == pytest.approx((test["label"] ** 2).mean(), rel=1e-6)
    accuracy_only = trainer.evaluate(test, batch_size=96, metrics=clu_metrics.Accuracy)
    assert set(accuracy_only.metrics) == {"accuracy"}


def test_evaluation_is_in_inference_mode_and_leaves_the_state_alone():
    model = BatchNormNet(axis_name=None)
    trainer = sgd_trainer(model)
    state = trainer.fit(make_batches(3), epochs=2)
    test = make_arrays(77, seed=4)
    result = trainer.evaluate(test, batch_size=16)
    # By hand: running statistics, no batch statistics.
    logits = model.apply(state.variables, test["image"], train=False)
    loss, accuracy = numpy_loss_accuracy(logits, test["label"])
    assert result.metrics["loss"] == pytest.approx(loss, rel=1e-5)
    assert result.metrics["accuracy"] == pytest.approx(accuracy, abs=1e-12)
    after = trainer.state
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(after), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_dropout_is_off_in_evaluation():
    class Dropped(nn.Module):
        @nn.compact
        def __call__(self, x, train: bool):
            return nn.Dropout(0.5, deterministic=not train)(nn.Dense(3)(x)) * 0 + jnp.ones((x.shape[0], 3))

    trainer = sgd_trainer(Dropped())
    trainer.fit(make_batches(1), steps=1)
    metrics = {"ones": clu_metrics.Average.from_fun(lambda logits, **_: logits.mean(-1))}
    assert trainer.evaluate(make_arrays(50), batch_size=16, metrics=metrics).metrics["ones"] == 1.0


def test_bad_evaluation_data_fails_before_compiling(trained, compiles):
    trainer, _ = trained
    before = trainer.evaluations.traces
    good = make_arrays(50)
    with pytest.raises(EmptyDataError):
        trainer.evaluate({k: v[:0] for k, v in good.items()}, batch_size=8)
    with pytest.raises(EmptyDataError):
        trainer.evaluate([])
    with pytest.raises(BatchError, match="different lengths"):
        trainer.evaluate({**good, "label": good["label"][:49]}, batch_size=8)
    bad_labels = {**good, "label": good["label"].copy()}
    bad_labels["label"][-1] = 3  # in the ragged last batch
    with pytest.raises(BatchError, match=r"range over \[0, 3\] but the model has 3 outputs"):
        trainer.evaluate(bad_labels, batch_size=8)
    with pytest.raises(BatchError, match="batch size must be positive"):
        trainer.evaluate(good, batch_size=0)
    with pytest.raises(BatchError, match="cannot be called in eval mode on batches of image float32"):
        trainer.evaluate({"image": np.zeros((8, 4), np.float32), "label": np.zeros(8, np.int32)})
    assert compiles == [] and trainer.evaluations.traces == before


def test_results_ride_the_eval_end_event():
    test = make_arrays(40, seed=6)
    payloads = []

    class Consume(Callback):
        def on_eval_end(self, loop):
            payloads.append(loop.payload)

    rec = Recorder(order=100)
    evaluate = Evaluate(test, every=Every(steps=2), batch_size=16)
    trainer = sgd_trainer(callbacks=[evaluate, Consume(), rec])
    trainer.fit(make_batches(2), epochs=2)
    events = [(event, step) for _, event, step in rec.log if event != "step_start"]
    assert events == [
        ("fit_start", 0), ("epoch_start", 0), ("step_end", 1),
        ("loss_read", 2), ("loss_read", 2), ("eval_start", 2), ("eval_end", 2), ("step_end", 2),
        ("epoch_end", 2), ("epoch_start", 2), ("step_end", 3),
        ("loss_read", 4), ("loss_read", 4), ("eval_start", 4), ("eval_end", 4), ("step_end", 4),
        ("epoch_end", 4),
        ("fit_end", 4),
    ]  # due twice at steps 2 and 4 (every 2, epoch end): evaluated once
    assert [(p.name, p.step, p.examples) for p in payloads] == [("eval", 2, 40), ("eval", 4, 40)]
    assert isinstance(payloads[-1], EvalResult) and evaluate.result is payloads[-1]


def test_evaluate_needs_a_state():
    with pytest.raises(ValueError, match="call fit first"):
        sgd_trainer().evaluate(make_arrays(10), batch_size=4)
    trainer = sgd_trainer()
    state = trainer.init(make_batches(1)[0])
    assert trainer.evaluate(make_arrays(10), batch_size=4, state=state).step == 0


def test_a_trainer_on_some_devices_evaluates_on_those_devices_exactly():
    devices = jax.local_devices()[:2]
    if len(jax.local_devices()) < 4:
        pytest.skip("needs devices left out")
    trainer = sgd_trainer(devices=devices)
    state = trainer.fit(make_batches(1), steps=1)
    result = trainer.evaluate(make_arrays(11), batch_size=4)  # ragged: padded to the 2 devices, masked
    assert result.examples == 11
    assert {d for leaf in jax.tree.leaves(state) for d in leaf.sharding.device_set} == set(devices)


class ScriptedEval(Callback):
    """An evaluation of its own: emits eval_end with scripted metrics at every step."""

    order = -60

    def __init__(self, values, name="eval"):
        self.values, self.name = list(values), name

    def on_step_end(self, loop):
        value = self.values.pop(0)
        result = EvalResult(self.name, {"loss": value, "accuracy": -value}, loop.step, 1)
        loop.emit(flaxhooks.Event.EVAL_END, result)


@pytest.mark.parametrize(
    "kwargs, values, stops_at",
    [
        (dict(patience=2), [3, 2, 2.5, 2.1, 1.0], 4),
        (dict(patience=2, min_delta=0.5), [3, 2, 1.8, 1.6, 1.0], 4),
        (dict(patience=1, monitor="accuracy", mode="max"), [3, 2, 2.5, 1.0, 1.0], 3),
        (dict(patience=3), [3, 2, 1, 0.5, 0.4], None),
    ],
    ids=["patience", "min_delta", "max", "keeps-improving"],
)
def test_early_stopping_stops_through_the_normal_path(kwargs, values, stops_at):
    rec = Recorder(order=100)
    stopper = EarlyStopping(**kwargs)
    trainer = sgd_trainer(callbacks=[ScriptedEval(values), stopper, rec])
    state = trainer.fit(make_batches(5), epochs=1)
    assert int(state.step) == (stops_at or 5)
    assert [e for _, e, _ in rec.log][-2:] == ["epoch_end", "fit_end"]


def test_early_stopping_ignores_other_evaluations_and_checks_its_metric():
    stopper = EarlyStopping(patience=1, source="eval")
    state = sgd_trainer(callbacks=[ScriptedEval([1, 2, 3, 4], name="train_eval"), stopper]).fit(
        make_batches(4), epochs=1)
    assert int(state.step) == 4 and stopper.best is None
    with pytest.raises(flaxhooks.CallbackError, match="monitors 'f1'"):
        sgd_trainer(callbacks=[ScriptedEval([1]), EarlyStopping("f1")]).fit(make_batches(1), epochs=1)


def test_early_stopping_with_real_evaluations():
    test = make_arrays(64, seed=7)
    trainer = flaxhooks.Trainer(
        MLP(), optax.sgd(0.0), lambda logits, batch: optax.losses.softmax_cross_entropy_with_integer_labels(
            logits, batch["label"]).mean(),
        callbacks=[Evaluate(test, every=Every(steps=1), at_epoch_end=False, batch_size=32),
                   EarlyStopping("loss", patience=2)],
    )
    state = trainer.fit(make_batches(10), epochs=1)
    assert int(state.step) == 3  # a learning rate of 0 never improves: stop after 1 + 2 evaluations


def test_dict_metrics_compile_once_across_evaluations():
    test = make_arrays(50, seed=8)
    metrics = {"accuracy": clu_metrics.Accuracy, "loss": clu_metrics.Average.from_output("loss")}
    evaluate = Evaluate(test, every=Every(steps=1), at_epoch_end=False, batch_size=16, metrics=metrics)
    trainer = sgd_trainer(callbacks=[evaluate])
    trainer.fit(make_batches(3), epochs=1)
    trainer.evaluate(test, batch_size=16, metrics=dict(metrics))
    trainer.evaluate(test, batch_size=16, metrics=clu_metrics.Accuracy)
    trainer.evaluate(test, batch_size=16, metrics=clu_metrics.Accuracy)
    assert trainer.evaluations.traces == 2  # the dict, then Accuracy alone


def test_batch_keys_named_like_metric_inputs_stay_reachable(trained):
    trainer, _ = trained
    test = {**make_arrays(40, seed=9), "mask": np.ones(40, np.float32) * 2, "loss": np.zeros(40, np.float32)}
    metrics = {
        "loss": clu_metrics.Average.from_output("loss"),
        "batch_mask": clu_metrics.Average.from_fun(lambda batch, **_: batch["mask"]),
    }
    result = trainer.evaluate(test, batch_size=16, metrics=metrics)
    assert result.metrics["batch_mask"] == 2.0  # padded rows masked out, the batch's own mask intact
    assert result.metrics["loss"] > 0  # the per-example loss, not the batch's "loss" key


def test_regression_and_binary_models_are_not_label_checked():
    class Regress(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(3)(x)

    def mse(outputs, batch):
        return jnp.mean((outputs - batch["label"]) ** 2)

    data = make_arrays(40)
    data["label"] = np.random.default_rng(0).normal(size=(40, 3)).astype(np.float32) * 10
    trainer = flaxhooks.Trainer(Regress(), optax.sgd(0.01), mse)
    state = trainer.fit([{k: v[:16] for k, v in data.items()}], steps=1)
    result = trainer.evaluate(data, batch_size=16, metrics={"mse": clu_metrics.Average.from_output("loss")})
    predictions = np.asarray(Regress().apply({"params": state.params}, data["image"]))
    expected = np.mean((predictions - data["label"]) ** 2)
    assert result.metrics["mse"] == pytest.approx(expected, rel=1e-5)


def test_without_a_label_key_the_default_is_the_loss_alone():
    trainer = sgd_trainer(label_key=None)
    trainer.fit(make_batches(1), steps=1)
    assert set(trainer.evaluate(make_arrays(20), batch_size=8).metrics) == {"loss"}


def test_iterable_eval_data_with_a_small_first_batch(trained):
    trainer, state = trained
    test = make_arrays(150, seed=10)
    batches = split_batches(test, [8, 64, 64, 14])
    result = trainer.evaluate(batches)
    loss, accuracy = numpy_loss_accuracy(MLP().apply({"params": state.params}, test["image"]), test["label"])
    assert result.examples == 150
    assert result.metrics["loss"] == pytest.approx(loss, rel=1e-5)
    assert result.metrics["accuracy"] == pytest.approx(accuracy, abs=1e-12)


def test_early_stopping_survives_a_nan_first_evaluation():
    stopper = EarlyStopping(patience=2)
    state = sgd_trainer(callbacks=[ScriptedEval([float("nan"), float("nan"), 1.0]), stopper]).fit(
        make_batches(3), epochs=1)
    assert int(state.step) == 2 and stopper.best is None


def test_a_second_fit_evaluates_again_at_a_step_seen_before():
    test = make_arrays(20)
    evaluate = Evaluate(test, at_epoch_end=True, batch_size=8)
    trainer = sgd_trainer(callbacks=[evaluate])
    initial = trainer.init(make_batches(1)[0])
    trainer.fit(make_batches(2), epochs=1, state=initial)
    first = evaluate.result
    trainer.fit(make_batches(2, seed=1), epochs=1, state=initial)  # step 2 again, other data
    assert evaluate.result is not first and evaluate.result.step == 2


# -- problems found before training, and models that sample at inference ------------


class SamplesWhenEvaluating(nn.Module):
    """Adds noise from the ``sample`` stream in eval mode only (as a decoder that samples)."""

    @nn.compact
    def __call__(self, x, train: bool):
        logits = nn.Dense(3)(x)
        if not train:
            logits = logits + jax.random.normal(self.make_rng("sample"), logits.shape)
        return logits


def _refused_before_the_fit(trainer, evaluate, error_type, data=None):
    """The fit is refused with ``error_type`` itself, before any event and before anything compiles."""
    events = Recorder()
    with pytest.raises(error_type) as raised:
        trainer.add(evaluate, events).fit(data or make_batches(4), epochs=1)
    assert events.log == []
    assert not trainer.runner.traces and trainer.evaluations.traces == 0  # nothing compiled
    return str(raised.value)


EMPTY = {"image": np.zeros((0, 5), np.float32), "label": np.zeros(0, np.int32)}


@pytest.mark.parametrize("data", [EMPTY, []], ids=["arrays", "iterable"])
def test_an_empty_eval_set_fails_before_the_train_step_compiles(data):
    evaluate = Evaluate(data, batch_size=8, name="test")
    message = _refused_before_the_fit(sgd_trainer(), evaluate, EmptyDataError)
    assert message.startswith("evaluation 'test': ")


def test_an_eval_mode_call_that_fails_names_the_cause_before_training():
    test = Evaluate(make_arrays(16), batch_size=8)
    missing_stream = _refused_before_the_fit(sgd_trainer(SamplesWhenEvaluating()), test, BatchError)
    assert "cannot be called in eval mode" in missing_stream and '"sample"' in missing_stream
    assert "flaxhooks.as_model(model, rng_names=...)" in missing_stream and "metrics" not in missing_stream
    pixels = Evaluate({"pixels": np.zeros((8, 5), np.float32)}, batch_size=8)
    missing_key = _refused_before_the_fit(sgd_trainer(), pixels, BatchError)
    assert "the batch has no key 'image', the model's input by default (input_keys=('image',)); its keys " \
        "are ['pixels']: give the Trainer flaxhooks.as_model(model, input_keys=('pixels',))" in missing_key
    auc = Evaluate(make_arrays(16), batch_size=8, metrics={"auc": clu_metrics.Average.from_output("auc")})
    wrong_metrics = _refused_before_the_fit(sgd_trainer(), auc, BatchError)
    assert "the loss or metrics cannot be computed from the model's outputs" in wrong_metrics
    assert "auc" in wrong_metrics


def test_labels_under_another_key_name_label_key_and_its_default():
    def under_y(batch):
        return {"image": batch["image"], "y": batch["label"]}

    def loss_fn(logits, batch):  # the user's loss reads the labels under their own key
        return cross_entropy(logits, {"label": batch["y"]})

    def trainer(**kwargs):
        return flaxhooks.Trainer(MLP(), optax.sgd(0.1), loss_fn, **kwargs)

    test, train = under_y(make_arrays(16)), [under_y(batch) for batch in make_batches(2)]
    message = _refused_before_the_fit(trainer(), Evaluate(test, batch_size=8), BatchError, train)
    assert message == (
        "evaluation 'eval': the metrics read class labels under label_key='label' (the default), which the "
        "batch lacks (its keys: ['image', 'y']): pass Trainer(label_key='y') to name them, or label_key=None "
        "to evaluate the loss alone")
    # Either fix it names works.
    for label_key, metrics in (("y", {"accuracy", "loss"}), (None, {"loss"})):
        evaluate = Evaluate(test, batch_size=8)
        trainer(label_key=label_key, callbacks=[evaluate]).fit(train, epochs=1)
        assert set(evaluate.result.metrics) == metrics


def test_a_model_that_samples_when_evaluating_gets_fixed_keys():
    trainer = sgd_trainer(flaxhooks.as_model(SamplesWhenEvaluating(), rng_names=("dropout", "sample")))
    state = trainer.fit(make_batches(2), epochs=1)
    test = make_arrays(40)
    first, again = trainer.evaluate(test, batch_size=16), trainer.evaluate(test, batch_size=16)
    assert first.metrics == again.metrics and first.examples == 40
    # The noise is there: the loss differs from a noise-free evaluation of the same parameters.
    logits = test["image"] @ state.params["Dense_0"]["kernel"] + state.params["Dense_0"]["bias"]
    clean = optax.softmax_cross_entropy_with_integer_labels(logits, test["label"]).mean()
    assert abs(first.metrics["loss"] - float(clean)) > 1e-3
