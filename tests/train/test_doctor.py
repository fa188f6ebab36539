"""The data-stall doctor on bottlenecks planted for real: a throttled shard server, one slow
shard, decoding large JPEGs with one worker, one slow rank of two, and a model whose compute
is the limit. The doctor must name the bottleneck, the rank and the host, and its first
prescription must help when the run is made again with it."""

from __future__ import annotations

import dataclasses
import http.server
import json
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from support.planted.planted_slowness import slow_decode, slow_forward
from support.runs import FORKSERVER_PRELOAD, made_stages, small_config

from raywds.runs.folder import RunDir
from raywds.train import trainer
from raywds.train.doctor import diagnose
from raywds.train.timing import ranks
from raywds.train.trainer import train
from raywds.world import World

torch.multiprocessing.set_forkserver_preload(FORKSERVER_PRELOAD)
HOST = socket.gethostname()


PLANTED_DECODE_S = 0.15


def rows(run: Path) -> list[dict]:
    return [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "stages" in r]


def verdict_of(row: dict) -> list[str]:
    """The doctor's lines, also printed (`pytest -s` shows them, as docs/doctor.md quotes them)."""
    lines = diagnose(row)
    print("\n".join(["$ raywds doctor RUN", *lines]))
    return lines


class _Throttled(http.server.SimpleHTTPRequestHandler):
    """Serves files at about `rate` bytes a second in all (one lock: the server's link is full)."""

    rate = 200_000
    lock = threading.Lock()

    def copyfile(self, source, outputfile) -> None:  # type: ignore[no-untyped-def]
        while chunk := source.read(4096):
            with self.lock:
                time.sleep(len(chunk) / self.rate)
            outputfile.write(chunk)

    def log_message(self, format: str, *args: object) -> None:
        pass


@contextmanager
def throttled(root: Path) -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), lambda *a: _Throttled(*a, directory=str(root)))
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.slow
def test_a_throttled_server_is_named_and_the_cache_takes_it_away(shards: Path, tmp_path: Path) -> None:
    with throttled(shards) as url:
        cfg = small_config(url, epochs=1, mode="split")
        train(cfg, World(), run_dir=RunDir(tmp_path / "slow"))
        (verdict, *fixes) = verdict_of(rows(tmp_path / "slow")[-1])
        assert verdict.startswith(f"rank 0 on {HOST} waits ") and "of its time reading shards" in verdict, verdict
        assert f"in all from {url}" in verdict, verdict
        assert fixes[0].startswith("1. --cache-dir"), fixes
        assert fixes[2].startswith("3. larger shards") and "this rank's 8 shards averaged 0.1 MB" in fixes[2], fixes
        cached = small_config(url, epochs=2, mode="split", cache_dir=str(tmp_path / "cache"))
        train(cached, World(), run_dir=RunDir(tmp_path / "cached"))
    first, second = rows(tmp_path / "cached")
    assert second["stages"]["read_s"][0] < first["stages"]["read_s"][0] / 3, (first["stages"], second["stages"])
    # From the cache the shards come at the local disk's rate, not the server's: about 400x on a quiet
    # machine. With the Ray tests beside it on both cores, reading the 8 tiny shards (68 KB each) once
    # took 6x as long (69x the server's rate), enough for the doctor to call that 0.4 s epoch
    # read-bound: so the rate is held to 10x, and the verdict only to not naming the cache.
    read_rate = [row["stages"]["read_bytes"][0] / row["stages"]["read_s"][0] for row in (first, second)]
    assert read_rate[1] >= 10 * read_rate[0], (first["stages"], second["stages"])
    assert not any("--cache-dir" in line for line in verdict_of(second)), verdict_of(second)


def test_one_slow_shard_is_named(shards: Path, tmp_path: Path) -> None:
    """A `pipe:` command that takes 1.5 s to start giving one shard."""
    slow = "imagenet-train-000003.tar"
    assert (shards / slow).is_file()
    command = f"pipe:sh -c 'case {{}} in {slow}) sleep 1.5;; esac; exec cat {shards}/{{}}'"
    cfg = small_config(str(shards), shards_at=command, epochs=1, mode="split")
    train(cfg, World(), run_dir=RunDir(tmp_path))
    verdict, fix = verdict_of(rows(tmp_path)[-1])[:2]
    assert verdict.startswith(f"rank 0 on {HOST} waits "), verdict
    assert f"for shard pipe:sh -c 'case {slow} in {slow})" in verdict, verdict
    assert fix.startswith("1. a slow shard"), fix


@pytest.mark.slow
def test_decoding_with_one_worker_is_named_and_more_workers_help(
    large: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each crop of the large JPEGs also waits 150 ms (planted), several times its own work,
    so that the loader's pace is set by how many workers decode at once, not by the cores other
    tests or a load left free (with 30 ms, beside the Ray tests in CI, 2 workers ran only 1.17x)."""
    slow_decode(monkeypatch, PLANTED_DECODE_S)
    one = small_config(str(large), decode="pil", image_size=32, epochs=1, batch_size=8)
    train(one, World(), run_dir=RunDir(tmp_path / "one"))
    row = rows(tmp_path / "one")[-1]
    verdict, fix = verdict_of(row)[:2]
    assert verdict.startswith(f"rank 0 on {HOST} waits ") and "decodes" in verdict and "1 worker(s)" in verdict, verdict
    cores = row["stages"]["cores_per_rank"]
    if cores < 2:
        pytest.skip("one core: more loader workers cannot help")
    assert fix.startswith(f"1. --loader-workers {cores}"), fix
    more = dataclasses.replace(one, loader_workers=cores)
    train(more, World(), run_dir=RunDir(tmp_path / "more"))
    again = rows(tmp_path / "more")[-1]
    assert again["images_per_s"] > 1.3 * row["images_per_s"], (row["images_per_s"], again["images_per_s"])
    assert each_worker(row) < 1 / PLANTED_DECODE_S, row["stages"]  # the planted wait was timed as decoding


def each_worker(row: dict) -> float:
    """Images a second each loader worker made while it ran (its wall time reading, decoding, collating)."""
    s = row["stages"]
    return s["decoded"][0] / max(s["read_s"][0] + s["decode_s"][0] + s["collate_s"][0], 1e-9)


PLANTED_FORWARD_S = 0.25


@pytest.mark.slow
def test_a_model_that_is_the_limit_is_not_blamed_on_the_data(
    shards: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each forward pass also spins 250 ms of CPU (planted), several times what one loader worker
    spends making a batch of the small test JPEGs: the model is the limit however busy the machine
    (others' load slows the rank's spin as much as its worker). The verdict is on the second epoch,
    whose first batches were made while the first validated, and names the model's rate, which
    the plant caps."""
    monkeypatch.setattr(trainer, "start_model", trainer.start_model)  # the slow models end with the test
    slow_forward(PLANTED_FORWARD_S)
    cfg = small_config(str(shards), epochs=2, batch_size=32)
    train(cfg, World(), run_dir=RunDir(tmp_path))
    lines = verdict_of(rows(tmp_path)[-1])
    assert len(lines) == 1 and lines[0].startswith("the data is not the bottleneck: no rank waits more than "), lines
    rate = float(lines[0].rsplit("the model takes ", 1)[1].removesuffix(" images/s a rank").replace(",", ""))
    assert 0 < rate <= cfg.batch_size / PLANTED_FORWARD_S, lines


def _rank(rank: int, data: str, store: str, out: str) -> None:
    torch.set_num_threads(1)
    if rank == 1:
        slow_forward(0.05)
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=2, timeout=timedelta(seconds=60)
    )
    try:
        cfg = small_config(data, epochs=1, mode="split", batch_size=8)
        train(cfg, World(rank=rank, world_size=2), run_dir=RunDir(Path(out)) if rank == 0 else None)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_one_slow_rank_of_two_is_named_as_compute_not_data(shards: Path, tmp_path: Path) -> None:
    """Rank 1 sleeps 50 ms in each forward pass: rank 0 waits for it in the all-reduce."""
    mp.start_processes(
        _rank, args=(str(shards), str(tmp_path / "store"), str(tmp_path)), nprocs=2, start_method="forkserver"
    )
    row = rows(tmp_path)[-1]
    lines = verdict_of(row)
    assert lines[0].startswith(f"rank 1 on {HOST} is "), lines
    assert "slower in compute than the others (same data wait)" in lines[0], lines
    assert any(line.startswith(f"1. check or leave out {HOST}") for line in lines), lines
    fast, slow = ranks(row["stages"])
    assert fast.blocked_s > 0.5 * 0.05 * 7 and slow.blocked_s == 0, (fast, slow)  # 7 steps of 50 ms more


def test_the_doctor_command_reads_a_runs_folder(
    shards: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from raywds.cli.main import main

    train(small_config(str(shards), epochs=2), World(), run_dir=RunDir(tmp_path))
    stages = rows(tmp_path)[0]["stages"]
    assert 0 < stages["resize_s"][0] < stages["decode_s"][0], stages  # the cpu decoder's resize, timed apart
    capsys.readouterr()
    main(["doctor", str(tmp_path), "--epoch", "1"])
    out = capsys.readouterr().out.splitlines()
    assert out == diagnose(rows(tmp_path)[0]), out
    assert main(["doctor", str(tmp_path / "nowhere")]) == 1
    assert "no metrics.jsonl" in capsys.readouterr().err


def test_late_batches_are_the_hand_over_only_where_the_loader_keeps_up() -> None:
    """A worker whose next decode holds its GIL holds back the batch it has just made: a loader
    slower than the model is decode-bound however late its batches arrive (the decode-bound
    run's first epoch with one worker was called a hand-over)."""
    slow = diagnose({"stages": made_stages((50, 350, 800), handover=0.8)})
    assert "its loader decodes 50 images/s with 1 worker(s)" in slow[0], slow
    assert slow[1].startswith("1. --loader-workers 8, as many as its 8 cores allow"), slow
    fast = diagnose({"stages": made_stages((2000, 350, 800), handover=0.8)})
    assert "mostly for batches already made" in fast[0] and "its loader makes 2,000 images/s" in fast[0], fast


def test_the_data_plane_is_prescribed_with_the_clusters_idle_cpus() -> None:
    """Under Ray each rank knows the CPUs no task held as it started; elsewhere `ray status` is named."""
    short = made_stages((50, 350, 800))  # 9 workers would keep up, the rank has 8 cores
    assert "(`ray status` lists them; CPU-only nodes may join)" in diagnose({"stages": short})[2]
    fix = diagnose({"stages": {**short, "idle_cpus": 24.0}})[2]
    assert fix.startswith("2. --data-plane ray: decode on the cluster's idle CPUs too (24 were idle as the run"), fix
