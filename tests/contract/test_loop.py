"""The callback contract: the loop's facts are read-only, and what a callback
asks of the loop is an explicit request, checked and recorded."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flaxhooks
from flaxhooks import Callback, CallbackError, Event, Loop
from flaxhooks.contract import HookBus
from tests.helpers import make_batches, sgd_trainer, tree_allclose

FACTS = [name for name, value in vars(Loop).items() if isinstance(value, property)]


def test_every_fact_is_read_only_and_the_error_names_the_requests():
    loop = Loop(state=None, step=3)
    assert {"state", "step", "epoch", "metrics", "totals", "stop_reason", "diverged", "published",
            "writers", "clock", "requests"} <= set(FACTS)
    for name in [*FACTS, "anything_new"]:
        with pytest.raises(AttributeError, match=r"loop\.stop\(\).*loop\.replace_state\(\)"):
            setattr(loop, name, 1)
    with pytest.raises(TypeError):
        loop.published["topic"] = 1  # type: ignore[index]
    loop.publish("topic", 1)
    assert dict(loop.published) == {"topic": 1} and loop.step == 3


def test_requests_are_checked():
    loop = Loop(state=None, step=2)
    for bad in ("", None, 3):
        with pytest.raises(ValueError, match="reason"):
            loop.stop(bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="1 to 2"):
        loop.mark_diverged(3, "NaN")
    with pytest.raises(ValueError, match="1 to 2"):
        loop.mark_diverged(0, "NaN")
    with pytest.raises(ValueError, match="may emit only 'loss_read', 'eval_start', 'eval_end', 'finding'"):
        loop.emit(Event.FIT_START)
    with pytest.raises(ValueError, match="may emit only"):
        loop.emit("no_such_event")
    with pytest.raises(TypeError, match="eval_end takes a EvalResult, got dict"):
        loop.emit("eval_end", {"loss": 1.0})
    with pytest.raises(RuntimeError, match="not attached"):
        loop.emit(Event.FINDING, flaxhooks.Finding("loss_spike", 2, None, "up", "lower it"))
    with pytest.raises(TypeError, match="callable"):
        loop.after(None, "not callable")  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="during fit"):
        loop.evaluate({})
    with pytest.raises(ValueError, match="topic"):
        loop.publish("", 1)
    assert loop.stop_reason is None and loop.diverged is None and loop.requests == ()


class Asks(Callback):
    """Makes a request at one step's end."""

    def __init__(self, step, ask):
        self.step, self.ask = step, ask

    def on_step_end(self, loop):
        if loop.step == self.step:
            self.ask(loop)


def test_requests_are_recorded_with_who_made_them_and_the_first_stop_reason_is_kept():
    first = Asks(2, lambda loop: loop.stop("enough"))
    second = Asks(2, lambda loop: loop.stop("me too"))
    trainer = sgd_trainer(callbacks=[first, second])
    seen = []
    trainer.add(Asks(2, lambda loop: seen.extend(loop.requests)))
    trainer.fit(make_batches(4), epochs=1)
    assert [(r.kind, r.step, r.event, r.by, r.detail) for r in seen] == [
        ("stop", 2, "step_end", first, "enough"), ("stop", 2, "step_end", second, "me too")]
    assert trainer.state is not None and int(trainer.state.step) == 2


def test_a_diverged_mark_stops_the_fit_with_a_nonfinite_error_at_that_step():
    trainer = sgd_trainer(callbacks=[Asks(3, lambda loop: loop.mark_diverged(2, "my watch saw a NaN"))],
                          if_nonfinite="off")
    with pytest.raises(flaxhooks.NonFiniteError, match="my watch saw a NaN"):
        trainer.fit(make_batches(6), epochs=1)
    # No guard kept an earlier state (the loss was finite): the next fit goes on from step 3.
    assert int(trainer.state.step) == 3
    assert int(trainer.fit(make_batches(6), steps=4).step) == 4


def test_a_replaced_state_is_what_the_next_step_starts_from():
    batches = make_batches(4)
    zeroed = {}

    def zero_params(loop):
        state = dataclasses.replace(loop.state, params=jax.tree.map(jnp.zeros_like, loop.state.params))
        zeroed["state"] = jax.tree.map(lambda x: x.copy(), state)  # the next step donates the state
        loop.replace_state(state)

    trainer = sgd_trainer(callbacks=[Asks(2, zero_params)])
    final = trainer.fit(batches, epochs=1)
    # The reference: the last two steps, from the zeroed state, by a fit of their own.
    reference = sgd_trainer().fit(batches, epochs=1, state=zeroed["state"])
    assert int(final.step) == int(reference.step) == 4
    assert tree_allclose(final.params, reference.params)


def test_a_replaced_state_must_match_the_current_one():
    errors = {}

    def replace_with(make):
        def ask(loop):
            try:
                loop.replace_state(make(loop.state))
            except ValueError as error:
                errors[len(errors)] = str(error)

        return ask

    wrong_shape = lambda s: dataclasses.replace(  # noqa: E731
        s, params=jax.tree.map(lambda x: jnp.zeros((*x.shape, 2), x.dtype), s.params))
    wrong_dtype = lambda s: dataclasses.replace(  # noqa: E731
        s, params=jax.tree.map(lambda x: x.astype(jnp.float16), s.params))
    wrong_tree = lambda s: dataclasses.replace(s, params={"only": jnp.zeros(3)})  # noqa: E731
    on_host = lambda s: jax.tree.map(np.asarray, s)  # noqa: E731
    trainer = sgd_trainer(callbacks=[Asks(1, replace_with(make))
                                     for make in (wrong_shape, wrong_dtype, wrong_tree, on_host)])
    trainer.fit(make_batches(2), epochs=1)
    assert "state.params['Dense_0']['bias'] is float32[8, 2], the current one float32[8]" in errors[0]
    assert "float16" in errors[1]
    assert "structure" in errors[2]
    assert "placed" in errors[3] and "jax.device_put" in errors[3]


def test_the_bus_takes_its_error_policy_when_built_and_keeps_it():
    bus = HookBus([], failure=lambda loop, error: error)
    with pytest.raises(AttributeError):
        bus.failure = lambda loop, error: error  # type: ignore[misc]
    with pytest.raises(AttributeError):
        bus.defer = None  # type: ignore[misc]


def test_an_emitted_evaluation_reaches_every_callback_and_a_wrong_one_is_the_emitters_error():
    seen = []

    class Listens(Callback):
        def on_eval_end(self, loop):
            seen.append((loop.event, loop.payload.name, loop.payload.metrics["accuracy"]))

    result = flaxhooks.EvalResult("own", {"accuracy": 0.5}, 2, 10)
    emits = Asks(2, lambda loop: loop.emit("eval_end", result))
    sgd_trainer(callbacks=[emits, Listens()]).fit(make_batches(3), epochs=1)
    assert seen == [(Event.EVAL_END, "own", 0.5)]

    wrong = Asks(1, lambda loop: loop.emit("step_end"))
    with pytest.raises(CallbackError, match="may emit only"):
        sgd_trainer(callbacks=[wrong]).fit(make_batches(3), epochs=1)
