"""The ``wandb`` and ``mlflow`` trackers (``pip install 'accelkit[wandb]'`` / ``'accelkit[mlflow]'``).

Both keep one run per training job: their ``run_id`` goes into the checkpoint with the trackers'
state (``state["trackers"] = accelkit.tracking.tracker_state(accel)``), and a resumed job's
``init_trackers`` re-attaches to that run instead of starting another. The libraries are
imported when a tracker is built, never by ``import accelkit``.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from accelkit.errors import ConfigError, PluginMissingError

if TYPE_CHECKING:
    from accelkit.log_values import Histogram, Image

log = logging.getLogger("accelkit")


def _require(module: str, tracker: str, package: str) -> Any:
    """Import ``module`` or say which extra installs it."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise PluginMissingError(
            f"the {tracker!r} tracker needs the {package} package: "
            f"pip install 'accelkit[{tracker}]'"
        ) from err


class WandbTracker:
    """A Weights & Biases run: scalars, config, images (``wandb.Image``) and histograms
    (``wandb.Histogram``) in its history at the logged step.

    Files go under ``<directory>/wandb`` unless ``dir=`` or ``WANDB_DIR`` says otherwise;
    ``WANDB_MODE=offline`` keeps the run local (``wandb sync`` uploads it later, resumed parts
    into the same run). ``init_kwargs`` go to ``wandb.init`` (``project``, ``entity``, ``name``,
    ``tags``, ``settings``, ...). Resuming passes the saved id with ``resume="allow"``.
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        config: Mapping[str, Any] | None = None,
        *,
        project: str | None = None,
        resume_run_id: str | None = None,
        **init_kwargs: Any,
    ) -> None:
        wandb = _require("wandb", "wandb", "wandb")
        self._wandb = wandb
        # read now and passed explicitly: wandb keeps the settings of its first run per process
        init_kwargs["dir"] = str(init_kwargs.get("dir") or os.environ.get("WANDB_DIR") or directory)
        Path(init_kwargs["dir"]).mkdir(parents=True, exist_ok=True)
        if resume_run_id is not None:
            init_kwargs.setdefault("id", resume_run_id)
            init_kwargs.setdefault("resume", "allow")
        self.run = wandb.init(
            project=project or os.environ.get("WANDB_PROJECT") or "accelkit",
            config=dict(config) if config else None,
            **init_kwargs,
        )

    @property
    def run_id(self) -> str:
        return self.run.id

    def log_hparams(self, config: Mapping[str, Any]) -> None:
        self.run.config.update(dict(config), allow_val_change=True)

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        self.run.log(dict(metrics), step=step)

    def log_images(self, images: Mapping[str, Image], step: int) -> None:
        self.run.log(
            {
                name: self._wandb.Image(image.to_numpy(), caption=image.caption)
                for name, image in images.items()
            },
            step=step,
        )

    def log_histograms(self, histograms: Mapping[str, Histogram], step: int) -> None:
        self.run.log(
            {
                name: self._wandb.Histogram(np_histogram=hist.counts_and_edges())
                for name, hist in histograms.items()
            },
            step=step,
        )

    def finish(self) -> None:
        self.run.finish()


class MLflowTracker:
    """An MLflow run: scalars as metrics at the logged step, the config as parameters (nested
    keys joined with ``.``), images through ``log_image`` (key and step; MLflow stores no
    caption). MLflow has no histogram type: each histogram is a JSON artifact
    ``histograms/<name>/step-<step>.json`` with ``counts`` and bin ``edges`` (not plotted).

    The store: ``tracking_uri=``, else ``MLFLOW_TRACKING_URI``, else a file store in
    ``<directory>/mlruns`` (MLflow 3 refuses file stores unless ``MLFLOW_ALLOW_FILE_STORE=true``;
    ``sqlite:`` stores need the full ``mlflow`` package, a server URI works with
    ``mlflow-skinny``). The experiment: ``experiment_name=``, else ``MLFLOW_EXPERIMENT_NAME``,
    else ``Default``. MLflow parameters cannot change inside a run: a resumed run's config value
    that differs from the logged one is skipped with a warning.
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        config: Mapping[str, Any] | None = None,
        *,
        tracking_uri: str | None = None,
        experiment_name: str | None = None,
        run_name: str | None = None,
        tags: Mapping[str, str] | None = None,
        resume_run_id: str | None = None,
    ) -> None:
        _require("mlflow", "mlflow", "mlflow-skinny")
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient

        uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:
            store = Path(directory).resolve() / "mlruns"
            store.mkdir(parents=True, exist_ok=True)
            uri = store.as_uri()
        try:
            self.client = MlflowClient(tracking_uri=uri)
        except MlflowException as err:
            raise ConfigError(
                f"the 'mlflow' tracker cannot open the store {uri}: {err.message} (pass "
                "tracker_kwargs={'mlflow': {'tracking_uri': ...}}, or for a local file store "
                "set MLFLOW_ALLOW_FILE_STORE=true)"
            ) from err
        if resume_run_id is not None:
            try:
                run = self.client.get_run(resume_run_id)
            except MlflowException as err:
                raise ConfigError(
                    f"the checkpoint's MLflow run {resume_run_id} is not in {uri}; resume with "
                    "the tracking URI the run was logged to"
                ) from err
            self.client.update_run(resume_run_id, status="RUNNING")
        else:
            name = experiment_name or os.environ.get("MLFLOW_EXPERIMENT_NAME") or "Default"
            experiment = self.client.get_experiment_by_name(name)
            experiment_id = (
                experiment.experiment_id if experiment else self.client.create_experiment(name)
            )
            run = self.client.create_run(experiment_id, run_name=run_name, tags=dict(tags or {}))
        self.run_id: str = run.info.run_id
        if config:
            self.log_hparams(config)

    def log_hparams(self, config: Mapping[str, Any]) -> None:
        from mlflow.entities import Param

        logged = self.client.get_run(self.run_id).data.params
        params = []
        for key, value in _flatten(config).items():
            text = str(value)
            if key in logged:
                if logged[key] != text:
                    log.warning(
                        "mlflow: parameter %r is %r in run %s; the new value %r is not logged "
                        "(MLflow parameters cannot change within a run)",
                        key,
                        logged[key],
                        self.run_id,
                        text,
                    )
                continue
            params.append(Param(key, text))
        for start in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
            self.client.log_batch(self.run_id, params=params[start : start + 100])

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(name, float(value), now, step) for name, value in metrics.items()]
        for start in range(0, len(batch), 1000):  # MLflow takes at most 1000 metrics per batch
            self.client.log_batch(self.run_id, metrics=batch[start : start + 1000])

    def log_images(self, images: Mapping[str, Image], step: int) -> None:
        for name, image in images.items():
            self.client.log_image(self.run_id, image.to_numpy(), key=name, step=step)

    def log_histograms(self, histograms: Mapping[str, Histogram], step: int) -> None:
        for name, hist in histograms.items():
            counts, edges = hist.counts_and_edges()
            self.client.log_dict(
                self.run_id,
                {"step": step, "counts": counts.tolist(), "edges": edges.tolist()},
                f"histograms/{name}/step-{step}.json",
            )

    def finish(self) -> None:
        self.client.set_terminated(self.run_id)


def _flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out.update(_flatten(value, f"{name}."))
        else:
            out[name] = value
    return out
