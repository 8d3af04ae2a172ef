"""The non-finite guard every Trainer has: it stops at the first NaN loss or
gradient, keeps the state from before it, and names the call that made it by
replaying that step instrumented."""

from __future__ import annotations

import logging
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import flaxhooks
from tests.helpers import (
    Diverging,
    HostReads,
    Recorder,
    SquareRoot,
    cross_entropy,
    make_arrays,
    make_batches,
    sgd_trainer,
    tree_allclose,
)


class SetupDiverging(nn.Module):
    """Defines its layers in setup(); NaN from the first batch holding a NaN on."""

    def setup(self):
        self.encoder = nn.Dense(4)
        self.root = SquareRoot()
        self.head = nn.Dense(3)

    def __call__(self, x):
        return self.head(self.root(jnp.abs(self.encoder(x))))


class Findings(flaxhooks.Callback):
    def __init__(self):
        self.seen = []

    def on_finding(self, loop):
        self.seen.append(loop.payload)


def test_every_trainer_has_a_guard_that_names_the_call_and_keeps_the_state_before_it(caplog):
    findings = Findings()
    trainer = sgd_trainer(Diverging(), callbacks=[findings])
    assert isinstance(trainer.callbacks[0], flaxhooks.NonFiniteGuard)
    with caplog.at_level(logging.ERROR, logger="flaxhooks"), pytest.raises(flaxhooks.NonFiniteError) as error:
        trainer.fit(make_batches(10, batch_size=8), epochs=3)
    assert error.value.step == 1
    message = str(error.value)
    assert message.startswith("the loss is nan at step 1: the first call, in execution order, whose output "
                              "went non-finite is 'root' (a SquareRoot) (found by replaying step 1 "
                              "instrumented, in")
    # Said in full once, by the error; the log line in a few words.
    assert [r.getMessage() for r in caplog.records] == [
        "the loss is nan at step 1; first non-finite: the output of 'root' (a SquareRoot): training stops, "
        "and fit raises NonFiniteError saying how and what to try"]
    assert int(trainer.state.step) == 0  # the state from before the step: nothing after it was applied
    assert [(f.kind, f.layer, f.step) for f in findings.seen] == [("nonfinite", "root", 1)]


def test_a_nan_on_any_step_is_named_by_a_replay_and_nothing_evaluates_the_state():
    batches = make_batches(12, batch_size=8)
    batches[4]["image"][0, 0] = np.nan  # step 5 goes non-finite
    evaluate = flaxhooks.Evaluate(make_arrays(16), batch_size=8)
    reference = sgd_trainer(SetupDiverging())
    reference.fit(batches[:4], epochs=1)
    trainer = sgd_trainer(SetupDiverging(), callbacks=[evaluate])
    with pytest.raises(flaxhooks.NonFiniteError) as error:
        trainer.fit(batches, epochs=2)
    assert error.value.step == 5
    # A setup() root: the child whose output went non-finite, not the model itself.
    assert "whose output went non-finite is 'encoder'" in str(error.value)
    assert evaluate.result is None  # the NaN state was never evaluated
    assert int(trainer.state.step) == 4
    assert tree_allclose(trainer.state.params, reference.state.params, rtol=0, atol=0)


class ZeroRoot(nn.Module):
    """``sqrt(0 * x)``: finite forward, NaN gradient (0 times the infinite slope)."""

    @nn.compact
    def __call__(self, x):
        return jnp.sqrt(0.0 * x) + x


class NanGradient(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.Dense(4, name="encoder")(x)
        x = ZeroRoot(name="zero_root")(x)
        return nn.Dense(3, name="head")(x)


def test_a_non_finite_gradient_under_a_finite_loss_is_caught_at_its_step():
    trainer = sgd_trainer(NanGradient())
    with pytest.raises(flaxhooks.NonFiniteError) as error:
        trainer.fit(make_batches(6, batch_size=8), epochs=1)
    message = str(error.value)
    assert error.value.step == 1 and message.startswith("the gradient norm is nan at step 1")
    # The backward pass starts at the loss: the deepest output whose gradient is not finite.
    assert "went non-finite in the backward pass of 'zero_root' (a ZeroRoot): the deepest output with a " \
        "non-finite gradient is 'encoder'" in message
    assert int(trainer.state.step) == 0


class ReadsLosses(flaxhooks.Callback):
    """Takes the losses the guard reads, as Diagnose's loss checks do."""

    def __init__(self):
        self.read, self.at = [], []

    def on_loss_read(self, loop):
        self.read.append(loop.payload)
        self.at.append(loop.step)

    def on_fit_end(self, loop):
        self.requests = loop.requests


def test_warn_trains_on_and_off_watches_nothing_and_says_so_to_readers_of_the_losses(caplog):
    for mode in ("warn", "off"):
        caplog.clear()
        reader = ReadsLosses()
        trainer = sgd_trainer(Diverging(), if_nonfinite=mode, callbacks=[reader])
        with caplog.at_level(logging.WARNING, logger="flaxhooks"):
            trainer.fit(make_batches(6, batch_size=8), epochs=1)
        assert int(trainer.state.step) == 6
        said = [r.getMessage() for r in caplog.records if "training goes on" in r.getMessage()]
        assert len(said) == (1 if mode == "warn" else 0)
        off = [r.getMessage() for r in caplog.records if "reads no step's loss" in r.getMessage()]
        assert reader.read == [] and len(off) == (1 if mode == "off" else 0)  # once, not each step
    with pytest.raises(ValueError, match="if_nonfinite must be one of"):
        sgd_trainer(Diverging(), if_nonfinite="ignore")


def test_a_guard_given_takes_the_place_of_the_default():
    guard = flaxhooks.NonFiniteGuard("stop", replay=False)
    trainer = sgd_trainer(Diverging(), callbacks=[guard])
    assert [cb for cb in trainer.callbacks if isinstance(cb, flaxhooks.NonFiniteGuard)] == [guard]
    with pytest.raises(flaxhooks.NonFiniteError, match="not replayed"):
        trainer.fit(make_batches(6, batch_size=8), epochs=1)


def test_the_guard_changes_no_healthy_step_and_compiles_nothing_more():
    # The same updates as a hand-written loop of plain SGD steps.
    batches = make_batches(5, batch_size=8)
    trainer = sgd_trainer(nn.Dense(3), optimizer_metrics=False)
    trainer.fit(batches, epochs=1)
    model = nn.Dense(3)
    params = trainer.init(batches[0]).params
    tx = optax.sgd(0.1, 0.9)
    opt = tx.init(params)
    for batch in batches:
        grads = jax.grad(lambda p, b=batch: cross_entropy(model.apply({"params": p}, b["image"]), b))(params)
        updates, opt = tx.update(grads, opt, params)
        params = optax.apply_updates(params, updates)
    assert tree_allclose(trainer.state.params, params, rtol=1e-5)
    assert trainer.runner.traces == {"train_step": 1}


def _copies_of_the_state(trainer: flaxhooks.Trainer, batch, norms: bool = True) -> tuple[int, str]:
    """How many of the compiled step's inputs it copies, and its text."""
    trainer.fit([batch], epochs=1)  # the runner as a fit leaves it: with the guard's freeze or not
    state = trainer.init(batch)
    step = trainer.runner.variant((), norms)
    lowered = step.lower(state, trainer.placement.put_batch(batch), trainer.runner.zero_totals(), ())
    text = lowered.compile().as_text()
    entry = text[text.index("\nENTRY "):]
    entry = entry[:entry.index("\n}\n")]
    inputs = set(re.findall(r"%(\S+) = \S+ parameter\(", entry))
    return sum(1 for name in re.findall(r" copy\(%(\S+)\)", entry) if name in inputs), text


def test_the_freeze_is_a_branch_that_copies_no_more_of_the_state_than_a_step_without_it():
    """The guard keeps the state from before a NaN by updating it in a branch taken only while
    every loss was finite: not a `where` over the state, which copied each donated leaf."""
    batch = make_batches(1, batch_size=8)[0]
    guarded, text = _copies_of_the_state(sgd_trainer(nn.Dense(3)), batch)
    unguarded, _ = _copies_of_the_state(sgd_trainer(nn.Dense(3), if_nonfinite="off"), batch)
    assert " conditional(" in text
    assert guarded <= unguarded
    # The optimizer metrics read the parameters before the branch updates them in place: no copy.
    lean, _ = _copies_of_the_state(sgd_trainer(nn.Dense(3)), batch, norms=False)
    assert guarded <= lean


def test_every_steps_loss_and_gradient_norm_reach_loss_read_once_in_order_as_a_hand_loop_computes_them():
    batches = make_batches(7, batch_size=8)
    reader, rec = ReadsLosses(), Recorder(order=10)
    trainer = sgd_trainer(nn.Dense(3), callbacks=[reader, rec])
    trainer.fit(batches, epochs=1)
    model, tx = nn.Dense(3), optax.sgd(0.1, 0.9)
    params = trainer.init(batches[0]).params
    opt = tx.init(params)
    expected = []
    for step, batch in enumerate(batches, 1):
        loss, grads = jax.value_and_grad(
            lambda p, b=batch: cross_entropy(model.apply({"params": p}, b["image"]), b))(params)
        expected.append((step, float(loss), float(optax.tree.norm(grads))))
        updates, opt = tx.update(grads, opt, params)
        params = optax.apply_updates(params, updates)
    assert [r.step for r in reader.read] == [1, 2, 3, 4, 5, 6, 7]
    assert reader.requests == ()  # readings are facts passed on: the requests' log keeps its room
    np.testing.assert_allclose([(r.step, r.loss, r.grad_norm) for r in reader.read], expected, rtol=1e-5)
    # A step is read once it settled: during a later step_end (or the epoch's end),
    # after the guard's own handler and before the other handlers of that event.
    # A step is read once it settled (two in flight: at the step_end of the step two
    # later), the epoch's last ones at its last step_end; before that event's other handlers.
    assert list(zip(reader.at, [r.step for r in reader.read], strict=True)) == [
        (3, 1), (4, 2), (5, 3), (6, 4), (7, 5), (7, 6), (7, 7)]
    assert [(event, step) for _, event, step in rec.log if event in ("loss_read", "step_end")] == [
        ("step_end", 1), ("step_end", 2), ("loss_read", 3), ("step_end", 3),
        ("loss_read", 4), ("step_end", 4),
        ("loss_read", 5), ("step_end", 5), ("loss_read", 6), ("step_end", 6),
        ("loss_read", 7), ("loss_read", 7), ("loss_read", 7), ("step_end", 7)]


def test_the_guard_reads_two_scalars_a_step_each_of_a_finished_step(monkeypatch):
    reads = HostReads(monkeypatch)
    sgd_trainer(callbacks=[reads]).fit(make_batches(10, batch_size=8), epochs=1)
    # The loss and the gradient norm, once the loop has waited for their step
    # anyway; the epoch's last two at its end, before any epoch-end handler.
    assert reads.count == 2 * 10 and reads.unready <= 2 * 2
    reads.count = 0
    sgd_trainer(callbacks=[reads], optimizer_metrics=False).fit(make_batches(10, batch_size=8), epochs=1)
    assert reads.count == 10  # no gradient norm: the loss alone


def test_a_fit_after_the_stop_goes_on_from_the_state_the_guard_kept():
    batches = make_batches(12, batch_size=8)
    poisoned = [dict(b) for b in batches]
    poisoned[4] = {**poisoned[4], "image": poisoned[4]["image"].copy()}
    poisoned[4]["image"][0, 0] = np.nan  # step 5
    trainer = sgd_trainer(SetupDiverging())
    with pytest.raises(flaxhooks.NonFiniteError):
        trainer.fit(poisoned, epochs=1)
    assert int(trainer.state.step) == 4
    # The steps dispatched after the NaN changed nothing: the next fit counts from step 4.
    state = trainer.fit(batches[4:], steps=6)
    assert int(state.step) == 6


def test_a_replay_that_fails_still_stops_and_says_why(monkeypatch):
    def out_of_memory(*args, **kwargs):
        raise RuntimeError("RESOURCE_EXHAUSTED: out of memory")

    monkeypatch.setattr(flaxhooks.step.StepRunner, "replay", out_of_memory)
    trainer = sgd_trainer(Diverging())
    failed = r"the replay that names the layer failed \(RuntimeError"
    with pytest.raises(flaxhooks.NonFiniteError, match=failed):
        trainer.fit(make_batches(6, batch_size=8), epochs=1)
    assert int(trainer.state.step) == 0


class LogOfData(nn.Module):
    """``log`` of the batch's last feature, in the model's own code between two
    submodules: NaN on a batch where that feature is negative (a finite batch)."""

    @nn.compact
    def __call__(self, x):
        h = nn.Dense(4, name="encoder")(x[..., :-1])
        return nn.Dense(3, name="head")(h * jnp.log(x[..., -1:]))


def log_data(count: int, bad_step: int | None = None) -> list[dict[str, np.ndarray]]:
    """Batches whose last feature is positive, but for one example of ``bad_step``'s batch (if any)."""
    batches = make_batches(count, batch_size=8)
    for batch in batches:
        batch["image"][:, -1] = np.abs(batch["image"][:, -1]) + 0.5
    if bad_step is not None:
        batches[bad_step - 1]["image"][0, -1] = -1.0
    return batches


class Reached(flaxhooks.Callback):
    def on_fit_end(self, loop):
        self.step = loop.step


def test_a_nan_is_said_in_full_once_by_the_error_and_named_at_its_own_step_elsewhere(caplog):
    import io

    from rich.console import Console

    printed, table, bar = io.StringIO(), io.StringIO(), io.StringIO()
    reached = Reached()
    callbacks = [flaxhooks.ConsoleLog(100, stream=printed), reached,
                 flaxhooks.Progress(console=Console(file=bar, width=400)),
                 flaxhooks.Diagnose(console=Console(file=table, width=400))]
    trainer = sgd_trainer(LogOfData(), callbacks=callbacks)
    with caplog.at_level(logging.WARNING, logger="flaxhooks"):
        with pytest.raises(flaxhooks.NonFiniteError) as error:
            trainer.fit(log_data(12, bad_step=4), steps=12)
    assert error.value.step == 4 and reached.step > 4  # found with steps in flight after it
    # In full, once: the error a script sees. The Dense after the log took a NaN it cannot make
    # from a finite input: the model's own code made it, and the first advice is about that code.
    full = str(error.value)
    cause = ("the loss is nan at step 4: the first call, in execution order, whose output went non-finite is "
             "'head' (a Dense), which makes no NaN or infinity from finite inputs and parameters: its input "
             "already was, made by the code of the model (not a submodule), after 'encoder' (a Dense) "
             "returned (found by replaying step 4 instrumented, in ")
    assert full.startswith(cause)
    assert full.split(". Try: ")[1] == (
        "look for log, sqrt, division or exp of values at or below 0 (or overflowing) in the code of the "
        "model, before 'head' (a Dense): add an epsilon or clip (jnp.log(jnp.maximum(x, 1e-6))); the loss "
        "and gradient norm did not grow before it, so a lower learning rate is unlikely to help")
    brief = "the loss is nan; first non-finite: the code of the model, before 'head' (a Dense)"
    logged = [r.getMessage() for r in caplog.records]
    assert logged == ["the loss is nan at step 4; first non-finite: the code of the model, before 'head' "
                      "(a Dense): training stops, and fit raises NonFiniteError saying how and what to try"]
    # Every other place names the NaN's step (not the one reached) and refers to the error.
    assert printed.getvalue().splitlines()[-1] == (
        f"training stopped at step 4: {brief}; details in the NonFiniteError")
    summary = bar.getvalue().splitlines()[-1]
    assert summary.startswith(f"stopped ({brief}; details in the NonFiniteError) at step 4/12  epoch 1  "
                              "(4 steps in")
    assert "loss" not in summary.split("(4 steps in")[1]  # no metrics of the steps thrown away after it
    row = [line for line in table.getvalue().splitlines() if "nonfinite" in line]
    assert len(row) == 1 and brief in row[0] and "look for log" in row[0]
    for text in (*logged, printed.getvalue(), bar.getvalue(), table.getvalue()):
        assert "execution order" not in text and "which makes no NaN" not in text
    assert "done at step" not in printed.getvalue()  # the stopped epoch was not done


def test_a_nan_in_the_batch_is_said_to_be_the_datas():
    batches = log_data(6)
    batches[1]["image"][3, 0] = np.inf  # step 2
    with pytest.raises(flaxhooks.NonFiniteError) as error:
        sgd_trainer(LogOfData()).fit(batches, epochs=1)
    message = str(error.value)
    assert message.startswith("the loss is nan at step 2: the batch of step 2 holds NaN or infinity (in "
                              "batch['image']): the data, not training, made it; the first call, in "
                              "execution order, whose output went non-finite is 'encoder' (a Dense) (found "
                              "by replaying step 2")
    assert message.split(". Try: ")[1].startswith("check the data: find and drop or repair the examples")


class Regression(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(1, name="head")(x)


def test_a_nan_after_the_gradient_norm_grew_is_told_to_lower_the_learning_rate():
    # Plain SGD with a step too long for the curvature: every step multiplies the error.
    arrays = make_arrays(8 * 40, seed=1)
    arrays["target"] = arrays["image"].sum(-1, keepdims=True)
    batches = [{k: v[i * 8:(i + 1) * 8] for k, v in arrays.items()} for i in range(40)]
    trainer = flaxhooks.Trainer(Regression(), optax.sgd(3.0),
                                lambda out, batch: jnp.mean((out - batch["target"]) ** 2))
    norms = []
    with pytest.raises(flaxhooks.NonFiniteError) as error:
        trainer.fit(batches, epochs=1)
    # The reference: the gradient norms of the steps before it, replayed by hand.
    params = trainer.init(batches[0]).params
    for batch in batches[:error.value.step - 1]:
        grads = jax.grad(lambda p, b=batch: jnp.mean((Regression().apply({"params": p}, b["image"])
                                                      - b["target"]) ** 2))(params)
        norms.append(float(optax.tree.norm(grads)))
        params = jax.tree.map(lambda p, g: p - 3.0 * g, params, grads)
    before, recent = np.median(norms[:-3]), max(norms[-3:])
    assert recent > 10 * before
    advice = str(error.value).split(". Try: ")[1]
    assert advice.startswith(f"the gradient norm grew from {before:.3g} to ")
    assert advice.endswith(": lower the learning rate or add warmup, clip gradients "
                           "(optax.clip_by_global_norm), or train in float32")


class LogBody(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        return jnp.log(nn.Dense(5)(x)), None  # NaN where the Dense gives a negative value


class Scanned(nn.Module):
    """A log inside an ``nn.scan`` body whose values the scan drops (its default variable_axes)."""

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(5, name="encoder")(x)
        x, _ = nn.scan(LogBody, variable_axes={"params": 0}, split_rngs={"params": True}, length=2)(
            name="layers")(x, None)
        return nn.Dense(3, name="head")(x)


def test_a_nan_made_inside_a_scan_that_hides_its_body_names_the_scan_not_the_next_call():
    findings = Findings()
    with pytest.warns(UserWarning, match="nn.scan module 'layers' drops"):
        with pytest.raises(flaxhooks.NonFiniteError) as error:
            sgd_trainer(Scanned(), callbacks=[findings]).fit(log_data(4), epochs=1)
    assert ("its input already was, made by 'layers', whose inside the replay cannot see (an nn.scan drops "
            "the values made in its body unless its variable_axes name 'intermediates' and 'perturbations'), "
            "or by the code of the model, after 'encoder' (a Dense) returned") in str(error.value)
    assert [(f.layer, f.brief) for f in findings.seen] == [
        ("layers", "the loss is nan; first non-finite: 'layers' (its inside unseen) or the code of the "
                   "model, before 'head' (a Dense)")]
