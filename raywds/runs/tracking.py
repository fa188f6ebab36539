"""Experiment tracking (`--tracking mlflow|wandb|tensorboard`): rank 0 sends the run's config and
each epoch's and in-epoch checkpoint's numbers of metrics.jsonl to MLflow or Weights & Biases,
one tracking run per training run, through resumes, Ray restarts and elastic resizes.

    check(["mlflow"])                                                  # before the run: refused in a line
    trackers = Trackers.open(["mlflow"], cfg, run_dir, saved_ids)     # raywds.runs.folder does this
    trackers.row(row)                                                  # each metrics.jsonl row
    trackers.note("doctor", verdict)
    lines = trackers.close(best_checkpoint)                            # what was not sent, a line each
    end_left(run_dir)                                                  # raywds report: what the end could not end

Each tool is configured as it is everywhere else: MLflow by MLFLOW_TRACKING_URI and
MLFLOW_EXPERIMENT_NAME (default experiment `raywds`), W&B by WANDB_PROJECT (default `raywds`),
WANDB_MODE (`offline` writes only files), WANDB_BASE_URL, WANDB_DIR (default the run folder) and
their own credentials. The tracking run's id is kept in RUN_DIR/tracking.json and in each
checkpoint, and reused by whatever continues the run, so its history is one: every number is logged
at step = samples seen (W&B: `samples_seen` is every chart's x axis), which a resume continues.

A server that does not answer within PROBE_S before the run is refused in one line that names it
(`check`). Once the run started nothing here can stop it: each tool's calls run in a thread of
their own (`Sender`), a call that fails is tried again (1 s, 2 s, ... up to 30 s apart; MLflow's own
retries are off, MLFLOW_CLIENT_ENV), and at the run's end the thread has CLOSE_WAIT_S more if the
server answers, none if it does not; whatever is still unsent is one line naming the server, and
metrics.jsonl stays the record. An MLflow run that the end could not end is kept in tracking.json
(NOT_ENDED) and ended as it should have been by the next raywds that reaches its server for the
folder: `--resume` continues it, `raywds report` and `raywds doctor` end it (`end_left`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from raywds.errors import ConfigError, Terminated
from raywds.runs import files as files_of_run
from raywds.runs.sender import CLOSE_WAIT_S, Sender, cause
from raywds.runs.tensorboard import TensorBoard
from raywds.runs.tracker import Opening, Tracker, missing

log = logging.getLogger(__name__)

START_WAIT_S = 10.0
"""How long a run's start waits for its tracking runs to exist (MLflow makes the id), so that the
first checkpoint already holds their ids; past it the run goes on and they start in the background."""
PROBE_S = 2.0
"""How long the check before a run, and the run's end, wait for a tracking server to answer."""
NOT_ENDED = "not_ended"
"""tracking.json's record of the tracking runs a run's end could not end: {tool: {"run_id", "uri",
"status", "end_time"}}, what `end_left` or the run that continues them needs."""
MLFLOW_CLIENT_ENV = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0"}
"""MLflow's client settings while raywds sends, where not set: MLflow's own retries (7, over minutes)
would hold a Sender, which retries itself and which the run's end wakes."""


def ending() -> str:
    """The status of a run that ends its tracking runs now, from the launchers' `finally`: FAILED while
    an error is on its way out, KILLED for SIGTERM or Ctrl-C, else FINISHED."""
    e = sys.exc_info()[1]
    if e is None:
        return "FINISHED"
    return "KILLED" if isinstance(e, Terminated | KeyboardInterrupt) else "FAILED"


@contextlib.contextmanager
def mlflow_client_env() -> Iterator[None]:
    """MLFLOW_CLIENT_ENV's settings where the environment has none, until the context ends."""
    ours = {name: value for name, value in MLFLOW_CLIENT_ENV.items() if name not in os.environ}
    os.environ.update(ours)
    try:
        yield
    finally:
        for name, value in ours.items():
            if os.environ.get(name) == value:
                del os.environ[name]


def params(config: Mapping[str, Mapping[str, Any]]) -> dict[str, str]:
    """The config's fields as parameters, named by section (`plan.batch_size`): text of at most
    500 characters (MLflow's limit)."""
    flat = {f"{section}.{name}": value for section, fields in config.items() for name, value in fields.items()}
    return {k: (v if isinstance(v, str) else json.dumps(v))[:500] for k, v in sorted(flat.items())}


class Mlflow(Tracker):
    """A run in the MLflow tracking server of MLFLOW_TRACKING_URI (or its local store)."""

    name, title, extra = "mlflow", "MLflow", "mlflow"
    sender: Sender
    setting, fixes = "MLFLOW_TRACKING_URI", ("start the server", "fix MLFLOW_TRACKING_URI")

    def __init__(self, run_id: str | None, config: Mapping[str, Mapping[str, Any]], name: str, sender: Sender):
        from mlflow.tracking import MlflowClient, get_tracking_uri

        super().__init__()
        self.uri = str(get_tracking_uri())
        self.client, self.run_id, self.sender = MlflowClient(self.uri), run_id, sender
        self.sender.put(lambda: self._start(config, name))

    @classmethod
    def client_env(cls) -> contextlib.AbstractContextManager[None]:
        return mlflow_client_env()

    @classmethod
    def start(cls, opening: Opening) -> Mlflow:
        assert opening.sender is not None
        return cls(opening.run_id, opening.config, opening.name, opening.sender)

    @classmethod
    def server(cls) -> str | None:
        """The tracking server's URL; None for a local store (nothing to reach)."""
        try:
            from mlflow.tracking import get_tracking_uri
        except ImportError as e:
            raise missing(cls.name, cls.extra, e) from None
        uri = str(get_tracking_uri())
        return uri if uri.startswith(("http://", "https://")) else None

    @classmethod
    def unanswered(cls, uri: str) -> str | None:
        """Why the MLflow server at `uri` gives no answer within PROBE_S (one request, no retries);
        None when it answers, whatever it says (a server without /health answers 404)."""
        from mlflow.utils.credentials import get_default_host_creds
        from mlflow.utils.rest_utils import http_request

        try:
            http_request(  # the server's /health: no store behind it, which may take seconds the first time
                get_default_host_creds(uri), "/health", "GET",
                max_retries=0, backoff_factor=0, retry_codes=(), raise_on_status=False, timeout=PROBE_S,
            )  # fmt: skip
        except Exception as e:  # noqa: BLE001 - whatever keeps the answer away is the answer
            return cause(e, PROBE_S)
        return None

    def _start(self, config: Mapping[str, Mapping[str, Any]], name: str) -> None:
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

    def send(self, step: int, values: dict[str, float]) -> None:
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

    def left(self, status: str) -> dict[str, Any] | None:
        """What tracking.json keeps of this run when the run's end could not end it (None: no run)."""
        if self.run_id is None:
            return None
        return {"run_id": self.run_id, "uri": self.uri, "status": status, "end_time": int(time.time() * 1000)}

    def continues(self, left: Mapping[str, Any] | None) -> bool:
        return left is not None and left.get("run_id") == self.run_id and left.get("uri") == self.uri

    @staticmethod
    def end_left(left: Mapping[str, Any]) -> str | None:
        """End the run of `left` (a NOT_ENDED entry) as it should have ended, if it is still RUNNING;
        None when done, else why not."""
        from mlflow.tracking import MlflowClient

        uri, run_id = str(left["uri"]), str(left["run_id"])
        if uri.startswith(("http://", "https://")) and (why := Mlflow.unanswered(uri)) is not None:
            return why
        with mlflow_client_env():
            try:
                client = MlflowClient(uri)
                if client.get_run(run_id).info.status == "RUNNING":
                    client.set_terminated(run_id, str(left["status"]), left.get("end_time"))
            except Exception as e:  # noqa: BLE001 - whatever the client raises, the record stays
                return cause(e)
        return None


class Wandb(Tracker):
    """A W&B run of project WANDB_PROJECT (WANDB_MODE=offline: files only, `wandb sync` later)."""

    name, title, extra = "wandb", "W&B", "wandb"
    sender: Sender
    setting, fixes = "WANDB_BASE_URL", ("start the server", "fix WANDB_BASE_URL", "set WANDB_MODE=offline")

    def __init__(
        self,
        run_id: str | None,
        config: Mapping[str, Mapping[str, Any]],
        name: str,
        folder: Path | None,
        sender: Sender,
    ):
        import wandb

        super().__init__()
        self.wandb, self.sender = wandb, sender
        self.run: Any = None
        self.run_id = run_id or secrets.token_hex(4)  # (W&B's own ids are 8 letters and digits too)
        self.sender.put(lambda: self._start(config, name, folder))

    @classmethod
    def start(cls, opening: Opening) -> Wandb:
        assert opening.sender is not None
        return cls(opening.run_id, opening.config, opening.name, opening.files, opening.sender)

    @classmethod
    def server(cls) -> str | None:
        """W&B's server (its base URL) as W&B resolves it; None in offline or disabled mode."""
        try:
            import wandb
        except ImportError as e:
            raise missing(cls.name, cls.extra, e) from None
        settings = wandb.Settings()
        config_dir = Path(os.environ.get("WANDB_CONFIG_DIR") or "~/.config/wandb").expanduser()
        settings.settings_system = str(config_dir / "settings")  # where `wandb offline` keeps the mode it sets
        settings.update_from_system_settings()
        settings.update_from_env_vars(dict(os.environ))
        return None if settings.mode in ("offline", "dryrun", "disabled") else str(settings.base_url)

    @classmethod
    def unanswered(cls, url: str) -> str | None:
        """Why the W&B server at `url` gives no answer within PROBE_S; None when it answers."""
        try:
            with urllib.request.urlopen(url, timeout=PROBE_S):
                return None
        except urllib.error.HTTPError:
            return None  # an answer, whatever it says
        except (OSError, ValueError) as e:
            return cause(e, PROBE_S)

    def _start(self, config: Mapping[str, Mapping[str, Any]], name: str, folder: Path | None) -> None:
        where = os.environ.get("WANDB_DIR") or (str(folder) if folder is not None else None)
        self.run = self.wandb.init(
            project=os.environ.get("WANDB_PROJECT") or "raywds", id=self.run_id, name=name, resume="allow",
            dir=where, config=dict(config), reinit="create_new",
        )  # fmt: skip
        self.run.config.update(dict(config), allow_val_change=True)  # a resume's config, where it changed
        self.run.define_metric("samples_seen")
        self.run.define_metric("*", step_metric="samples_seen")
        self.started.set()

    def send(self, step: int, values: dict[str, float]) -> None:
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

    def left(self, status: str) -> dict[str, Any] | None:
        """None: a W&B run that stops sending is marked crashed by W&B itself, and --resume continues it."""
        return None


TRACKERS: dict[str, type[Tracker]] = {tool.name: tool for tool in (Mlflow, Wandb, TensorBoard)}
"""What --tracking takes, each name's tracker (--tensorboard is `tensorboard` too); the Lightning
loggers (raywds.lightning.loggers) make one for each name here."""


def check(names: Sequence[str]) -> dict[str, str | None]:
    """Refuse, before a run starts, a tool of `names` whose client does not import or whose server
    gives no answer within PROBE_S, in one line naming the server; each tool's server (None:
    nothing to reach)."""
    servers: dict[str, str | None] = {}
    for tool in dict.fromkeys(names):
        if tool not in TRACKERS:
            raise ConfigError(f"--tracking {tool}: not one of {', '.join(TRACKERS)}")
        made = TRACKERS[tool]
        server = servers[tool] = made.server()
        if server is not None and (why := made.unanswered(server)) is not None:
            raise ConfigError(
                f"--tracking {tool}: the {made.title} server at {server} ({made.setting}) does not answer "
                f"({why}): {', '.join(made.fixes)}, or train without --tracking {tool}"
            )
    return servers


def end_left(folder: Path) -> None:
    """End the MLflow runs that the run in `folder` left RUNNING (tracking.json's NOT_ENDED) where
    their server answers now, as they should have ended; a line for each, ended or not."""
    path = folder / files_of_run.TRACKING
    record = json.loads(path.read_text()) if path.is_file() else {}
    left = dict(record.get(NOT_ENDED) or {})
    for tool, entry in list(left.items()):
        try:
            why = Mlflow.end_left(entry)
        except ImportError as e:
            why = str(missing(Mlflow.name, Mlflow.extra, e))
        what = f"the MLflow run {entry['run_id']} at {entry['uri']}"
        if why is None:
            log.info(f"tracking: ended {what} as {entry['status']}, which the run's end could not reach")
            del left[tool]
        else:
            log.warning(f"tracking: {what} is still RUNNING ({why}); `raywds report {folder}` ends it once it answers")
    if left != record.get(NOT_ENDED, {}):
        record = {k: v for k, v in record.items() if k != NOT_ENDED}
        path.write_text(json.dumps({**record, **({NOT_ENDED: left} if left else {})}) + "\n")


class Trackers:
    """The tools a run's rows go to, each a Tracker of TRACKERS."""

    def __init__(self, tools: dict[str, Tracker], ids: Path, written: dict[str, Any], left: dict[str, Any]):
        self.tools, self.ids = tools, ids
        self.written = written
        """What tracking.json holds now (written only when it changes)."""
        self.left = left
        """Its NOT_ENDED record: the tracking runs an end could not end, that this run does not continue."""
        self.env = contextlib.ExitStack()

    @classmethod
    def open(
        cls,
        names: Sequence[str],
        config: Mapping[str, Mapping[str, Any]],
        folder: Path,
        saved: Mapping[str, str] | None,
        *,
        name: str | None = None,
        files: Path | None = None,
        append: bool = True,
    ) -> Trackers:
        """Start each of `names` for the run in `folder` (tracking runs called `name`, default the
        folder's), continuing the tracking runs of `saved` (a checkpoint's ids) or of the folder's
        tracking.json; W&B keeps its files in `files` (else its default); `append`: TensorBoard
        keeps the folder's event files."""
        servers = check(names)
        ids_path = folder / files_of_run.TRACKING
        on_disk = json.loads(ids_path.read_text()) if ids_path.is_file() else {}
        known = {**(saved or {}), **on_disk}
        name = name or folder.name
        trackers = cls({}, ids_path, on_disk, dict(on_disk.get(NOT_ENDED) or {}))
        for tool, server in servers.items():
            made = TRACKERS[tool]
            trackers.env.enter_context(made.client_env())
            sender = Sender(tool, server) if made.sends else None
            opening = Opening(known.get(tool), config, name, folder, files, server, append, sender)
            started = trackers.tools[tool] = made.start(opening)
            if started.continues(trackers.left.get(tool)):
                del trackers.left[tool]  # this run ends it
        deadline = time.monotonic() + START_WAIT_S
        for each in trackers.tools.values():
            each.started.wait(max(0.0, deadline - time.monotonic()))
        trackers.keep_ids()
        return trackers

    def saved(self) -> dict[str, str]:
        """Each tool's tracking run id, as far as known (MLflow's once the server made the run)."""
        return {tool: run_id for tool, t in self.tools.items() if (run_id := t.saved()) is not None}

    def keep_ids(self) -> None:
        ids: dict[str, Any] = dict(self.saved())
        if ids and self.left:
            ids[NOT_ENDED] = dict(self.left)
        if ids and ids != self.written:
            self.ids.write_text(json.dumps(ids) + "\n")
            self.written = ids

    def row(self, row: Mapping[str, Any]) -> None:
        for tool in self.tools.values():
            tool.row(row)
        self.keep_ids()

    @property
    def events(self) -> TensorBoard | None:
        """The TensorBoard tracker, where the run has one (its event files' folder)."""
        found = self.tools.get(TensorBoard.name)
        return found if isinstance(found, TensorBoard) else None

    def note(self, key: str, text: str) -> None:
        for tool in self.tools.values():
            tool.note(key, text)

    def close(self, *, best: Path | None = None, status: str | None = None) -> list[str]:
        """End each tracking run as `status` (default: as `ending` says), with the best checkpoint as
        an artifact if given; what was not sent, a line each. A tool whose server does not answer now
        is not waited for; a run it leaves RUNNING is kept in tracking.json for `end_left`."""
        status = status or ending()
        for tool in self.tools.values():
            if best is not None and best.is_file():
                tool.artifact(best)
            tool.end(status)
        lines = []
        for name, tool in self.tools.items():
            if tool.sender is None:  # it wrote as rows came: nothing left to send
                continue
            server = tool.sender.where
            why = type(tool).unanswered(server) if server is not None else None
            line = tool.sender.close(CLOSE_WAIT_S if why is None else 0.0, why)
            if line is not None and (left := tool.left(status)) is not None:
                self.left[name] = left
                line += (
                    f"; the {type(tool).title} run {left['run_id']} there stays RUNNING until `raywds report "
                    f"{self.ids.parent}` or --resume of this run reaches the server"
                )
            lines += [line] if line is not None else []
        self.keep_ids()
        self.env.close()
        return lines
