"""Benchmark: the host cost of a training step on which no callback is due.

What is compared
    Trainers train the same tiny MLP (64 inputs, 256 hidden, 10 classes;
    well under a millisecond a step on a CPU, where every microsecond of
    per-step host work shows) with the same loss (cross-entropy plus
    accuracy), optimizer (``optax.sgd(0.1, momentum=0.9)``), initial state
    and host batches, data-parallel over ``--processes`` JAX processes of 2
    CPU devices each (``jax.distributed`` on 127.0.0.1, gloo collectives):

    (0) ``raw``: the floor, a hand-written loop of one ``jax.jit`` train
        step over the same mesh (each batch put on it inline, at most two
        steps in flight, as the Trainer keeps them).
    (a) ``lean``: no callbacks (every Trainer still has its non-finite
        guard); ``lean_off``: the same with ``if_nonfinite="off"``.
    (b) ``idle``: every built-in callback, none of them due in the timed
        steps: Summary, Progress (a terminal bar redrawn once a minute),
        ConsoleLog, TensorBoard, ActivationStats, ActivationGradStats,
        ParamStats, Diagnose, Checkpoint, Evaluate (all every 1000 steps, the
        last two not at epoch ends), EarlyStopping and Profile (of steps far
        beyond the fit). ``tb50``: the same with TensorBoard every 50 steps.
    (c) ``tb1``: (b) with TensorBoard every step.

    Each process feeds its own share of a fixed global batch. What is timed
    is the steady state of a fit: the input thread stamps the moment it
    takes each host batch, and ms/step is the time between the stamps of
    batch ``--skip`` and the last over the steps between them, so the fit's
    start and end (compiling, Summary, the final checkpoint) are left out;
    the whole fit's time is reported beside it. Every fit starts from the
    same initial state (the Checkpoint writes into a fresh directory each
    time). Each round times every Trainer once, rotating which goes first;
    the results are medians over rounds of process 0's figures, and of the
    per-round ratios ``ms/step lean / ms/step other`` (the speed ratio). The
    host cost of a step with nothing due is ``ms/step idle - ms/step lean``:
    target below 0.1 ms. Below target is reported as FAIL, but the script
    exits 0: it is a measurement.

    Then (``--profile``, on by default) one more fit each of ``idle`` and
    ``lean`` runs with every per-step site wrapped in a
    ``time.perf_counter_ns`` timer (monkeypatched in the worker processes
    only; flaxhooks is not changed): ``HookBus.emit`` of ``step_start`` and
    ``step_end`` and each handler it calls, the stops' per-step checks,
    ``StepRunner.run`` and its parts (due checks, the choice of variant,
    the carries, the jitted call, the wait for the step in flight), the
    input pipeline's queue and the fit clock's timing of it. The ranked
    table gives each site's own time (its inner sites left out) in µs per
    step. A timer costs about a microsecond, so sites called many times a
    step read high; compare sites, not the instrumented total with (b).
    One more fit of ``idle`` runs under ``cProfile`` on process 0; its 25
    functions of most own time are printed, and the handlers, the bus and the
    runner by their cumulative time.

How to run
    python -m benchmarks.bench_host_overhead [--processes 2] [--steps 300]
        [--skip 50] [--rounds 15] [--batch-size 64] [--steps-per-dispatch 1] [--no-profile]

    Each worker runs under ``timeout -s KILL``. The last line of output is
    one JSON object with the results (``sites_p0``: the profile).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import cProfile
import functools
import io
import json
import os
import pstats
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

HOST_COST_TARGET_MS = 0.1
FEATURES = 64
NEVER = 1000  # the period of every callback that must not be due in the timed steps
CONFIGS = ("raw", "lean", "lean_off", "idle", "tb50", "tb1")
ROOT = Path(__file__).resolve().parents[1]


# -- the parent: spawns the workers and reports -------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--processes", type=int, default=2,
                        help="JAX processes, 2 CPU devices each (default 2)")
    parser.add_argument("--steps", type=int, default=300, help="steps per timed fit (default 300)")
    parser.add_argument("--skip", type=int, default=50,
                        help="steps of each fit left out of the steady-state timing (default 50)")
    parser.add_argument("--rounds", type=int, default=15, help="interleaved rounds (default 15)")
    parser.add_argument("--batch-size", type=int, default=64, help="global batch size (default 64)")
    parser.add_argument("--steps-per-dispatch", type=int, default=1,
                        help="Trainer(steps_per_dispatch=) of every Trainer (default 1)")
    parser.add_argument("--no-profile", dest="profile", action="store_false",
                        help="leave out the per-site profile and cProfile")
    parser.add_argument("--timeout", type=int, default=600, help="seconds before a worker is killed")
    parser.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--out", default="", help=argparse.SUPPRESS)
    parser.add_argument("--shared", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if min(args.processes, args.steps, args.rounds, args.batch_size) < 1:
        parser.error("--processes, --steps, --rounds and --batch-size must be positive")
    if not 0 <= args.skip < args.steps - 10:
        parser.error("--skip must leave at least 10 timed steps")
    if args.batch_size % (2 * args.processes):
        parser.error(f"--batch-size must divide over {2 * args.processes} devices")
    return args


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def worker_env() -> dict[str, str]:
    """The environment of a worker: 2 CPU devices, set before JAX starts."""
    env = dict(os.environ)
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", env.get("XLA_FLAGS", ""))
    env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count=2".strip()
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH", "")]))
    return env


def spawn(args: argparse.Namespace, out: str) -> list[dict[str, Any]]:
    """Runs the workers (process 0 prints to this terminal); returns each one's results."""
    port, shared = free_port(), os.path.join(out, "shared")
    os.makedirs(shared)
    workers = []
    for index in range(args.processes):
        command = ["timeout", "-s", "KILL", str(args.timeout), sys.executable,
                   "-m", "benchmarks.bench_host_overhead",
                   "--worker", str(index), "--port", str(port), "--out", out, "--shared", shared,
                   "--processes", str(args.processes), "--steps", str(args.steps), "--skip", str(args.skip),
                   "--rounds", str(args.rounds), "--batch-size", str(args.batch_size)]
        if not args.profile:
            command.append("--no-profile")
        log = None if index == 0 else open(os.path.join(out, f"p{index}.log"), "w")  # noqa: SIM115
        workers.append((subprocess.Popen(command, cwd=ROOT, env=worker_env(), stdout=log,
                                         stderr=subprocess.STDOUT if log else None), log))
    codes = [process.wait() for process, _ in workers]
    for (_, log), index in zip(workers, range(args.processes), strict=True):
        if log is not None:
            log.close()
            if codes[index]:
                print(Path(log.name).read_text()[-4000:])
    if any(codes):
        sys.exit(f"a worker failed: exit codes {codes}")
    return [json.loads(Path(out, f"p{i}.json").read_text()) for i in range(args.processes)]


def ranked(sites: dict[str, float]) -> list[tuple[str, float]]:
    return sorted(sites.items(), key=lambda item: -item[1])


def report(args: argparse.Namespace, results: list[dict[str, Any]]) -> dict[str, Any]:
    """Prints the medians, ratios, verdict and profile; returns the JSON result."""
    mine = results[0]
    rounds: list[dict[str, dict[str, float]]] = mine["rounds"]
    ms = {name: statistics.median(r[name]["ms_per_step"] for r in rounds) for name in CONFIGS}
    fit_ms = {name: statistics.median(r[name]["fit_ms_per_step"] for r in rounds) for name in CONFIGS}
    ratios = {name: [r["lean"]["ms_per_step"] / r[name]["ms_per_step"] for r in rounds]
              for name in CONFIGS if name != "lean"}
    def over(name: str, base: str = "lean") -> float:
        """The median over rounds of ``name``'s ms/step less ``base``'s."""
        return statistics.median(r[name]["ms_per_step"] - r[base]["ms_per_step"] for r in rounds)

    costs = [r["idle"]["ms_per_step"] - r["lean"]["ms_per_step"] for r in rounds]
    result: dict[str, Any] = {
        "benchmark": "host_overhead",
        "processes": args.processes,
        "devices_per_process": 2,
        "steps": args.steps,
        "skip": args.skip,
        "rounds": args.rounds,
        "batch_size": args.batch_size,
        **{f"ms_per_step_{name}": ms[name] for name in CONFIGS},
        **{f"fit_ms_per_step_{name}": fit_ms[name] for name in CONFIGS},
        **{f"ratio_{name}": statistics.median(ratios[name]) for name in ratios},
        "host_cost_ms": statistics.median(costs),
        "host_costs_ms": costs,
        "host_cost_tb50_ms": over("tb50"),
        "host_cost_tb1_ms": over("tb1"),
        "steps_per_dispatch": args.steps_per_dispatch,
        # Per dispatch: what one call of the compiled step costs the host, its steps together.
        "host_cost_per_dispatch_ms": statistics.median(costs) * args.steps_per_dispatch,
        "guard_cost_ms": over("lean", "lean_off"),
        # Load from elsewhere only slows a fit: the fastest round of each is the least disturbed.
        **{f"min_ms_per_step_{name}": min(r[name]["ms_per_step"] for r in rounds) for name in CONFIGS},
        "host_cost_of_minima_ms": (min(r["idle"]["ms_per_step"] for r in rounds)
                                   - min(r["lean"]["ms_per_step"] for r in rounds)),
        "load_average": os.getloadavg()[0],
        "lean_minus_raw_ms": over("lean", "raw"),
        "target_host_cost_ms": HOST_COST_TARGET_MS,
        "jax_version": mine["jax_version"],
    }
    for i, worker in enumerate(results):
        if "sites" in worker:
            result[f"sites_p{i}"] = worker["sites"]
    print(f"\nhost_overhead: {args.processes} process(es) x 2 CPU devices, {args.steps} steps per fit "
          f"(timed after {args.skip}) x {args.rounds} rounds, global batch {args.batch_size}; "
          f"jax {result['jax_version']}")
    print(f"{'config':10} {'ms/step':>8} {'fastest':>8} {'fit ms/step':>12} {'lean/this':>10}")
    for name in CONFIGS:
        ratio = f"{result[f'ratio_{name}']:.3f}" if name != "lean" else "1"
        fastest = result[f"min_ms_per_step_{name}"]
        print(f"{name:10} {ms[name]:8.4f} {fastest:8.4f} {fit_ms[name]:12.4f} {ratio:>10}")
    print(f"host cost of a step, nothing due (idle - lean): {result['host_cost_ms']:.4f} ms; with "
          f"TensorBoard every 50: {result['host_cost_tb50_ms']:.4f} ms, every step: "
          f"{result['host_cost_tb1_ms']:.4f} ms")
    print(f"the same of the fastest rounds: {result['host_cost_of_minima_ms']:.4f} ms (1-minute load average "
          f"{result['load_average']:.1f} on {os.cpu_count()} cores)")
    print(f"the lean Trainer over the hand-written loop (lean - raw): {result['lean_minus_raw_ms']:.4f} ms")
    print(f"the non-finite guard (lean - lean_off): {result['guard_cost_ms'] * 1e3:.1f} us a step; "
          f"{args.steps_per_dispatch} step(s) a dispatch: host cost "
          f"{result['host_cost_per_dispatch_ms']:.4f} ms a dispatch")
    verdict = "PASS" if result["host_cost_ms"] < HOST_COST_TARGET_MS else "FAIL"
    print(f"host cost per step with nothing due: {result['host_cost_ms']:.4f} ms "
          f"(target < {HOST_COST_TARGET_MS} ms): {verdict}")
    for key in [k for k in result if k.startswith("sites_p")]:
        profile = result[key]
        for config in ("idle", "lean"):
            sites = profile[config]
            print(f"\nprofile, process {key[-1]}, {config} ({sites['ms_per_step']:.4f} ms/step instrumented, "
                  f"{sites['steps']} steps; {sites['timer_overhead_ns']:.0f} ns per timer taken out): "
                  f"own time per step; threads: {', '.join(sites['threads'])}")
            for site, micros in ranked(sites["us_per_step"]):
                calls = sites["calls_per_step"].get(site)
                print(f"  {micros:8.2f} us  {site}" + (f"  ({calls:.2f} calls)" if calls else ""))
        if profile.get("cprofile"):
            print(f"\ncProfile, process {key[-1]}, idle: the 25 functions of most own time, then "
                  "the handlers', the bus's and the runner's by cumulative time")
            print(profile["cprofile"])
    print(json.dumps({k: v for k, v in result.items() if not k.startswith("sites_")}))
    return result


def main(argv: Sequence[str] | None = None) -> dict[str, Any] | None:
    args = parse_args(argv)
    if args.worker is not None:
        worker(args)
        return None
    out = tempfile.mkdtemp(prefix="bench-host-overhead-")
    try:
        results = spawn(args, out)
        result = report(args, results)
    finally:
        shutil.rmtree(out, ignore_errors=True)
    return result


# -- a worker: one JAX process ------------------------------------------------


class StampedBatches:
    """Host batches, re-iterable with a length, stamping when each one is taken."""

    def __init__(self, batches: list[dict[str, Any]]):
        self.batches = batches
        self.stamps: list[float] = []
        self.on_take: Callable[[int], None] = lambda index: None
        self.threads_at = 0
        #: The threads of the process once batch ``threads_at`` is taken.
        self.threads: list[str] = []

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        self.stamps = []
        for index, batch in enumerate(self.batches):
            self.on_take(index)
            if index == self.threads_at:
                self.threads = sorted(thread.name for thread in threading.enumerate())
            self.stamps.append(time.perf_counter())
            yield batch


class Sites:
    """Own time (ns) and calls per site, counted while ``on``: a site's own
    time leaves out its inner sites and what timing them cost (``overhead_ns``
    per inner call, measured by :meth:`calibrate`)."""

    def __init__(self) -> None:
        self.ns: collections.Counter[str] = collections.Counter()
        self.calls: collections.Counter[str] = collections.Counter()
        self.on = False
        self.overhead_ns = 0.0
        self._stack: list[list[int]] = []  # per open site: the time its inner sites took, and their count

    def calibrate(self, calls: int = 20000) -> float:
        """The time a timer adds to the site that calls it (ns per call): an
        outer site calling a timed no-op against one calling the bare no-op."""

        def noop() -> None:
            pass

        timed_noop = self.timed("inner", noop)

        def outer(fn: Callable[[], None]) -> int:
            start = time.perf_counter_ns()
            for _ in range(calls):
                fn()
            return time.perf_counter_ns() - start

        self.on = True
        self._stack.append([0, 0])  # an open site, as the outer would be
        added = []
        for _ in range(5):
            bare = outer(noop)
            self.ns.clear()
            wrapped = outer(timed_noop)  # of which the inner site's own time is left out of the outer's
            added.append((wrapped - self.ns["inner"] - bare) / calls)
        self._stack.pop()
        self.on = False
        self.ns.clear()
        self.calls.clear()
        self.overhead_ns = max(statistics.median(added), 0.0)
        return self.overhead_ns

    def _enter(self) -> int:
        self._stack.append([0, 0])
        return time.perf_counter_ns()

    def _exit(self, name: str, start: int) -> None:
        end = time.perf_counter_ns()
        inner_ns, inner_calls = self._stack.pop()
        self.ns[name] += end - start - inner_ns - inner_calls * self.overhead_ns
        self.calls[name] += 1
        if self._stack:
            self._stack[-1][0] += end - start
            self._stack[-1][1] += 1

    def timed(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            if not self.on:
                return fn(*args, **kwargs)
            start = self._enter()
            try:
                return fn(*args, **kwargs)
            finally:
                self._exit(name, start)

        return timed

    def timed_iter(self, name: str, iterable: Iterable[Any]) -> Iterator[Any]:
        iterator = iter(iterable)
        try:
            while True:
                counting = self.on
                start = self._enter() if counting else 0
                try:
                    item = next(iterator)
                except StopIteration:
                    return
                finally:
                    if counting:
                        self._exit(name, start)
                yield item
        finally:
            close = getattr(iterator, "close", None)
            if close is not None:
                close()  # the pipeline's thread stops when its generator closes


def count_between(sites: Sites, first: int, end: int, taken: int) -> None:
    """Counts the steps whose batches the input thread takes from ``first`` to before ``end``."""
    sites.on = first <= taken < end


def instrument_callbacks(callbacks: Sequence[Any], sites: Sites) -> None:
    """Wraps each callback's per-step handlers and due check (before the
    Trainer registers them: the bus looks handlers up at registration)."""
    for callback in callbacks:
        kind = type(callback).__name__
        for name in ("on_step_start", "on_step_end", "due"):
            if hasattr(callback, name):
                setattr(callback, name, sites.timed(f"{kind}.{name}", getattr(callback, name)))


@contextlib.contextmanager
def instrumented_fit(trainer: Any, sites: Sites) -> Iterator[None]:
    """Wraps the per-step sites of ``trainer``'s next fits."""
    import flaxhooks.contract
    import flaxhooks.loop

    runner, pipeline = trainer.runner, trainer.pipeline
    run, run_steps, variant, carries = runner.run, runner.run_steps, runner.variant, runner._carries
    device_batches = pipeline.device_batches
    fit_run, clock_batches = flaxhooks.loop.Fit.run, flaxhooks.contract.FitClock.batches
    step_events = {flaxhooks.Event.STEP_START: "HookBus.emit(step_start)",
                   flaxhooks.Event.STEP_END: "HookBus.emit(step_end)"}

    def timed_emits(emit: Any) -> Any:
        def timed_emit(event: Any, loop: Any, *rest: Any, **kwargs: Any) -> Any:
            name = step_events.get(event)
            timed = emit if name is None else sites.timed(name, emit)
            return timed(event, loop, *rest, **kwargs)

        return timed_emit

    def timed_variant(*args: Any, **kwargs: Any) -> Any:
        step_fn = sites.timed("StepRunner.variant", variant)(*args, **kwargs)
        return sites.timed("StepRunner: jitted step call (dispatch)", step_fn)

    def timed_run(loop: Any, batch: Any, wait: Any, due: Any = None) -> Any:
        timed_wait = sites.timed("wait for the step in flight", wait)
        return sites.timed("StepRunner.run (own)", run)(loop, batch, timed_wait, due)

    def timed_run_steps(loop: Any, batches: Any, wait: Any) -> Any:
        timed_wait = sites.timed("wait for the dispatch in flight", wait)
        own = sites.timed("StepRunner.run_steps (own, with its jitted call)", run_steps)
        return own(loop, batches, timed_wait)

    def timed_fit_run(fit: Any, *args: Any, **kwargs: Any) -> Any:
        fit.bus.emit = timed_emits(fit.bus.emit)  # the fit's bus, which its loop emits through too
        stops = fit.stops
        for name in ("at_boundary", "dispatch_through"):
            setattr(stops, name, sites.timed(f"{type(stops).__name__}.{name}", getattr(stops, name)))
        own_batches = stops.batches
        stops.batches = lambda *a: sites.timed_iter(f"{type(stops).__name__}.batches (next)", own_batches(*a))
        return fit_run(fit, *args, **kwargs)

    runner.run, runner.run_steps, runner.variant = timed_run, timed_run_steps, timed_variant
    runner._carries = sites.timed("StepRunner._carries", carries)
    pipeline.device_batches = lambda *a: sites.timed_iter("DevicePrefetch.device_batches (queue get)",
                                                          device_batches(*a))
    flaxhooks.loop.Fit.run = timed_fit_run
    flaxhooks.contract.FitClock.batches = lambda clock, b: sites.timed_iter("FitClock.batches (next)",
                                                                        clock_batches(clock, b))
    try:
        yield
    finally:
        del runner.run, runner.run_steps, runner.variant, runner._carries, pipeline.device_batches
        flaxhooks.loop.Fit.run, flaxhooks.contract.FitClock.batches = fit_run, clock_batches


def worker(args: argparse.Namespace) -> None:
    import flaxhooks

    index, count = args.worker, args.processes
    flaxhooks.use_cpu_devices(None, across_processes=count > 1)  # XLA_FLAGS set the 2; PJRT_NPROC for gloo
    import jax

    if count > 1:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(f"127.0.0.1:{args.port}", num_processes=count, process_id=index)
    import flax.linen as nn
    import numpy as np
    import optax
    from rich.console import Console

    from recipes.models import cross_entropy_loss

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x: jax.Array) -> jax.Array:
            return nn.Dense(10)(nn.relu(nn.Dense(256)(x)))

    local = args.batch_size // count
    rng = np.random.default_rng(index)
    batches = StampedBatches([
        {"image": rng.normal(size=(local, FEATURES)).astype(np.float32),
         "label": rng.integers(0, 10, local).astype(np.int32)}
        for _ in range(args.steps)
    ])
    batches.threads_at = args.skip
    eval_data = {"image": rng.normal(size=(4 * local, FEATURES)).astype(np.float32),
                 "label": rng.integers(0, 10, 4 * local).astype(np.int32)}
    quiet = Console(file=open(os.devnull, "w"), force_terminal=True, width=120)  # noqa: SIM115
    fits = iter(range(10**6))  # the same on every process: names each fit's checkpoint directory

    def every_callback(tensorboard_every: int) -> list[Any]:
        logdir = os.path.join(args.shared, f"tb-{tensorboard_every}")
        return [
            flaxhooks.NonFiniteGuard(),
            flaxhooks.Summary(console=quiet),
            flaxhooks.Progress(refresh_per_second=1 / 60, every=NEVER, console=quiet),
            flaxhooks.ConsoleLog(every=NEVER, stream=quiet.file),
            flaxhooks.TensorBoard(logdir, every=tensorboard_every),
            flaxhooks.ActivationStats(every=NEVER),
            flaxhooks.ActivationGradStats(every=NEVER),
            flaxhooks.ParamStats(every=NEVER),
            flaxhooks.Diagnose(every=NEVER, window=NEVER, console=quiet),
            flaxhooks.Checkpoint(os.path.join(args.shared, "ckpt"), every=NEVER, at_epoch_end=False),
            flaxhooks.Evaluate(eval_data, every=NEVER, at_epoch_end=False, batch_size=local),
            flaxhooks.EarlyStopping(),
            flaxhooks.Profile(os.path.join(logdir, "profile"), steps=(10**6, 10**6 + 1)),
        ]

    def make(name: str, sites: Sites | None = None) -> flaxhooks.Trainer:
        tensorboard_every = {"idle": NEVER, "tb50": 50, "tb1": 1}.get(name)
        callbacks = [] if tensorboard_every is None else every_callback(tensorboard_every)
        if sites is not None:
            callbacks = callbacks or [flaxhooks.NonFiniteGuard()]
            instrument_callbacks(callbacks, sites)
        return flaxhooks.Trainer(MLP(), optax.sgd(0.1, momentum=0.9), cross_entropy_loss, callbacks=callbacks,
                                 if_nonfinite="off" if name == "lean_off" else "stop",
                                 steps_per_dispatch=args.steps_per_dispatch)

    def fit(trainer: flaxhooks.Trainer, steps: int) -> dict[str, float]:
        for checkpoint in (cb for cb in trainer.callbacks if isinstance(cb, flaxhooks.Checkpoint)):
            checkpoint.directory = os.path.join(args.shared, f"ckpt-{next(fits)}")  # a fresh run each fit
            os.makedirs(checkpoint.directory, exist_ok=True)
        start = time.perf_counter()
        final = trainer.fit(batches, steps=steps, state=init)
        jax.block_until_ready(final.params)
        seconds = time.perf_counter() - start
        stamps = batches.stamps
        skip = min(args.skip, steps - 10)
        return {"ms_per_step": 1e3 * (stamps[steps - 1] - stamps[skip]) / (steps - 1 - skip),
                "fit_ms_per_step": 1e3 * seconds / steps}

    trainers = {name: make(name) for name in CONFIGS if name != "raw"}
    init = trainers["lean"].init(batches.batches[0])
    raw = raw_loop(MLP(), optax.sgd(0.1, momentum=0.9), cross_entropy_loss, init.params, batches, args.skip)
    for trainer in trainers.values():  # compile and warm up
        fit(trainer, min(args.steps, 2 * args.skip))
    raw(min(args.steps, 2 * args.skip))

    def say(text: str) -> None:
        if index == 0:
            print(text, flush=True)

    rounds = []
    for round_index in range(args.rounds):
        order = CONFIGS[round_index % len(CONFIGS):] + CONFIGS[:round_index % len(CONFIGS)]
        timed = {name: raw(args.steps) if name == "raw" else fit(trainers[name], args.steps)
                 for name in order}
        rounds.append(timed)
        say(f"round {round_index + 1}/{args.rounds} ({order[0]} first): " + "  ".join(
            f"{name} {timed[name]['ms_per_step']:.4f}" for name in CONFIGS) + " ms/step; idle - lean "
            f"{timed['idle']['ms_per_step'] - timed['lean']['ms_per_step']:+.4f} ms")
    result: dict[str, Any] = {"rounds": rounds, "jax_version": jax.__version__}
    if args.profile:
        result["sites"] = profile(args, make, fit, batches, index, say)
    Path(args.out, f"p{index}.json").write_text(json.dumps(result))


def raw_loop(model: Any, tx: Any, loss_fn: Callable[..., Any], params: Any, batches: StampedBatches,
             skip: int) -> Callable[[int], dict[str, float]]:
    """The floor: a hand-written loop of one ``jax.jit`` step over the same
    mesh, each batch put on it inline, two steps in flight."""
    import jax
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec

    mesh = jax.make_mesh((jax.device_count(),), ("data",))
    replicated, split = NamedSharding(mesh, PartitionSpec()), NamedSharding(mesh, PartitionSpec("data"))

    def train_step(state: Any, batch: dict[str, Any]) -> tuple[Any, Any]:
        params, opt_state = state

        def objective(params: Any) -> Any:
            return loss_fn(model.apply({"params": params}, batch["image"]), batch)

        (loss, metrics), grads = jax.value_and_grad(objective, has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = jax.tree.map(lambda p, u: p + u, params, updates)
        return (params, opt_state), {"loss": loss, **metrics}

    step = jax.jit(train_step, donate_argnums=(0,), out_shardings=replicated)

    def run(steps: int) -> dict[str, float]:
        start = time.perf_counter()
        state = jax.device_put((jax.tree.map(np.array, params), tx.init(params)), replicated)
        in_flight: collections.deque[Any] = collections.deque()
        stamps = []
        for batch in batches.batches[:steps]:
            stamps.append(time.perf_counter())
            state, metrics = step(state, {k: jax.make_array_from_process_local_data(split, v)
                                          for k, v in batch.items()})
            in_flight.append(metrics["loss"])
            if len(in_flight) > 2:
                in_flight.popleft().block_until_ready()
        jax.block_until_ready(state)
        seconds = time.perf_counter() - start
        skipped = min(skip, steps - 10)
        return {"ms_per_step": 1e3 * (stamps[steps - 1] - stamps[skipped]) / (steps - 1 - skipped),
                "fit_ms_per_step": 1e3 * seconds / steps}

    return run


def profile(args: argparse.Namespace, make: Callable[..., Any], fit: Callable[..., dict[str, float]],
            batches: StampedBatches, index: int, say: Callable[[str], None]) -> dict[str, Any]:
    """The per-site table of ``idle`` and ``lean``, and cProfile of ``idle`` (process 0)."""
    found: dict[str, Any] = {}
    for config in ("idle", "lean"):
        sites = Sites()
        sites.calibrate()
        trainer = make(config, sites)
        fit(trainer, min(args.steps, 2 * args.skip))  # compile and warm up, not counted
        batches.on_take = functools.partial(count_between, sites, args.skip, args.steps - 5)
        with instrumented_fit(trainer, sites):
            timed = fit(trainer, args.steps)
        batches.on_take = lambda taken: None
        steps = sites.calls["HookBus.emit(step_end)"]
        found[config] = {
            "ms_per_step": timed["ms_per_step"],
            "steps": steps,
            "us_per_step": {name: ns / 1e3 / steps for name, ns in sites.ns.items()},
            "calls_per_step": {name: calls / steps for name, calls in sites.calls.items() if calls != steps},
            "timer_overhead_ns": sites.overhead_ns,
            "threads": batches.threads,
        }
        say(f"profiled {config}: {timed['ms_per_step']:.4f} ms/step instrumented")
    trainer = make("idle")
    fit(trainer, min(args.steps, 2 * args.skip))
    profiler = cProfile.Profile() if index == 0 else None
    if profiler is not None:
        profiler.enable()
    fit(trainer, args.steps)
    if profiler is not None:
        profiler.disable()
        text = io.StringIO()
        profile = pstats.Stats(profiler, stream=text)
        profile.sort_stats("tottime").print_stats(25)
        # The whole fit's: its first steps (the progress bar starting, ...) count here too.
        profile.sort_stats("cumulative").print_stats(r"on_step_|_bus\.py|_runner\.py", 20)
        found["cprofile"] = "\n".join(line for line in text.getvalue().splitlines()
                                      if line.strip() and not line.startswith(("   Ordered", "   List")))
    return found


if __name__ == "__main__":
    main()
