"""Train Flax's MNIST CNN with flaxhooks, data-parallel over every local device.

Run ``python -m recipes.mnist --help`` for the options. On a CPU-only host the
recipe splits the CPU into one XLA device per core (``--cpu-devices`` or an
``XLA_FLAGS`` device count overrides that) and trains across them with pmap.

Full MNIST is used when it can be found or downloaded; otherwise the recipe
says so and trains on the real MNIST sample bundled in ``recipes/data``.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any


@dataclasses.dataclass(frozen=True)
class Config:
    """The recipe's settings; every field is a command-line option."""

    api: str = "linen"
    epochs: int = 10
    batch_size: int = 128
    eval_batch_size: int = 1000
    learning_rate: float = 0.1
    momentum: float = 0.9
    seed: int = 0
    data_dir: str | None = None
    cache_dir: str | None = None
    download: bool = True
    cpu_devices: int | None = None
    log_every: int = 50
    stats_every: int = 100
    histograms: bool = True
    checkpoint_every: int = 0
    keep_checkpoints: int = 3
    resume: bool = False
    coordinator: str | None = None
    num_processes: int | None = None
    process_id: int | None = None


_HELP = {
    "api": "the Flax API the CNN is written with: linen or nnx (the same network)",
    "epochs": "passes over the training set",
    "batch_size": "global batch size (split over the devices)",
    "eval_batch_size": "evaluation batch size (the last, smaller batch is padded, not dropped)",
    "learning_rate": "SGD learning rate",
    "momentum": "SGD momentum",
    "seed": "seed for initialization and shuffling",
    "data_dir": "directory holding the four MNIST .gz files (checked by sha256)",
    "cache_dir": "where downloaded MNIST is kept (default ~/.cache/flaxhooks/mnist)",
    "download": "try to download full MNIST when it is not found locally",
    "cpu_devices": "XLA CPU devices to expose (default: one per core, unless XLA_FLAGS sets it)",
    "log_every": "log to TensorBoard (and print, off a terminal) every this many steps",
    "stats_every": "log per-layer activation and activation-gradient statistics every this many steps "
                   "(0: never)",
    "histograms": "with the statistics, also log per-layer histograms",
    "checkpoint_every": "save a checkpoint every this many steps, besides each epoch's end and the "
                        "end of training (0: only those)",
    "keep_checkpoints": "how many of the latest checkpoints to keep",
    "resume": "go on from the latest checkpoint in the workdir (a fresh start if there is none)",
    "coordinator": "several processes: the address (host:port) of process 0, where JAX's coordination "
                   "service runs; with --num-processes and --process-id, or 'auto' to let JAX detect "
                   "all three (SLURM, Cloud TPU, ...)",
    "num_processes": "several processes: how many take part",
    "process_id": "several processes: this one's index, from 0",
}

#: Settings of where the run happens, not of the run: a resumed run, or one
#: on another number of processes, is the same run.
_PLACEMENT = ("resume", "coordinator", "num_processes", "process_id")


def _images(images: Any) -> Any:
    import numpy as np

    return (np.asarray(images, np.float32) / 255.0)[..., None]


def _hyperparameters(config: Config) -> dict[str, Any]:
    """The settings that define the run (a resumed run is the same run)."""
    return {k: v for k, v in dataclasses.asdict(config).items() if k not in _PLACEMENT}


def train_and_evaluate(config: Config, workdir: str | Path) -> dict[str, float]:
    """Trains the CNN and evaluates it on every held-out example.

    Args:
        config: the settings.
        workdir: where the run writes its files.

    Returns:
        The final held-out ``accuracy`` and ``loss``, the number of ``examples``
        evaluated and the number of train ``steps``. Checkpoints go to
        ``workdir/checkpoints`` (each epoch's end, every ``checkpoint_every``
        steps, and on Ctrl-C or SIGTERM, after which
        :class:`flaxhooks.TrainingInterrupted` is raised); ``config.resume``
        goes on from the latest. TensorBoard logs go to
        ``workdir/tensorboard``: training and test scalars, the model
        summary, and every ``stats_every`` steps per-layer statistics of
        activations (``activations/...``: each module's output and the
        post-ReLU values the CNN sows) and of their gradients
        (``activation_grads/...``).
    """
    import jax
    import optax
    from flax import nnx

    import flaxhooks
    from recipes import mnist_data
    from recipes.models import CNN, NNXCNN, cross_entropy_loss

    models = {"linen": CNN, "nnx": lambda: NNXCNN(nnx.Rngs(config.seed))}
    if config.api not in models:
        raise ValueError(f"--api must be one of {sorted(models)}, got {config.api!r}")
    Path(workdir).mkdir(parents=True, exist_ok=True)
    logdir = str(Path(workdir) / "tensorboard")
    # Says in one logged line why it fell back to the bundled sample, if it did.
    data = mnist_data.load_mnist(config.data_dir, config.cache_dir, download=config.download)
    processes = jax.process_count()
    if config.batch_size % processes:
        raise ValueError(f"--batch-size {config.batch_size} does not divide over {processes} processes")
    # Each process takes its own share of every global batch.
    train = flaxhooks.ArrayLoader(
        {"image": _images(data.train_images), "label": data.train_labels},
        config.batch_size // processes, seed=config.seed,
    )
    test = {"image": _images(data.test_images), "label": data.test_labels}
    # Every test digit, exactly once, at each epoch's end.
    evaluation = flaxhooks.Evaluate(test, at_epoch_end=True, batch_size=config.eval_batch_size, name="test")
    callbacks: list[flaxhooks.Callback] = [
        evaluation,
        flaxhooks.Summary(depth=1),
        flaxhooks.Progress(every=config.log_every),
        flaxhooks.TensorBoard(logdir, every=config.log_every,
                              hparams={**_hyperparameters(config), "data": data.source}),
    ]
    callbacks.append(flaxhooks.Checkpoint(
        Path(workdir) / "checkpoints", every=config.checkpoint_every or None, keep=config.keep_checkpoints,
    ))
    if config.stats_every:
        callbacks += [
            flaxhooks.ActivationStats(every=config.stats_every, histograms=config.histograms),
            flaxhooks.ActivationGradStats(every=config.stats_every, histograms=config.histograms),
        ]
    trainer = flaxhooks.Trainer(
        models[config.api](),
        optax.sgd(config.learning_rate, config.momentum),
        cross_entropy_loss,
        seed=config.seed,
        callbacks=callbacks,
    )
    say = print if jax.process_index() == 0 else (lambda *args, **kwargs: None)
    where = f" on {processes} processes" if processes > 1 else ""
    say(
        f"training on {len(data.train_labels)} {data.source} MNIST digits, "
        f"{jax.device_count()} {trainer.devices[0].platform} device(s){where}, "
        f"{config.epochs} epochs of {len(train)} steps, the CNN in Flax {config.api}",
        flush=True,
    )
    state = trainer.fit(train, epochs=config.epochs, resume=config.resume)
    final = evaluation.result  # the evaluation at the last epoch's end
    assert final is not None and final.step == int(state.step)
    say(
        f"held-out accuracy {final.metrics['accuracy']:.4f}  loss {final.metrics['loss']:.4f} "
        f"({final.examples} {data.source} MNIST test digits, step {int(state.step)})",
        flush=True,
    )
    say(f"view the run: tensorboard --logdir {logdir}", flush=True)
    return {**final.metrics, "examples": final.examples, "steps": int(state.step)}


def parse_config(argv: Sequence[str] | None = None) -> tuple[Config, str]:
    """Builds the Config and workdir from command-line arguments."""
    parser = argparse.ArgumentParser(
        prog="python -m recipes.mnist", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--workdir", default="runs/mnist", help="where the run writes its files")
    for field in dataclasses.fields(Config):
        flag = "--" + field.name.replace("_", "-")
        if field.type == "bool":
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=field.default,
                                help=_HELP[field.name])
            continue
        kind = {"int": int, "float": float, "int | None": int}.get(str(field.type), str)
        parser.add_argument(flag, type=kind, default=field.default,
                            help=_HELP[field.name] + " (default: %(default)s)")
    args = vars(parser.parse_args(argv))
    workdir = args.pop("workdir")
    return Config(**args), workdir


def _join_processes(config: Config) -> None:
    """Joins this process to the others with JAX's own multi-process runtime."""
    import jax

    # CPU devices of several processes reduce over TCP (gloo); GPUs and TPUs
    # use their own interconnect and ignore this.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if config.coordinator == "auto":
        jax.distributed.initialize()
    else:
        jax.distributed.initialize(config.coordinator, config.num_processes, config.process_id)


def main(argv: Sequence[str] | None = None) -> int:
    config, workdir = parse_config(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logging.getLogger("flaxhooks").setLevel(logging.INFO)
    import flaxhooks  # JAX's backends start only when first used, after this

    flaxhooks.use_cpu_devices(config.cpu_devices)
    if config.coordinator or config.num_processes or config.process_id is not None:
        _join_processes(config)
    try:
        train_and_evaluate(config, workdir)
    except flaxhooks.TrainingInterrupted as interrupted:
        print(f"{interrupted}; checkpoint saved: continue with\n"
              f"  python -m recipes.mnist --workdir {workdir} --resume", flush=True)
        return 128 + interrupted.signal  # as a shell reports a signal
    return 0


if __name__ == "__main__":
    sys.exit(main())
