"""The fault table: shards and servers broken on purpose, each trained on through the `raywds
train` command in split and in resample mode. Every run ends in bounded time with either exit 0
and the right skip count, or exit 1 and one line naming the shard (and the sample when one is to
blame): never a traceback, never a wrong sample count.

The resample skip counts are checked against a replay of the epoch's shard draws (one loader
worker, no worker shuffle buffer, so the stream order is the draw order)."""

from __future__ import annotations

import http.server
import itertools
import json
import re
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from support import shardedit as edit
from support.data import audited
from support.runs import small_config

from raywds.cli.main import main
from raywds.data.manifest import Manifest, ShardInfo, read_manifest
from raywds.errors import DataError
from raywds.loader.loader import expected
from raywds.loader.plane import Rebatcher, decode_rows, shard_rows
from raywds.loader.stages import BadSample, train_decoder
from raywds.plan.modes import Resample
from raywds.train.compute import Compute
from raywds.train.config import TrainConfig
from raywds.train.loop import train_epoch
from raywds.train.model import build_model
from raywds.train.trainer import train
from raywds.world import World

pytestmark = [pytest.mark.faults, pytest.mark.timeout(120)]

BATCH = 16
NOT_AN_IMAGE = b"this is not an image\n"


@dataclass
class Broken:
    """What a fault did: the shard to name, the sample to blame, and for the replay which
    samples of which shard cannot be used and where a shard stops being readable."""

    shard: str
    key: str | None = None
    bad_samples: dict[str, set[int]] = field(default_factory=dict)
    """shard name -> places of samples that cannot be decoded."""
    unreadable: dict[str, int] = field(default_factory=dict)
    """shard name -> samples readable before the shard fails (0: it never opens)."""
    server: dict[str, int] = field(default_factory=dict)
    """shard name -> the HTTP status the test server answers for it."""
    server_dies_after: int | None = None
    """The test server stops after this many shard requests."""
    requested: list[str] = field(default_factory=list)
    """The shards the test server was asked for, in order (filled as it serves)."""


def bad_member(ext: str, data: bytes | Callable[[bytes], bytes], nth: int = 3) -> Callable[[Path, int], Broken]:
    """Sample `nth` of train shard i gets another `.ext` member; the manifest agrees (a faulty
    source slipped through another tool), so only decoding can tell."""

    def make(d: Path, i: int) -> Broken:
        shard = edit.entry(d, "train", i)["name"]
        files = edit.members(d / shard)
        keys = list(dict.fromkeys(n.split(".", 1)[0] for n, _ in files))
        old = dict(files)[f"{keys[nth]}.{ext}"]
        edit.rewrite(
            d, "train", i, edit.replace_member(ext, data(old) if callable(data) else data, nth=nth), in_manifest=True
        )
        return Broken(shard, keys[nth], bad_samples={shard: {nth}})

    return make


def short_shard(split: str) -> Callable[[Path, int], Broken]:
    def make(d: Path, i: int) -> Broken:
        index = i if split == "train" else 1
        shard = edit.entry(d, split, index)["name"]
        edit.rewrite(d, split, index, edit.keep_samples(10), in_manifest=False)
        return Broken(shard)

    return make


def changed_shard(change: Callable[[edit.Members], edit.Members]) -> Callable[[Path, int], Broken]:
    def make(d: Path, i: int) -> Broken:
        shard = edit.entry(d, "train", i)["name"]
        edit.rewrite(d, "train", i, change, in_manifest=False)
        return Broken(shard)

    return make


SIZE_AT_OPEN = r"is \d+ bytes, its manifest entry \d+: it changed after the manifest was made"
"""A shard of another size than its manifest entry's is refused as it is opened, before any of its samples
is used, in either mode: it is not the shard the manifest lists."""


def truncated_mid_member(d: Path, i: int) -> Broken:
    """Cut inside sample 5's first member: samples 0-3 come out, then the tar ends mid-data."""
    shard = edit.entry(d, "train", i)["name"]
    offsets = edit.member_offsets(d / shard)
    keys = list(dict.fromkeys(n.split(".", 1)[0] for n, _, _ in offsets))
    first = next(off for n, off, _ in offsets if n.startswith(keys[5] + "."))
    edit.truncate_bytes(d / shard, first)
    return Broken(shard, unreadable={shard: 4})


def not_a_tar(d: Path, i: int) -> Broken:
    shard = edit.entry(d, "train", i)["name"]
    (d / shard).write_bytes(bytes(range(256)) * 40)
    return Broken(shard, unreadable={shard: 0})


def empty_file(d: Path, i: int) -> Broken:
    shard = edit.entry(d, "train", i)["name"]
    (d / shard).write_bytes(b"")
    return Broken(shard)


def missing(d: Path, i: int) -> Broken:
    shard = edit.entry(d, "train", i)["name"]
    (d / shard).unlink()
    return Broken(shard, unreadable={shard: 0})


def http_status(status: int) -> Callable[[Path, int], Broken]:
    def make(d: Path, i: int) -> Broken:
        shard = edit.entry(d, "train", i)["name"]
        return Broken(shard, unreadable={shard: 0}, server={shard: status})

    return make


def server_dies(d: Path, i: int) -> Broken:
    return Broken("", server_dies_after=3)


def flipped_class(d: Path, i: int) -> Broken:
    """A class digit changed inside a shard: no decoder can see it, only --verify-hashes."""
    shard = edit.entry(d, "train", i)["name"]
    path = d / shard
    name, offset, _ = next(m for m in edit.member_offsets(path) if m[0].endswith(".cls"))
    data = bytearray(path.read_bytes())
    data[offset] = ord("0") + (data[offset] - ord("0") + 1) % 10
    path.write_bytes(bytes(data))
    return Broken(shard)


SAMPLE_ERROR = "sample"  # exit 1, one line naming the shard and the sample
SHARD_ERROR = "shard"  # exit 1, one line naming the shard
SKIP = "skip"  # exit 0, the replayed number of skips

# fault, how to make it, split outcome and resample outcome, the error's words, extra flags
FAULTS: list[tuple[str, Callable[[Path, int], Broken], str, str, str, list[str]]] = [
    ("non-image member", bad_member("jpg", NOT_AN_IMAGE), SAMPLE_ERROR, SKIP, r"cannot identify image file", []),
    ("zero-byte JPEG", bad_member("jpg", b""), SAMPLE_ERROR, SKIP, r"cannot identify image file|empty", []),
    (
        "JPEG without its pixel data",
        bad_member("jpg", edit.jpeg_cut_after_scan_header),
        SAMPLE_ERROR,
        SKIP,
        r"corrupt JPEG data: Premature end of JPEG file",
        [],
    ),
    (
        "class that is not a number",
        bad_member("cls", b"n01440764"),
        SAMPLE_ERROR,
        SKIP,
        r"class b'n01440764' is not a number",
        [],
    ),
    (
        "train shard cut short",
        short_shard("train"),
        SHARD_ERROR,
        SHARD_ERROR,
        SIZE_AT_OPEN,
        [],
    ),
    (
        "validation shard cut short",
        short_shard("val"),
        SHARD_ERROR,
        SHARD_ERROR,
        SIZE_AT_OPEN,
        [],
    ),
    (
        "more samples than the manifest",
        changed_shard(edit.extra_sample),
        SHARD_ERROR,
        SHARD_ERROR,
        r"holds more than the 16 samples its manifest entry lists",
        [],
    ),
    ("a key twice", changed_shard(edit.duplicate_key), SHARD_ERROR, SHARD_ERROR, r"key \S+ appears twice", []),
    (
        "member truncated mid-file",
        truncated_mid_member,
        SHARD_ERROR,
        SHARD_ERROR,
        SIZE_AT_OPEN,
        [],
    ),
    (
        "not a tar",
        not_a_tar,
        SHARD_ERROR,
        SHARD_ERROR,
        SIZE_AT_OPEN,
        [],
    ),
    ("empty file", empty_file, SHARD_ERROR, SHARD_ERROR, SIZE_AT_OPEN, []),
    ("missing shard", missing, SHARD_ERROR, SKIP, r"cannot open it: No such file or directory", []),
    ("HTTP 404", http_status(404), SHARD_ERROR, SKIP, r"is missing on the server \(HTTP 404\)", []),
    ("HTTP 500", http_status(500), SHARD_ERROR, SKIP, r"HTTP 500", []),
    (
        "server killed mid-epoch",
        server_dies,
        SHARD_ERROR,
        SHARD_ERROR,
        r"shard http://127\.0\.0\.1:\d+/\S+: cannot read it|shards in a row were unreadable",
        [],
    ),
    (
        "flipped class digit, --verify-hashes",
        flipped_class,
        SHARD_ERROR,
        SHARD_ERROR,
        r"sha256 \w+… \(\d+ bytes\) differs from the manifest's",
        ["--verify-hashes"],
    ),
]


class _Handler(http.server.SimpleHTTPRequestHandler):
    faults: dict[str, int] = {}
    dies_after: int | None = None
    served: list[str] = []
    server_ref: list[http.server.ThreadingHTTPServer] = []

    def do_GET(self) -> None:
        name = self.path.lstrip("/")
        if name.endswith(".tar"):
            self.served.append(name)
            if self.dies_after is not None and len(self.served) > self.dies_after:
                threading.Thread(target=self._die, daemon=True).start()
                self.close_connection = True
                self.connection.close()
                return
        if name in self.faults:
            self.send_error(self.faults[name])
            return
        super().do_GET()

    def _die(self) -> None:
        server = self.server_ref[0]
        server.socket.shutdown(socket.SHUT_RDWR)  # refuse new connections at once, as a killed server would
        server.socket.close()
        server.shutdown()

    def log_message(self, format: str, *args: object) -> None:
        pass


@contextmanager
def faulty_server(root: Path, broken: Broken) -> Iterator[str]:
    """Serves `root` on loopback, answering `broken.server`'s statuses and dying on cue."""
    handler = type(
        "H",
        (_Handler,),
        {"faults": broken.server, "dies_after": broken.server_dies_after, "served": broken.requested, "server_ref": []},
    )
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), lambda *a: handler(*a, directory=str(root)))
    server.daemon_threads, server.block_on_close = True, False
    handler.server_ref.append(server)
    # polls for shutdown() every 0.05 s, not socketserver's 0.5 s: the test ends that much sooner
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        if broken.server_dies_after is None:
            server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def replay(
    data: Path, broken: Broken, *, num_batches: int, rank: int = 0, num_ranks: int = 1
) -> tuple[int, int] | None:
    """(bad samples, skipped shards) `rank`'s epoch carries in its `num_batches` batches, from
    the epoch's own shard draws; None when 5 unreadable shards in a row end the run."""
    manifest = read_manifest(str(data))
    sizes = {s.name: s.num_samples for s in manifest.shards("train")}
    good = counted_samples = counted_shards = pending_samples = pending_shards = in_a_row = 0
    for shard in draws(manifest, rank=rank, num_ranks=num_ranks):
        name = shard.name
        readable = broken.unreadable.get(name, sizes[name])
        for place in range(readable):
            if place in broken.bad_samples.get(name, set()):
                pending_samples += 1
                continue
            good += 1
            if good % BATCH == 0:
                counted_samples, counted_shards = counted_samples + pending_samples, counted_shards + pending_shards
                pending_samples = pending_shards = 0
                if good == num_batches * BATCH:
                    return counted_samples, counted_shards
        if name in broken.unreadable:
            pending_shards += 1
            in_a_row += 1
            if in_a_row >= 5:
                return None
        else:
            in_a_row = 0
    raise AssertionError("unreachable: the draws never end")


def refused(broken: Broken, data: Path, mode: str) -> str:
    """The shard a run must name when its server dies: in split mode the one the dying server
    dropped (the first it did not send); in resample mode the last of the 5 unreadable draws in
    a row that end the run, from the dropped one on."""
    assert broken.server_dies_after is not None and len(broken.requested) > broken.server_dies_after
    if mode == "split":
        return broken.requested[broken.server_dies_after]
    drawn = list(itertools.islice(draws(read_manifest(str(data))), broken.server_dies_after + 5))
    names = [shard.name for shard in drawn]
    assert broken.requested[: broken.server_dies_after + 1] == names[: broken.server_dies_after + 1]
    return names[-1]


def first_drawn(data: Path) -> int:
    """The train shard rank 0 reads first in resample mode (any shard serves split mode): a fault
    there is met in every run."""
    manifest = read_manifest(str(data))
    return manifest.shards("train").index(next(draws(manifest)))


def draws(manifest: Manifest, *, rank: int = 0, num_ranks: int = 1) -> Iterator[ShardInfo]:
    """The shards `rank`'s one loader worker draws in epoch 0 of a resample run with seed 0."""
    shards = manifest.shards("train")
    plan = Resample().plan(shards, num_ranks=num_ranks, num_workers=1, batch_size=BATCH)
    return Resample().shards_for(plan, shards, rank=rank, worker=0, seed=0, epoch=0)


def train_flags(data: str, out: Path, mode: str) -> list[str]:
    return [
        "train",
        "--data",
        data,
        "--model",
        "demo",
        "--epochs",
        "1",
        "--batch-size",
        str(BATCH),
        "--image-size",
        "28",
        "--loader-workers",
        "1",
        "--worker-shuffle-buffer",
        "0",
        "--mode",
        mode,
        "--out",
        str(out / "run"),
        "--read-retries",
        "1",
        "--read-timeout",
        "2",
        "--max-bad-samples",
        "50",
        "--checkpoint-every-steps",
        "2",
        "--audit-dir",
        str(out / "audit"),
    ]


@pytest.mark.parametrize("mode", ["split", "resample"])
@pytest.mark.parametrize(("fault", "make", "split", "resample", "words", "flags"), FAULTS, ids=[f[0] for f in FAULTS])
def test_fault(
    shards: Path,
    tmp_path: Path,
    capfd: pytest.CaptureFixture[str],
    short_backoff: None,
    mode: str,
    fault: str,
    make: Callable[[Path, int], Broken],
    split: str,
    resample: str,
    words: str,
    flags: list[str],
) -> None:
    data = edit.copy(shards, tmp_path / "shards")
    broken = make(data, first_drawn(data))
    outcome = split if mode == "split" else resample
    expected = replay(data, broken, num_batches=8) if mode == "resample" else None
    if outcome == SKIP and expected is None:
        outcome = SHARD_ERROR  # the replay says the run must give up: 5 unreadable shards in a row
    served = faulty_server(data, broken) if broken.server or broken.server_dies_after else None
    if served is not None:
        with served as url:
            code = main([*train_flags(url, tmp_path, mode), *flags])
    else:
        code = main([*train_flags(str(data), tmp_path, mode), *flags])
    out, err = capfd.readouterr()
    assert "Traceback" not in out + err, err[-3000:]
    if outcome == SKIP:
        assert code == 0, err[-2000:]
        assert expected is not None
        bad_samples, bad_shards = expected
        assert bad_samples + bad_shards > 0, "the fault was met at least once in this epoch"
        metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
        final = metrics[-1]
        assert (final["bad_samples"], final["bad_shards"]) == (bad_samples, bad_shards)
        assert final["bad_samples_distinct"] == min(bad_samples, 1), "each fault breaks one sample at most"
        assert final["train_samples"] == 8 * BATCH, "every batch stays full"
        trained = audited((tmp_path / "audit").glob("*.ids"), shards)  # the ids as the unbroken shards' keys
        assert broken.key is None or broken.key not in trained, "the bad sample was never trained on"
        if bad_samples:
            assert re.search(rf"skipped {bad_samples} bad samples \(1 distinct\)", out), out
            assert f"bad samples skipped {bad_samples} (1 distinct" in out
            logged = [line for line in err.splitlines() if line.startswith("raywds: warning: skipped a bad sample: ")]
            assert len(logged) == min(bad_samples, 5) and all(
                broken.shard in line and str(broken.key) in line for line in logged
            )
        if bad_shards:
            assert re.search(rf"skipped (\d+ bad samples \(\d+ distinct\) and )?{bad_shards} bad shards", out), out
        return
    assert code == 1, (out + err)[-2000:]
    errors = [line for line in err.splitlines() if line.startswith("raywds: error: ")]
    assert len(errors) == 1 and err.strip().endswith(errors[0]), err[-2000:]
    line = errors[0]
    assert re.search(words, line), line
    assert line.startswith("raywds: error: shard ") or "shards in a row were unreadable" in line, line
    shard = broken.shard or refused(broken, data, mode)
    assert re.search(rf"shard \S+/{re.escape(shard)}\b", line), (shard, line)
    if outcome == SAMPLE_ERROR:
        assert re.search(
            (
                rf"raywds: error: shard \S+/{re.escape(broken.shard)}: sample {re.escape(str(broken.key))} "
                rf"\({re.escape(str(broken.key))}\.\w+\): "
            ),
            line,
        ), line
    checkpoints = [int(m) for m in re.findall(r"^step (\d+): checkpoint inside epoch 1", out, re.M)]
    if checkpoints:  # the last good step's checkpoint is kept
        state = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=False)
        assert state["progress"]["position"]["step"] == checkpoints[-1]


def test_debug_shows_the_traceback(shards: Path, tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    data = edit.copy(shards, tmp_path / "shards")
    short_shard("train")(data, 1)
    assert main(["--debug", *train_flags(str(data), tmp_path, "split")]) == 1
    err = capfd.readouterr().err
    assert "Traceback (most recent call last)" in err and re.search(r"raywds: error: shard .* is \d+ bytes, its", err)


def test_a_failed_run_stops_its_loader_workers_at_once(shards: Path, tmp_path: Path) -> None:
    """The error leaves no loader worker behind: they are stopped as the error passes, not when
    the garbage collector frees the loader (which then waited 5 s for each worker)."""
    import multiprocessing

    data = edit.copy(shards, tmp_path / "shards")
    short_shard("train")(data, 1)
    started = time.perf_counter()
    assert main([*train_flags(str(data), tmp_path, "split"), "--loader-workers", "2"]) == 1
    assert multiprocessing.active_children() == [], "the loader's workers still run after the error"
    assert time.perf_counter() - started < 4.5


def test_too_many_bad_samples_stop_a_resample_run(
    shards: Path, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    data = edit.copy(shards, tmp_path / "shards")
    for nth in range(6):
        bad_member("jpg", NOT_AN_IMAGE, nth=nth)(data, first_drawn(data))
    code = main([*train_flags(str(data), tmp_path, "resample"), "--max-bad-samples", "2"])
    err = capfd.readouterr().err
    assert code == 1 and "Traceback" not in err
    match = re.search(
        (
            r"^raywds: error: shard \S+: sample \S+ \(\S+\.jpg\): cannot identify image file \((\d+) bad samples "
            r"skipped this epoch on this rank, (\d+) distinct: more than the 2 that --max-bad-samples 2 allows\)"
        ),
        err,
        re.M,
    )
    assert match and int(match.group(1)) >= int(match.group(2)) > 2, err[-2000:]


def test_a_fraction_bounds_bad_samples_by_the_epoch(shards: Path) -> None:
    from raywds.train.config import TrainConfig

    assert TrainConfig(data="x", max_bad_samples=0.01).bad_samples_allowed(1_281_167) == 12811
    assert TrainConfig(data="x", max_bad_samples=3).bad_samples_allowed(10) == 3
    with pytest.raises(ValueError, match=r"max_bad_samples=2.5 must be a fraction below 1 or a whole number"):
        TrainConfig(data="x", max_bad_samples=2.5)


def test_one_bad_sample_drawn_again_and_again_counts_once_against_the_bound(
    shards: Path, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """Shards repeat within a resample epoch, and a bad sample with them: every draw is skipped,
    the sample counts once against --max-bad-samples (1 here, as 0.001 of a 1,437-sample epoch),
    and both counts carry through a resume."""
    data = edit.copy(shards, tmp_path / "shards")
    broken = bad_member("jpg", NOT_AN_IMAGE)(data, first_drawn(data))
    expected = replay(data, broken, num_batches=8)
    assert expected is not None and expected[0] >= 2, "the epoch draws the broken shard more than once"
    draws_skipped = expected[0]
    code = main([*train_flags(str(data), tmp_path, "resample"), "--max-bad-samples", "1"])
    out, err = capfd.readouterr()
    assert code == 0 and "Traceback" not in err, err[-2000:]
    final = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    assert [final[k] for k in ("bad_samples", "bad_samples_distinct", "bad_samples_total")] == [
        draws_skipped,
        1,
        draws_skipped,
    ]
    assert final["bad_samples_distinct_total"] == 1
    assert f"skipped {draws_skipped} bad samples (1 distinct)" in out
    assert f"bad samples skipped {draws_skipped} (1 distinct, counted by epoch)" in out
    checkpoint = tmp_path / "run" / "checkpoint.pt"
    state = torch.load(checkpoint, weights_only=False)
    assert (state["progress"]["bad_samples"], state["progress"]["bad_samples_distinct"]) == (draws_skipped, 1)
    flags = [*train_flags(str(data), tmp_path / "again", "resample"), "--max-bad-samples", "1"]
    assert main([*flags, "--epochs", "2", "--resume", str(checkpoint)]) == 0, capfd.readouterr().err[-2000:]
    resumed = json.loads((tmp_path / "again" / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    assert resumed["epoch"] == 2 and resumed["bad_samples_total"] == draws_skipped + resumed["bad_samples"]
    assert resumed["bad_samples_distinct_total"] == 1 + resumed["bad_samples_distinct"]


def test_two_distinct_bad_samples_past_a_bound_of_one_stop_naming_both_counts(
    shards: Path, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    data = edit.copy(shards, tmp_path / "shards")
    manifest = read_manifest(str(data))
    order = [s.name for s in itertools.islice(draws(manifest), 8)]
    first, second = order[0], next(n for n in order if n != order[0])
    names = [s.name for s in manifest.shards("train")]
    for name in (first, second):
        bad_member("jpg", NOT_AN_IMAGE)(data, names.index(name))
    draws_skipped = order[: order.index(second)].count(first) + 1  # the first bad sample's draws, then the second
    assert draws_skipped >= 3, "the first broken shard is drawn again before the second"
    code = main([*train_flags(str(data), tmp_path, "resample"), "--max-bad-samples", "1"])
    err = capfd.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("raywds: error: ")]
    assert code == 1 and "Traceback" not in err and len(errors) == 1, err[-2000:]
    assert re.match(
        (
            rf"raywds: error: shard \S+/{re.escape(second)}: sample \S+ \(\S+\.jpg\): cannot identify image file "
            rf"\({draws_skipped} bad samples skipped this epoch on this rank, 2 distinct: more than the 1 that "
            r"--max-bad-samples 1 allows\); run `raywds verify` on the shards$"
        ),
        errors[0],
    ), errors[0]


def _resample_rank(rank: int, cfg: TrainConfig, store: str, out: str) -> None:
    """One of two gloo ranks: its metrics, or the error that stopped it, to out/rankN.json."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=2, timeout=timedelta(seconds=60)
    )
    try:
        result = {"metrics": train(cfg, World(rank=rank, world_size=2))}
    except DataError as e:
        result = {"error": str(e)}
    finally:
        dist.destroy_process_group()
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))


def _two_ranks(data: Path, tmp_path: Path) -> list[dict]:
    """A one-epoch resample run on two gloo ranks, 4 batches each, bound 1; what each rank ended with."""
    cfg = small_config(data, mode="resample", epochs=1, worker_shuffle_buffer=0, max_bad_samples=1)
    mp.start_processes(
        _resample_rank, args=(cfg, str(tmp_path / "store"), str(tmp_path)), nprocs=2, start_method="forkserver"
    )
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.slow
def test_the_same_bad_sample_drawn_on_two_ranks_counts_once(shards: Path, tmp_path: Path) -> None:
    data = edit.copy(shards, tmp_path / "shards")
    broken = bad_member("jpg", NOT_AN_IMAGE)(data, first_drawn(data))
    per_rank = [replay(data, broken, num_batches=4, rank=r, num_ranks=2) for r in range(2)]
    assert per_rank[0] and per_rank[1] and per_rank[0][0] >= 1 and per_rank[1][0] >= 1, "both ranks draw it"
    results = _two_ranks(data, tmp_path)
    assert results[0] == results[1] and "metrics" in results[0], results
    final = results[0]["metrics"]
    assert (final["bad_samples"], final["bad_samples_distinct"]) == (per_rank[0][0] + per_rank[1][0], 1)
    assert final["train_samples"] == 2 * 4 * 16


@pytest.mark.slow
def test_distinct_bad_samples_on_two_ranks_add_up_against_the_bound(shards: Path, tmp_path: Path) -> None:
    """Each rank alone stays within the bound of 1; the job's 2 distinct do not: every rank stops
    at the epoch's end with the job's counts (none waits for another in a collective)."""
    data = edit.copy(shards, tmp_path / "shards")
    one = bad_member("jpg", NOT_AN_IMAGE, nth=12)(data, 6)  # read by rank 0; rank 1's epoch ends before it
    other = bad_member("jpg", NOT_AN_IMAGE)(data, 0)  # drawn by rank 1 only
    both = Broken("", bad_samples={**one.bad_samples, **other.bad_samples})
    assert [replay(data, both, num_batches=4, rank=r, num_ranks=2) for r in range(2)] == [(1, 0), (1, 0)]
    results = _two_ranks(data, tmp_path)
    for rank, (result, broken) in enumerate(zip(results, (one, other))):
        assert re.match(
            (
                rf"shard \S+/{re.escape(broken.shard)}: sample {broken.key} \(\S+\.jpg\): cannot identify image file "
                r"\(2 bad samples skipped this epoch across ranks, 2 distinct: more than the 1 that "
                r"--max-bad-samples 1 allows\)"
            ),
            result.get("error", ""),
        ), (rank, result)


def test_the_ray_data_planes_steps_count_a_bad_sample_the_same_way(shards: Path, tmp_path: Path) -> None:
    """The Ray Data plane's own steps (raywds.loader.plane, plain functions, run here without Ray):
    two draws of a shard with one bad sample hand on two reasons, which the loop counts as one
    distinct sample, as it counts the per-rank loader's."""
    data = edit.copy(shards, tmp_path / "shards")
    broken = bad_member("jpg", NOT_AN_IMAGE)(data, 1)
    manifest = read_manifest(str(data))
    cfg = small_config(data, mode="resample", epochs=1, max_bad_samples=1)
    url = manifest.url(manifest.shards("train")[1])
    policy = cfg.loader().read_policy(skip_unreadable=True)
    draw = [
        decode_rows(c, train_decoder(cfg.loader(), 0), policy, size=28)
        for c in shard_rows(url, expected(manifest, "train")[url], policy)
    ]
    batches = list(Rebatcher(8, partial=False)(draw + draw))
    assert [len(b.bad_samples) for b in batches] == [1, 1, 0], "each draw's reason rides on the next batch out"
    model = build_model("demo", len(manifest.classes))
    result = train_epoch(
        model,
        batches,
        torch.optim.SGD(model.parameters(), lr=0.01),
        lambda step: 0.01,
        World(),
        Compute.for_run(cfg, "cpu"),
        uneven=False,
    )
    assert len(result.bad_samples) == 2 and list(result.distinct_bad) == [(url, broken.key)]


def test_a_bad_sample_is_its_shard_and_key_whatever_its_member_and_complaint() -> None:
    """What makes draws of one sample one distinct sample: the shard and key the worker names,
    carried as fields from the worker (a key may hold ' (' itself: nothing is parsed back)."""
    jpg = BadSample("http://h:8080/a.tar", "k (1)", "k (1).jpg", "cannot identify image file")
    cls = BadSample("http://h:8080/a.tar", "k (1)", "k (1).cls", "class b'x' is not a number")
    assert (jpg.shard, jpg.key) == (cls.shard, cls.key) and jpg != cls
    assert jpg.line == "shard http://h:8080/a.tar: sample k (1) (k (1).jpg): cannot identify image file"
