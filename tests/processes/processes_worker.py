"""One JAX process of a multi-process test (gloo on 127.0.0.1, 2 CPU devices each).

Usage: ``python -m tests.processes.processes_worker SCENARIO INDEX COUNT PORT OUTDIR [ARGS...]``.
Each scenario writes ``OUTDIR/p<INDEX>.json`` and prints progress lines
(flushed) that ``tests/test_multiprocess.py`` reads.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections.abc import Callable
from typing import Any

import jax

SCENARIOS: dict[str, Callable[..., Any]] = {}


def scenario(fn: Callable[..., Any]) -> Callable[..., Any]:
    SCENARIOS[fn.__name__] = fn
    return fn


def say(text: str) -> None:
    print(f"[{jax.process_index()}] {text}", flush=True)


def leaves(tree: Any) -> list[list[float]]:
    """Every leaf whole, gathered from every process (a leaf split over processes included)."""
    import numpy as np
    from jax.experimental import multihost_utils

    def whole(x: Any) -> Any:
        return x if x.is_fully_replicated else multihost_utils.process_allgather(x, tiled=True)

    return [np.asarray(whole(x), np.float64).ravel().tolist() for x in jax.tree.leaves(tree)]


class StatsHistory:
    """Keeps every step's published activation and gradient statistics (a test reads them all)."""

    def __new__(cls):
        import flaxhooks

        class _History(flaxhooks.Callback):
            order = 50  # after the statistics callbacks publish

            def __init__(self):
                self.steps: dict[int, Any] = {}

            def on_step_end(self, loop):
                self.steps[loop.step] = {
                    topic: loop.published[topic].to_dict()
                    for topic in ("activations", "activation_grads") if topic in loop.published
                }

        return _History()


@scenario
def equivalence(index: int, count: int, out: str) -> dict[str, Any]:
    """Statistics every step change nothing, and evaluation is exact over processes."""
    import flaxhooks
    from tests.helpers import BatchNormNet, make_arrays, sgd_trainer

    def loader():
        return flaxhooks.ArrayLoader(make_arrays(64), batch_size=16 // count, seed=1)

    history = StatsHistory()
    instrumented = sgd_trainer(BatchNormNet(), callbacks=[
        flaxhooks.ActivationStats(every=1), flaxhooks.ActivationGradStats(every=1), history,
    ])
    with_stats = instrumented.fit(loader(), epochs=2)
    lean = sgd_trainer(BatchNormNet())
    without = lean.fit(loader(), epochs=2)
    # FSDP over the 4 devices of the 2 processes: each holds a share of a kernel.
    fsdp = sgd_trainer(BatchNormNet(), shard=flaxhooks.FSDP(min_size=16)).fit(loader(), epochs=2)
    # Three steps per dispatch (3 + 1 an epoch), statistics at every third step alone: the same training.
    dispatched = sgd_trainer(BatchNormNet(), shard=flaxhooks.FSDP(min_size=16), steps_per_dispatch=3,
                             callbacks=[flaxhooks.ActivationStats(every=3)]).fit(loader(), epochs=2)
    # "auto", its windows shortened to fit 16 steps (1 2 1 2, two dispatches each): process 0's
    # timings choose for both (the same programs on each).
    from flaxhooks.loop import AutoSteps

    AutoSteps.WINDOW, AutoSteps.SKIP, AutoSteps.LIMITS = 1, 0, {"cpu": 2}
    auto = sgd_trainer(BatchNormNet(), steps_per_dispatch="auto")
    auto_state = auto.fit(loader(), epochs=4)
    four_epochs = sgd_trainer(BatchNormNet()).fit(loader(), epochs=4)
    # Gradient accumulation and the weights' moving average, split over both processes' devices (FSDP),
    # statistics every other update: the same as the whole batch's update, replicated (an MLP: no
    # batch statistics to differ between micro-batches).
    import optax

    from tests.helpers import MLP, cross_entropy

    def averaged(**options: Any) -> Any:
        optimizer = flaxhooks.with_ema(optax.sgd(0.1, 0.9), 0.9)
        return flaxhooks.Trainer(MLP(), optimizer, cross_entropy, **options)

    accumulated = averaged(shard=flaxhooks.FSDP(min_size=16), accumulate=2, callbacks=[
        flaxhooks.ActivationStats(every=2)]).fit(loader(), epochs=1)
    whole_batches = averaged().fit(loader(), epochs=1)
    ema_kernel = flaxhooks.ema_params(accumulated)["Dense_0"]["kernel"]
    # Reduce-on-plateau: each process advances the rule on the same evaluation, the scale the same.
    plateau = flaxhooks.ReduceLROnPlateau("loss", factor=0.5, patience=1, rtol=0.2)
    plateaued = flaxhooks.Trainer(MLP(), plateau.wrap(optax.sgd(0.5)), cross_entropy, callbacks=[
        flaxhooks.Evaluate(make_arrays(48, seed=9), every=2, at_epoch_end=False, batch_size=16), plateau,
    ]).fit(loader(), epochs=1)
    kernel = fsdp.params["Dense_0"]["kernel"]
    # Each process evaluates its share (every 2nd example: 501 and 500); the
    # result covers all 1001 exactly once.
    result = lean.evaluate(make_arrays(1001, seed=5), batch_size=100)
    # One example: process 1's share is empty, and it still takes part.
    tiny = lean.evaluate(make_arrays(1, seed=9), batch_size=100)
    # Evaluate's check before training passes there too (nothing to check on process 1).
    lean.evaluate(make_arrays(1, seed=9), batch_size=100, check=True)
    # Prediction: each process gets the outputs of the examples it fed, in order (every 2nd of the
    # arrays; of batches, its own: 3 on process 0 and 1 on process 1); process 1 feeds none of one example.
    predicted = lean.predict(make_arrays(1001, seed=5), batch_size=100)
    spans = [(0, 30), (30, 70), (70, 75)] if index == 0 else [(75, 80)]
    images = make_arrays(80, seed=6)["image"]
    predicted_batches = lean.predict([{"image": images[a:b]} for a, b in spans])
    predicted_tiny = lean.predict(make_arrays(1, seed=9), batch_size=100)
    # A bad label on process 1 only: both processes raise, neither waits forever.
    batch = make_arrays(8, seed=index)
    batch["label"][0] = 3 * index
    try:
        lean.evaluate([batch])
        bad_label = None
    except Exception as error:  # noqa: BLE001
        bad_label = f"{type(error).__name__}: {error}"
    say(f"{len(jax.local_devices())} local of {len(jax.devices())} devices, step {int(with_stats.step)}")
    return {
        "with_stats": leaves(with_stats.params), "without": leaves(without.params),
        "fsdp": leaves(fsdp.params), "dispatched": leaves(dispatched.params),
        "auto": leaves(auto_state.params), "four_epochs": leaves(four_epochs.params),
        "auto_count": auto.chosen_steps_per_dispatch,
        "accumulated": leaves((accumulated.params, flaxhooks.ema_params(accumulated))),
        "whole_batches": leaves((whole_batches.params, flaxhooks.ema_params(whole_batches))),
        "ema_split": not ema_kernel.is_fully_addressable,
        "plateau": [plateau.scale, leaves(plateaued.params)],
        "fsdp_kernel": [str(kernel.sharding.spec), not kernel.is_fully_addressable],
        "batch_stats": leaves(with_stats.model_state), "stats": history.steps,
        "eval": [result.examples, result.metrics["loss"], result.metrics["accuracy"]],
        "tiny": tiny.examples, "bad_label": bad_label,
        "predicted": predicted.tolist(), "predicted_batches": predicted_batches.tolist(),
        "predicted_tiny": list(predicted_tiny.shape),
    }


def _outcome(fit: Callable[[], Any]) -> dict[str, Any]:
    """How one fit ended here: its step, its error type and message, its stop reason."""
    import flaxhooks

    start = time.monotonic()
    outcome: dict[str, Any] = {"error": None, "message": None}
    try:
        fit()
    except flaxhooks.TrainingInterrupted as error:
        outcome.update(error="TrainingInterrupted", message=str(error))
    except Exception as error:  # noqa: BLE001
        outcome.update(error=type(error).__name__, message=str(error))
        if isinstance(error, flaxhooks.ProcessError):
            outcome.update(processes=list(error.processes), error_step=error.step)
    outcome["seconds"] = time.monotonic() - start
    return outcome


@scenario
def agreement(index: int, count: int, out: str) -> dict[str, Any]:
    """Stops and faults decided on one process, one fit after another in the
    same processes (each must leave the run healthy for the next)."""
    import flax.linen as nn
    import numpy as np
    import optax

    import flaxhooks
    from tests.helpers import MLP, cross_entropy, make_arrays, sgd_trainer

    class Act(flaxhooks.Callback):
        """Does ``act(loop)`` at ``event`` of ``step`` on process ``process`` only."""

        order = -100
        plan: tuple[int, int, str, Callable[[Any], None]] | None = None

        def _maybe(self, loop, event):
            if self.plan is not None:
                process, step, when, act = self.plan
                if jax.process_index() == process and loop.step == step and event == when:
                    act(loop)

        def on_step_end(self, loop):
            self._maybe(loop, "step_end")

        def on_epoch_end(self, loop):
            self._maybe(loop, "epoch_end")

    class Steps(flaxhooks.Callback):
        """Every step_end this process saw, and the final loop state."""

        order = 500

        def on_fit_start(self, loop):
            self.seen, self.final, self.findings = [], {}, []

        def on_step_end(self, loop):
            self.seen.append(loop.step)

        def on_finding(self, loop):
            found = loop.payload
            self.findings.append([found.kind, found.layer, found.step, found.message()])

        def on_fit_end(self, loop):
            self.final = {"step": loop.step, "stop_reason": loop.stop_reason}

    def loader(n=128, batch=16):
        return flaxhooks.ArrayLoader(make_arrays(n), batch_size=batch // count, seed=1)

    results: dict[str, Any] = {}
    act, steps = Act(), Steps()
    # One Trainer for most cases: each fit starts from the same state and
    # reuses the compiled step.
    trainer = sgd_trainer(callbacks=[act, steps])
    initial = trainer.init(next(iter(loader()(0))))

    def run(name, plan=None, data=None, epochs=2, other=None):
        act.plan = plan
        steps.seen, steps.final, steps.findings = [], {}, []
        fit = other or trainer
        outcome = _outcome(lambda: fit.fit(data or loader(), epochs=epochs, state=None if other else initial))
        outcome.update(steps.final, seen=steps.seen, findings=steps.findings)
        results[name] = outcome
        say(f"{name}: {outcome}")

    def stop(loop):
        loop.stop("process 1 had enough")

    def raise_stop(loop):
        raise flaxhooks.StopTraining("process 0 says stop")

    def boom(loop):
        raise ValueError("boom")

    run("stop_on_1", (1, 3, "step_end", stop))
    run("stoptraining_on_0", (0, 2, "step_end", raise_stop))
    run("error_on_1", (1, 3, "step_end", boom))
    run("error_at_epoch_end_on_0", (0, 8, "epoch_end", boom))

    def failing_data(epoch):
        for i, batch in enumerate(loader()(epoch)):
            if index == 0 and i == 3:
                raise OSError("disk read failed")
            yield batch

    # No length: every process agrees at the step its data runs out.
    run("data_error_on_0", data=failing_data)
    run("unequal_lengths", data=loader(128 if index == 0 else 96))

    def unsized(epoch):  # the same number of batches everywhere, but no length
        yield from loader()(epoch)

    run("unsized_epochs", data=unsized)

    def short_on_1(epoch):
        for i, batch in enumerate(loader()(epoch)):
            if index == 1 and i == 5:
                return
            yield batch

    run("data_runs_out_on_1", data=short_on_1)

    compiles = []

    def listener(name, duration, **kwargs):
        if name == "/jax/core/compile/backend_compile_duration":
            compiles.append(kwargs.get("fun_name"))

    jax.monitoring.register_event_duration_secs_listener(listener)
    run("layout", data=loader(batch=16 if index == 0 else 8))
    jax.monitoring.unregister_event_duration_listener(listener)
    results["layout"]["compiles"] = compiles

    diverging = flaxhooks.Trainer(MLP(), optax.sgd(1e9), cross_entropy, callbacks=[
        flaxhooks.ActivationStats(every=1), act, steps])
    run("nonfinite", other=diverging)

    # A NaN in process 1's share of step 3's batch alone: the loss (a mean over
    # every process's share) is NaN on both, and both replay step 3 (a step
    # compiled over every process's devices) from the state before it; each
    # times its replay, and both say the same words all the same.
    def nan_on_1(epoch):
        for i, batch in enumerate(loader()(epoch)):
            if index == 1 and epoch == 0 and i == 2:
                batch = {**batch, "image": batch["image"].copy()}
                batch["image"][1, 2] = np.nan
            yield batch

    def slow_replay(loop):  # process 1 has the replay's outcome half a second after process 0
        replay = trainer.runner.replay

        def slow(*args):
            flags = replay(*args)
            time.sleep(0.5)
            return flags

        trainer.runner.replay = slow  # the fit's loop.replay runs the runner's

    run("nan_on_1", (1, 1, "step_end", slow_replay), data=nan_on_1)
    vars(trainer.runner).pop("replay", None)
    results["nan_on_1"]["state_step"] = int(np.asarray(trainer.state.step.addressable_shards[0].data))
    results["nan_on_1"]["params"] = leaves(trainer.state.params)
    results["nan_on_1"]["two_steps"] = leaves(trainer.fit(loader(), steps=2, state=initial).params)

    # Diagnose: every process reads the same window sums (replicated), so each
    # finds the same; process 0 alone logs them.
    import logging

    class Killed(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.relu(nn.Dense(32)(x))
            x = nn.relu(nn.Dense(32, bias_init=nn.initializers.constant(-20.0), name="killed")(x))
            return nn.Dense(3)(nn.relu(nn.Dense(32, name="after")(x)))

    class Logged(logging.Handler):
        def __init__(self):
            super().__init__(logging.WARNING)
            self.said: list[str] = []

        def emit(self, record):
            self.said.append(record.getMessage())

    logged = Logged()
    logging.getLogger("flaxhooks").addHandler(logged)
    diagnose = flaxhooks.Diagnose(every=1, window=4, table=False)
    run("diagnose", other=flaxhooks.Trainer(Killed(), optax.adam(1e-2), cross_entropy,
                                            callbacks=[diagnose, act, steps]), epochs=1)
    logging.getLogger("flaxhooks").removeHandler(logged)
    results["diagnose"]["logged"] = logged.said
    results["diagnose"]["table"] = [[f.kind, f.layer, f.step, f.message()] for f in diagnose.findings]

    results["eval_by_time"] = _outcome(lambda: sgd_trainer(callbacks=[
        flaxhooks.Evaluate(make_arrays(20), every=flaxhooks.Every(seconds=5))]).fit(loader(), epochs=1))
    run("healthy_after_all")
    results["healthy_params"] = float(np.asarray(jax.tree.leaves(
        trainer.fit(loader(), epochs=1, state=initial).params)[0]).sum())
    return results


@scenario
def interrupted(index: int, count: int, out: str, workdir: str,
                steps_per_dispatch: str = "1") -> dict[str, Any]:
    """Slow steps, printed; the test signals one process; a checkpoint at the end."""
    import flaxhooks
    from tests.helpers import make_arrays, sgd_trainer

    class Slow(flaxhooks.Callback):
        def on_step_end(self, loop):
            say(f"step {loop.step}")
            time.sleep(0.2)

    checkpoint = flaxhooks.Checkpoint(os.path.join(workdir, "checkpoints"), every=1000, at_epoch_end=False)
    trainer = sgd_trainer(callbacks=[Slow(), checkpoint], steps_per_dispatch=int(steps_per_dispatch))
    loader = flaxhooks.ArrayLoader(make_arrays(4096), batch_size=16 // count, seed=1)
    try:
        trainer.fit(loader, epochs=1)
    except flaxhooks.TrainingInterrupted as interrupted:
        say(f"INTERRUPTED {interrupted.step} {signal.Signals(interrupted.signal).name}")
        checkpoint.wait()
        return {"step": interrupted.step, "saved": checkpoint.saved_steps(), "exit": 128 + interrupted.signal}
    return {"step": None}


@scenario
def preempted_before_resuming(index: int, count: int, out: str, workdir: str, phase: str) -> dict[str, Any]:
    """Phase "train": 4 steps and a checkpoint. Phase "resume": SIGTERM reaches
    process 1 before the resumed fit (at step 4) asks JAX's sync point at all."""
    import flaxhooks
    from tests.helpers import make_arrays, sgd_trainer

    checkpoint = flaxhooks.Checkpoint(os.path.join(workdir, "checkpoints"), every=1000, at_epoch_end=False)
    trainer = sgd_trainer(callbacks=[checkpoint])
    loader = flaxhooks.ArrayLoader(make_arrays(64), batch_size=16 // count, seed=1)
    if phase == "train":
        trainer.fit(loader, steps=4)
        checkpoint.wait()
        return {"saved": checkpoint.saved_steps()}
    if index == 1:
        os.kill(os.getpid(), signal.SIGTERM)  # JAX's notifier holds it
    time.sleep(3)  # JAX's sync protocol places the sync point (about 1 s here)
    try:
        trainer.fit(loader, epochs=3, resume=True)
    except flaxhooks.TrainingInterrupted as interrupted:
        say(f"INTERRUPTED {interrupted.step} {signal.Signals(interrupted.signal).name}")
        checkpoint.wait()
        return {"step": interrupted.step, "saved": checkpoint.saved_steps(), "exit": 128 + interrupted.signal}
    return {"step": None}


@scenario
def lost(index: int, count: int, out: str, victim: str = "1") -> dict[str, Any]:
    """Process ``victim`` is killed (SIGKILL) at step 4; the others must not hang."""
    import flaxhooks
    from tests.helpers import make_arrays, sgd_trainer

    class Die(flaxhooks.Callback):
        def on_step_end(self, loop):
            if jax.process_index() == int(victim) and loop.step == 4:
                say("killing myself")
                os.kill(os.getpid(), signal.SIGKILL)

    trainer = sgd_trainer(callbacks=[Die(), flaxhooks.TensorBoard(os.path.join(out, f"tb{index}"), every=1)])
    loader = flaxhooks.ArrayLoader(make_arrays(1024), batch_size=16 // count, seed=1)
    started = time.monotonic()
    outcome = _outcome(lambda: trainer.fit(loader, epochs=1))
    say(f"LOST after {time.monotonic() - started:.1f} s: {outcome['error']}: {outcome['message']}")
    with open(os.path.join(out, f"p{index}.json"), "w") as file:
        json.dump(outcome, file)
    return outcome


@scenario
def killed(index: int, count: int, out: str, workdir: str) -> dict[str, Any]:
    """Evaluates every 3 steps and saves every 4; the test kills process 1 (SIGKILL) mid-run."""
    import flaxhooks
    from tests.helpers import make_arrays, sgd_trainer

    class Slow(flaxhooks.Callback):
        def on_step_end(self, loop):
            say(f"step {loop.step}")
            time.sleep(0.1)

    trainer = sgd_trainer(callbacks=[
        Slow(), flaxhooks.Evaluate(make_arrays(256, seed=5), every=flaxhooks.Every(steps=3), batch_size=32),
        flaxhooks.Checkpoint(os.path.join(workdir, "checkpoints"), every=4, at_epoch_end=False),
    ])
    loader = flaxhooks.ArrayLoader(make_arrays(4096), batch_size=16 // count, seed=1)
    outcome = _outcome(lambda: trainer.fit(loader, epochs=1))
    say(f"KILLED: {outcome['error']}: {outcome['message']}")
    return outcome


@scenario
def resume(index: int, count: int, out: str, workdir: str, late: str, timeout: str) -> dict[str, Any]:
    """Trains one epoch with checkpoints, then (in new processes) resumes with
    one process starting ``late`` seconds after the others."""
    import flaxhooks
    from tests.helpers import make_arrays, sgd_trainer

    checkpoint = flaxhooks.Checkpoint(os.path.join(workdir, "checkpoints"), every=2)
    trainer = sgd_trainer(callbacks=[checkpoint], peer_timeout=float(timeout))
    loader = flaxhooks.ArrayLoader(make_arrays(96), batch_size=16 // count, seed=1)
    if float(late) < 0:  # the first run
        state = trainer.fit(loader, epochs=1)
        return {"step": int(state.step)}
    if index == 1:
        time.sleep(float(late))
    outcome = _outcome(lambda: trainer.fit(loader, epochs=2, resume=True))
    outcome["saved"] = checkpoint.saved_steps()
    outcome["entries"] = sorted(os.listdir(checkpoint.directory))
    return outcome


@scenario
def run_directories(index: int, count: int, out: str, root: str) -> dict[str, Any]:
    """Each process asks for a new run directory a second apart, then for the
    latest; then trains into it twice, the second time refused."""
    import flaxhooks
    from tests.helpers import make_arrays, sgd_trainer

    if index == 1:
        time.sleep(1.2)  # its own clock would name another directory
    new = flaxhooks.run_directory(root)
    latest = flaxhooks.run_directory(root, resume=True)
    loader = flaxhooks.ArrayLoader(make_arrays(32), batch_size=16 // count, seed=1)

    def trainer() -> Any:
        return sgd_trainer(callbacks=[flaxhooks.Checkpoint(new / "checkpoints"),
                                      flaxhooks.TensorBoard(new / "tensorboard", hparams={"lr": 0.1}),
                                      flaxhooks.MetricsFile(new / "metrics.jsonl", every=1)])

    def files() -> dict[str, str]:
        import hashlib

        paths = [path for path in sorted(new.rglob("*")) if path.is_file()]
        return {str(path): hashlib.sha256(path.read_bytes()).hexdigest() for path in paths}

    trainer().fit(loader, epochs=1)
    say("FIRST DONE")
    before = files()
    try:
        trainer().fit(loader, epochs=1)
        refused = {"error": None}
    except Exception as error:  # noqa: BLE001
        refused = {"error": type(error).__name__, "message": str(error),
                   "cause": type(error.__cause__).__name__ if error.__cause__ else None}
    from flaxhooks.writers import read_metrics

    records = read_metrics(new / "metrics.jsonl")
    losses = [step for step, run, tag, _ in records if (run, tag) == ("train", "loss")]
    return {"new": str(new), "latest": str(latest), "refused": refused, "unchanged": files() == before,
            "files": len(before), "losses": losses}


@scenario
def split_checkpoint(index: int, count: int, out: str, workdir: str) -> dict[str, Any]:
    """A state split over a mesh axis within each process is saved from process
    0's parts; one split across the processes (FSDP over "data") is saved by
    every process writing its part, resumed on both, and a NaN in process 1's
    part alone skips that save on both."""
    import numpy as np
    from jax.sharding import AxisType

    import flaxhooks
    from tests.helpers import BatchNormNet, make_arrays, sgd_trainer

    mesh = jax.make_mesh((count, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    loader = flaxhooks.ArrayLoader(make_arrays(64), batch_size=16 // count, seed=1)
    within = sgd_trainer(BatchNormNet(), mesh=mesh, shard=flaxhooks.FSDP("model", min_size=16),
                         callbacks=[flaxhooks.Checkpoint(os.path.join(workdir, "within"), every=4)])
    state = within.fit(loader, epochs=2)
    kernel = state.params["Dense_0"]["kernel"]

    class Poison(flaxhooks.Callback):
        """At step ``at``, NaN in process 1's shards of the first leaf split across processes."""

        at: int | None = None

        def on_step_end(self, loop):
            if loop.step != self.at:
                return
            leaves_, treedef = jax.tree.flatten(loop.state)
            i = next(i for i, x in enumerate(leaves_) if not x.is_fully_replicated)
            x = leaves_[i]
            if index == 1:  # no collective: process 1 rebuilds the array from its own poisoned shards
                leaves_[i] = jax.make_array_from_single_device_arrays(
                    x.shape, x.sharding, [s.data * np.nan for s in x.addressable_shards])
            loop.replace_state(jax.tree.unflatten(treedef, leaves_))

    poison = Poison()
    across_checkpoint = flaxhooks.Checkpoint(os.path.join(workdir, "across"), every=4)
    across = sgd_trainer(BatchNormNet(), mesh=mesh, shard=flaxhooks.FSDP("data", min_size=16),
                         callbacks=[across_checkpoint, poison])
    across_state = across.fit(loader, epochs=2)
    across_kernel = across_state.params["Dense_0"]["kernel"]
    saved = across_checkpoint.saved_steps()
    # Resumed on both processes from their own parts' checkpoint; step 12's state
    # has NaN in process 1's part only: neither process saves it.
    poison.at = 12
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resumed = across.fit(loader, epochs=3, resume=True)
    say(f"saved step {int(jax.device_get(state.step))}")
    return {
        "leaves": leaves(state), "spec": str(kernel.sharding.spec),
        "local_parts": len({tuple((s.start, s.stop) for s in x.index) for x in kernel.addressable_shards}),
        "whole": bool(np.all(np.isfinite(leaves(state)[0]))),
        "across_leaves": leaves(across_state), "across_spec": str(across_kernel.sharding.spec),
        "across_split": not across_kernel.is_fully_addressable, "across_saved": saved,
        "resumed_step": int(jax.device_get(resumed.step)), "after_nan": across_checkpoint.saved_steps(),
        "skipped": across_checkpoint.skipped_steps,
        "nan_warnings": [str(w.message) for w in caught if "NaN or inf" in str(w.message)],
    }


@scenario
def lost_while_saving(index: int, count: int, out: str, workdir: str) -> dict[str, Any]:
    """A state split across the processes; process 1 dies (SIGKILL) in step 2's
    save once it has written its part, before orbax's commit barrier."""
    from jax.sharding import AxisType
    from orbax.checkpoint._src.checkpointers import async_checkpointer

    import flaxhooks
    from tests.helpers import BatchNormNet, make_arrays, sgd_trainer

    commit = async_checkpointer._background_wait_for_commit_futures

    def dying(directory: Any, commit_futures: Any, *args: Any, **kwargs: Any) -> None:
        if index == 1:
            for written in commit_futures:
                written.result()
            say("killing myself at the commit barrier")
            os.kill(os.getpid(), signal.SIGKILL)
        commit(directory, commit_futures, *args, **kwargs)

    async_checkpointer._background_wait_for_commit_futures = dying
    mesh = jax.make_mesh((count, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    trainer = sgd_trainer(BatchNormNet(), mesh=mesh, shard=flaxhooks.FSDP("data", min_size=16), callbacks=[
        flaxhooks.Checkpoint(os.path.join(workdir, "checkpoints"), every=2)])
    loader = flaxhooks.ArrayLoader(make_arrays(1024), batch_size=16 // count, seed=1)
    outcome = _outcome(lambda: trainer.fit(loader, epochs=1))
    say(f"LOST: {outcome['error']}: {outcome['message']}")
    return outcome


@scenario
def error_while_saving(index: int, count: int, out: str, workdir: str) -> dict[str, Any]:
    """A state split across the processes, saved every 2 steps; a callback
    raises on process 1 at step 4, a checkpoint step, with a save in flight."""
    from jax.sharding import AxisType

    import flaxhooks
    from tests.helpers import BatchNormNet, make_arrays, sgd_trainer

    raised: dict[str, float] = {}

    class Boom(flaxhooks.Callback):
        def on_step_end(self, loop):
            if index == 1 and loop.step == 4:
                raised["at"] = time.time()
                raise ValueError("boom at a checkpoint step")

    mesh = jax.make_mesh((count, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    checkpoint = flaxhooks.Checkpoint(os.path.join(workdir, "checkpoints"), every=2)
    trainer = sgd_trainer(BatchNormNet(), mesh=mesh, shard=flaxhooks.FSDP("data", min_size=16),
                          callbacks=[Boom(), checkpoint])
    loader = flaxhooks.ArrayLoader(make_arrays(1024), batch_size=16 // count, seed=1)
    outcome = _outcome(lambda: trainer.fit(loader, epochs=1))
    outcome.update(ended=time.time(), raised=raised.get("at"), saved=checkpoint.saved_steps())
    return outcome


def main() -> None:
    import faulthandler

    faulthandler.register(signal.SIGUSR1)  # where a stuck worker is: kill -USR1
    name, index, count, port, out, *args = sys.argv[1:]
    index, count = int(index), int(count)
    import flaxhooks

    # Two devices per process on a 2-core machine: sized so that collectives across processes cannot
    # starve XLA:CPU's thread pool (PJRT_NPROC).
    flaxhooks.use_cpu_devices(2, across_processes=True)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=count, process_id=index)
    import logging

    logging.basicConfig(level=logging.WARNING, format=f"[{index}] %(levelname)s %(message)s")
    result = SCENARIOS[name](index, count, out, *args)
    with open(os.path.join(out, f"p{index}.json"), "w") as file:
        json.dump(result, file)
    say("DONE")
    if isinstance(result, dict) and result.get("exit"):
        sys.exit(result["exit"])


if __name__ == "__main__":
    main()
