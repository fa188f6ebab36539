"""A Ray run's folder in a bucket (`raywds ray --storage-path s3://BUCKET/runs`): rank 0 writes
raywds-config.json (when the run starts), metrics.jsonl, best/ and TensorBoard's event files into
a local folder, as for any run, and puts
each file that changed into s3://BUCKET/runs/NAME/ as soon as it is written, beside Ray's own
checkpoint folders. A restarted or resumed rank 0 first fetches the run's metrics.jsonl and
best/metrics.json, so rows are added to the run's record and best/ is replaced only by a better
top-1, as in a folder.

    run_dir = BucketRunDir("s3://bucket/runs/raywds-20261124-101500", endpoint=None)

An object store has no append: metrics.jsonl is put whole each time (a row per epoch and one
every --log-every seconds; a few kB). A put that fails is a warning, not the end of a run: the
next row puts the whole file again, and Ray's checkpoints (the run's state) are Ray's to keep.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from raywds.data import s3
from raywds.errors import DataError
from raywds.runs import files
from raywds.runs.folder import Described, Metrics, RunDir

log = logging.getLogger(__name__)

FETCHED = (files.METRICS, files.BEST_ROW, files.TRACKING)
"""What a restarted or resumed rank 0 needs of the run so far: the rows, the top-1 to beat, the
tracking runs' ids."""


class BucketRunDir(RunDir):
    def __init__(self, url: str, endpoint: str | None = None):
        self.url, self.endpoint = url.rstrip("/"), endpoint
        local = Path(tempfile.mkdtemp(prefix="raywds-run-"))
        for name in FETCHED:
            (local / name).parent.mkdir(parents=True, exist_ok=True)
            s3.get_file(s3.join(self.url, name), local / name, endpoint)
        super().__init__(local, append=True, config=files.RAY_CONFIG)
        self.sent: dict[str, tuple[int, int]] = {}

    def start(self, cfg: Described | None = None, saved: dict[str, str] | None = None) -> None:
        super().start(cfg, saved)
        if cfg is not None:
            self.push(self.path / files.RAY_CONFIG)

    @property
    def name(self) -> str:
        return self.url.rsplit("/", 1)[-1]

    @property
    def tracker_files(self) -> Path | None:
        return None  # this folder is a copy removed at the end: W&B's files where W&B keeps them

    def append(self, row: Mapping[str, Any]) -> None:
        super().append(row)
        self.push(self.metrics_path)
        if (self.path / files.TRACKING).is_file():
            self.push(self.path / files.TRACKING)
        if self.events is not None:  # TensorBoard's files, as the row reached them
            for events in sorted(self.events.folder.iterdir()):
                self.push(events)

    def keep_best(self, metrics: Metrics, state: dict[str, Any]) -> bool:
        kept = super().keep_best(metrics, state)
        if kept:
            for name in (f"{files.BEST}/{files.CHECKPOINT}", files.BEST_ROW):  # the record last
                self.push(self.path / name)
        return kept

    def put_text(self, name: str, text: str) -> None:
        super().put_text(name, text)
        self.push(self.path / name)

    def get_text(self, name: str) -> str | None:
        with tempfile.TemporaryDirectory(prefix="raywds-get-") as tmp:
            got = Path(tmp) / "file"
            return got.read_text() if s3.get_file(s3.join(self.url, name), got, self.endpoint) else None

    def push(self, path: Path) -> None:
        """Put `path` at its place under the run's URL, unless it went up unchanged already."""
        name = path.relative_to(self.path).as_posix()
        stat = path.stat()
        if self.sent.get(name) == (stat.st_size, stat.st_mtime_ns):
            return
        try:
            s3.put_file(path, s3.join(self.url, name), self.endpoint)
        except DataError as e:
            log.warning(f"could not put {name} into the run's bucket (the next row tries again): {e}")
            return
        self.sent[name] = (stat.st_size, stat.st_mtime_ns)

    def close(self, *, artifact: bool = False) -> None:
        """Put what is left, then remove the local copy."""
        super().close(artifact=artifact)
        if (self.path / files.TENSORBOARD).is_dir():
            for events in sorted((self.path / files.TENSORBOARD).iterdir()):
                self.push(events)
        shutil.rmtree(self.path, ignore_errors=True)
