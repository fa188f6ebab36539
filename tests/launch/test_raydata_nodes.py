"""The Ray Data plane on a real two-node cluster (tests/support/netnodes.py): the training workers hold a
custom resource only the head has, so both ranks run there, while the read-and-decode tasks run
on both nodes; the demo trained this way reaches the per-rank loader's top-1."""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from support import netnodes
from support.netnodes import HEAD_IP, SUMMARY, WORKER_IP, TwoNodes, ranks, raywds_ray
from support.raycluster import HeadNode

from raywds.data.manifest import read_manifest

pytestmark = pytest.mark.multinode

DEMO_TOP1 = 0.99
"""The demo's validation top-1 with each rank's own loader (README, docs/performance.md: 0.99 to 1.00 after
6 epochs; 0.997 after the 3 this test trains, `raywds train --demo --epochs 3`)."""
DECODED_ON = re.compile(r"rank (\d+)'s epoch (\d+) was decoded on (\d+) node\(s\): (.*)")


@pytest.fixture(scope="module")
def trainer_head(user_cluster: HeadNode) -> Iterator[TwoNodes]:
    """A head with a `trainer` resource for two workers and a CPU to spare; a worker node with one CPU, no `trainer`."""
    netnodes.require()
    with netnodes.two_nodes("rwp-", head_cpus=3, worker_cpus=1, head_resources={"trainer": 2}) as cluster:
        yield cluster


def test_the_demo_on_the_data_plane_decodes_on_both_nodes_and_trains_on_the_head(
    trainer_head: TwoNodes, demo: Path, tmp_path: Path
) -> None:
    out = raywds_ray(
        trainer_head,
        "--demo",
        "--demo-dir",
        str(demo.parent),
        "--data-plane",
        "ray",
        "--worker-resource",
        "trainer=1",
        "--num-workers",
        "2",
        "--epochs",
        "3",
        "--storage-path",
        str(tmp_path / "ray"),
    )
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    assert "decoding on Ray Data tasks" in out.stdout
    assert [ip for _, _, ip in ranks(out.stdout)] == [HEAD_IP, HEAD_IP], "both ranks on the node with `trainer`"
    decoded = {(int(rank), int(epoch)): where for rank, epoch, _, where in DECODED_ON.findall(out.stdout)}
    assert sorted(decoded) == [(r, e) for r in (0, 1) for e in range(1, 4)], out.stdout[-3000:]
    crops: Counter[str] = Counter()
    per_rank_epoch = set()
    for where in decoded.values():
        counts = {ip: int(n) for ip, n in re.findall(r"([\d.]+) \((\d+)\)", where)}
        crops.update(counts)
        per_rank_epoch.add(sum(counts.values()))
    # which rank's task lands on which node is Ray's choice (SPREAD, both ranks' executors racing
    # for the free CPUs): the run as a whole must have used both nodes' CPUs
    assert set(crops) == {HEAD_IP, WORKER_IP}, f"the crops came from both nodes: {dict(crops)}"
    # resample, the demo's mode: each rank decodes at least its half of an epoch (a round may draw more)
    assert 2 * min(per_rank_epoch) >= read_manifest(str(demo)).num_samples("train"), per_rank_epoch
    match = SUMMARY.search(out.stdout)
    assert match, out.stdout[-3000:]
    assert int(match.group(1)) == 3 and float(match.group(2)) >= DEMO_TOP1 - 0.03, match.group(0)
