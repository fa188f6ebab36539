"""`raywds report RUN_DIR`: loss, accuracy, throughput and data-wait plots from a run's
metrics.jsonl (written by local runs, torchrun and Ray runs alike), as one PNG.

    raywds report runs/demo                              # -> runs/demo/report.png
    raywds report s3://bucket/runs/raywds-20261124-1015  # -> ./raywds-20261124-1015-report.png

A folder's MLflow run that its run's end could not end (the server gone) is ended first, where the
server answers now (raywds.runs.tracking.end_left), by `raywds report` and `raywds doctor` alike.
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from raywds.data import s3
from raywds.errors import ConfigError
from raywds.runs import files
from raywds.runs.rows import epochs, read_rows
from raywds.runs.stagetimes import shares
from raywds.runs.tracking import end_left


@contextlib.contextmanager
def local_copy(run: str, endpoint: str | None = None) -> Iterator[Path]:
    """The run folder `run`, or for an s3:// run (`raywds ray --storage-path s3://…`) a temporary
    folder named as the run, holding its metrics.jsonl. A folder's tracking runs that its run's end
    could not end (its MLflow server gone) are ended first, where the server answers now."""
    if not s3.is_s3(run):
        end_left(Path(run))
        yield Path(run)
        return
    with tempfile.TemporaryDirectory(prefix="raywds-report-") as tmp:
        folder = Path(tmp) / run.rstrip("/").rsplit("/", 1)[-1]
        folder.mkdir()
        if not s3.get_file(s3.join(run, files.METRICS), folder / files.METRICS, endpoint):
            raise ConfigError(f"no metrics.jsonl under {run}: give a Ray run's --storage-path and its name")
        yield folder


def read_epochs(run_dir: Path) -> list[dict[str, Any]]:
    """The per-epoch rows of RUN_DIR/metrics.jsonl (progress rows and mid-epoch checkpoints left out)."""
    path = run_dir / files.METRICS
    if not path.is_file():
        raise ConfigError(f"no metrics.jsonl in {run_dir}: give the --out folder of a run, or a Ray run folder")
    finished = epochs(read_rows(path))  # a resumed run may repeat an epoch: the last counts
    if not finished:
        raise ConfigError(f"{path} has no finished epoch yet")
    return finished


def _step_bars(ax: Any, row: dict[str, Any]) -> None:
    """Where each rank's time went in the epoch of `row`: a stacked bar per rank (raywds.train.doctor)."""
    parts = shares(row["stages"])
    ranks = range(len(parts["compute"]))
    left = [0.0 for _ in ranks]
    for name, values in parts.items():
        ax.barh([f"rank {r}" for r in ranks], [100 * v for v in values], left=left, label=name)
        left = [a + 100 * b for a, b in zip(left, values)]
    ax.set(title=f"where each rank's time went, epoch {row['epoch']} (%)", xlim=(0, 100))
    ax.invert_yaxis()


def plot(run_dir: Path, out: Path | None = None) -> Path:
    """Draw the four panels to `out` (default RUN_DIR/report.png); returns the path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_epochs(run_dir)
    epochs = [r["epoch"] for r in rows]
    fig, ax = plt.subplots(2, 2, figsize=(11, 7.5))
    ax[0][0].plot(epochs, [r["train_loss"] for r in rows], "o-", label="train")
    val = [r for r in rows if "val_loss" in r]
    ax[0][0].plot([r["epoch"] for r in val], [r["val_loss"] for r in val], "s-", label="validation")
    ax[0][0].set(title="loss", xlabel="epoch")
    ax[0][1].plot([r["epoch"] for r in val], [r["val_top1"] for r in val], "o-", label="top-1")
    ax[0][1].plot([r["epoch"] for r in val], [r["val_top5"] for r in val], "s-", label="top-5")
    ax[0][1].set(title="validation accuracy", xlabel="epoch", ylim=(0, 1.02))
    ax[1][0].plot(epochs, [r["images_per_s"] for r in rows], "o-", label="all ranks")
    per_rank = [r.get("images_per_s_per_rank", []) for r in rows]
    for rank in range(max(len(p) for p in per_rank)):
        ax[1][0].plot(epochs, [p[rank] if rank < len(p) else None for p in per_rank], ".--", label=f"rank {rank}")
    ax[1][0].set(title="throughput (images/s)", xlabel="epoch", ylim=(0, None))
    if "stages" in rows[-1]:
        _step_bars(ax[1][1], rows[-1])
    else:  # a run from before step times were kept
        waits = [r.get("data_wait_per_rank", []) for r in rows]
        for rank in range(max(len(w) for w in waits)):
            ax[1][1].plot(epochs, [100 * w[rank] if rank < len(w) else None for w in waits], "o-", label=f"rank {rank}")
        ax[1][1].set(title="time waiting for data (% of step time)", xlabel="epoch", ylim=(0, 100))
    for a in ax.flat:
        a.grid(alpha=0.3)
        if a.get_legend_handles_labels()[0]:
            a.legend(fontsize=8)
    fig.suptitle(f"{run_dir.name}: {len(rows)} epochs, last top-1 {val[-1]['val_top1']:.3f}" if val else run_dir.name)
    fig.tight_layout()
    out = out or run_dir / "report.png"
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
