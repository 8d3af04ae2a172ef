"""The hook bus: event order, registration checks, ordering, stopping, failures."""

import logging

import jax
import pytest

import flaxhooks
from flaxhooks import EVENTS, Callback, CallbackError, Event, StopTraining
from flaxhooks.contract import ALWAYS_RUN, HookBus, Phase
from tests.helpers import Recorder, make_arrays, make_batches, sgd_trainer


def test_events_are_data_in_loop_order():
    assert EVENTS == (
        "fit_start", "epoch_start", "step_start", "step_end", "loss_read",
        "eval_start", "eval_end", "finding", "epoch_end", "fit_end", "exception",
    )
    assert [event.value for event in Event] == list(EVENTS)
    assert [event.handler for event in Event][:2] == ["on_fit_start", "on_epoch_start"]
    assert ALWAYS_RUN == {Event.EPOCH_END, Event.FIT_END}


def test_event_order_over_two_epochs_is_exact():
    rec = Recorder()
    sgd_trainer(callbacks=[rec]).fit(make_batches(2), epochs=2)
    steps = lambda first: [  # noqa: E731
        ("rec", "step_start", first), ("rec", "step_end", first + 1),
        ("rec", "step_start", first + 1),
        # The guard reads the epoch's losses at its last step_end (its handler first).
        ("rec", "loss_read", first + 2), ("rec", "loss_read", first + 2), ("rec", "step_end", first + 2),
    ]
    assert rec.log == [
        ("rec", "fit_start", 0),
        ("rec", "epoch_start", 0), *steps(0), ("rec", "epoch_end", 2),
        ("rec", "epoch_start", 2), *steps(2), ("rec", "epoch_end", 4),
        ("rec", "fit_end", 4),
    ]


def test_unknown_handler_name_is_rejected_at_registration():
    class Typo(Callback):
        def on_step_ends(self, loop):
            pass

    with pytest.raises(ValueError, match=r"on_step_ends does not name an event.*on_step_end"):
        sgd_trainer(callbacks=[Typo()])
    trainer = sgd_trainer()
    with pytest.raises(ValueError, match="on_step_ends"):
        trainer.add(Typo())
    assert [type(cb) for cb in trainer.callbacks] == [flaxhooks.NonFiniteGuard]  # every Trainer's


def test_non_callbacks_and_duplicates_are_rejected():
    with pytest.raises(TypeError, match="not a flaxhooks.Callback"):
        sgd_trainer(callbacks=[object()])
    rec = Recorder()
    with pytest.raises(ValueError, match="already registered"):
        sgd_trainer(callbacks=[rec, rec])


def test_callbacks_run_by_order_then_registration():
    log = []
    late, first_zero, early, second_zero = (
        Recorder("late", 10, log), Recorder("zero-a", 0, log),
        Recorder("early", -5, log), Recorder("zero-b", 0, log),
    )
    trainer = sgd_trainer(callbacks=[late, first_zero]).add(early, second_zero)
    trainer.fit(make_batches(1), steps=1)
    fit_start = [name for name, event, _ in log if event == "fit_start"]
    assert fit_start == ["early", "zero-a", "zero-b", "late"]
    # The input pipeline is the Trainer's, not a callback.
    assert isinstance(trainer.pipeline, flaxhooks.DevicePrefetch)
    assert len(trainer.callbacks) == 5  # with the guard every Trainer has


class StopAt(Callback):
    def __init__(self, step, how):
        self.step, self.how = step, how

    def on_step_end(self, loop):
        if loop.step == self.step:
            if self.how == "raise":
                raise StopTraining("enough")
            loop.stop("enough")


@pytest.mark.parametrize("how", ["flag", "raise"])
def test_a_callback_stops_training_cleanly_and_end_hooks_run(how):
    rec = Recorder(order=10)
    trainer = sgd_trainer(callbacks=[StopAt(3, how), rec])
    state = trainer.fit(make_batches(4), epochs=5)
    assert int(state.step) == 3
    events = [e for _, e, _ in rec.log]
    assert events[-2:] == ["epoch_end", "fit_end"]
    assert "exception" not in events
    if how == "flag":  # later handlers of the same event still ran; the guard reads the last losses
        assert rec.log[-5:] == [("rec", "step_end", 3), ("rec", "loss_read", 3), ("rec", "loss_read", 3),
                                ("rec", "epoch_end", 3), ("rec", "fit_end", 3)]
    else:  # StopTraining skips the rest of that event
        assert ("rec", "step_end", 3) not in rec.log


class Boom(Callback):
    def __init__(self, event, error=None):
        self.error = error or ValueError("boom")
        setattr(self, f"on_{event}", self._raise)

    def _raise(self, loop):
        raise self.error

    def __repr__(self):
        return "Boom()"


def test_a_failing_callback_is_named_and_end_hooks_still_run():
    rec = Recorder(order=10)
    trainer = sgd_trainer(callbacks=[Boom("step_end"), rec])
    expected = r"Boom\(\) raised in on_step_end at step 1: ValueError: boom"
    with pytest.raises(CallbackError, match=expected) as info:
        trainer.fit(make_batches(3), epochs=1)
    assert isinstance(info.value.__cause__, ValueError)
    assert (info.value.event, info.value.step) == ("step_end", 1)
    assert [e for _, e, _ in rec.log] == [
        "fit_start", "epoch_start", "step_start", "exception", "epoch_end", "fit_end",
    ]


def test_keyboard_interrupt_runs_exception_and_end_hooks_then_propagates():
    seen = {}

    class Watch(Callback):
        def on_exception(self, loop):
            seen["exception"] = type(loop.exception)

        def on_fit_end(self, loop):
            seen["fit_end_step"] = loop.step

    trainer = sgd_trainer(callbacks=[Boom("step_start", KeyboardInterrupt()), Watch()])
    with pytest.raises(KeyboardInterrupt):
        trainer.fit(make_batches(3), epochs=1)
    assert seen == {"exception": KeyboardInterrupt, "fit_end_step": 0}


def test_errors_in_end_hooks_while_failing_do_not_hide_the_original(caplog):
    class BadEnd(Callback):
        def on_fit_end(self, loop):
            raise RuntimeError("cleanup failed")

    trainer = sgd_trainer(callbacks=[Boom("epoch_start"), BadEnd()])
    with caplog.at_level(logging.ERROR, logger="flaxhooks"), pytest.raises(CallbackError, match="boom"):
        trainer.fit(make_batches(2), epochs=1)
    assert "raised in on_fit_end while training was already ending" in caplog.text


def test_a_failing_step_reports_and_cleans_up():
    rec = Recorder()
    trainer = sgd_trainer(callbacks=[rec])
    batches = make_batches(2)

    def data():
        yield from batches
        yield {"image": batches[0]["image"][:, :2], "label": batches[0]["label"]}

    with pytest.raises(flaxhooks.BatchError, match="'image' has shape"):
        trainer.fit(data(), steps=10)
    assert [e for _, e, _ in rec.log][-3:] == ["exception", "epoch_end", "fit_end"]


def test_published_results_reach_later_callbacks():
    class Producer(Callback):
        order = -1

        def on_step_end(self, loop):
            loop.publish("double_step", 2 * loop.step)

    class Consumer(Callback):
        def __init__(self):
            self.seen = []

        def on_step_end(self, loop):
            self.seen.append(loop.published["double_step"])

    consumer = Consumer()
    sgd_trainer(callbacks=[consumer, Producer()]).fit(make_batches(3), epochs=1)
    assert consumer.seen == [2, 4, 6]


def test_process_zero_only_callbacks_are_skipped_on_other_processes(monkeypatch):
    class Writer(Callback):
        process_zero_only = True

    class Everywhere(Callback):
        pass

    monkeypatch.setattr(jax, "process_index", lambda: 1)
    bus = HookBus([Writer(), Everywhere()])
    assert [type(cb).__name__ for cb in bus.callbacks] == ["Everywhere"]


def test_every_end_handler_runs_when_one_of_them_fails(caplog):
    class BadEpochEnd(Callback):
        def on_epoch_end(self, loop):
            raise RuntimeError("flush failed")

    rec = Recorder(order=50)
    trainer = sgd_trainer(callbacks=[BadEpochEnd(), rec])
    with pytest.raises(CallbackError, match="BadEpochEnd.*on_epoch_end.*flush failed"):
        trainer.fit(make_batches(2), epochs=1)
    # The later epoch_end handler still ran, then the failure path: exception, fit_end.
    assert [e for _, e, _ in rec.log][-3:] == ["epoch_end", "exception", "fit_end"]


def test_stop_requested_at_epoch_start_takes_no_step():
    class StopAtStart(Callback):
        def on_epoch_start(self, loop):
            loop.stop("not today")

    rec = Recorder(order=10)
    state = sgd_trainer(callbacks=[StopAtStart(), rec]).fit(make_batches(3), epochs=2)
    assert int(state.step) == 0
    assert [e for _, e, _ in rec.log] == ["fit_start", "epoch_start", "epoch_end", "fit_end"]


def test_a_nested_event_leaves_the_outer_event_and_payload_intact():
    seen = []

    class Evaluate(Callback):
        order = -1

        def on_step_end(self, loop):
            loop.evaluate(make_arrays(8), batch_size=8)

    class Watch(Callback):
        def on_eval_start(self, loop):
            seen.append((loop.event, loop.payload))

        def on_eval_end(self, loop):
            seen.append((loop.event, loop.payload.examples))

        def on_step_end(self, loop):
            seen.append((loop.event, loop.payload))

    sgd_trainer(callbacks=[Evaluate(), Watch()]).fit(make_batches(1), steps=1)
    assert seen == [("eval_start", flaxhooks.eval.EvalStart("eval", 1)), ("eval_end", 8), ("step_end", None)]


def test_work_after_an_event_runs_once_all_its_handlers_ran_whatever_their_order():
    log = []

    class Early(Callback):
        order = -10

        def on_step_end(self, loop):
            loop.after(self, lambda loop: log.append(("after", loop.event, loop.step)))
            log.append(("early", loop.step))

    class Late(Callback):
        order = 10

        def on_step_end(self, loop):
            log.append(("late", loop.step))

    sgd_trainer(callbacks=[Late(), Early()]).fit(make_batches(2), epochs=1)
    assert log == [("early", 1), ("late", 1), ("after", "step_end", 1),
                   ("early", 2), ("late", 2), ("after", "step_end", 2)]


def test_work_after_an_event_does_not_run_when_a_handler_fails():
    ran = []

    class Then(Callback):
        def on_step_end(self, loop):
            loop.after(self, lambda loop: ran.append(loop.step))

    class Fails(Callback):
        order = 1

        def on_step_end(self, loop):
            raise RuntimeError("no")

    with pytest.raises(CallbackError, match="Fails"):
        sgd_trainer(callbacks=[Then(), Fails()]).fit(make_batches(2), epochs=1)
    assert ran == []



def test_with_errors_deferred_work_after_an_event_still_runs_when_a_handler_fails():
    """On several processes errors are deferred to an agreed stop: what the
    event's handlers asked for still runs on the process that failed (a
    checkpoint's save, which every process must take part in), and the
    error is deferred once, after it."""
    happened = []

    class Then(Callback):
        def on_step_end(self, loop):
            loop.after(self, lambda loop: happened.append("after"))

    class Fails(Callback):
        order = 1

        def on_step_end(self, loop):
            raise RuntimeError("no")

    bus = HookBus([Then(), Fails()], defer=lambda loop, error: happened.append(type(error).__name__))
    bus.emit(Event.STEP_END, flaxhooks.Loop(state=None))
    assert happened == ["after", "CallbackError"]

def test_a_peer_lost_while_an_end_hook_waits_is_the_loops_failure_not_the_callbacks():
    """A fit_end handler that waited for a lost peer (a checkpoint's save of a
    state split across processes) fails the fit as a lost peer anywhere in
    the loop does: through the bus's ``failure`` (which names it, and makes
    this process leave the run), not as that callback's own error."""

    class WaitsForAPeer(Callback):
        def on_fit_end(self, loop):
            raise flaxhooks.PeerLost("process 1 was lost at step 3", [1], 3)

    named = flaxhooks.PeerLost("named by failure", [1], 3)
    seen = []
    bus = HookBus([WaitsForAPeer()], failure=lambda loop, error: seen.append(error) or named)
    loop = flaxhooks.Loop(state=None)
    with pytest.raises(flaxhooks.PeerLost, match="named by failure") as info, bus.phase(Phase.FIT, loop):
        pass
    assert loop.exception is named and isinstance(info.value.__cause__, CallbackError)
    assert [type(e) for e in seen] == [flaxhooks.PeerLost]

    class FailsAtTheEnd(Callback):  # any other error in an end hook stays the callback's
        def on_fit_end(self, loop):
            raise RuntimeError("cleanup failed")

    bus = HookBus([FailsAtTheEnd()], failure=lambda loop, error: pytest.fail("not a failure of the loop"))
    loop = flaxhooks.Loop(state=None)
    with pytest.raises(CallbackError, match="cleanup failed"), bus.phase(Phase.FIT, loop):
        pass
    assert loop.exception is None
