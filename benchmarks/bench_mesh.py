"""Benchmark: the Trainer's one jitted step over a mesh against hand-written loops, and FSDP's memory.

What is compared
    The recipe's CNN (``recipes.models.CNN``), its loss, ``optax.sgd(0.1,
    momentum=0.9)`` and the same fixed host batches, data parallel over every
    local device, each side timed end to end (place the state, run
    ``--steps`` steps, block on the final parameters), compiled before
    anything is timed, at most two steps queued ahead of the devices:

    (a) ``pmap``: a hand-written ``jax.pmap`` step (``lax.pmean`` of the
        gradients and metrics), the state replicated with
        ``flax.jax_utils.replicate``, batches reshaped to ``[devices, ...]``
        and fed by ``flax.jax_utils.prefetch_to_device``: what flaxhooks 0.6
        compiled.
    (b) ``jit``: a hand-written ``jax.jit`` step over the mesh, the state
        replicated with ``NamedSharding(mesh, P())``, each batch put on the
        mesh with one ``jax.device_put`` split over ``data``, two batches ahead.
    (c) ``trainer``: ``flaxhooks.Trainer`` with ``Progress`` (to a terminal
        nobody reads) and ``TensorBoard``, on the default mesh (every device
        on ``data``). Its step also computes the gradient norm, the update
        ratio and the running totals of the metrics, every step.
    (d) ``lean``: no callbacks and ``optimizer_metrics=False``.
    (e) ``shared_norms``: (c) with the norms of replicated parameters shared
        out between the devices, as 0.7 did on every platform and 0.8 does on
        GPU and TPU (``StepRunner.SHARE_NORMS_ON``): on CPU their all-reduce
        split the gradients' one all-reduce into three a step.
    (f) ``k_K``: (c) with ``steps_per_dispatch=K`` for each
        ``--steps-per-dispatch`` value (default ``4 auto``); "auto" is left
        to choose its count before anything is timed.

    Each segment is one whole ``fit`` (or hand loop) of ``--steps`` batches
    from the same initial state, timed end to end (place the state, run, block
    on the final parameters), with the process's CPU time over the wall time
    as the cores busy. Each round times every segment back to back, rotating
    which goes first; the results are the medians of the per-round ratios
    over the ``jit`` loop (targets: (c) at least 0.99; the fastest (f) at
    least 1.5 at batch 4 and 1.1 at batch 32) and of ``trainer / pmap``.

    Then the memory of FSDP: the recipe's CNN with ``optax.adam`` on
    ``--fsdp-devices`` devices, the bytes of state each device holds (from
    ``addressable_shards``) with ``flaxhooks.FSDP("data")`` against
    ``flaxhooks.Replicated()`` (target: at most 1/N x 1.1 of the replicated
    state, the small leaves FSDP keeps whole included).

How to run
    python -m benchmarks.bench_mesh [--steps 50] [--rounds 5] [--batch-size 128]
        [--cpu-devices 2] [--fsdp-devices 8] [--steps-per-dispatch 4 auto] [--no-shared-norms]
    python -m benchmarks.bench_mesh --compiled [--batch-size 4]   # the compiled steps alone

    The FSDP part runs in a subprocess of its own with ``--fsdp-devices`` CPU
    devices. The last line of output is one JSON object with the results.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import numpy as np
import optax
from flax import jax_utils
from flax.training import train_state
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from rich.console import Console

import flaxhooks
from benchmarks.rounds import alternate
from recipes.models import CNN, cross_entropy_loss

HostBatch = dict[str, Any]
TARGET_RATIO = 0.99
#: Several steps a dispatch against the hand jit loop, by batch size (issue 37).
TARGET_OVER_JIT = {4: 1.5, 32: 1.1}
TARGET_FSDP = 1.1
IN_FLIGHT = 2
IMAGE_SHAPE = (28, 28, 1)


def make_batches(count: int, batch_size: int) -> list[HostBatch]:
    rng = np.random.default_rng(0)
    return [{"image": rng.random((batch_size, *IMAGE_SHAPE), dtype=np.float32),
             "label": rng.integers(0, 10, batch_size, dtype=np.int32)} for _ in range(count)]


def _objective(model: CNN, params: Any, batch: HostBatch) -> tuple[jax.Array, dict[str, jax.Array]]:
    return cross_entropy_loss(model.apply({"params": params}, batch["image"]), batch)


def _bounded(step: Callable[..., Any], state: Any, batches: Iterator[Any]) -> Any:
    """Runs ``step`` over ``batches``, at most ``IN_FLIGHT`` steps ahead of the devices."""
    in_flight: collections.deque[jax.Array] = collections.deque()
    for batch in batches:
        state, metrics = step(state, batch)
        in_flight.append(metrics["loss"])
        if len(in_flight) > IN_FLIGHT:
            in_flight.popleft().block_until_ready()
    return state


class PmapLoop:
    """(a): flaxhooks 0.6's way, by hand."""

    def __init__(self, model: CNN, tx: optax.GradientTransformation):
        def step(state: train_state.TrainState, batch: HostBatch) -> Any:
            (loss, metrics), grads = jax.value_and_grad(
                lambda p: _objective(model, p, batch), has_aux=True)(state.params)
            grads = lax.pmean(grads, "batch")
            return state.apply_gradients(grads=grads), lax.pmean({"loss": loss, **metrics}, "batch")

        self.model, self.tx = model, tx
        self._step = jax.pmap(step, axis_name="batch", donate_argnums=(0,))

    def run(self, params: Any, batches: Sequence[HostBatch]) -> Any:
        devices = jax.local_device_count()
        state = jax_utils.replicate(train_state.TrainState.create(apply_fn=None, params=params, tx=self.tx))
        shaped = ({k: v.reshape(devices, -1, *v.shape[1:]) for k, v in b.items()} for b in batches)
        state = _bounded(self._step, state, jax_utils.prefetch_to_device(shaped, IN_FLIGHT))
        return jax.block_until_ready(state.params)


class JitLoop:
    """(b): one jit step over the mesh, by hand."""

    def __init__(self, model: CNN, tx: optax.GradientTransformation, mesh: jax.sharding.Mesh):
        def step(state: train_state.TrainState, batch: HostBatch) -> Any:
            (loss, metrics), grads = jax.value_and_grad(
                lambda p: _objective(model, p, batch), has_aux=True)(state.params)
            return state.apply_gradients(grads=grads), {"loss": loss, **metrics}

        self.tx, self.mesh = tx, mesh
        self.replicated, self.split = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
        self._step = jax.jit(step, donate_argnums=(0,), out_shardings=(self.replicated, self.replicated))

    def _ahead(self, batches: Sequence[HostBatch]) -> Iterator[Any]:
        queue: collections.deque[Any] = collections.deque()
        for batch in batches:
            queue.append(jax.device_put(batch, self.split))
            if len(queue) > IN_FLIGHT:
                yield queue.popleft()
        yield from queue

    def run(self, params: Any, batches: Sequence[HostBatch]) -> Any:
        state = jax.device_put(train_state.TrainState.create(apply_fn=None, params=params, tx=self.tx),
                               self.replicated)
        state = _bounded(self._step, state, self._ahead(batches))
        return jax.block_until_ready(state.params)


def fsdp_bytes(devices: int) -> dict[str, Any]:
    """Bytes of state per device under FSDP and replicated (run in a process of ``devices`` CPU devices)."""
    batch = make_batches(1, 8 * devices)
    held = {}
    for name, rule in (("replicated", flaxhooks.Replicated()), ("fsdp", flaxhooks.FSDP("data"))):
        trainer = flaxhooks.Trainer(CNN(), optax.adam(1e-3), cross_entropy_loss, shard=rule)
        state = trainer.init(batch[0])
        first = jax.devices()[0]
        held[name] = sum(s.data.nbytes for x in jax.tree.leaves(state)
                         for s in x.addressable_shards if s.device == first)
    whole = held["replicated"]
    return {"devices": devices, "bytes_replicated": whole, "bytes_fsdp": held["fsdp"],
            "fsdp_share": held["fsdp"] / whole, "target_share": TARGET_FSDP / devices}


def compiled_steps(args: argparse.Namespace) -> dict[str, Any]:
    """The compiled steps alone, side by side, every batch already on the
    devices (no input, no loop): the hand ``jit`` step against the Trainer's
    lean step and its step with the optimizer metrics."""
    batches = make_batches(args.steps, args.batch_size)
    model, tx = CNN(), optax.sgd(0.1, momentum=0.9)
    trainer = flaxhooks.Trainer(model, tx, cross_entropy_loss)
    initial = trainer.init(batches[0])
    trainer.fit(batches[:1], steps=1, state=initial)  # places and checks: the variants exist
    hand = JitLoop(model, tx, trainer.placement.mesh)
    on_devices = [jax.device_put(b, hand.split) for b in batches]
    params = jax.device_get(initial.params)

    def hand_run() -> None:
        state = jax.device_put(train_state.TrainState.create(apply_fn=None, params=params, tx=tx),
                               hand.replicated)
        jax.block_until_ready(_bounded(hand._step, state, iter(on_devices)).params)

    def trainer_run(norms: bool) -> Callable[[], None]:
        step = trainer.runner.variant((), norms)

        def run() -> None:
            state, totals = jax.tree.map(lambda x: x.copy(), initial), trainer.runner.zero_totals()
            in_flight: collections.deque[jax.Array] = collections.deque()
            for batch in on_devices:
                state, metrics, totals, _ = step(state, batch, totals)
                in_flight.append(metrics["loss"])
                if len(in_flight) > IN_FLIGHT:
                    in_flight.popleft().block_until_ready()
            jax.block_until_ready(state.params)

        return run

    runs = {"jit": hand_run, "lean_step": trainer_run(False), "step_with_norms": trainer_run(True)}
    for run in runs.values():
        run()
    rates: dict[str, list[float]] = {name: [] for name in runs}
    names = list(runs)
    for index in range(args.rounds):
        for name in names[index % len(names):] + names[:index % len(names)]:
            start = time.perf_counter()
            runs[name]()
            rates[name].append(args.steps / (time.perf_counter() - start))
    result = {"benchmark": "mesh_compiled", "batch_size": args.batch_size, "steps": args.steps,
              "rounds": args.rounds, **{f"steps_per_s_{n}": statistics.median(r) for n, r in rates.items()}}
    for name in ("lean_step", "step_with_norms"):
        ratio = statistics.median(a / b for a, b in zip(rates[name], rates["jit"], strict=True))
        result[f"{name}_over_jit"] = ratio
        print(f"median ratio compiled {name.replace('_', ' ')} / hand jit step: {ratio:.4f}")
    print(json.dumps(result))
    return result


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=50, help="timed steps per round (default 50)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds (default 5)")
    parser.add_argument("--batch-size", type=int, default=128, help="global batch size (default 128)")
    parser.add_argument("--cpu-devices", type=int, default=None, help="CPU devices (default: one per core)")
    parser.add_argument("--fsdp-devices", type=int, default=8,
                        help="CPU devices for the FSDP part (default 8)")
    parser.add_argument("--steps-per-dispatch", type=_dispatch, nargs="*", default=[4, "auto"],
                        help="a Trainer segment for each (default: 4 auto)")
    parser.add_argument("--no-shared-norms", action="store_true",
                        help="leave out the segment whose norms are shared out as on GPU")
    parser.add_argument("--guard-off", action="store_true",
                        help="add a segment of the Trainer with if_nonfinite='off' (the guard's cost)")
    parser.add_argument("--fsdp-only", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--compiled", action="store_true",
                        help="time the compiled steps alone, every batch already on the devices")
    return parser.parse_args(argv)


def _observed(model: CNN, tx: optax.GradientTransformation, **options: Any) -> flaxhooks.Trainer:
    """The Trainer with what a user watches: Progress (to a terminal nobody reads) and TensorBoard."""
    terminal = Console(file=open(os.devnull, "w"), force_terminal=True, width=120)  # noqa: SIM115
    callbacks = [flaxhooks.Progress(console=terminal),
                 flaxhooks.TensorBoard(tempfile.mkdtemp(prefix="bench-mesh-tb-"))]
    return flaxhooks.Trainer(model, tx, cross_entropy_loss, callbacks=callbacks, **options)


def _dispatch(value: str) -> int | str:
    return value if value == "auto" else int(value)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.fsdp_only:
        flaxhooks.use_cpu_devices(args.fsdp_devices)
        result = fsdp_bytes(args.fsdp_devices)
        print(json.dumps(result))
        return result
    flaxhooks.use_cpu_devices(args.cpu_devices)
    if args.compiled:
        return compiled_steps(args)
    devices = jax.local_device_count()
    batches = make_batches(args.steps, args.batch_size)
    model, tx = CNN(), optax.sgd(0.1, momentum=0.9)
    trainers = {"trainer": _observed(model, tx),
                "lean": flaxhooks.Trainer(model, tx, cross_entropy_loss, optimizer_metrics=False)}
    if not args.no_shared_norms:
        trainers["shared_norms"] = _observed(model, tx)
        trainers["shared_norms"].runner.SHARE_NORMS_ON = frozenset({"cpu"})  # as before 0.8, as on GPU
    if args.guard_off:
        trainers["guard_off"] = _observed(model, tx, if_nonfinite="off")
    for k in args.steps_per_dispatch:
        trainers[f"k_{k}"] = _observed(model, tx, steps_per_dispatch=k)
    initial = trainers["trainer"].init(batches[0])
    pmap, jit = PmapLoop(model, tx), JitLoop(model, tx, trainers["trainer"].placement.mesh)
    # On the host: the loops' steps donate what they are given (the Trainer copies a given state).
    params = jax.device_get(initial.params)
    runs: dict[str, Callable[[], Any]] = {"pmap": lambda: pmap.run(params, batches),
                                          "jit": lambda: jit.run(params, batches)}
    for name, trainer in trainers.items():
        runs[name] = lambda t=trainer: jax.block_until_ready(
            t.fit(batches, steps=args.steps, state=initial).params)
    for name, run in runs.items():  # compile everything first
        run()
        auto = trainers.get(name)
        for _ in range(64):  # "auto" times each count it tries, then keeps its choice: all before timing
            if auto is None or auto.chosen_steps_per_dispatch is not None:
                break
            run()
        if auto is not None:
            run()  # compiles the chosen count and the fit's tail
    names = list(runs)
    print(f"mesh step: {devices} device(s), batch {args.batch_size}, {args.steps} steps x {args.rounds} "
          f"rounds; each segment a whole fit (or hand loop) from the same state, the order rotated per round")
    rates, busy = alternate(runs, args.rounds, args.steps)

    def over(name: str, base: str) -> float:
        return statistics.median(a / b for a, b in zip(rates[name], rates[base], strict=True))

    ratios = {f"{name}_over_jit": over(name, "jit") for name in trainers}
    ratios["trainer_over_pmap"] = over("trainer", "pmap")
    if "guard_off" in trainers:  # the guard's cost: the same Trainer without it
        ratios["trainer_over_guard_off"] = over("trainer", "guard_off")
    fastest = max((n for n in trainers if n.startswith("k_")), key=lambda n: ratios[f"{n}_over_jit"],
                  default="trainer")
    target = TARGET_OVER_JIT.get(args.batch_size, TARGET_RATIO)
    fsdp = json.loads(subprocess.run(
        [sys.executable, "-m", "benchmarks.bench_mesh", "--fsdp-only",
         "--fsdp-devices", str(args.fsdp_devices)],
        check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1])
    chosen = {n: t.chosen_steps_per_dispatch for n, t in trainers.items() if n.startswith("k_")}
    result = {"benchmark": "mesh", "devices": devices, "batch_size": args.batch_size, "steps": args.steps,
              "rounds": args.rounds, **{f"steps_per_s_{n}": statistics.median(r) for n, r in rates.items()},
              **{f"cores_busy_{n}": statistics.median(b) for n, b in busy.items()},
              **ratios, "chosen_steps_per_dispatch": chosen, "fastest": fastest, "target_over_jit": target,
              "target_trainer": TARGET_RATIO,
              "compiles": dict(trainers["trainer"].runner.traces), "fsdp": fsdp,
              "jax_version": jax.__version__}
    for name in names:
        print(f"{name:>14}: {result[f'steps_per_s_{name}']:8.1f} steps/s, "
              f"{result[f'cores_busy_{name}']:.2f} cores busy (median)")
    for name in trainers:
        print(f"median ratio {name} / jit loop: {ratios[f'{name}_over_jit']:.4f}")
    print(f"median ratio trainer / pmap loop: {ratios['trainer_over_pmap']:.4f}")
    if "trainer_over_guard_off" in ratios:
        print(f"median ratio trainer / the same without the guard: {ratios['trainer_over_guard_off']:.4f}")
    for label, name, goal in (("trainer (one step a dispatch)", "trainer", TARGET_RATIO),
                              (f"fastest with several steps a dispatch ({fastest})", fastest, target)):
        ratio = ratios[f"{name}_over_jit"]
        print(f"{label} / jit loop: {ratio:.4f} (target >= {goal}): {'PASS' if ratio >= goal else 'FAIL'}")
    print(f"FSDP on {fsdp['devices']} devices: {fsdp['bytes_fsdp']:,} of {fsdp['bytes_replicated']:,} "
          f"bytes per device ({fsdp['fsdp_share']:.4f}; target <= {fsdp['target_share']:.4f}): "
          f"{'PASS' if fsdp['fsdp_share'] <= fsdp['target_share'] else 'FAIL'}")
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
