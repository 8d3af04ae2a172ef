"""Train Flax's MNIST CNN with flaxhooks, data-parallel over every device.

Run ``python -m recipes.mnist --help`` for the options. On a CPU-only host the
recipe splits the CPU into one XLA device per core (``--cpu-devices`` or an
``XLA_FLAGS`` device count overrides that) and trains across them with one
jitted step over a device mesh (``--mesh`` lays it out, ``--fsdp`` shards the
state over it).

Full MNIST is used when it can be found or downloaded; otherwise the recipe
says so and trains on the real MNIST sample bundled in ``recipes/data``.

Each run writes into a directory of its own, ``runs/mnist/<the time it
started>`` (``--workdir`` names another); ``--resume`` goes on with the latest.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import logging
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

from recipes import _common
from recipes._common import OPTIONS as OPTIONS  # where a run's options are saved
from recipes._common import saved_options


@dataclasses.dataclass(frozen=True)
class Config:
    """The recipe's settings; every field is a command-line option."""

    api: str = "linen"
    precision: str = "float32"
    epochs: int = 10
    batch_size: int = 128
    eval_batch_size: int = 1000
    learning_rate: float = 0.1
    momentum: float = 0.9
    accumulate: int = 1
    ema: float = 0.0
    seed: int = 0
    data_dir: str | None = None
    cache_dir: str | None = None
    download: bool = True
    loader: str = "array"
    cpu_devices: int | None = None
    mesh: str | None = None
    fsdp: bool = False
    log_every: int = 50
    metrics_file: bool = True
    stats_every: int = 100
    diagnose_every: int = 10
    histograms: bool = True
    profile: bool = False
    checkpoint_every: int = 0
    keep_checkpoints: int = 3
    resume: bool = False
    coordinator: str | None = None
    num_processes: int | None = None
    process_id: int | None = None


_HELP = {
    "api": "the Flax API the CNN is written with: the same network either way",
    "precision": "what the layers compute in: 'float32', or 'bf16' (bfloat16, the parameters and the "
                 "loss staying float32)",
    "epochs": "passes over the training set",
    "batch_size": "global batch size, split over the devices",
    "eval_batch_size": "evaluation batch size; the last, smaller batch is padded, not dropped",
    "learning_rate": "SGD learning rate",
    "momentum": "SGD momentum",
    "accumulate": "gradient accumulation: take each batch in this many micro-batches, one after another, "
                  "for one update (the batch's; less memory for the activations)",
    "ema": "also keep an exponential moving average of the weights with this decay, in [0, 1) (e.g. "
           "0.999; 0 for none), and evaluate it beside them (the eval_ema run)",
    "seed": "seed for initialization and shuffling",
    "data_dir": "directory holding the four MNIST .gz files, checked by sha256 (default: the cache dir)",
    "cache_dir": "where downloaded MNIST is kept (default: $FLAXHOOKS_CACHE, else "
                 "~/.cache/flaxhooks/mnist)",
    "download": "try to download full MNIST when it is not found locally",
    "loader": "the training input: 'array' (flaxhooks.ArrayLoader) or 'grain' (a grain MapDataset: "
              "pip install 'flaxhooks[grain]'); either resumes mid-epoch exactly",
    "cpu_devices": "XLA CPU devices to expose (default: one per core, unless XLA_FLAGS sets it)",
    "mesh": "the device mesh as data=N,model=M (default: every device on data); the batch is split "
            "over data, and the CNN, which names no axis, is whole on each model device",
    "fsdp": "shard the parameters and the optimizer state over the data axis (FSDP) instead of "
            "keeping them whole on every device",
    "log_every": "log to TensorBoard, and print when not on a terminal, every this many steps",
    "metrics_file": "also write the training and evaluation scalars to metrics.jsonl in the run "
                    "directory (JSON lines: step, run and values per write), to read without TensorBoard",
    "diagnose_every": "sample every this many steps for Diagnose, which names what is wrong with "
                      "training (dead units, vanishing gradients, loss spikes, ...) over windows of 200 "
                      "steps; 0 for never",
    "stats_every": "log per-layer statistics (activations, their gradients, parameter updates) every "
                   "this many steps, 0 for never",
    "histograms": "with the statistics, also log per-layer histograms",
    "profile": "trace steps 10 to 12 with jax.profiler into the TensorBoard run, for its Profile tab; "
               "viewing it needs pip install tensorboard-plugin-profile",
    "checkpoint_every": "save a checkpoint every this many steps, besides each epoch's end and the "
                        "end of training; 0 for only those",
    "keep_checkpoints": "how many of the latest checkpoints to keep",
    "resume": "go on with the latest run under runs/mnist (or the --workdir given) from its latest "
              "checkpoint; a new run if there is none",
    "coordinator": "several processes: the address (host:port) of process 0, where JAX's coordination "
                   "service runs, with --num-processes and --process-id; or 'auto' to let JAX detect "
                   "all three (Cloud TPU, Kubernetes, ...); none of them under srun or mpirun, "
                   "which JAX reads itself",
    "num_processes": "several processes: how many take part",
    "process_id": "several processes: this one's index, from 0",
}

#: Options that take one of a few values, and the least value of numeric ones.
_CHOICES = {"api": ("linen", "nnx"), "precision": ("float32", "bf16")}
_AT_LEAST = {"epochs": 1, "batch_size": 1, "eval_batch_size": 1, "learning_rate": 0.0, "log_every": 1,
             "accumulate": 1, "ema": 0.0,
             "stats_every": 0, "diagnose_every": 0, "checkpoint_every": 0, "keep_checkpoints": 1,
             "cpu_devices": 1, "num_processes": 1, "process_id": 0}

#: Where runs go unless --workdir names a directory: one directory each, named by its start.
RUNS = Path("runs/mnist")

#: Options that say where and how a run is placed, not what it is: a resumed run may change them.
_PLACEMENT = ("cpu_devices", "mesh", "fsdp", "coordinator", "num_processes", "process_id", "resume")

#: The settings runs are compared by in TensorBoard's HParams tab (with the
#: data and the model's size); the rest (paths, logging, placement) are not results.
_COMPARED = ("api", "precision", "epochs", "batch_size", "learning_rate", "momentum", "accumulate", "ema",
             "seed")


def train_loader(config: Config, arrays: dict[str, Any], batch_size: int) -> Any:
    """This process's batches of ``arrays``, from flaxhooks' ArrayLoader or from grain."""
    import jax

    import flaxhooks

    if config.loader == "array":
        return flaxhooks.ArrayLoader(arrays, batch_size, seed=config.seed)
    if config.loader != "grain":
        raise ValueError(f"--loader must be 'array' or 'grain', got {config.loader!r}")
    try:
        import grain
    except ImportError as error:
        raise ValueError("--loader grain needs grain: pip install 'flaxhooks[grain]' (Python 3.11 or later)"
                         ) from error
    # The examples' indices shuffled globally, every process-count-th one for this process (its
    # share of every batch), batched, then each batch gathered from the arrays at once: for arrays
    # in memory, one gather a batch costs far less than making and stacking each example.
    indices = grain.MapDataset.range(len(arrays["label"])).seed(config.seed).shuffle()
    mine = indices[jax.process_index()::jax.process_count()].batch(batch_size, drop_remainder=True)
    return mine.map(_common.Gather(arrays))


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
        The final held-out ``accuracy`` and ``loss`` (with ``config.ema``, the moving
        average's as ``ema_accuracy`` and ``ema_loss``), the number of ``examples``
        evaluated and the number of train ``steps``. Checkpoints go to
        ``workdir/checkpoints`` (each epoch's end, every ``checkpoint_every``
        steps, and on Ctrl-C or SIGTERM, after which
        :class:`flaxhooks.TrainingInterrupted` is raised); ``config.resume``
        goes on from the latest. TensorBoard logs go to
        ``workdir/tensorboard``: the ``train`` and ``eval`` sub-runs (loss,
        accuracy, the optimizer's gradient norm and update ratio, as means
        over each logging window), the model summary, the hyperparameters,
        and every ``stats_every`` steps per-layer statistics, one run per
        layer (``layers/Conv_0``, ``layers/Conv_0_relu`` for the post-ReLU
        values the CNN sows, ...) with one tag per statistic
        (``stats/activations/mean``, ``stats/activation_grads/log10_rms``,
        ``stats/params/log10_update_ratio``, ...), one chart per statistic.
        ``config.metrics_file`` writes the same scalars to ``workdir/metrics.jsonl``.
        ``config.profile`` traces steps 10 to 12 for TensorBoard's Profile tab.
        ``config.diagnose_every`` samples steps for :class:`flaxhooks.Diagnose`,
        whose findings are logged, charted under ``health/`` and written with its
        heatmaps to ``workdir/diagnose``.
        The options go to ``workdir/options.json`` once the run is accepted.
        Errors are raised as they are (``main`` turns refusals into one line).
    """
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    import flaxhooks
    from recipes import mnist_data
    from recipes.models import CNN, NNXCNN, cross_entropy_loss

    dtypes = {"float32": jnp.float32, "bf16": jnp.bfloat16}
    if config.precision not in dtypes:
        raise ValueError(f"--precision must be one of {sorted(dtypes)}, got {config.precision!r}")
    dtype = dtypes[config.precision]
    models: dict[str, Callable[[], CNN | NNXCNN]] = {
        "linen": lambda: CNN(dtype=dtype), "nnx": lambda: NNXCNN(nnx.Rngs(config.seed), dtype=dtype)}
    if config.api not in models:
        raise ValueError(f"--api must be one of {sorted(models)}, got {config.api!r}")
    Path(workdir).mkdir(parents=True, exist_ok=True)
    logdir = str(Path(workdir) / "tensorboard")
    # Why it fell back to the bundled sample, if it did, is said once the run is accepted.
    data = mnist_data.load_mnist(config.data_dir, config.cache_dir, download=config.download, warn=False)
    processes = jax.process_count()
    if config.batch_size % processes:
        raise flaxhooks.BatchError(f"the global batch does not divide over {processes} processes")
    # Each process takes its own share of every global batch.
    train = train_loader(config, {"image": _images(data.train_images), "label": data.train_labels},
                    config.batch_size // processes)
    test = {"image": _images(data.test_images), "label": data.test_labels}
    # Every test digit, exactly once, at each epoch's end.
    evaluation = flaxhooks.Evaluate(test, at_epoch_end=True, batch_size=config.eval_batch_size, name="eval",
                                    weights="both" if config.ema else "trained")
    lines: list[str] = []  # what runs, said once the Trainer has accepted the run
    callbacks: list[flaxhooks.Callback] = [
        _run_start(config, workdir, lines),
        evaluation,
        flaxhooks.Summary(depth=1),
        flaxhooks.Progress(every=config.log_every),
        flaxhooks.TensorBoard(logdir, every=config.log_every,
                              hparams={**_hyperparameters(config), "data": data.source}),
    ]
    if config.metrics_file:
        callbacks.append(_common.metrics_file(workdir, config.log_every))
    callbacks.append(flaxhooks.Checkpoint(
        Path(workdir) / "checkpoints", every=config.checkpoint_every or None, keep=config.keep_checkpoints,
    ))
    if config.profile:
        callbacks.append(flaxhooks.Profile(logdir))
    if config.diagnose_every:  # its report (findings.md, heatmaps) beside the TensorBoard logs
        report = Path(workdir) / "diagnose"
        callbacks.append(flaxhooks.Diagnose(every=config.diagnose_every, report_dir=report))
    if config.stats_every:
        callbacks += [
            flaxhooks.ActivationStats(every=config.stats_every, histograms=config.histograms),
            flaxhooks.ActivationGradStats(every=config.stats_every, histograms=config.histograms),
            flaxhooks.ParamStats(every=config.stats_every),
        ]
    mesh_sizes = _common.parse_mesh(config.mesh or f"data={jax.device_count()}", jax.device_count())
    optimizer = optax.sgd(config.learning_rate, config.momentum)
    trainer = flaxhooks.Trainer(
        models[config.api](),
        flaxhooks.with_ema(optimizer, config.ema) if config.ema else optimizer,
        cross_entropy_loss,
        accumulate=config.accumulate,
        seed=config.seed,
        callbacks=callbacks,
        mesh=_common.mesh_of(mesh_sizes),
        shard=flaxhooks.FSDP("data") if config.fsdp else flaxhooks.Replicated(),
    )
    say = print if jax.process_index() == 0 else (lambda *args, **kwargs: None)
    where = f" on {processes} processes" if processes > 1 else ""

    counted = _common.counted
    devices = counted(jax.device_count(), f"{trainer.devices[0].platform.upper()} device")
    placed = (f", mesh {','.join(f'{k}={v}' for k, v in mesh_sizes.items())}" if config.mesh else "") + (
        ", FSDP over data" if config.fsdp else "")
    lines += [
        *([data.note] if data.source != "full" else []),
        f"training the Flax {config.api} CNN on {len(data.train_labels)} {data.source} MNIST digits: "
        f"{counted(config.epochs, 'epoch')} of {counted(len(train), 'step')}",
        f"{devices}{where}{placed}; run directory: {workdir}",
    ]
    state = trainer.fit(train, epochs=config.epochs, resume=config.resume)
    final = evaluation.result  # the evaluation at the last epoch's end
    assert final is not None and final.step == int(state.step)
    say(
        f"held-out accuracy {final.metrics['accuracy']:.4f}  loss {final.metrics['loss']:.4f} "
        f"({final.examples} {data.source} MNIST test digits, step {int(state.step)})",
        flush=True,
    )
    averaged = evaluation.ema_result
    if averaged is not None:
        say(f"the weights' moving average (--ema {config.ema:g}): held-out accuracy "
            f"{averaged.metrics['accuracy']:.4f}  loss {averaged.metrics['loss']:.4f}", flush=True)
    say(_viewing(logdir), flush=True)
    if config.metrics_file:
        say(_common.metrics_line(workdir), flush=True)
    ema = {} if averaged is None else {f"ema_{k}": v for k, v in averaged.metrics.items()}
    return {**final.metrics, **ema, "examples": final.examples, "steps": int(state.step)}


def resumed_config(config: Config, given: set[str], workdir: str | Path) -> Config:
    """``config`` for going on with the run in ``workdir``: the options it was
    started with, except those the command line sets itself."""
    return _common.resumed_config(config, given, workdir, _PLACEMENT)


def _run_start(config: Config, workdir: str | Path, lines: Sequence[str]) -> Any:
    """A callback that says what runs (``lines``) and saves the options once the Trainer accepts the run."""
    return _common.run_start(config, workdir, lines, _PLACEMENT)


def _viewing(logdir: str) -> str:
    """The command that views the run (and every run of the recipe), installing TensorBoard if missing."""
    return _common.viewing(logdir, RUNS)


_at_least = _common.at_least


def parse_config(argv: Sequence[str] | None = None) -> tuple[Config, str | None]:
    """Builds the Config and workdir (None: a new run directory) from command-line arguments."""
    parser = _parser()
    args = vars(parser.parse_args(argv))
    if args["loader"] == "grain" and importlib.util.find_spec("grain") is None:
        parser.error("--loader grain needs grain: pip install 'flaxhooks[grain]' (Python 3.11 or later)")
    if not args["ema"] < 1:
        parser.error(f"argument --ema: must be less than 1, got {args['ema']:g}")
    workdir = args.pop("workdir")
    return Config(**args), workdir


def given_options(argv: Sequence[str] | None = None) -> set[str]:
    """The Config fields the command line sets itself (the rest take their defaults)."""
    return _common.given_options(_parser(), Config, argv)


def _parser() -> argparse.ArgumentParser:
    """The command line: one option per Config field, and ``--workdir``."""
    return _common.build_parser(
        Config, _HELP, prog="python -m recipes.mnist", description=__doc__.split("\n\n")[0], runs=RUNS,
        choices=_CHOICES, least=_AT_LEAST,
        metavars={"data_dir": "DIR", "cache_dir": "DIR", "coordinator": "ADDRESS"},
    )


def _join_processes(config: Config) -> None:
    """Joins this process to the others with JAX's own multi-process runtime."""
    import jax

    # CPU devices of several processes reduce over TCP (gloo); GPUs and TPUs
    # use their own interconnect and ignore this.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    # What is not given, JAX detects from the cluster (SLURM, Open MPI, Cloud TPU, Kubernetes).
    coordinator = None if config.coordinator == "auto" else config.coordinator
    jax.distributed.initialize(coordinator, config.num_processes, config.process_id)


class RunOptions(Protocol):
    """What :func:`refusal` reads of a recipe's Config (the addition recipe's too)."""

    @property
    def batch_size(self) -> int: ...

    @property
    def mesh(self) -> str | None: ...


def refusal(error: BaseException, workdir: str | Path, config: RunOptions) -> str | None:
    """What to tell a person whose run was refused, in one line naming the
    option to change; None when ``error`` is not a refusal (a fault: its
    traceback is what helps)."""
    import flaxhooks
    from flaxhooks.callbacks import CheckpointConflictError, CheckpointError, CheckpointMismatchError

    cause: BaseException | None = error
    while isinstance(cause, flaxhooks.ProcessError):  # several processes: the refusal behind it
        cause = cause.__cause__
    if isinstance(cause, CheckpointConflictError):
        return (f"{workdir} holds another run (checkpoints up to step {max(cause.steps)}): "
                "add --resume to go on with it, or leave --workdir out to start a new run in a directory "
                "of its own")
    if isinstance(cause, CheckpointMismatchError):
        started = (saved_options(workdir) or {}).get("api")
        if started is not None and isinstance(config, Config) and started != config.api:
            return (f"the run in {workdir} was started with --api {started}: leave --api out to go on with "
                    "it, or leave --resume out to start a new run")
        return (f"the checkpoint in {workdir} does not fit this model: the model changed since it was "
                "saved; resume it with the options it was started with, or leave --resume out to start a "
                "new run")
    if isinstance(cause, (CheckpointError, flaxhooks.LogdirError)):
        return f"{cause} (--workdir {workdir})"
    if isinstance(cause, flaxhooks.BatchError):
        return f"--batch-size {config.batch_size}: {cause}"
    if isinstance(cause, (_common.MeshError, flaxhooks.ShardingError)):
        return f"--mesh {config.mesh}: {cause}"
    return None


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the recipe from the command line; a refused run is one line on
    stderr and exit status 2, as a usage error."""
    config, workdir = parse_config(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logging.getLogger("flaxhooks").setLevel(logging.INFO)
    import flaxhooks  # JAX's backends start only when first used, after this
    from flaxhooks.processes import latest_run

    several = (bool(config.coordinator or config.num_processes or config.process_id is not None)
               or _common.launched_processes() is not None)
    flaxhooks.use_cpu_devices(config.cpu_devices, across_processes=several)
    if several:
        _join_processes(config)
    latest = latest_run(RUNS) if workdir is None and config.resume else None
    if workdir is None and config.resume and latest is None and (RUNS / "checkpoints").is_dir():
        workdir = str(RUNS)  # a run of flaxhooks 0.5, which wrote into runs/mnist itself
    new = workdir is None and latest is None  # a directory made for this run
    run = flaxhooks.run_directory(RUNS, resume=config.resume) if workdir is None else Path(workdir)
    if config.resume:
        config = resumed_config(config, given_options(argv), run)
    try:
        train_and_evaluate(config, run)
    except flaxhooks.TrainingInterrupted as interrupted:
        print(f"to go on from step {interrupted.step}:\n  python -m recipes.mnist --workdir {run} --resume",
              flush=True)
        return 128 + interrupted.signal  # as a shell reports a signal
    except Exception as error:
        if new:  # a run that never started leaves no directory to resume, whatever stopped it
            _common.remove_if_unstarted(run)
        message = refusal(error, run, config)
        if message is None:
            raise
        print(f"python -m recipes.mnist: error: {message}", file=sys.stderr, flush=True)
        return 2
    return 0



if __name__ == "__main__":
    sys.exit(main())
