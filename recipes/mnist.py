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
import textwrap
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
    profile: bool = False
    checkpoint_every: int = 0
    keep_checkpoints: int = 3
    resume: bool = False
    coordinator: str | None = None
    num_processes: int | None = None
    process_id: int | None = None


_HELP = {
    "api": "the Flax API the CNN is written with, linen or nnx: the same network either way",
    "epochs": "passes over the training set",
    "batch_size": "global batch size, split over the devices",
    "eval_batch_size": "evaluation batch size; the last, smaller batch is padded, not dropped",
    "learning_rate": "SGD learning rate",
    "momentum": "SGD momentum",
    "seed": "seed for initialization and shuffling",
    "data_dir": "directory holding the four MNIST .gz files, checked by sha256 (default: the cache dir)",
    "cache_dir": "where downloaded MNIST is kept (default: $FLAXHOOKS_CACHE, else "
                 "~/.cache/flaxhooks/mnist)",
    "download": "try to download full MNIST when it is not found locally",
    "cpu_devices": "XLA CPU devices to expose (default: one per core, unless XLA_FLAGS sets it)",
    "log_every": "log to TensorBoard, and print when not on a terminal, every this many steps",
    "stats_every": "log per-layer statistics (activations, their gradients, parameter updates) every "
                   "this many steps, 0 for never",
    "histograms": "with the statistics, also log per-layer histograms",
    "profile": "trace steps 10 to 12 with jax.profiler into the TensorBoard run, for its Profile tab; "
               "viewing it needs pip install tensorboard-plugin-profile",
    "checkpoint_every": "save a checkpoint every this many steps, besides each epoch's end and the "
                        "end of training; 0 for only those",
    "keep_checkpoints": "how many of the latest checkpoints to keep",
    "resume": "go on from the latest checkpoint in the workdir, or start afresh if there is none",
    "coordinator": "several processes: the address (host:port) of process 0, where JAX's coordination "
                   "service runs, with --num-processes and --process-id; or 'auto' to let JAX detect "
                   "all three (SLURM, Cloud TPU, ...)",
    "num_processes": "several processes: how many take part",
    "process_id": "several processes: this one's index, from 0",
}

#: The settings runs are compared by in TensorBoard's HParams tab (with the
#: data and the model's size); the rest (paths, logging, placement) are not results.
_COMPARED = ("api", "epochs", "batch_size", "learning_rate", "momentum", "seed")


def _images(images: Any) -> Any:
    import numpy as np

    return (np.asarray(images, np.float32) / 255.0)[..., None]


def _hyperparameters(config: Config) -> dict[str, Any]:
    """The settings runs differ by (a resumed run, or one on other devices, is the same run)."""
    return {k: getattr(config, k) for k in _COMPARED}


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
        ``workdir/tensorboard``: the ``train`` and ``eval`` sub-runs (loss,
        accuracy, the optimizer's gradient norm and update ratio, as means
        over each logging window), the model summary, the hyperparameters,
        and every ``stats_every`` steps per-layer statistics
        (``stats/activations/...``: each module's output and the post-ReLU
        values the CNN sows; ``stats/activation_grads/...``;
        ``stats/params/...``), one Custom Scalars chart per statistic.
        ``config.profile`` traces steps 10 to 12 for TensorBoard's Profile tab.
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
    evaluation = flaxhooks.Evaluate(test, at_epoch_end=True, batch_size=config.eval_batch_size, name="eval")
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
    if config.profile:
        callbacks.append(flaxhooks.Profile(logdir))
    if config.stats_every:
        callbacks += [
            flaxhooks.ActivationStats(every=config.stats_every, histograms=config.histograms),
            flaxhooks.ActivationGradStats(every=config.stats_every, histograms=config.histograms),
            flaxhooks.ParamStats(every=config.stats_every),
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

    def counted(count: int, noun: str) -> str:  # "1 epoch", "2 epochs"
        return f"{count} {noun}" if count == 1 else f"{count} {noun}s"

    devices = counted(jax.device_count(), f"{trainer.devices[0].platform.upper()} device")
    say(
        f"training on {len(data.train_labels)} {data.source} MNIST digits, {devices}{where}, "
        f"{counted(config.epochs, 'epoch')} of {counted(len(train), 'step')}, the CNN in Flax {config.api}",
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
    """Builds the Config and workdir from command-line arguments.

    Each option's help ends with its default, once: unless it has none or its
    text already says it (``BooleanOptionalAction`` adds one of its own on
    some Python versions; it is replaced).
    """

    class Formatter(argparse.HelpFormatter):
        """Wraps help without breaking an option's name (``--num-processes``) at
        a hyphen, or a default from its value."""

        def _split_lines(self, text: str, width: int) -> list[str]:
            glued = " ".join(text.split()).replace("(default: ", "(default:\0")  # \0: not a space to wrap at
            return [line.replace("\0", " ") for line in textwrap.wrap(glued, width, break_on_hyphens=False)]

    def with_default(text: str, flag: str, default: Any) -> str:
        if default is None or "(default" in text:
            return text
        if isinstance(default, bool):  # the flag that is in effect
            default = flag if default else "--no-" + flag[2:]
        return f"{text} (default: {default})".replace("%", "%%")  # argparse %-formats help

    parser = argparse.ArgumentParser(
        prog="python -m recipes.mnist", description=__doc__.split("\n\n")[0], formatter_class=Formatter,
    )
    parser.add_argument("--workdir", default="runs/mnist", metavar="DIR",
                        help=with_default("where the run writes its files", "--workdir", "runs/mnist"))
    metavars = {int: "N", float: "X", "data_dir": "DIR", "cache_dir": "DIR", "coordinator": "ADDRESS"}
    for field in dataclasses.fields(Config):
        flag = "--" + field.name.replace("_", "-")
        if field.type == "bool":
            action = parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=field.default)
        else:
            kind = {"int": int, "float": float, "int | None": int}.get(str(field.type), str)
            action = parser.add_argument(flag, type=kind, default=field.default,
                                         metavar=metavars.get(kind) or metavars.get(field.name))
        action.help = with_default(_HELP[field.name], flag, field.default)
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
