"""The Ray Data plane's steps, as plain functions over columns (no ray here: the plane's Ray
side, raywds.launch.raydata, calls them in its read tasks and on each rank):

- `shard_rows`: one shard -> blocks of samples as columns (key, url, id, member, image bytes,
  class bytes), each shard checked against the manifest as it is read
  (raywds.loader.readers), the samples an interrupted epoch already trained on left out;
- `task_blocks`, a read task's whole work: its shards' encoded samples, shuffled together
  (seeded) while still encoded (a JPEG is a tenth of its crop's bytes), then decoded
  `batch_size` at a time, so every block but a task's last is one whole batch;
- `decode_rows`: a block of such rows -> uint8 crops (N, H, W, 3), labels and ids, by the
  loader's own decoders (raywds.loader.stages), each crop seeded by (seed, epoch, sample id);
- `Rebatcher`: on the rank, the decoded blocks -> the loop's `Batch`es, whole batches of the
  rank's batch size (an exact epoch ends with its partial rest, a rest of one sample folded);
  a whole block is a batch as it is, no copy;
- `ahead`: the rank's batches made in a thread of their own, pinned there for CUDA, a few ahead
  of the loop.

Exact passes raise on a bad sample or unreadable shard (the run stops, naming it); resample
mode marks it in the row's `error` and the rank hands it on with the next batch, as the
per-rank loader does.

    for columns in shard_rows(url, expected, policy): decoded = decode_rows(columns, decoder, policy, size=224)
"""

from __future__ import annotations

import math
import queue
import threading
import time
import warnings
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import numpy as np
import torch

from raywds.data.manifest import ShardInfo
from raywds.loader.clock import Spent
from raywds.loader.labels import IMAGE_KEYS, Labels
from raywds.loader.readers import Expected, Failures, ReadPolicy, tar_samples
from raywds.loader.stages import BadSample, Batch, Decoder, Skips, decoded, fold_single_tail
from raywds.plan.epoch import EpochPlan

TIMED = ("read_s", "read_bytes", "decode_s")
"""Columns a decoded block carries for the doctor (raywds.train.doctor): each row's seconds
reading it in its read task, its bytes, its seconds decoding in its decode task."""

ROWS_PER_BLOCK = 64
"""Samples per block a read task emits: many samples per block (Ray Data's cost is per block),
few enough that a 224 px decoded block stays near 10 MB."""

Columns = dict[str, Any]
"""Column name -> a list or numpy array, one entry per row."""


def _block(rows: list[dict[str, Any]]) -> Columns:
    return {name: [row[name] for row in rows] for name in rows[0]}


def _row(sample: dict[str, Any] | None, error: str = "", labels: Labels | None = None) -> dict[str, Any]:
    if sample is None:  # a shard skipped as unreadable (resample): a row that only carries why
        return {"key": "", "url": "", "id": -1, "member": "", "image": b"", "cls": b"", "error": error}
    member = (labels.image(sample) if labels is not None else next((k for k in IMAGE_KEYS if k in sample), "")) or ""
    return {
        "key": sample["__key__"],
        "url": sample["__url__"],
        "id": sample["__id__"],
        "member": member,
        "image": bytes(sample[member]) if member else b"",
        "cls": _label(sample, labels),
        "error": "",
    }


def _label(sample: dict[str, Any], labels: Labels | None) -> bytes:
    """The row's `cls`: the .cls member's bytes, or for shards raywds indexed the class index that
    their label member holds (as text; where it cannot be read, its bytes, which decoding refuses
    in the loader's own words)."""
    if labels is None:
        return bytes(sample["cls"]) if "cls" in sample else b""
    where = labels.members.label_member(sample)
    if where is None:
        return b""
    try:
        return str(labels.label(sample, where)).encode()
    except ValueError:
        return bytes(sample[where])


def shard_rows(
    url: str,
    expected: Expected,
    policy: ReadPolicy,
    *,
    verify_hash: bool = False,
    consumed: np.ndarray | None = None,
    rows_per_block: int = ROWS_PER_BLOCK,
    labels: Labels | None = None,
) -> Iterator[Columns]:
    """The shard at `url` in blocks of rows; `consumed` (a bool per sample of the shard) leaves
    out what an interrupted epoch already trained on. A shard that stays unreadable raises, or
    (policy.skip_unreadable) becomes one row whose `error` says why."""
    failures = Failures(policy)
    rows: list[dict[str, Any]] = []
    samples = tar_samples([{"url": url}], policy, {url: expected}, verify_hashes=verify_hash, failures=failures)
    waited = time.perf_counter()
    for sample in samples:
        if consumed is not None and consumed[sample["__id__"] - expected.first_id]:
            continue
        rows.append({**_row(sample, labels=labels), "read_s": time.perf_counter() - waited})  # the seconds to read it
        if len(rows) == rows_per_block:
            yield _block(rows)
            rows = []
        waited = time.perf_counter()
    rows += [{**_row(None, f"shard: {why}"), "read_s": 0.0} for why in failures.skipped]
    if rows:
        yield _block(rows)


def groups(shards: Sequence[ShardInfo], buffer: int, *, tasks_at_least: int = 4) -> list[list[ShardInfo]]:
    """The read tasks' shards, in the order given: each task as many shards in a row as hold the
    shuffle `buffer` of samples (one when the buffer is 0), but never so many that there are
    fewer than `tasks_at_least` tasks (the tasks run side by side)."""
    if not shards:
        return []
    mean = max(1.0, sum(s.num_samples for s in shards) / len(shards))
    per_task = max(1, min(math.ceil(buffer / mean), math.ceil(len(shards) / tasks_at_least)))
    return [list(shards[i : i + per_task]) for i in range(0, len(shards), per_task)]


Read = tuple[str, Expected, "np.ndarray | None"]
"""One shard of a read task: its URL, what the manifest says reading it gives, and (a resumed
epoch) a bool per sample already trained on."""


def task_blocks(
    reads: Sequence[Read],
    decoder: Decoder,
    policy: ReadPolicy,
    *,
    size: int,
    batch_size: int,
    shuffle_seed: int | None,
    verify_hash: bool = False,
    labels: Labels | None = None,
) -> Iterator[Columns]:
    """A read task: its shards' samples read (each shard checked), shuffled together while
    encoded (`shuffle_seed`; None keeps the shards' order), then decoded `batch_size` at a
    time: blocks of exactly `batch_size` rows but the last."""
    parts = [
        block
        for url, expected, consumed in reads
        for block in shard_rows(
            url, expected, policy, verify_hash=verify_hash, consumed=consumed, rows_per_block=1 << 62, labels=labels
        )
    ]
    if not parts:
        return
    rows = {k: [v for part in parts for v in part[k]] for k in parts[0]}
    n = len(rows["key"])
    order = np.random.default_rng(shuffle_seed).permutation(n) if shuffle_seed is not None else np.arange(n)
    for start in range(0, n, batch_size):
        taken = order[start : start + batch_size]
        yield decode_rows({k: [v[i] for i in taken] for k, v in rows.items()}, decoder, policy, size=size)


def _sample(columns: Columns, i: int) -> dict[str, Any]:
    """Row i as the sample dict the loader's `decoded` stage reads."""
    sample = {"__key__": columns["key"][i], "__url__": columns["url"][i], "__id__": int(columns["id"][i])}
    if columns["member"][i]:
        sample[columns["member"][i]] = columns["image"][i]
    if len(columns["cls"][i]):
        sample["cls"] = columns["cls"][i]
    return sample


def decode_rows(columns: Columns, decoder: Decoder, policy: ReadPolicy, *, size: int) -> Columns:
    """A block of `shard_rows` -> image (N, size, size, 3) uint8, label, id, key and error. A
    sample that cannot be decoded raises, or (policy.skip_unreadable) keeps its row with a black
    image and its reason in `error`, as does a shard row that already carries one."""
    n = len(columns["key"])
    images = np.zeros((n, size, size, 3), dtype=np.uint8)
    labels = np.full(n, -1, dtype=np.int64)
    errors = [str(e) for e in columns["error"]]
    members = [""] * n
    decode_s = np.zeros(n)
    skips = Skips(policy)
    for i in range(n):
        if errors[i]:
            continue
        started = time.perf_counter()
        out = list(decoded([_sample(columns, i)], decoder, skips))
        decode_s[i] = time.perf_counter() - started
        if not out:  # skipped: the reason is the one `decoded` just gave
            bad = skips.samples.pop()
            errors[i], members[i] = f"sample: {bad.reason}", bad.member
            continue
        image, labels[i], _, _ = out[0]
        images[i] = image.permute(1, 2, 0).numpy()
    return {
        "image": images,
        "label": labels,
        "id": np.asarray(columns["id"], dtype=np.int64),
        "key": np.asarray(columns["key"], dtype=object),
        "url": np.asarray(columns["url"], dtype=object),
        "member": np.asarray(members, dtype=object),
        "error": np.asarray(errors, dtype=object),
        "read_s": np.asarray(columns.get("read_s", np.zeros(n)), dtype=np.float64),
        "read_bytes": np.asarray([len(image) + len(c) for image, c in zip(columns["image"], columns["cls"])]),
        "decode_s": decode_s,
    }


def rebatcher(plan: EpochPlan, batch_size: int) -> Rebatcher:
    """The rank's side of the plane for an epoch of `plan`: an exact epoch (split) ends with a short
    batch of what is left (`partial`) and raises on a bad sample; a resample one keeps its batches full."""
    return Rebatcher(batch_size, partial=plan.mode.exact)


class Rebatcher:
    """A rank's side of the plane: decoded blocks (numpy columns, any sizes) -> Batches of
    `batch_size`, the decoded samples only; what was skipped rides on the next batch out.
    `partial` (exact epochs): the rest ends the epoch as a short batch, a rest of one folded
    into the batch before. Counts the samples decoded on each node (a `node` column)."""

    def __init__(self, batch_size: int, *, partial: bool):
        self.batch_size = batch_size
        self.partial = partial
        self.nodes: Counter[str] = Counter()
        self.num_decoded = 0
        """Rows decoded so far, whether or not a batch has taken them yet."""
        self.last_bad_shard = ""
        self.bad_samples: list[BadSample] = []
        self.bad_shards: list[str] = []

    def __call__(self, blocks: Iterable[Columns]) -> Iterator[Batch]:
        batches = self._whole(blocks)
        return fold_single_tail(batches) if self.partial else batches

    def _whole(self, blocks: Iterable[Columns]) -> Iterator[Batch]:
        held: list[Columns] = []
        num_held = 0
        for block in blocks:
            good = self._sort_out(block)
            if good is None:
                continue
            held.append(good)
            num_held += len(good["id"])
            while num_held >= self.batch_size:
                taken, held = _take(held, self.batch_size)
                num_held -= self.batch_size
                yield self._batch(taken)
        if num_held and self.partial:
            yield self._batch(_concat(held))

    def _sort_out(self, block: Columns) -> Columns | None:
        """The block's decoded rows; its error rows go to the counts of what was skipped."""
        errors = block["error"]
        bad = np.array([bool(e) for e in errors], dtype=bool)
        for i in np.flatnonzero(bad):
            kind, why = str(errors[i]).split(": ", 1)  # the row's kind, as decode_rows wrote it
            if kind == "shard":
                self.bad_shards.append(why)
                self.last_bad_shard = why
            else:
                url, key, member = (str(block[k][i]) for k in ("url", "key", "member"))
                self.bad_samples.append(BadSample(url, key, member, why))
        self.num_decoded += int((~bad).sum())
        if "node" in block:
            self.nodes.update(str(node) for node in block["node"][~bad])
        if bad.all():
            return None
        kept = ("image", "label", "id", "key", *(k for k in TIMED if k in block))
        return {k: block[k][~bad] if bad.any() else block[k] for k in kept}

    def _batch(self, columns: Columns) -> Batch:
        with warnings.catch_warnings():  # Arrow's buffers are read-only; nothing here writes to a batch's images
            warnings.filterwarnings("ignore", "The given NumPy array is not writable")
            images = torch.from_numpy(np.ascontiguousarray(columns["image"]))
        batch = Batch(
            images.permute(0, 3, 1, 2),  # NHWC in memory: NCHW stored channels-last, as the loader's
            torch.tensor(columns["label"], dtype=torch.long),
            torch.tensor(columns["id"], dtype=torch.long),
            [str(k) for k in columns["key"]],
            tuple(self.bad_samples),
            tuple(self.bad_shards),
            spent=_spent(columns, len(columns["id"])),
        )
        self.bad_samples, self.bad_shards = [], []
        return batch


def _spent(columns: Columns, n: int) -> Spent | None:
    """What the plane's tasks spent on a batch's rows: reading and decoding them (None for blocks
    that carry no times)."""
    if "decode_s" not in columns:
        return None
    reads, decodes = columns.get("read_s", np.zeros(n)), columns["decode_s"]
    read_bytes = int(np.sum(columns.get("read_bytes", 0)))
    return Spent(float(np.sum(reads)), float(np.sum(decodes)), 0.0, read_bytes, n, plane=True)


def _concat(blocks: list[Columns]) -> Columns:
    if len(blocks) == 1:
        return blocks[0]
    return {k: np.concatenate([b[k] for b in blocks]) for k in blocks[0]}


def _take(blocks: list[Columns], n: int) -> tuple[Columns, list[Columns]]:
    """The first `n` rows of `blocks`, and the rest, copying only where a batch spans blocks."""
    first = blocks[0]
    if len(first["id"]) == n:
        return first, blocks[1:]
    whole = _concat(blocks)
    rest = [{k: v[n:] for k, v in whole.items()}] if len(whole["id"]) > n else []
    return {k: v[:n] for k, v in whole.items()}, rest


AHEAD = 4
"""Batches the rank's thread makes ahead of the training loop."""

_END = object()


def ahead(batches: Iterator[Any], *, depth: int = AHEAD, each: Callable[[Any], Any] | None = None) -> Iterator[Any]:
    """`batches` pulled by a thread of their own from now on (`each` applied there: pinning),
    at most `depth` ahead of whoever iterates the result; closing the result stops the thread
    and closes `batches`. An error in the thread is raised here, at its place in the stream."""
    held: queue.Queue[Any] = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def put(item: Any) -> bool:
        while not stop.is_set():
            try:
                held.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def pull() -> None:
        try:
            for batch in batches:
                if not put(each(batch) if each is not None else batch):
                    break
            put(_END)
        except BaseException as e:  # noqa: BLE001 - raised again in the consumer
            put(e)
        finally:
            close = getattr(batches, "close", None)
            if close is not None:
                close()

    thread = threading.Thread(target=pull, name="raywds-plane-ahead", daemon=True)
    thread.start()
    return _drained(held, stop, thread)


def _drained(held: queue.Queue[Any], stop: threading.Event, thread: threading.Thread) -> Iterator[Any]:
    try:
        while True:
            item = held.get()
            if item is _END:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()  # the thread ends once its current batch is made (and closes the stream)
        thread.join(timeout=1)


def pinned(batch: Batch) -> Batch:
    """`batch` with its images in pinned memory (torch's caching host allocator reuses the
    buffers), so that the copy to the GPU can overlap the step."""
    assert isinstance(batch.images, torch.Tensor), "the plane ships decoded crops"
    return batch._replace(images=batch.images.pin_memory())
