"""Train a small Transformer to add multi-digit numbers, with flaxhooks.

Run ``python -m recipes.addition --help`` for the options. The recipe makes
its own data from the seed (nothing is downloaded): sums such as
``123+045=0168``, a train set and a held-out set with no sum in both. A
decoder-only Transformer learns to write the answer; the held-out exact
match says how many sums it gets entirely right.

Every parameter names its logical axes, so the same model can be sharded:
``--mesh data=4,model=2`` lays the devices out as a mesh and ``--fsdp``
shards the parameters and the optimizer state over ``data`` too.
On a CPU-only host the recipe splits the CPU into 8 XLA devices
(``--cpu-devices``), so a mesh of 8 can be tried anywhere.

Each run writes into a directory of its own, ``runs/addition/<the time it
started>`` (``--workdir`` names another); ``--resume`` goes on with the latest.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from recipes import _common
from recipes._common import MESH_AXES, MeshError, parse_mesh  # noqa: F401 (the recipe's names)


@dataclasses.dataclass(frozen=True)
class Config:
    """The recipe's settings; every field is a command-line option."""

    digits: int = 3
    train_examples: int = 50_000
    eval_examples: int = 2_000
    epochs: int = 8
    batch_size: int = 256
    eval_batch_size: int = 1000
    learning_rate: float = 2e-3
    warmup_steps: int = 100
    weight_decay: float = 0.01
    accumulate: int = 1
    ema: float = 0.0
    width: int = 128
    depth: int = 2
    heads: int = 4
    seed: int = 0
    cpu_devices: int | None = 8
    mesh: str | None = None
    fsdp: bool = False
    log_every: int = 50
    metrics_file: bool = True
    diagnose_every: int = 10
    checkpoint_every: int = 0
    keep_checkpoints: int = 3
    resume: bool = False


_HELP = {
    "digits": "digits of each number added (the answer has one more)",
    "train_examples": "distinct sums to train on, drawn from the seed",
    "eval_examples": "held-out sums, none of them in the train set, each evaluated once per epoch",
    "epochs": "passes over the training set",
    "batch_size": "global batch size, split over the devices",
    "eval_batch_size": "evaluation batch size; the last, smaller batch is padded, not dropped",
    "learning_rate": "AdamW's peak learning rate, reached after the warmup, then decayed to 1% by a cosine",
    "warmup_steps": "steps over which the learning rate rises from 0",
    "weight_decay": "AdamW's weight decay",
    "accumulate": "gradient accumulation: take each batch in this many micro-batches, one after another, "
                  "for one update (the batch's; on GPU and TPU, less memory for the activations)",
    "ema": "also keep an exponential moving average of the weights with this decay, in [0, 1) (e.g. "
           "0.999; 0 for none), and evaluate it beside them (the eval_ema run)",
    "width": "the Transformer's embedding width",
    "depth": "how many Transformer blocks",
    "heads": "attention heads per block (they divide the width)",
    "seed": "seed for the data, initialization and shuffling",
    "cpu_devices": "XLA CPU devices to expose on a host without accelerators (8 lets --mesh data=4,model=2 "
                   "run anywhere)",
    "mesh": "the device mesh as axis sizes, e.g. data=4,model=2: the axes are data and model, an axis left "
            "out has size 1 and the sizes multiply to the device count (default: data over every device)",
    "fsdp": "shard the parameters and optimizer state over the data axis too (FSDP), not only the model "
            "axis",
    "log_every": "log to TensorBoard, and print when not on a terminal, every this many steps",
    "metrics_file": "also write the training and evaluation scalars to metrics.jsonl in the run "
                    "directory (JSON lines: step, run and values per write), to read without TensorBoard",
    "diagnose_every": "sample every this many steps for Diagnose, which names what is wrong with "
                      "training over windows of 200 steps; 0 for never",
    "checkpoint_every": "save a checkpoint every this many steps, besides each epoch's end and the end of "
                        "training; 0 for only those",
    "keep_checkpoints": "how many of the latest checkpoints to keep",
    "resume": "go on with the latest run under runs/addition (or the --workdir given) from its latest "
              "checkpoint; a new run if there is none",
}

#: The least value of numeric options.
_AT_LEAST = {"digits": 1, "train_examples": 1, "eval_examples": 1, "epochs": 1, "batch_size": 1,
             "eval_batch_size": 1, "learning_rate": 0.0, "warmup_steps": 0, "weight_decay": 0.0,
             "accumulate": 1, "ema": 0.0, "width": 1,
             "depth": 1, "heads": 1, "cpu_devices": 1, "log_every": 1, "diagnose_every": 0,
             "checkpoint_every": 0, "keep_checkpoints": 1}

#: Where runs go unless --workdir names a directory: one directory each, named by its start.
RUNS = Path("runs/addition")
#: Options that say where and how a run is placed, not what it is: a resumed run may change them.
_PLACEMENT = ("cpu_devices", "mesh", "fsdp", "resume")
#: The settings runs are compared by in TensorBoard's HParams tab.
_COMPARED = ("digits", "train_examples", "epochs", "batch_size", "learning_rate", "warmup_steps",
             "weight_decay", "accumulate", "ema", "width", "depth", "heads", "seed")

#: Token ids in use (digits, ``+``, ``=``, padding) padded up to a multiple of 8, so the
#: vocabulary splits evenly over a ``model`` axis of 1, 2, 4 or 8 devices.
VOCAB_SIZE = 16

_PROG = "python -m recipes.addition"


class OptionError(ValueError):
    """Settings that cannot run together; the message names the option to change."""


def sharding_arguments(config: Config, mesh_sizes: dict[str, int]) -> dict[str, Any]:
    """The Trainer's ``mesh=``, ``shard=`` and ``axis_rules=`` for ``mesh_sizes``."""
    import flaxhooks
    from recipes.transformer import AXIS_RULES

    mesh = _common.mesh_of(mesh_sizes)
    shard = flaxhooks.FSDP("data") if config.fsdp else flaxhooks.Replicated()
    # Rules to an axis this mesh lacks keep those dimensions whole.
    rules = tuple((name, axis if axis in mesh_sizes else None) for name, axis in AXIS_RULES)
    return {"mesh": mesh, "shard": shard, "axis_rules": rules}


def _hyperparameters(config: Config) -> dict[str, Any]:
    """The settings runs differ by (a resumed run, or one on other devices, is the same run)."""
    return {k: getattr(config, k) for k in _COMPARED}


def _metrics() -> dict[str, Any]:
    """The held-out metrics, each a mean over every example (padding masked out)."""
    from clu import metrics

    return {name: metrics.Average.from_output(name) for name in ("loss", "token_accuracy", "exact_match")}


def check_options(config: Config, device_count: int) -> dict[str, int]:
    """Refuses settings that cannot run, before anything is made or written.

    Returns:
        The mesh's axis sizes (``--mesh``, else ``data`` over every device).

    Raises:
        OptionError: the heads do not divide the width or split over the
            mesh's ``model`` axis; the digits are out of range or have fewer
            distinct sums than the examples asked for.
        MeshError: ``--mesh`` does not fit ``device_count`` devices.
    """
    from recipes import addition_data

    if config.width % config.heads:
        raise OptionError(f"--heads {config.heads} does not divide --width {config.width}")
    if config.digits > addition_data.MAX_DIGITS:
        raise OptionError(f"--digits {config.digits}: the recipe adds numbers of at most "
                          f"{addition_data.MAX_DIGITS} digits")
    sums = 10 ** (2 * config.digits)
    if config.train_examples + config.eval_examples > sums:
        raise OptionError(
            f"--digits {config.digits} makes {sums} distinct sums, fewer than --train-examples "
            f"{config.train_examples} and --eval-examples {config.eval_examples} together")
    mesh_sizes = parse_mesh(config.mesh or f"data={device_count}", device_count)
    if config.heads % mesh_sizes["model"]:
        raise OptionError(f"--heads {config.heads} does not split over the {mesh_sizes['model']} devices "
                          "of the mesh's model axis")
    return mesh_sizes


def train_and_evaluate(config: Config, workdir: str | Path) -> dict[str, float]:
    """Trains the Transformer on sums and evaluates it on every held-out sum.

    Args:
        config: the settings.
        workdir: where the run writes its files.

    Returns:
        The final held-out ``exact_match`` (the fraction of sums whose whole
        answer is right), ``token_accuracy`` (of the answer's digits) and
        ``loss`` (cross-entropy on the answer's tokens), the number of
        ``examples`` evaluated and the number of train ``steps``.
        Checkpoints go to ``workdir/checkpoints`` (each epoch's end, every
        ``checkpoint_every`` steps, and on Ctrl-C or SIGTERM, after which
        :class:`flaxhooks.TrainingInterrupted` is raised); ``config.resume``
        goes on from the latest. TensorBoard logs go to
        ``workdir/tensorboard`` (and, with ``config.metrics_file``, the same
        scalars to ``workdir/metrics.jsonl``); the options to ``workdir/options.json`` once
        the run is accepted. Errors are raised as they are (``main`` turns
        refusals into one line).

    Raises:
        OptionError, MeshError: settings that cannot run (:func:`check_options`), before
            anything is written.
    """
    import jax
    import optax

    import flaxhooks
    from recipes import addition_data
    from recipes.transformer import Transformer, batch_loss, example_loss

    mesh_sizes = check_options(config, jax.device_count())
    sums = addition_data.make_sums(config.digits, config.train_examples, config.eval_examples, config.seed)
    Path(workdir).mkdir(parents=True, exist_ok=True)
    logdir = str(Path(workdir) / "tensorboard")
    train = flaxhooks.ArrayLoader(sums.train(), config.batch_size, seed=config.seed)
    steps = config.epochs * len(train)
    schedule = optax.warmup_cosine_decay_schedule(
        # A run shorter than the warmup still decays over its last step.
        0.0, config.learning_rate, min(config.warmup_steps, steps - 1), steps, config.learning_rate / 100,
    )
    # Clipping keeps the first steps, before the warmup has settled Adam's statistics, from jumping.
    optimizer = optax.chain(optax.clip_by_global_norm(1.0),
                            optax.adamw(schedule, weight_decay=config.weight_decay))
    model = Transformer(vocab_size=VOCAB_SIZE, length=addition_data.sequence_length(config.digits) - 1,
                        width=config.width, depth=config.depth, heads=config.heads)
    # Every held-out sum, exactly once, at each epoch's end.
    evaluation = flaxhooks.Evaluate(sums.eval(), at_epoch_end=True, batch_size=config.eval_batch_size,
                                    metrics=_metrics(), name="eval",
                                    weights="both" if config.ema else "trained")
    lines: list[str] = []  # what runs, said once the Trainer has accepted the run
    callbacks: list[flaxhooks.Callback] = [
        _common.run_start(config, workdir, lines, _PLACEMENT),
        evaluation,
        flaxhooks.Summary(depth=1),
        flaxhooks.Progress(every=config.log_every),
        flaxhooks.TensorBoard(logdir, every=config.log_every, hparams=_hyperparameters(config)),
        flaxhooks.Checkpoint(Path(workdir) / "checkpoints", every=config.checkpoint_every or None,
                             keep=config.keep_checkpoints),
    ]
    if config.metrics_file:
        callbacks.append(_common.metrics_file(workdir, config.log_every))
    if config.diagnose_every:  # its report (findings.md, heatmaps) beside the TensorBoard logs
        report = Path(workdir) / "diagnose"
        callbacks.append(flaxhooks.Diagnose(every=config.diagnose_every, report_dir=report))
    sharding = sharding_arguments(config, mesh_sizes)
    trainer = flaxhooks.Trainer(
        flaxhooks.as_model(model, input_keys=("tokens",)),
        flaxhooks.with_ema(optimizer, config.ema) if config.ema else optimizer,
        functools.partial(batch_loss, pad=addition_data.PAD),
        # The metrics read the targets by name: there are no class labels.
        label_key=None,
        example_loss_fn=functools.partial(example_loss, pad=addition_data.PAD),
        seed=config.seed,
        callbacks=callbacks,
        accumulate=config.accumulate,
        **sharding,
    )
    axes = ",".join(f"{name}={size}" for name, size in mesh_sizes.items())
    placement = f"mesh {axes}{', FSDP over data' if config.fsdp else ''}"

    counted = _common.counted
    lines += [
        f"training a {config.depth}-block Transformer (width {config.width}, {config.heads} heads) on "
        f"{len(sums.train_pairs)} {config.digits}-digit sums: {counted(config.epochs, 'epoch')} of "
        f"{counted(len(train), 'step')}",
        f"{counted(jax.device_count(), trainer.devices[0].platform.upper() + ' device')}, {placement}; "
        f"run directory: {workdir}",
    ]
    state = trainer.fit(train, epochs=config.epochs, resume=config.resume)
    final = evaluation.result  # the evaluation at the last epoch's end
    assert final is not None and final.step == int(state.step)
    print(
        f"held-out exact match {final.metrics['exact_match']:.4f}  token accuracy "
        f"{final.metrics['token_accuracy']:.4f}  loss {final.metrics['loss']:.4f} "
        f"({final.examples} unseen {config.digits}-digit sums, step {int(state.step)})",
        flush=True,
    )
    averaged = evaluation.ema_result
    if averaged is not None:
        print(f"the weights' moving average (--ema {config.ema:g}): held-out exact match "
              f"{averaged.metrics['exact_match']:.4f}  token accuracy "
              f"{averaged.metrics['token_accuracy']:.4f}", flush=True)
    print(_common.viewing(logdir, RUNS), flush=True)
    if config.metrics_file:
        print(_common.metrics_line(workdir), flush=True)
    ema = {} if averaged is None else {f"ema_{k}": v for k, v in averaged.metrics.items()}
    return {**final.metrics, **ema, "examples": final.examples, "steps": int(state.step)}


def _parser() -> argparse.ArgumentParser:
    """The command line: one option per Config field, and ``--workdir``."""
    return _common.build_parser(Config, _HELP, prog=_PROG, description=__doc__.split("\n\n")[0], runs=RUNS,
                                least=_AT_LEAST, metavars={"mesh": "AXES"})


def parse_config(argv: Sequence[str] | None = None) -> tuple[Config, str | None]:
    """Builds the Config and workdir (None: a new run directory) from command-line arguments."""
    parser = _parser()
    args = vars(parser.parse_args(argv))
    if not args["ema"] < 1:
        parser.error(f"argument --ema: must be less than 1, got {args['ema']:g}")
    workdir = args.pop("workdir")
    return Config(**args), workdir


def refusal(error: BaseException, workdir: str | Path, config: Config) -> str | None:
    """What to tell a person whose run was refused, in one line naming the
    option to change; None when ``error`` is not a refusal (a fault: its
    traceback is what helps)."""
    from recipes import mnist

    if isinstance(error, OptionError):
        return str(error)
    if isinstance(error, MeshError):
        return f"--mesh {config.mesh or '(default)'}: {error}"
    # The checkpoint, run-directory and batch refusals read as MNIST's do.
    return mnist.refusal(error, workdir, config)


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the recipe from the command line; a refused run is one line on
    stderr and exit status 2, as a usage error."""
    config, workdir = parse_config(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logging.getLogger("flaxhooks").setLevel(logging.INFO)
    import jax

    import flaxhooks  # JAX's backends start only when first used, after this
    from flaxhooks.processes import latest_run

    flaxhooks.use_cpu_devices(config.cpu_devices)
    if not config.resume:  # refused before a run directory is made (a resumed run's options are its own)
        try:
            check_options(config, jax.device_count())
        except (OptionError, MeshError) as error:
            print(f"{_PROG}: error: {refusal(error, '', config)}", file=sys.stderr, flush=True)
            return 2
    new = workdir is None and (not config.resume or latest_run(RUNS) is None)  # a directory made for this run
    run = flaxhooks.run_directory(RUNS, resume=config.resume) if workdir is None else Path(workdir)
    if config.resume:
        given = _common.given_options(_parser(), Config, argv)
        config = _common.resumed_config(config, given, run, _PLACEMENT)
    try:
        train_and_evaluate(config, run)
    except flaxhooks.TrainingInterrupted as interrupted:
        print(f"to go on from step {interrupted.step}:\n  {_PROG} --workdir {run} --resume", flush=True)
        return 128 + interrupted.signal  # as a shell reports a signal
    except Exception as error:
        if new:  # a run that never started leaves no directory to resume, whatever stopped it
            _common.remove_if_unstarted(run)
        message = refusal(error, run, config)
        if message is None:
            raise
        print(f"{_PROG}: error: {message}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
