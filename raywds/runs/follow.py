"""Follow a run from outside it: a progress bar drawn from the rows rank 0 appends to the run's
metrics.jsonl (raywds.runs.folder), for a run in another process (a Ray run's workers, a
torchrun job, a `raywds train` started elsewhere). In Jupyter the bar is a widget
(tqdm.auto); on a terminal it is tqdm's text bar.

    name, storage = time.strftime("nb-%Y%m%d-%H%M%S"), "runs/ray"
    with follow(os.path.join(storage, name), epochs=cfg.epochs):
        run = ray_train.run(cfg, RayOptions(storage_path=storage, name=name))

Progress rows come every `log_every` of the run's config (60 s by default: set it to a few
seconds for a bar that moves inside epochs); each finished epoch moves the bar too.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from raywds.runs import files
from raywds.runs.rows import kind

"""Where a run folder keeps its resolved config: a Ray run's driver writes the first, local runs the second."""


class RunProgress:
    """Where a run stands, from its metrics.jsonl rows: steps done, the run's total steps once
    an epoch's length is known, and a short line (epoch, loss, top-1)."""

    def __init__(self, epochs: int | None = None, max_steps: int | None = None):
        self.epochs = epochs
        self.max_steps = max_steps
        self.steps = 0
        """Steps done in all (a resumed run's earlier steps included)."""
        self.steps_per_epoch: int | None = None
        self.epoch_end_steps: dict[int, int] = {}
        """Finished epoch (1-based) -> steps done at its end."""
        self.status = ""

    @property
    def total(self) -> int | None:
        """The run's steps: epochs epochs (or max_steps, if fewer); None until both are known."""
        if self.epochs is None or self.steps_per_epoch is None:
            return self.max_steps
        total = self.epochs * self.steps_per_epoch
        return min(total, self.max_steps) if self.max_steps is not None else total

    def add(self, row: dict[str, Any]) -> None:
        """One row of metrics.jsonl: a progress row, a finished epoch, an in-epoch checkpoint, or an
        epoch's validation done apart."""
        epochs = f"/{self.epochs}" if self.epochs else ""
        if kind(row) == "progress":
            epoch, self.steps_per_epoch = int(row["epoch"]), int(row["steps_in_epoch"])
            start = self.epoch_end_steps.get(epoch - 1, (epoch - 1) * self.steps_per_epoch)
            self.steps = start + int(row["step_in_epoch"])
            self.status = f"epoch {epoch}{epochs}  loss {row['loss']:.3f}"
        elif kind(row) == "checkpoint":  # its epoch is 0-based, its step counts the whole run
            self.steps = int(row["step"])
        elif kind(row) == "validation":  # an earlier epoch's, validated apart while training went on
            self.status = f"epoch {row['epoch']}{epochs} validated  top-1 {row['val_top1']:.3f}"
        else:
            epoch, self.steps = int(row["epoch"]), int(row["step"])
            self.epoch_end_steps[epoch] = self.steps
            if self.steps_per_epoch is None:
                self.steps_per_epoch = self.steps // max(epoch, 1)
            top1 = f"  top-1 {row['val_top1']:.3f}" if "val_top1" in row else ""
            self.status = f"epoch {epoch}{epochs} done  loss {row.get('train_loss', float('nan')):.3f}{top1}"


class RowReader:
    """The complete rows appended to a JSONL file since the last read; starts over when the
    file was rewritten (its first row changed, or it is shorter than what was read) and waits
    while it does not exist."""

    def __init__(self, path: Path):
        self.path = path
        self.offset = 0
        self.first = b""
        """The first row read, to tell a rewritten file from a longer one."""

    def read(self) -> tuple[list[dict[str, Any]], bool]:
        """(new rows, whether the file started over)."""
        try:
            with self.path.open("rb") as f:
                size = f.seek(0, 2)
                f.seek(0)
                restarted = size < self.offset or (self.offset > 0 and f.read(len(self.first)) != self.first)
                if restarted:
                    self.offset, self.first = 0, b""
                f.seek(self.offset)
                data = f.read(size - self.offset)
        except FileNotFoundError:
            return [], False
        complete = data[: data.rfind(b"\n") + 1]  # a row being written waits for its newline
        if not self.first:
            self.first = complete[: complete.find(b"\n") + 1]
        self.offset += len(complete)
        rows = []
        for line in complete.splitlines():
            try:
                row = json.loads(line)
            except ValueError:  # not a row of ours: skip it rather than stop following
                continue
            if isinstance(row, dict):
                rows.append(row)
        return rows, restarted


def run_config(run_dir: Path) -> dict[str, Any]:
    """The resolved config in `run_dir`, or {} when it has none yet."""
    for name in (files.RAY_CONFIG, files.CONFIG):
        try:
            config = json.loads((run_dir / name).read_text())
        except (OSError, ValueError):
            continue
        if isinstance(config, dict):
            return config
    return {}


class Follower:
    """A thread that reads new rows every `poll_s` and moves `bar`; `stop()` reads the last ones,
    then closes the bar (red in Jupyter when the run ended short of its total)."""

    def __init__(self, run_dir: Path, progress: RunProgress, bar: Any, poll_s: float):
        self.run_dir, self.progress, self.bar, self.poll_s = run_dir, progress, bar, poll_s
        self.reader = RowReader(run_dir / files.METRICS)
        self.polls = 0
        """Reads done so far (by the thread or `stop()`): a caller can wait for the next one."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"follow {run_dir.name}", daemon=True)

    def start(self) -> Follower:
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(self.poll_s):
            self.poll()

    def poll(self) -> None:
        """Read what was appended and redraw the bar."""
        progress = self.progress
        if progress.epochs is None:
            config = run_config(self.run_dir)
            progress.epochs = config.get("train", {}).get("epochs")
            progress.max_steps = config.get("run", {}).get("max_steps")
        rows, restarted = self.reader.read()
        self.polls += 1
        if restarted:
            self.progress = progress = RunProgress(progress.epochs, progress.max_steps)
        if not rows and not restarted:
            return
        for row in rows:
            try:
                progress.add(row)
            except (KeyError, TypeError, ValueError):  # a row of another shape: the bar skips it
                continue
        if progress.total is not None and progress.total != self.bar.total:
            self.bar.reset(total=progress.total)
        self.bar.n = min(progress.steps, progress.total) if progress.total else progress.steps
        self.bar.set_postfix_str(progress.status, refresh=False)
        self.bar.refresh()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        self.poll()
        self.bar.close()


@contextmanager
def follow(
    run_dir: str | Path,
    *,
    epochs: int | None = None,
    max_steps: int | None = None,
    poll_s: float = 0.5,
    desc: str = "train",
    **bar_options: Any,
) -> Iterator[Follower]:
    """A progress bar of the run whose folder is `run_dir` (it need not exist yet) while the
    `with` block runs: its total is `epochs` epochs (else the run folder's config's) of
    the length the first row shows, at most `max_steps`. `bar_options` go to tqdm (say,
    `file=` for a terminal bar, `disable=True`)."""
    run_dir = Path(run_dir)
    progress = RunProgress(epochs, max_steps)
    # Made here, not in the thread: in Jupyter the widget is shown in the cell that runs this.
    bar = tqdm(total=progress.total, desc=desc, unit="step", dynamic_ncols=True, **bar_options)
    follower = Follower(run_dir, progress, bar, poll_s).start()
    try:
        yield follower
    finally:
        follower.stop()
