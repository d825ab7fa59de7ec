"""MLflow logging for training runs (rank 0 only; other ranks get a logger that does nothing).

The run id is kept in the output folder, so a resumed training continues the same MLflow run
and its loss curve simply goes on from the checkpoint's step. Metrics are buffered and sent in
batches: a SQLite store costs a transaction per call, which would otherwise rival a CPU step.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import mlflow
from mlflow import MlflowClient
from mlflow.entities import Metric, Param
from mlflow.exceptions import MlflowException

from components.registry.mlflow_registry import configure
from components.training.config import MlflowSection

RUN_ID_FILE = "mlflow_run.json"


class RunLogger:
    """``log_params`` / ``log_metrics`` / ``log_model_folder`` / ``finish``; inactive when disabled."""

    def __init__(self, section: MlflowSection, output_dir: Path, active: bool, flush_every: int = 20):
        self.section = section
        self.output_dir = output_dir
        self.active = active and section.enabled
        self.flush_every = flush_every
        self.run_id: str | None = None
        self._pending: list[Any] = []
        self._client = None

    def start(self, run_name: str, tags: dict[str, str], resume: bool = False) -> str | None:
        """Open the MLflow run; with ``resume`` continue the run recorded in the output folder."""
        if not self.active:
            return None

        try:
            experiment_id = configure(self.section.tracking_uri, self.section.experiment)
        except Exception as exc:
            raise RuntimeError(
                f"MLflow tracking at {self.section.tracking_uri or 'the default store'} is unavailable ({exc}); "
                "fix the tracking URI or set mlflow.enabled=false to train without tracking"
            ) from exc
        self._client = MlflowClient()
        id_file = self.output_dir / RUN_ID_FILE
        previous = json.loads(id_file.read_text())["run_id"] if resume and id_file.exists() else None
        if previous is not None:
            try:
                self._client.get_run(previous)
                self.run_id = previous
                self._client.update_run(previous, status="RUNNING")
            except mlflow.exceptions.MlflowException:
                previous = None
        if self.run_id is None:
            run = self._client.create_run(experiment_id, run_name=run_name, tags=tags)
            self.run_id = run.info.run_id
            id_file.parent.mkdir(parents=True, exist_ok=True)
            id_file.write_text(json.dumps({"run_id": self.run_id, "tracking_uri": mlflow.get_tracking_uri()}))
        return self.run_id

    def log_params(self, params: dict[str, Any]) -> None:
        if not self.active:
            return

        existing = self._client.get_run(self.run_id).data.params
        fresh = [Param(k, str(v)[:6000]) for k, v in params.items() if k not in existing]
        for start in range(0, len(fresh), 100):
            self._client.log_batch(self.run_id, params=fresh[start : start + 100])

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        if not self.active:
            return

        now = int(time.time() * 1000)
        self._pending += [Metric(k, float(v), now, step) for k, v in metrics.items()]
        if len(self._pending) >= self.flush_every * max(1, len(metrics)):
            self.flush()

    def flush(self) -> None:
        """Send buffered metrics; a failed send (e.g. SQLite locked by another writer) is retried
        at the next flush instead of stopping the training."""
        if not self.active or not self._pending:
            return

        try:
            while self._pending:
                self._client.log_batch(self.run_id, metrics=self._pending[:900])
                self._pending = self._pending[900:]
        except MlflowException as exc:
            print(f"[train] MLflow metric upload failed, will retry: {exc}")

    def log_file(self, path: Path, artifact_path: str | None = None) -> None:
        if self.active:
            self._client.log_artifact(self.run_id, str(path), artifact_path)

    def log_model_folder(self, folder: Path) -> None:
        if self.active and self.section.log_model:
            self._client.log_artifacts(self.run_id, str(folder), artifact_path="model")

    def set_tags(self, tags: dict[str, str]) -> None:
        if self.active:
            for key, value in tags.items():
                self._client.set_tag(self.run_id, key, value)

    def finish(self, status: str = "FINISHED") -> None:
        if not self.active:
            return
        self.flush()
        self._client.set_terminated(self.run_id, status=status)
