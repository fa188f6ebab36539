"""raywds on a real two-node Ray cluster (tests/support/netnodes.py): a rank on each node, exact split
epochs across nodes, `ray job submit`, the worker node slower than the head and named so by the
doctor, and a node lost mid-epoch, with a fixed worker count and elastic. The driver runs on
the head node, as a user's does."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from support import netnodes
from support.data import audited, tar_keys
from support.netnodes import HEAD_IP, RANK, RAYWDS, SUMMARY, WORKER_IP, TwoNodes, ranks, raywds_ray
from support.planted import planted_slowness
from support.raycluster import RAY, HeadNode

from raywds.data.convert import ConvertOptions, convert
from raywds.data.resume import JOURNAL
from raywds.train.audit import NAME, kept

SLOW_S = 0.1

ROOT = Path(__file__).resolve().parents[2]

# A healthy run's console: raywds's lines (the doctor's verdict too), the workers' raywds lines, Ray's connect lines
CLEAN = re.compile(
    r"^(raywds: |epochs \d+  top-1|doctor: |\d{4}-\d\d-\d\d [\d:,]+\tINFO worker\.py:\d+ -- Connect"
    r"|(\x1b\[\d+m)?\(RayTrainWorker pid=\d+(, ip=[\d.]+)?\)(\x1b\[0m)? "
    r"(rank \d+ of \d+ on node|epoch \d+/\d+  loss|  doctor: ))"
)
JOB = re.compile(
    r"^(\d{4}-\d\d-\d\d [\d:,]+\tINFO (job_manager\.py:\d+ -- Runtime env is setting up\."
    r"|worker\.py:\d+ -- Using address \S+ set in the environment variable RAY_ADDRESS)|Running entrypoint for job )"
)
"""What Ray adds to a job's log as it starts the job's driver."""


@pytest.fixture(scope="module")
def unseen(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder on the head node that the worker node cannot see (an empty tmpfs of its own there)."""
    return tmp_path_factory.mktemp("local-only")


@pytest.fixture(scope="module")
def held(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the slow worker node's conversion tasks mark each `held-*` shard they hold
    (planted_slowness: after its first, each waits 120 s, until the test kills the node)."""
    return tmp_path_factory.mktemp("held")


@pytest.fixture(scope="module")
def two_node_cluster(user_cluster: HeadNode, unseen: Path, held: Path) -> Iterator[TwoNodes]:
    """The worker node starts as a slow node: each rank there computes 100 ms of CPU longer in each
    step (its Ray's environment), which the doctor must name (`slow_worker`); and it cannot see
    `unseen`, from its first start on, so that no test restarts it for that (each restart waits
    for the GCS to find the old node dead). The node-loss tests start it again at full speed."""
    netnodes.require()
    with netnodes.two_nodes(
        "rwm-", worker_env=planted_slowness.environment(SLOW_S, hold_dir=str(held)), worker_private=[str(unseen)]
    ) as cluster:
        yield cluster


@pytest.fixture
def slow_worker(two_node_cluster: TwoNodes) -> TwoNodes:
    """The two nodes with the worker node slow: where a node-loss test that ran before (in another
    order of the tests) left it at full speed, it is started again, slow."""
    if not (two_node_cluster.worker_running and two_node_cluster.worker_env_set):
        two_node_cluster.lose_worker()
        two_node_cluster.start_worker()
    return two_node_cluster


@pytest.fixture
def both_nodes(two_node_cluster: TwoNodes) -> TwoNodes:
    """The two nodes, the worker node slow or not: where a node-loss test before left it lost (the
    last one does not start it again, and a failed one may not have), it is started again. So the
    module's last test may lose the node for good, and the cluster's end stops what is left."""
    if not two_node_cluster.worker_running:
        start_worker_again(two_node_cluster)
    return two_node_cluster


def start_worker_again(cluster: TwoNodes) -> None:
    """The lost worker node started again, at full speed: a slow rank's 100 ms of spinning a step
    held a core for the rest of each run (in one elastic timeline, each epoch after the node's
    return took 7.5 s), and no test after a node's loss asks for the slow node's verdict."""
    cluster.start_worker(with_worker_env=False)


def trained_once(audit: Path, epoch: int, demo: Path) -> Counter:
    """The keys of `epoch` that the run's final line of checkpoints holds (raywds.train.audit.kept)."""
    return audited(kept(audit).get(epoch, []), demo)


def controller_node(cluster: TwoNodes) -> str:
    """The IP of the node that ran the newest Ray Train controller (from Ray's state API)."""
    script = (
        "import os; from ray.util.state import list_actors, list_nodes; url = os.environ['DASHBOARD']; "
        "ips = {n.node_id: n.node_ip for n in list_nodes(address=url)}; "
        "a = [a for a in list_actors(address=url, detail=True, limit=1000) if a.class_name == 'TrainController']; "
        "print('CONTROLLER', ips[a[-1].node_id])"
    )
    out = cluster.run([sys.executable, "-c", script], timeout=120, env={"DASHBOARD": cluster.head.dashboard_url})
    assert out.returncode == 0, out.stderr[-2000:]
    return next(line.split()[1] for line in out.stdout.splitlines() if line.startswith("CONTROLLER "))


def job_log(output: str) -> list[str]:
    """The job's own lines in `ray job submit`'s output: those it tails after its "Tailing logs"
    line, without `ray job submit`'s own (its `cli.py` log lines)."""
    lines = output.splitlines()
    begin = next(i for i, line in enumerate(lines) if "Tailing logs until the job exits" in line)
    return [line for line in lines[begin + 1 :] if line.strip() and not re.search(r"\t\w+ cli\.py:\d+ -- ", line)]


def test_the_demo_submitted_as_a_job_runs_a_rank_on_each_node_and_trains_every_sample_once(
    slow_worker: TwoNodes, demo: Path, tmp_path: Path
) -> None:
    """`ray job submit --working-dir .` of the demo in split mode, as a user submits it: a rank on
    each node reading the head's server, every sample once, the slow node named, a clean console."""
    two_node_cluster = slow_worker
    audit = tmp_path / "audit"
    args = ["--demo", "--demo-dir", str(demo.parent), "--mode", "split", "--batch-size", "32", "--epochs", "1"]
    args += ["--audit-dir", str(audit), "--name", "demo"]
    args += ["--storage-path", f"file://{tmp_path}/ray"]  # a URI goes to Ray untouched
    out = two_node_cluster.run(
        [str(RAY), "job", "submit", "--address", two_node_cluster.head.dashboard_url, "--working-dir", str(ROOT)]
        + ["--", sys.executable, "-m", "raywds", "ray", *args],
        timeout=400,
    )
    output = out.stdout + out.stderr
    assert out.returncode == 0, output[-4000:]
    assert re.search(r"Job '\S+' succeeded", output)
    assert "raywds: training on 2 CPU (gloo) workers (2 node(s))" in out.stdout
    assert sorted(ip for _, _, ip in ranks(out.stdout)) == [HEAD_IP, WORKER_IP], out.stdout[-3000:]
    assert re.search(rf"serving \S+ at http://{re.escape(HEAD_IP)}:\d+", out.stdout), "workers read the head's server"
    assert re.search(r"RayTrainWorker pid=\d+[^)]*\)(\x1b\[0m)? epoch 1/1  loss", out.stdout), (
        f"the workers' lines reach the job's:\n{out.stdout[-3000:]}"
    )
    match = SUMMARY.search(out.stdout)
    assert match and match.group(4) == "1200" and float(match.group(2)) > 0.5, out.stdout[-2000:]
    assert trained_once(audit, 0, demo) == Counter(tar_keys(demo)), "every sample once, none on two nodes"
    assert {NAME.fullmatch(f.name)["rank"] for f in audit.glob("*.ids")} == {"00000", "00001"}  # type: ignore[index]
    assert (tmp_path / "ray" / "demo" / "metrics.jsonl").is_file()
    slow = next(r for r, _, ip in ranks(out.stdout) if ip == WORKER_IP)
    verdict = re.search(r"^doctor: (rank (\d+) on \S+ is \d+% slower in compute than the others.*)$", out.stdout, re.M)
    assert verdict and verdict.group(2) == str(slow), f"the slow node's rank {slow} is named:\n{out.stdout[-3000:]}"
    print(
        "\n".join(re.findall(r"^doctor: .*$", out.stdout, re.M))
    )  # `pytest -s` shows them, as docs/doctor.md quotes them
    assert controller_node(two_node_cluster) == HEAD_IP, "Train's controller runs beside the driver, on the head"
    # Not even the INFO line Ray Train logs at every report, nor a traceback of any process
    unexpected = [line for line in job_log(out.stdout) if not (CLEAN.match(line) or JOB.match(line))]
    assert not unexpected, "the job's log holds raywds's lines and Ray's connect lines only:\n" + "\n".join(unexpected)
    assert "Traceback" not in output, output[-3000:]


def test_a_storage_path_other_nodes_cannot_see_is_refused_before_training(
    both_nodes: TwoNodes, unseen: Path, demo: Path
) -> None:
    storage = unseen  # the worker node has its own empty tmpfs over that path
    out = raywds_ray(both_nodes, "--demo", "--demo-dir", str(demo.parent), "--storage-path", str(storage))
    assert out.returncode == 1, out.stdout[-3000:]
    assert f"raywds: error: --storage-path {storage} is on this machine only: node(s) {WORKER_IP} cannot see" in (
        out.stderr
    ), out.stderr[-3000:]
    assert "epoch 1/" not in out.stdout


def test_convert_from_a_folder_another_node_cannot_see_is_one_line_before_any_task(
    both_nodes: TwoNodes, unseen: Path, tmp_path: Path
) -> None:
    from raywds.data.demo import DemoSpec, write_tree

    src = write_tree(unseen / "tree", DemoSpec(num_train_per_class=2, num_val_per_class=1, image_side_px=16))
    out = both_nodes.run([str(RAYWDS), "convert", str(src), str(tmp_path / "out"), "--ray"], timeout=120)
    assert out.returncode == 1, out.stdout[-3000:]
    assert f"raywds: error: SRC is on this machine only: node(s) {WORKER_IP} cannot see {src}" in out.stderr
    assert not list((tmp_path / "out").glob("*.tar"))


def test_convert_on_both_nodes_loses_the_worker_node_and_still_writes_the_local_converters_shards(
    slow_worker: TwoNodes, tree: Path, held: Path, tmp_path: Path
) -> None:
    """`raywds convert --ray` on the two nodes: tasks on both; the worker node killed while one of
    its tasks is under way (held there after it wrote a shard); Ray runs that task again on the
    head and the conversion ends with every shard once, the local converter's bytes."""
    out = tmp_path / "ray"
    args = [str(RAYWDS), "convert", str(tree), str(out), "--ray", "--address", slow_worker.gcs_address]
    driver = slow_worker.popen(
        [*args, "--maxcount", "4", "--prefix", "held"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and driver.poll() is None:
        journal = (out / JOURNAL).read_text() if (out / JOURNAL).exists() else ""
        on_worker = [json.loads(line)["shard"]["name"] for line in journal.splitlines() if WORKER_IP in line]
        if on_worker and list(held.glob("held-*")):
            break
        time.sleep(0.1)
    assert driver.poll() is None, f"ended before a task was held on the worker node:\n{driver.communicate()[0][-3000:]}"
    assert slow_worker.lose_worker() > 0
    output = driver.communicate(timeout=240)[0]
    assert driver.returncode == 0, output[-3000:]
    assert re.search(
        rf"written by Ray tasks on 2 nodes: {re.escape(HEAD_IP)} \(\d+\), {re.escape(WORKER_IP)} \(\d+\)", output
    )
    records = [json.loads(line) for line in (out / JOURNAL).read_text().splitlines()]
    names = [r["shard"]["name"] for r in records]
    assert len(names) == len(set(names)) == 30 + 13, "every shard once (120 train and 50 val samples in fours)"
    [marker] = held.glob("held-*")
    retried = marker.name.split("-", 2)[2]
    assert next(r["node"] for r in records if r["shard"]["name"] == retried) == HEAD_IP, (
        "the held task ran again on the head"
    )
    here = tmp_path / "local"
    convert(tree, here, ConvertOptions(maxcount=4, prefix="held"))
    for shard in here.glob("*.tar"):
        assert (out / shard.name).read_bytes() == shard.read_bytes(), shard.name
    assert not list(out.glob(".held-*")), "no temporary file is left"


class Driver:
    """`raywds ray` started on the head in the background; its output is read as it comes, so a
    test can act when a line appears."""

    def __init__(self, cluster: TwoNodes, *args: str, env: dict[str, str] | None = None):
        self.lines: list[str] = []
        self.times: list[float] = []
        self.started = time.monotonic()
        self.process = cluster.popen(
            [str(RAYWDS), "ray", "--address", cluster.gcs_address, *args],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.append(line)
            self.times.append(time.monotonic() - self.started)

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def timeline(self) -> str:
        """The output with each line's arrival in seconds since the start (for failure messages)."""
        return "".join(f"{t:6.1f} {line}" for t, line in zip(self.times, self.lines))

    def wait_for(self, pattern: str, timeout_s: float = 300, after: int = 0) -> re.Match[str]:
        """The first match of `pattern` in the output from position `after` on, waiting for it to appear."""
        deadline = time.monotonic() + timeout_s
        compiled = re.compile(pattern, re.M)
        while time.monotonic() < deadline:
            match = compiled.search(self.output, after)
            if match:
                return match
            if self.process.poll() is not None:
                self.reader.join(5)
                match = compiled.search(self.output, after)
                if match:
                    return match
                raise AssertionError(f"exited {self.process.returncode} before {pattern!r}:\n{self.output[-4000:]}")
            time.sleep(0.2)
        raise AssertionError(f"no {pattern!r} after {timeout_s:.0f} s:\n{self.output[-4000:]}")

    def finish(self, timeout_s: float = 400) -> int:
        try:
            code = self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            raise AssertionError(f"still running after {timeout_s:.0f} s:\n{self.output[-4000:]}") from None
        self.reader.join(10)
        return code


def split_run(demo: Path, tmp_path: Path, workers: str, *extra: str, epochs: int = 2) -> list[str]:
    """Flags for a split-mode run of `epochs` from the head's server, checkpointing every 8 steps."""
    return [
        *("--recipe", "demo", "--data", str(demo), "--serve", "--server-backend", "embedded", "--mode", "split"),
        *("--num-workers", workers, "--epochs", str(epochs), "--batch-size", "16", "--checkpoint-every-steps", "8"),
        *("--audit-dir", str(tmp_path / "audit"), "--storage-path", str(tmp_path / "ray"), *extra),
    ]


def assert_every_epoch_exact(audit: Path, demo: Path, epochs: int) -> None:
    """Every sample once in each epoch by the tars' keys, and `raywds audit` agrees."""
    everything = Counter(tar_keys(demo))
    for epoch in range(epochs):
        trained = trained_once(audit, epoch, demo)
        assert trained == everything, (
            f"epoch {epoch + 1}: {sum((trained - everything).values())} repeated, "
            f"{sum((everything - trained).values())} missing after the node loss"
        )
    out = subprocess.run(
        [RAYWDS, "audit", str(audit), "--data", str(demo), "--epochs", str(epochs)], capture_output=True, text=True
    )
    assert out.returncode == 0 and f"{epochs} epochs in {audit}: every sample exactly once" in out.stdout, out


def test_a_lost_node_with_a_fixed_worker_count_restarts_when_it_returns(
    both_nodes: TwoNodes, demo: Path, tmp_path: Path
) -> None:
    two_node_cluster = both_nodes
    driver = Driver(two_node_cluster, *split_run(demo, tmp_path, "2"))
    try:
        driver.wait_for(r"step \d+: checkpoint inside epoch 1 ")
        assert two_node_cluster.lose_worker() > 0
        lost_at = time.monotonic()
        time.sleep(5)
        start_worker_again(two_node_cluster)
        assert driver.finish() == 0, driver.output[-4000:]
    finally:
        driver.process.kill()
    assert time.monotonic() - lost_at < 240
    # A node that returns may print its old lines again (its log monitor rereads the session's logs): count by pid.
    started = {pid: (n, ip) for _, n, ip, pid in RANK.findall(driver.output)}
    assert sorted(started.values()) == [("2", HEAD_IP)] * 2 + [("2", WORKER_IP)] * 2, (
        f"two attempts of a rank on each node:\n{driver.timeline()}"
    )
    assert_every_epoch_exact(tmp_path / "audit", demo, 2)
    assert SUMMARY.search(driver.output), driver.output[-2000:]


EPOCHS_ELASTIC = 6


def test_an_elastic_run_shrinks_on_node_loss_and_grows_back_with_exact_epochs(
    both_nodes: TwoNodes, demo: Path, tmp_path: Path
) -> None:
    two_node_cluster = both_nodes
    # Enough epochs that the run is still going when it grows back: from the shrink to the grown
    # group's first lines (the node's start, the controller's next resize check, the group's
    # restart) took about three of the head's epochs alone (24 s at 5 s an epoch, 35 s at 10 s on a
    # slower hour). The loss comes in epoch 1, so with 6 epochs the run would train two more alone
    # before it ended; with 2 it once ended 11 s after the shrink, before it could grow. More
    # epochs after the growth check nothing more, at 3 to 6 s each.
    driver = Driver(
        two_node_cluster,
        *split_run(demo, tmp_path, "1..2", "--resize-check-s", "2", "--node-wait-s", "20", epochs=EPOCHS_ELASTIC),
    )
    try:
        driver.wait_for(r"step \d+: checkpoint inside epoch 1 ")
        two_node_cluster.lose_worker()
        alone = driver.wait_for(r"rank 0 of 1 on node " + re.escape(HEAD_IP), timeout_s=120)  # the head alone
        driver.wait_for(r"step \d+: checkpoint inside epoch \d+ ", timeout_s=120, after=alone.end())  # trained alone
        start_worker_again(two_node_cluster)
        assert driver.finish() == 0, driver.output[-4000:]
    finally:
        driver.process.kill()
    starts = RANK.findall(driver.output)  # a dead node's last lines may arrive late, so not in order
    alone = [i for i, (_, n, ip, _) in enumerate(starts) if n == "1" and ip == HEAD_IP]
    assert alone, f"went on with one rank on the head:\n{driver.timeline()}"
    before = {pid for *_, pid in starts[: alone[0]]}
    regrown = {ip for _, n, ip, pid in starts[alone[0] :] if n == "2" and pid not in before}
    assert regrown == {HEAD_IP, WORKER_IP}, f"grew back to a rank on each node:\n{driver.timeline()}"
    assert "restarted: resuming from the checkpoint at step" in driver.output
    assert_every_epoch_exact(tmp_path / "audit", demo, EPOCHS_ELASTIC)


def test_a_node_that_stays_lost_is_an_error_naming_it_in_bounded_time(
    both_nodes: TwoNodes, demo: Path, tmp_path: Path
) -> None:
    two_node_cluster = both_nodes
    driver = Driver(two_node_cluster, *split_run(demo, tmp_path, "2", "--max-failures", "1", "--node-wait-s", "10"))
    try:
        driver.wait_for(r"step \d+: checkpoint inside epoch 1 ")
        two_node_cluster.lose_worker()
        lost_at = time.monotonic()
        assert driver.finish(timeout_s=180) == 1
        waited = time.monotonic() - lost_at
    finally:
        driver.process.kill()  # the node stays lost: a test after this one starts it again (`both_nodes`)
    assert f"raywds: error: lost node(s) {WORKER_IP} during the run" in driver.output, driver.output[-3000:]
    assert waited < 120, f"{waited:.0f} s from the loss to the error"


def node_id(cluster: TwoNodes, ip: str) -> str:
    """The Ray node id of the live node at `ip`."""
    script = (
        "import ray; ray.init(address='auto', logging_level='ERROR'); "
        f"print('NODE', next(n['NodeID'] for n in ray.nodes() if n['Alive'] and n['NodeManagerAddress'] == {ip!r}))"
    )
    out = cluster.run([sys.executable, "-c", script], timeout=120, env={"RAY_ADDRESS": cluster.gcs_address})
    assert out.returncode == 0, out.stderr[-2000:]
    return next(line.split()[1] for line in out.stdout.splitlines() if line.startswith("NODE "))


DEADLINE_S = 25


def test_a_preemption_notice_checkpoints_at_once_and_the_restart_trains_no_step_again(
    both_nodes: TwoNodes, demo: Path, tmp_path: Path
) -> None:
    """A real notice: the worker node drained for preemption with a 25 s deadline (as a cloud's
    notice reaches Ray), its processes killed at the deadline. The run checkpoints at once, trains
    no step past it, goes on alone from it, and every epoch stays exact; with --global-batch 32,
    the head alone takes two batches a step, and the optimizer as many steps an epoch as before."""
    cluster = both_nodes
    flags = ("--resize-check-s", "2", "--node-wait-s", "20", "--notice-every", "2", "--global-batch", "32")
    driver = Driver(cluster, *split_run(demo, tmp_path, "1..2", *flags, epochs=4))  # epochs left after the notice
    try:
        driver.wait_for(r"step \d+: checkpoint inside epoch 1 ")
        worker = node_id(cluster, WORKER_IP)
        drain = cluster.run(
            [str(RAY), "drain-node", "--address", cluster.gcs_address, "--node-id", worker, "--reason",
             "DRAIN_NODE_REASON_PREEMPTION", "--reason-message", "spot reclaim", "--deadline-remaining-seconds",
             str(DEADLINE_S)],
            timeout=60,
        )  # fmt: skip
        drained_at = time.monotonic()
        assert drain.returncode == 0, drain.stdout[-2000:] + drain.stderr[-2000:]
        driver.wait_for(r"step \d+: checkpoint inside epoch \d+ on a preemption notice", timeout_s=DEADLINE_S)
        time.sleep(max(0.0, drained_at + DEADLINE_S - time.monotonic()))
        cluster.lose_worker()  # the cloud takes the node at the deadline
        driver.wait_for(r"rank 0 of 1 on node " + re.escape(HEAD_IP), timeout_s=120)
        assert driver.finish() == 0, driver.output[-4000:]
    finally:
        driver.process.kill()
    (metrics,) = (tmp_path / "ray").glob("*/metrics.jsonl")
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    noticed = [r for r in rows if r["kind"] == "checkpoint" and r.get("reason") == "preemption"]
    assert len(noticed) == 1 and noticed[0]["nodes"] == [worker] and noticed[0]["deadline"], driver.timeline()
    epochs = [r for r in rows if r["kind"] == "epoch"]
    assert [r["epoch"] for r in epochs] == [1, 2, 3, 4]
    assert all(r["steps_redone"] == 0 for r in epochs), [r["steps_redone"] for r in epochs]
    assert {r["global_batch"] for r in epochs} == {32}
    steps = [r["optimizer_steps"] for r in epochs]  # the longest rank's: a split deal of 2 may give one a batch more
    assert max(steps) - min(steps) <= 1, steps
    alone = [
        r for r in epochs if r["step"] - r["optimizer_steps"] > 0
    ]  # epochs the head trained alone, at least partly
    assert alone, "the head alone took two batches a step"
    assert "restarted: resuming from the checkpoint at step" in driver.output
    assert_every_epoch_exact(tmp_path / "audit", demo, 4)
