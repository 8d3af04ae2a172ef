"""Benchmark: the Trainer on a Flax NNX model against Flax's own NNX loop, with the Linen CNN beside it.

What is compared
    The recipe's CNN (Flax's MNIST example) in both Flax APIs
    (``recipes.models.NNXCNN`` and ``recipes.models.CNN``), trained with
    ``optax.sgd(0.1, momentum=0.9)`` on the same fixed random host batches
    (float32 images ``[batch, 28, 28, 1]``, int32 labels), on one device so
    the hand-written loops are the ones users write:

    NNX
      (a) ``nnx_hand``: ``nnx.jit`` over a step taking the module and an
          ``nnx.Optimizer``, as Flax's NNX examples write it (the model is
          called under ``nnx.capture``, so its ``sow`` calls do nothing, as
          in the Trainer's lean step).
      (b) ``nnx_trainer``: ``flaxhooks.Trainer`` on the same module, no callbacks.
      (c) ``nnx_every_100``: (b) with ``ActivationStats`` and
          ``ActivationGradStats`` every 100 steps.
    Linen
      (d) ``linen_hand``: ``jax.jit`` over ``(params, opt_state, batch)``.
      (e) ``linen_trainer`` and (f) ``linen_every_100``: as (b) and (c).

    Everything is compiled before timing. Each round runs every variant
    over ``--steps`` steps, end to end until the final parameters are on the
    host, rotating which goes first. Results are medians of per-round
    ratios; targets: trainer / hand ≥ 1.0 for both APIs (a pure step over
    split state avoids ``nnx.jit``'s per-step host work), every_100 /
    trainer ≥ 0.98. A ratio below target prints FAIL; the script exits 0.

How to run
    python -m benchmarks.bench_nnx [--steps 200] [--rounds 7] [--batch-size 32]

    The last line of output is one JSON object with the results.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
import optax
from flax import nnx

import flaxhooks
from benchmarks.bench_trainer import make_batches, run_trainer
from recipes.models import CNN, NNXCNN, cross_entropy_loss

TARGETS = {"nnx_trainer/nnx_hand": 1.0, "nnx_every_100/nnx_trainer": 0.98,
           "linen_trainer/linen_hand": 1.0, "linen_every_100/linen_trainer": 0.98}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200, help="timed steps per round (default 200)")
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds (default 7)")
    parser.add_argument("--batch-size", type=int, default=32, help="batch size (default 32: small steps)")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.rounds < 1 or args.batch_size < 1:
        parser.error("--steps, --rounds and --batch-size must be positive")
    return args


def optimizer() -> optax.GradientTransformation:
    return optax.sgd(0.1, momentum=0.9)


def nnx_hand_loop(model: nnx.Module, batches: list[dict[str, np.ndarray]]) -> Callable[[int], Any]:
    """Flax's NNX example loop: ``nnx.jit`` over the module and an ``nnx.Optimizer``."""
    model = nnx.clone(model)
    model.train()
    opt = nnx.Optimizer(model, optimizer(), wrt=nnx.Param)

    @nnx.jit
    def step(model: nnx.Module, opt: nnx.Optimizer, batch: dict[str, jax.Array]) -> jax.Array:
        def loss(model: nnx.Module) -> jax.Array:
            # Under nnx.capture the model's sow calls do nothing; outside it
            # each one adds to an attribute, which grows and recompiles every step.
            logits = nnx.capture(lambda m: m(batch["image"]))(model)
            return cross_entropy_loss(logits, batch)[0]

        value, grads = nnx.value_and_grad(loss)(model)
        opt.update(model, grads)
        return value

    def run(steps: int) -> Any:
        for i in range(steps):
            step(model, opt, batches[i % len(batches)])
        return jax.block_until_ready(nnx.state(model, nnx.Param))

    return run


def linen_hand_loop(batches: list[dict[str, np.ndarray]]) -> Callable[[int], Any]:
    """A plain ``jax.jit`` Linen loop over ``(params, opt_state)``."""
    module, tx = CNN(), optimizer()
    params = module.init(jax.random.PRNGKey(0), batches[0]["image"][:1])["params"]
    carry = [params, tx.init(params)]

    @jax.jit
    def step(params: Any, opt_state: Any, batch: dict[str, jax.Array]) -> tuple[Any, Any]:
        grads = jax.grad(lambda p: cross_entropy_loss(module.apply({"params": p}, batch["image"]), batch)[0])(
            params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    def run(steps: int) -> Any:
        for i in range(steps):
            carry[:] = step(*carry, batches[i % len(batches)])
        return jax.block_until_ready(carry[0])

    return run


def trainer_loop(model: Any, batches: list[dict[str, np.ndarray]], every: int | None) -> Callable[[int], Any]:
    callbacks: list[flaxhooks.Callback] = []
    if every is not None:
        callbacks = [flaxhooks.ActivationStats(every=every), flaxhooks.ActivationGradStats(every=every)]
    trainer = flaxhooks.Trainer(model, optimizer(), cross_entropy_loss, callbacks=callbacks,
                                devices=jax.local_devices()[:1])
    init = trainer.init(batches[0])
    return lambda steps: run_trainer(trainer, init, batches, steps)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    batches = make_batches(args.steps, args.batch_size)
    runs = {
        "nnx_hand": nnx_hand_loop(NNXCNN(nnx.Rngs(0)), batches),
        "nnx_trainer": trainer_loop(NNXCNN(nnx.Rngs(0)), batches, None),
        "nnx_every_100": trainer_loop(NNXCNN(nnx.Rngs(0)), batches, 100),
        "linen_hand": linen_hand_loop(batches),
        "linen_trainer": trainer_loop(CNN(), batches, None),
        "linen_every_100": trainer_loop(CNN(), batches, 100),
    }
    for run in runs.values():  # compile everything (every_100 runs its instrumented step too)
        run(101)
    print(f"nnx: 1 device, {args.steps} steps x {args.rounds} rounds, batch {args.batch_size}; "
          f"jax {jax.__version__}")
    names = list(runs)
    rates: dict[str, list[float]] = {name: [] for name in names}
    ratios: dict[str, list[float]] = {name: [] for name in TARGETS}
    for round_index in range(args.rounds):
        shift = round_index % len(names)
        order = names[shift:] + names[:shift]
        for name in order:
            start = time.perf_counter()
            runs[name](args.steps)
            rates[name].append(args.steps / (time.perf_counter() - start))
        for ratio in TARGETS:
            top, bottom = ratio.split("/")
            ratios[ratio].append(rates[top][-1] / rates[bottom][-1])
        print(f"round {round_index + 1}/{args.rounds}: "
              + "  ".join(f"{n} {rates[n][-1]:6.1f}/s" for n in names), flush=True)
    result: dict[str, Any] = {
        "benchmark": "nnx",
        "steps": args.steps,
        "rounds": args.rounds,
        "batch_size": args.batch_size,
        **{f"steps_per_s_{name}": statistics.median(rates[name]) for name in names},
        **{f"ratio {name}": statistics.median(values) for name, values in ratios.items()},
        "targets": TARGETS,
        "jax_version": jax.__version__,
    }
    for name, target in TARGETS.items():
        value = result[f"ratio {name}"]
        verdict = "PASS" if value >= target else "FAIL"
        print(f"median ratio {name}: {value:.4f} (target >= {target}): {verdict}")
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
