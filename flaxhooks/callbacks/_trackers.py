"""Experiment trackers: the training and evaluation scalars in a Weights & Biases or an MLflow run."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from flaxhooks.callbacks._scalars import ScalarLogger
from flaxhooks.contract import Every, Loop
from flaxhooks.writers import AsyncWriter, MlflowWriter, WandbWriter, Writer, check_writable


def require(who: str, extra: str, *modules: str) -> None:
    """Raises ImportError, naming the extra to install, if a package ``who`` needs is missing."""
    missing = [module for module in modules if importlib.util.find_spec(module) is None]
    if missing:
        raise ImportError(f"{who} needs {', '.join(missing)}, which is not installed: "
                          f'pip install "flaxhooks[{extra}]"')


class Wandb(ScalarLogger):
    """Logs the training and evaluation scalars to a Weights & Biases run, off the training thread.

    Needs ``pip install "flaxhooks[wandb]"``. Each value is named by its sub-run
    and tag (``train/loss``, ``eval/accuracy``, ``layers/<name>/stats/...``) and
    charted against ``global_step``. Each fit runs ``wandb.init`` to
    ``finish`` on one run: later fits, and a run resumed from a checkpoint
    (which keeps its id), go on with it; W&B keeps every row, so the steps
    between a checkpoint and a failure appear twice after a resume. Text is
    a string value, histograms are W&B's; images are left out.

    Args:
        project: the W&B project (default: wandb's, ``$WANDB_PROJECT``).
        every: when to write training scalars (default every 50 steps).
        hparams: the run's config (``parameters`` is added).
        learning_rate: a schedule ``step -> learning rate`` to log (default: an
            ``optax.inject_hyperparams`` one, if found).
        **init: more ``wandb.init`` arguments: ``name``, ``dir``, ``mode``
            (``"offline"``: nothing leaves the machine; ``wandb sync`` uploads
            it later), ``entity``, ``group``, ``tags``, ``settings``, ``id``...

    Examples:
        >>> import tempfile, flaxhooks
        >>> logger = flaxhooks.Wandb("mnist", mode="offline", dir=tempfile.mkdtemp())  # doctest: +SKIP
    """

    #: ``wandb.init`` arguments it sets itself, and what to give instead.
    RESERVED = {"config": "hparams=", "reinit": "nothing", "resume": "id="}

    def __init__(self, project: str | None = None, every: Every | int | None = None,
                 hparams: Mapping[str, Any] | None = None, learning_rate: Callable[[int], Any] | None = None,
                 **init: Any):
        require("Wandb", "wandb", "wandb")
        for name, instead in self.RESERVED.items():
            if name in init:
                raise ValueError(f"Wandb sets wandb.init's {name} itself: give {instead}")
        self.project = project
        self.run_id: str | None = init.pop("id", None)
        self.init = init
        if init.get("dir") is not None:
            check_writable(init["dir"], "W&B runs")
        super().__init__(every=every, learning_rate=learning_rate, hparams=hparams)
        self._backend: WandbWriter | None = None

    def __repr__(self) -> str:
        return f"Wandb({self.project!r}, every={self.every!r})"

    def state_dict(self) -> dict[str, Any]:
        """The run's id (a resumed run goes on with it) and the steps since the last log."""
        return {"run_id": self.run_id, **super().state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.run_id = state.get("run_id") or self.run_id
        super().load_state_dict(state)

    def new_writer(self, loop: Loop | None) -> Writer:
        import wandb

        run = wandb.init(project=self.project, config=self.hparams_with_size() or None, id=self.run_id,
                         resume="allow" if self.run_id else None, reinit="create_new", **self.init)
        self.run_id = run.id
        self._backend = WandbWriter(run)
        return self._backend

    def before_close(self, loop: Loop, writer: AsyncWriter) -> None:
        if self._backend is not None:
            self._backend.exit_code = 0 if loop.exception is None else 1


class MLflow(ScalarLogger):
    """Logs the training and evaluation scalars to an MLflow run, off the training thread.

    Needs ``pip install "flaxhooks[mlflow]"``. Each value is a metric named by
    its sub-run and tag (``train/loss``, ``eval/accuracy``; a character MLflow
    refuses becomes ``_``) at its step; ``hparams`` are the run's parameters.
    Later fits, and a run resumed from a checkpoint (which keeps its id), go
    on with the run; MLflow keeps every point, so the steps between a
    checkpoint and a failure appear twice after a resume. Text goes to the
    run's artifacts; histograms and images are left out.

    Args:
        directory: a local store: runs in ``directory/mlflow.db`` (SQLite),
            artifacts in ``directory/artifacts``; view them with ``mlflow ui
            --backend-store-uri sqlite:///<directory>/mlflow.db``.
        tracking_uri: any MLflow tracking URI instead (a server, ``sqlite:///...``).
            Neither: MLflow's default (``$MLFLOW_TRACKING_URI``, else ``./mlflow.db``).
        experiment: the experiment's name (made if missing).
        run_name: the run's name (default: MLflow's).
        tags: the run's tags.
        every: when to write training scalars (default every 50 steps).
        hparams: the run's parameters (``parameters`` is added).
        learning_rate: a schedule ``step -> learning rate`` to log (default: an
            ``optax.inject_hyperparams`` one, if found).

    Examples:
        >>> import tempfile, flaxhooks
        >>> logger = flaxhooks.MLflow(tempfile.mkdtemp(), hparams={"lr": 0.1})  # doctest: +SKIP
    """

    def __init__(self, directory: str | os.PathLike[str] | None = None, *, tracking_uri: str | None = None,
                 experiment: str = "flaxhooks", run_name: str | None = None,
                 tags: Mapping[str, str] | None = None, every: Every | int | None = None,
                 hparams: Mapping[str, Any] | None = None, learning_rate: Callable[[int], Any] | None = None):
        if directory is not None and tracking_uri is not None:
            raise ValueError("MLflow takes a directory (a local store) or a tracking_uri, not both")
        local = tracking_uri is None or tracking_uri.startswith("sqlite:")
        require("MLflow", "mlflow", "mlflow", *(("sqlalchemy", "alembic") if local else ()))
        self.directory = None if directory is None else os.path.abspath(directory)
        if self.directory is not None:
            check_writable(self.directory, "MLflow runs")
            tracking_uri = f"sqlite:///{self.directory}/mlflow.db"
        self.tracking_uri = tracking_uri
        self.experiment = experiment
        self.run_name = run_name
        self.tags = dict(tags or {})
        self.run_id: str | None = None
        super().__init__(every=every, learning_rate=learning_rate, hparams=hparams)
        self._params: set[str] = set()  # the parameters logged (MLflow's are written once)
        self._backend: MlflowWriter | None = None

    def __repr__(self) -> str:
        return f"MLflow({self.tracking_uri!r}, every={self.every!r})"

    def state_dict(self) -> dict[str, Any]:
        """The run's id (a resumed run goes on with it), its parameters and the steps since the last log."""
        return {"run_id": self.run_id, "params": sorted(self._params), **super().state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.run_id = state.get("run_id") or self.run_id
        self._params = set(state.get("params", ()))
        super().load_state_dict(state)

    def new_writer(self, loop: Loop | None) -> Writer:
        from mlflow import MlflowClient
        from mlflow.entities import Param

        client = MlflowClient(tracking_uri=self.tracking_uri)
        if self.run_id is None:
            found = client.get_experiment_by_name(self.experiment)
            if found is not None:
                experiment = found.experiment_id
            else:
                artifacts = None if self.directory is None else Path(self.directory, "artifacts").as_uri()
                experiment = client.create_experiment(self.experiment, artifact_location=artifacts)
            self.run_id = client.create_run(experiment, run_name=self.run_name, tags=self.tags).info.run_id
        else:
            client.update_run(self.run_id, status="RUNNING")
        params = {k: str(v) for k, v in self.hparams_with_size().items() if k not in self._params}
        if params:
            client.log_batch(self.run_id, params=[Param(k, v) for k, v in params.items()])
            self._params.update(params)
        self._backend = MlflowWriter(client, self.run_id)
        return self._backend

    def before_close(self, loop: Loop, writer: AsyncWriter) -> None:
        if self._backend is not None:
            failed = loop.exception
            self._backend.status = ("FINISHED" if failed is None else
                                    "KILLED" if isinstance(failed, KeyboardInterrupt) else "FAILED")
