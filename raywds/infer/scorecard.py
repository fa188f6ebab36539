"""What `raywds evaluate` writes and says: a folder (by default `evaluation-SPLIT/` in MODEL's
folder: a run folder, an export, or the folder of a checkpoint file) of

    metrics.json     top-1, top-5, loss and samples (and the EMA's), the samples of each split and
                     of each rank, the most confused pairs, what was scored on what
    per_class.csv    class, name, samples, correct, recall, predicted, precision: one row a class
    confusion.csv    the whole matrix, a row per true class, a column per predicted one
    confused.png     the most confused (true -> predicted) pairs as bars: readable at 1,000 classes

and the summary line, as `raywds train` ends with one: `top-1 0.912  top-5 0.998  loss 0.301  samples 50`.

    lines = write(scored, model="runs/local", out=default_out("runs/local", "val"))
"""

from __future__ import annotations

import csv
import io
import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from raywds.data.stores import write_atomic
from raywds.errors import StorageError
from raywds.infer.evaluation import EMA, Score, Scored

METRICS, PER_CLASS, CONFUSION, CONFUSED = "metrics.json", "per_class.csv", "confusion.csv", "confused.png"
FILES = (METRICS, PER_CLASS, CONFUSION, CONFUSED)
MOST_CONFUSED = 20
"""The pairs confused.png shows (and metrics.json lists)."""


def default_out(model: str, split: str) -> Path:
    """`evaluation-SPLIT/` in MODEL's folder (a run folder, an export), or beside a checkpoint file:
    the numbers stay with the model they are of."""
    path = Path(model)
    return (path if path.is_dir() else path.parent) / f"evaluation-{split}"


def check_out(out: Path) -> None:
    """Refuse, before any work and making nothing, a result folder that cannot be written."""
    place = out
    while not place.exists() and place != place.parent:
        place = place.parent
    if not place.is_dir() or not os.access(place, os.W_OK | os.X_OK):
        why = "not a folder" if not place.is_dir() else "not writable"
        raise StorageError(f"cannot write the evaluation to {out}: {place} is {why}; give --out DIR")


def summary_line(scored: Scored) -> str:
    """The one line a script can parse: the first model's numbers, then the EMA's where it was scored too."""
    (first, score), *rest = scored.scores.items()
    said = f"{'EMA ' if first == EMA else ''}top-1 {score.top1:.3f}  top-5 {score.top5:.3f}  loss {score.loss:.3f}"
    also = "".join(f"  (EMA top-1 {s.top1:.3f}  top-5 {s.top5:.3f}  loss {s.loss:.3f})" for _, s in rest)
    return f"{said}  samples {score.samples}{also}"


def most_confused(confusion: np.ndarray, count: int = MOST_CONFUSED) -> list[tuple[int, int, int]]:
    """The `count` largest off-diagonal cells as (true, predicted, samples), largest first, ties in
    class order; none that are 0."""
    off = confusion.copy()
    np.fill_diagonal(off, 0)
    order = np.argsort(-off, axis=None, kind="stable")[:count]
    k = confusion.shape[1]
    return [(int(i) // k, int(i) % k, int(off.flat[i])) for i in order if off.flat[i] > 0]


def metrics(scored: Scored, model: str) -> dict[str, Any]:
    """metrics.json: the first model's numbers at the top, another's (the EMA's) under its name."""
    (first, score), *rest = scored.scores.items()
    names = scored.classes
    pairs = [dict(true=names[t], predicted=names[p], samples=n) for t, p, n in most_confused(score.confusion)]
    return dict(
        **score.numbers(),
        scored=first,
        **{name: s.numbers() for name, s in rest},
        model=model,
        source=scored.model_source,
        model_name=scored.model_name,
        data=scored.data,
        val_data=scored.val_data,
        split=scored.split,
        splits=scored.splits,
        samples_per_rank=scored.per_rank,
        ranks=len(scored.per_rank),
        loader_workers=scored.loader_workers,
        batch_size=scored.batch_size,
        classes=len(names),
        most_confused=pairs,
        seconds=round(scored.seconds, 3),
    )


def _csv(rows: list[list[Any]]) -> bytes:
    text = io.StringIO()
    csv.writer(text, lineterminator="\n").writerows(rows)
    return text.getvalue().encode()


def _share(part: int, whole: int) -> str:
    return f"{part / whole:.6f}" if whole else ""


def per_class(score: Score, classes: list[str]) -> bytes:
    """A row per class: its samples, those predicted right, recall, how often it was predicted,
    precision (blank where there is nothing to divide by)."""
    confusion = score.confusion
    truths, predicted, right = confusion.sum(axis=1), confusion.sum(axis=0), np.diag(confusion)
    rows: list[list[Any]] = [["class", "name", "samples", "correct", "recall", "predicted", "precision"]]
    for i, name in enumerate(classes):
        t, p, r = int(truths[i]), int(predicted[i]), int(right[i])
        rows.append([i, name, t, r, _share(r, t), p, _share(r, p)])
    return _csv(rows)


def confusion_csv(score: Score, classes: list[str]) -> bytes:
    """The matrix: the first column and the header the class names, rows true, columns predicted."""
    rows: list[list[Any]] = [["true \\ predicted", *classes]]
    rows += [[name, *row] for name, row in zip(classes, score.confusion.tolist())]
    return _csv(rows)


def confused_png(score: Score, classes: list[str], title: str) -> bytes:
    """A bar a pair, the most confused at the top, each labelled `true -> predicted` with its count
    and its share of the true class's samples."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    pairs = most_confused(score.confusion)
    truths = score.confusion.sum(axis=1)
    fig, ax = plt.subplots(figsize=(10, 1.5 + 0.35 * max(len(pairs), 1)))
    if pairs:
        labels = [f"{classes[t]} \u2192 {classes[p]}" for t, p, _ in pairs]
        counts = [n for _, _, n in pairs]
        bars = ax.barh(labels, counts, color="tab:red")
        ax.bar_label(bars, [f"{n} ({n / max(int(truths[t]), 1):.0%} of its class)" for t, _, n in pairs], padding=3)
        ax.invert_yaxis()
        ax.set(xlabel="samples of the true class predicted as the other", ylabel="true \u2192 predicted")
        ax.set_xlim(0, max(counts) * 1.35)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    else:
        ax.text(0.5, 0.5, "no sample was confused", ha="center", va="center", transform=ax.transAxes)
        ax.set_axis_off()
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    out = io.BytesIO()
    fig.savefig(out, format="png", dpi=100)
    plt.close(fig)
    return out.getvalue()


def write(scored: Scored, *, model: str, out: Path) -> Path:
    """The result folder `out` (made where missing; its files replaced whole); metrics.json last."""
    (first, score), *_ = scored.scores.items()
    title = (
        f"{model}{' (EMA)' if first == EMA else ''} on {score.samples} {scored.split} samples of {scored.data}\n"
        f"{summary_line(scored).split('  samples')[0]}; the most confused pairs of {len(scored.classes)} classes"
    )
    contents = {
        PER_CLASS: per_class(score, scored.classes),
        CONFUSION: confusion_csv(score, scored.classes),
        CONFUSED: confused_png(score, scored.classes, title),
        METRICS: (json.dumps(metrics(scored, model), indent=1) + "\n").encode(),
    }
    try:
        out.mkdir(parents=True, exist_ok=True)
        for name, data in contents.items():
            write_atomic(out / name, data)
    except OSError as e:
        raise StorageError(f"cannot write the evaluation to {out} ({e.strerror or e}): give --out DIR") from None
    return out
