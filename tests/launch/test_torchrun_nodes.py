"""Multi-node without Ray: `torchrun --nnodes 2 --rdzv-backend c10d` started on each of two
machines (network namespaces joined by a veth pair, tests/support/netnodes.py), both reading the head's
shard server, in split mode: every sample once, proven by the audit files."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from support import netnodes
from support.data import audited, tar_keys
from support.netnodes import HEAD_IP, WORKER_IP

pytestmark = pytest.mark.multinode
BIN = Path(sys.executable).parent


@pytest.fixture
def namespaces() -> Iterator[tuple[str, str]]:
    netnodes.require()
    with netnodes.veth_pair(f"rt{os.getpid() % 100000}") as names:
        yield names


def test_torchrun_on_two_machines_trains_a_split_epoch_exactly_once(
    namespaces: tuple[str, str], uneven: Path, tmp_path: Path
) -> None:
    head, worker = namespaces
    server = subprocess.Popen(
        [*netnodes.in_namespace(head), str(BIN / "raywds"), "serve", str(uneven), "--backend", "embedded"]
        + ["--host", HEAD_IP, "--port", "8080"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    ranks: list[subprocess.Popen[str]] = []
    try:
        assert server.stdout is not None and "serving" in server.stdout.readline()
        # The head hosts the rendezvous store (torchrun finds that by the hostname, which here, as on
        # many hosts, resolves to a loopback address); --local-addr: the address the others reach.
        for namespace, address, is_host in ((head, HEAD_IP, "1"), (worker, WORKER_IP, "0")):
            ranks.append(
                subprocess.Popen(
                    [*netnodes.in_namespace(namespace), str(BIN / "torchrun"), "--nnodes", "2", "--nproc-per-node", "1"]
                    + ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"{HEAD_IP}:29400", "--rdzv-id", "raywds-test"]
                    + ["--rdzv-conf", f"is_host={is_host}"]
                    + ["--local-addr", address, "-m", "raywds", "train", "--data", f"http://{HEAD_IP}:8080"]
                    + ["--model", "demo", "--epochs", "1", "--batch-size", "8", "--image-size", "24"]
                    + ["--loader-workers", "1", "--mode", "split", "--audit-dir", str(tmp_path / "audit")]
                    + ["--out", str(tmp_path / f"run-{namespace}")],
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                    env={**os.environ, "OMP_NUM_THREADS": "1"},
                )
            )
        deadline = time.monotonic() + 240
        outputs = [rank.communicate(timeout=max(1.0, deadline - time.monotonic()))[0] for rank in ranks]
    finally:
        for process in (*ranks, server):
            process.kill()
            process.wait()
    assert [rank.returncode for rank in ranks] == [0, 0], "\n".join(out[-3000:] for out in outputs)
    everything = Counter(tar_keys(uneven))
    trained = audited((tmp_path / "audit").glob("epoch0000-*.ids"), uneven)
    assert trained == everything, "the two machines together trained every sample once"
    assert {f.name.split("-")[1] for f in (tmp_path / "audit").glob("*.ids")} == {"rank00000", "rank00001"}
    assert "samples seen 120" in "".join(outputs), "rank 0 counted the whole split"
