"""Experiment tracking (`--tracking mlflow|wandb|tensorboard`): rank 0 sends the run's config and
each epoch's and in-epoch checkpoint's numbers of metrics.jsonl to MLflow or Weights & Biases,
one tracking run per training run, through resumes, Ray restarts and elastic resizes.

    trackers = Trackers.open(["mlflow"], cfg, run_dir, saved_ids)     # raywds.runs.folder does this
    trackers.row(row)                                                  # each metrics.jsonl row
    trackers.note("doctor", verdict)
    lines = trackers.close(best_checkpoint)                            # what was not sent, a line each

Each tool is configured as it is everywhere else: MLflow by MLFLOW_TRACKING_URI and
MLFLOW_EXPERIMENT_NAME (default experiment `raywds`), W&B by WANDB_PROJECT (default `raywds`),
WANDB_MODE (`offline` writes only files), WANDB_DIR (default the run folder) and their own
credentials. The tracking run's id is kept in RUN_DIR/tracking.json and in each checkpoint, and
reused by whatever continues the run, so its history is one: every number is logged at step =
samples seen (W&B: `samples_seen` is every chart's x axis), which a resume continues.

Nothing here can stop a run: each tool's calls run in a thread of their own (`Sender`), a call
that fails is tried again (1 s, 2 s, ... up to 30 s apart), and at the run's end the thread has
CLOSE_WAIT_S more; whatever is still unsent is one line, and metrics.jsonl stays the record.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import secrets
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from raywds.errors import ConfigError
from raywds.runs import files as files_of_run
from raywds.runs.rows import kind

log = logging.getLogger(__name__)

TRACKERS = ("mlflow", "wandb", "tensorboard")
"""What --tracking takes (tensorboard: raywds.runs.tensorboard, what --tensorboard turns on)."""
EXTRAS = {"mlflow": "mlflow", "wandb": "wandb"}
"""The raywds extra each tool's client comes in."""
EPOCH_METRICS = (
    "train_loss", "val_loss", "val_top1", "val_top5", "lr", "images_per_s", "data_wait_max", "samples_seen",
    "epoch", "optimizer_steps", "global_batch", "steps_redone", "bad_samples", "epoch_duplicates", "epoch_missing",
    "val_loss_ema", "val_top1_ema", "val_top5_ema",
)  # fmt: skip
"""An epoch row's numbers that the trackers get (the val_ ones on epochs that validated)."""
CHECKPOINT_METRICS = ("samples_seen", "epoch_samples_done")
"""An in-epoch checkpoint row's: how far the epoch is, at the checkpoint cadence."""
START_WAIT_S = 10.0
"""How long a run's start waits for its tracking runs to exist (MLflow makes the id), so that the
first checkpoint already holds their ids; past it the run goes on and they start in the background."""
CLOSE_WAIT_S = 15.0
"""How long the end of a run waits for a tool's unsent calls."""
RETRY_MAX_S = 30.0


def numbers(row: Mapping[str, Any]) -> tuple[int, dict[str, float]] | None:
    """(samples seen, the numbers to log) of a metrics.jsonl row; None for a progress row (rank 0's
    look inside an epoch every --log-every seconds, for TensorBoard and the console)."""
    keys: tuple[str, ...]
    if kind(row) == "epoch":
        keys = EPOCH_METRICS
    elif kind(row) == "checkpoint":
        keys = CHECKPOINT_METRICS
    else:
        return None
    return int(row["samples_seen"]), {key: float(row[key]) for key in keys if isinstance(row.get(key), int | float)}


class Sender:
    """One thread that makes a tool's calls in order, each until it goes through; `close` gives it
    CLOSE_WAIT_S more and says what is left."""

    def __init__(self, name: str):
        self.name = name
        self.calls: queue.Queue[Callable[[], object] | None] = queue.Queue()
        self.sent = self.unsent = 0
        self.error = ""
        self.deadline: float | None = None
        self.thread = threading.Thread(target=self._run, name=f"raywds-{name}", daemon=True)
        self.thread.start()

    def put(self, call: Callable[[], object]) -> None:
        self.calls.put(call)

    def _run(self) -> None:
        while (call := self.calls.get()) is not None:
            wait = 1.0
            while True:
                try:
                    call()
                    self.sent += 1
                    break
                except Exception as e:  # noqa: BLE001 - whatever the client raises, training goes on
                    self.error = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
                    if self.deadline is not None and time.monotonic() + wait > self.deadline:
                        self.unsent += 1 + self._drop()
                        return
                    time.sleep(wait)
                    wait = min(wait * 2, RETRY_MAX_S)

    def _drop(self) -> int:
        dropped = 0
        while self.calls.get() is not None:
            dropped += 1
        return dropped

    def close(self, wait_s: float = CLOSE_WAIT_S) -> str | None:
        """Wait up to `wait_s` for the calls still queued; a line of what was not sent, or None."""
        self.deadline = time.monotonic() + wait_s
        self.calls.put(None)
        self.thread.join(wait_s + 1)
        left = self.unsent + (self.calls.qsize() if self.thread.is_alive() else 0)
        if self.thread.is_alive():
            left += 1  # the call under way
        if not left:
            return None
        return (
            f"{self.name}: {left} of {self.sent + left} updates were not sent ({self.error or 'no answer'}); "
            "metrics.jsonl in the run folder holds every number"
        )


def missing(tool: str, e: ImportError) -> ConfigError:
    return ConfigError(
        f"--tracking {tool} needs the {tool} package, which does not import here ({e}): "
        f"pip install 'raywds[{EXTRAS[tool]}]'"
    )


def params(config: Mapping[str, Any]) -> dict[str, str]:
    """The config's fields as parameters: text of at most 500 characters (MLflow's limit)."""
    return {k: (v if isinstance(v, str) else json.dumps(v))[:500] for k, v in sorted(config.items())}


class Mlflow:
    """A run in the MLflow tracking server of MLFLOW_TRACKING_URI (or its local ./mlruns)."""

    def __init__(self, run_id: str | None, config: Mapping[str, Any], name: str, sender: Sender):
        try:
            from mlflow.tracking import MlflowClient
        except ImportError as e:
            raise missing("mlflow", e) from None
        self.client, self.run_id, self.sender = MlflowClient(), run_id, sender
        self.started = threading.Event()
        self.sender.put(lambda: self._start(config, name))

    def _start(self, config: Mapping[str, Any], name: str) -> None:
        from mlflow.entities import Param

        client = self.client
        if self.run_id is None:
            experiment = os.environ.get("MLFLOW_EXPERIMENT_NAME") or "raywds"
            found = client.get_experiment_by_name(experiment)
            experiment_id = found.experiment_id if found is not None else client.create_experiment(experiment)
            self.run_id = client.create_run(experiment_id, run_name=name).info.run_id
            before: dict[str, str] = {}
        else:
            client.update_run(self.run_id, status="RUNNING")
            before = client.get_run(self.run_id).data.params
        new = {k: v for k, v in params(config).items() if k not in before}
        changed = {f"resumed.{k}": v for k, v in params(config).items() if k in before and before[k] != v}
        items = [Param(k, v) for k, v in new.items()]
        for i in range(0, len(items), 100):  # MLflow takes up to 100 params a batch
            client.log_batch(self.run_id, params=items[i : i + 100])
        for key, value in changed.items():  # a parameter cannot change: the resumed run's value is a tag
            client.set_tag(self.run_id, key, value)
        self.started.set()

    def row(self, step: int, values: dict[str, float]) -> None:
        from mlflow.entities import Metric

        stamp = int(time.time() * 1000)
        metrics = [Metric(k, v, stamp, step) for k, v in values.items()]
        self.sender.put(lambda: self.client.log_batch(self._id(), metrics=metrics))

    def note(self, key: str, text: str) -> None:
        self.sender.put(lambda: self.client.set_tag(self._id(), key, text[:5000]))

    def artifact(self, path: Path) -> None:
        self.sender.put(lambda: self.client.log_artifact(self._id(), str(path), "best"))

    def end(self, status: str) -> None:
        self.sender.put(lambda: self.client.set_terminated(self._id(), status))

    def _id(self) -> str:
        if self.run_id is None:
            raise RuntimeError("the MLflow run was not created")
        return self.run_id

    def saved(self) -> str | None:
        return self.run_id


class Wandb:
    """A W&B run of project WANDB_PROJECT (WANDB_MODE=offline: files only, `wandb sync` later)."""

    def __init__(self, run_id: str | None, config: Mapping[str, Any], name: str, folder: Path | None, sender: Sender):
        try:
            import wandb
        except ImportError as e:
            raise missing("wandb", e) from None
        self.wandb, self.sender = wandb, sender
        self.run: Any = None
        self.started = threading.Event()
        self.run_id = run_id or secrets.token_hex(4)  # (W&B's own ids are 8 letters and digits too)
        self.sender.put(lambda: self._start(config, name, folder))

    def _start(self, config: Mapping[str, Any], name: str, folder: Path | None) -> None:
        where = os.environ.get("WANDB_DIR") or (str(folder) if folder is not None else None)
        self.run = self.wandb.init(
            project=os.environ.get("WANDB_PROJECT") or "raywds", id=self.run_id, name=name, resume="allow",
            dir=where, config=dict(config), reinit="create_new",
        )  # fmt: skip
        self.run.config.update(dict(config), allow_val_change=True)  # a resume's config, where it changed
        self.run.define_metric("samples_seen")
        self.run.define_metric("*", step_metric="samples_seen")
        self.started.set()

    def row(self, step: int, values: dict[str, float]) -> None:
        self.sender.put(lambda: self.run.log({**values, "samples_seen": step}))

    def note(self, key: str, text: str) -> None:
        self.sender.put(lambda: self.run.summary.update({key: text}))

    def artifact(self, path: Path) -> None:
        def send() -> None:
            artifact = self.wandb.Artifact(f"{self.run_id}-best", type="model")
            artifact.add_file(str(path))
            self.run.log_artifact(artifact)

        self.sender.put(send)

    def end(self, status: str) -> None:
        self.sender.put(lambda: self.run.finish(exit_code=0 if status == "FINISHED" else 1))

    def saved(self) -> str | None:
        return self.run_id


class Trackers:
    """The tools a run sends to (not TensorBoard, which writes files as rows come: raywds.runs.folder)."""

    def __init__(self, tools: dict[str, Any], senders: list[Sender], ids: Path, written: dict[str, str]):
        self.tools, self.senders, self.ids = tools, senders, ids
        self.written = written
        """What tracking.json holds now (written only when the ids change)."""

    @classmethod
    def open(
        cls,
        names: Sequence[str],
        config: Mapping[str, Any],
        folder: Path,
        saved: Mapping[str, str] | None,
        *,
        name: str | None = None,
        files: Path | None = None,
    ) -> Trackers:
        """Start each of `names` (but tensorboard) for the run in `folder` (tracking runs called
        `name`, default the folder's), continuing the tracking runs of `saved` (a checkpoint's
        ids) or of the folder's tracking.json; W&B keeps its files in `files` (else its default)."""
        ids_path = folder / files_of_run.TRACKING
        on_disk = json.loads(ids_path.read_text()) if ids_path.is_file() else {}
        known = {**(saved or {}), **on_disk}
        name = name or folder.name
        tools: dict[str, Any] = {}
        senders = []
        for tool in dict.fromkeys(names):
            if tool == "tensorboard":
                continue
            sender = Sender(tool)
            senders.append(sender)
            if tool == "mlflow":
                tools[tool] = Mlflow(known.get(tool), config, name, sender)
            elif tool == "wandb":
                tools[tool] = Wandb(known.get(tool), config, name, files, sender)
            else:
                raise ConfigError(f"--tracking {tool}: not one of {', '.join(TRACKERS)}")
        trackers = cls(tools, senders, ids_path, on_disk)
        deadline = time.monotonic() + START_WAIT_S
        for tool in tools.values():
            tool.started.wait(max(0.0, deadline - time.monotonic()))
        trackers.keep_ids()
        return trackers

    def saved(self) -> dict[str, str]:
        """Each tool's tracking run id, as far as known (MLflow's once the server made the run)."""
        return {tool: run_id for tool, t in self.tools.items() if (run_id := t.saved()) is not None}

    def keep_ids(self) -> None:
        ids = self.saved()
        if ids and ids != self.written:
            self.ids.write_text(json.dumps(ids) + "\n")
            self.written = ids

    def row(self, row: Mapping[str, Any]) -> None:
        got = numbers(row)
        if got is not None:
            for tool in self.tools.values():
                tool.row(*got)
        self.keep_ids()

    def note(self, key: str, text: str) -> None:
        for tool in self.tools.values():
            tool.note(key, text)

    def close(self, *, best: Path | None = None, status: str = "FINISHED") -> list[str]:
        """End each tracking run (with the best checkpoint as an artifact, if given); what was not sent."""
        for tool in self.tools.values():
            if best is not None and best.is_file():
                tool.artifact(best)
            tool.end(status)
        lines = [line for sender in self.senders if (line := sender.close()) is not None]
        self.keep_ids()
        return lines
