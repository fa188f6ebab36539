"""Shared test data: a small demo tree and its shards, made by our own generator and converter."""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest
from support import mlflowserver, raycluster, s3server, turns
from support.data import SMALL, UNEVEN_SIZES, made_shards, recut
from support.runs import FORKSERVER_PRELOAD

from raywds import console
from raywds.data.convert import ConvertOptions, convert
from raywds.data.demo import DemoSpec, write_tree

# Every Ray the tests start (in this process, `ray start`, a raywds command's own) inherits this. A
# raylet whose temp dir's disk is over 95% full logs an error every 10 s, and Ray forwards it into each
# driver's console, which the tests read line by line: 1 turns that disk check off for them.
os.environ["RAY_local_fs_capacity_threshold"] = "1"


@pytest.fixture(scope="session", autouse=True)
def console_lines() -> None:
    """raywds's log records reach stdout and stderr as they do under the CLI (raywds.console)."""
    console.configure()


@pytest.fixture(scope="session")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """10 classes, 120 train and 50 val JPEGs."""
    return write_tree(tmp_path_factory.mktemp("tree"), SMALL)


@pytest.fixture(scope="session")
def large(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """80 JPEGs of 1,024 x 1,024 in shards of 10: decoding each whole takes ~10 ms."""
    spec = DemoSpec(num_train_per_class=8, num_val_per_class=1, image_side_px=1024, seed=3)
    return made_shards(tmp_path_factory, "large", spec, ConvertOptions(maxcount=10, seed=1))


@pytest.fixture(scope="session")
def shards(tree: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tree as shards of at most 16 samples: 8 train shards (7 x 16 + 8) and 4 val shards."""
    out = tmp_path_factory.mktemp("shards")
    convert(tree, out, ConvertOptions(maxcount=16, seed=3))
    return out


@pytest.fixture(scope="session")
def uneven(shards: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same 120 train samples in 9 shards of 1 to 30 samples."""
    return recut(shards, tmp_path_factory.mktemp("uneven") / "shards", UNEVEN_SIZES)


@pytest.fixture(scope="session")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo's shards (1200 train, 300 val samples), as `raywds ray --demo` makes them in demo.parent."""
    from raywds.data.demo import prepare

    return prepare(tmp_path_factory.mktemp("demo"))


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[mlflowserver.MlflowServer]:
    """One real MLflow tracking server for the session (tests/support/mlflowserver.py), started when a
    test first asks for it (8-15 s); each test names an experiment of its own."""
    with mlflowserver.mlflow_server(tmp_path_factory.mktemp("mlflow")) as server:
        yield server


@pytest.fixture(scope="session")
def s3_server_session() -> Iterator[s3server.S3Server]:
    """One private SeaweedFS S3 server for the session (tests/support/s3server.py), started when a test
    first asks for it: ~1.5 s to start, ~140-170 MiB resident."""
    with s3server.s3_server() as server:
        yield server


@pytest.fixture
def s3(s3_server_session: s3server.S3Server, monkeypatch: pytest.MonkeyPatch) -> Iterator[s3server.S3Server]:
    """The session's S3 server with a fresh, empty bucket of this test's own, found through the
    standard AWS variables (set here, the user's own that would lead elsewhere unset); the bucket
    and what the test left in it are deleted afterwards."""
    import dataclasses
    import uuid

    server = dataclasses.replace(s3_server_session, bucket=f"t-{uuid.uuid4().hex[:16]}")
    client = server.client()
    client.create_bucket(Bucket=server.bucket)
    for name in s3server.FOREIGN_AWS_VARS:
        monkeypatch.delenv(name, raising=False)
    for name, value in server.env().items():
        monkeypatch.setenv(name, value)
    yield server
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=server.bucket):
        keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
        if keys:
            client.delete_objects(Bucket=server.bucket, Delete={"Objects": keys, "Quiet": True})
    for upload in client.list_multipart_uploads(Bucket=server.bucket).get("Uploads", []):
        client.abort_multipart_upload(Bucket=server.bucket, Key=upload["Key"], UploadId=upload["UploadId"])
    client.delete_bucket(Bucket=server.bucket)


# --- Ray: every cluster a test starts is private (its own temp dir, ports and token) -------------


@pytest.hookimpl(wrapper=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> Iterator[None]:
    """Tests that start Ray (they ask for `user_cluster`) get the `ray` mark, so `-m "not ray"` leaves
    them out; those on the two-node cluster also get `multinode`, and every multinode test gets
    `ray` (the torchrun one starts no Ray, but is as slow). RAYWDS_TEST_REVERSE=1 runs the tests in
    reverse order: none may lean on what an earlier one left behind (a token in ~/.ray, a running
    cluster)."""
    for item in items:
        if "user_cluster" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.ray)  # before `-m` selects
        if "two_node_cluster" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.multinode)
        slow = item.get_closest_marker("multinode") or item.get_closest_marker("image")
        if slow and not item.get_closest_marker("ray"):
            item.add_marker(pytest.mark.ray)  # torchrun across namespaces, the image: as slow, out of the inner loop
        if starts_ray(item.nodeid) and not item.get_closest_marker("timeout"):
            item.add_marker(pytest.mark.timeout(RAY_TEST_TIMEOUT_S))
    ray_slots = [i for i, item in enumerate(items) if starts_ray(item.nodeid)]
    ray_items = sorted((items[i] for i in ray_slots), key=lambda item: ray_file_rank(item.nodeid))  # stable
    for slot, item in zip(ray_slots, ray_items):
        items[slot] = item
    yield
    if os.environ.get("RAYWDS_TEST_REVERSE") == "1":
        items.reverse()  # after everything else has ordered and selected


RAY_TEST_TIMEOUT_S = 900
"""A Ray test's limit (pytest-timeout's, setup included): the suite's 600 s, and the wait for its
turn (`ray_tests_take_turns`) while the image's container cluster runs, 1.5 to 3 minutes."""


def pytest_collection_finish(session: pytest.Session) -> None:
    """What collection imported (torch and the test modules: torch alone is about 290,000 objects, a
    0.18 s full collection) goes to the garbage collector's permanent generation, which no
    collection walks: a full collection in a test then looks only at what the tests made."""
    gc.freeze()
    users = [item.nodeid for item in session.items if "local_ray" in getattr(item, "fixturenames", ())]
    LAST_ON_LOCAL_RAY[:] = users[-1:]


def pytest_unconfigure(config: pytest.Config) -> None:
    gc.freeze()  # and what the tests left: the collection at exit, 1.5 s after test_train.py, walks none of it


RAY_FREE_LAUNCH_FILES = (
    "tests/launch/test_kernel.py",
    "tests/launch/test_torchrun_nodes.py",
)
"""Files in tests/launch/ that start no Ray (a Jupyter kernel's shutdown;
torchrun across two network namespaces of their own): scheduled as the other files are, beside the Ray tests."""


LONGEST_FIRST = (
    "tests/launch/",  # the Ray tests, one after another in one worker: about half the suite's time
    "tests/deploy/test_image.py",  # the image's Debian base and build, then three container runs
    "tests/lightning/test_lightning.py",  # seven Lightning runs
    "tests/launch/test_torchrun_nodes.py",  # torchrun across two network namespaces
    "tests/train/test_train.py",
    "tests/train/test_doctor.py",
)
"""The work units xdist hands out first, longest first (seconds in docs/testing.md); every other file
after them, in xdist's own order. xdist orders files by their number of tests, so the image's file
(three tests, 400 s) and the Lightning file came last, and one worker ran them while the other had
nothing left: the cores were 25-85% busy for the run's last 60 to 140 s. Short files last let both
workers end near together."""


def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """Under pytest-xdist (`-n 2`, the default in pyproject.toml): every test in tests/launch/ that
    starts Ray (those that do are all there) in one worker, one after another, as in one process;
    the other files each whole in whichever worker is free, beside them, the longest first
    (`LONGEST_FIRST`). (xdist's own `loadgroup` marks do not take under pytest 9: it renames node
    ids by a field pytest no longer reads.)"""
    from collections import OrderedDict

    from xdist.scheduler import LoadScopeScheduling

    class RayInOneWorker(LoadScopeScheduling):
        ordered = False

        def _split_scope(self, nodeid: str) -> str:
            return "tests/launch/" if starts_ray(nodeid) else nodeid.split("::", 1)[0]

        def _assign_work_unit(self, node: Any) -> None:
            if not self.ordered:  # the queue is complete when the first unit is handed out
                rank = {scope: i for i, scope in enumerate(LONGEST_FIRST)}
                queue = sorted(self.workqueue.items(), key=lambda unit: rank.get(unit[0], len(rank)))
                self.workqueue = OrderedDict(queue)
                self.ordered = True
            super()._assign_work_unit(node)

    return RayInOneWorker(config, log)


RAY_FILES_IN_ORDER = (
    "tests/launch/test_lab.py",
    "tests/launch/test_lightning_ray.py",
    "tests/launch/test_ray.py",  # short tests (25-65 s each) where the image's container cluster
    "tests/launch/test_raydata.py",  # asks for the turn, 4 to 6 minutes in (after the build and
    "tests/launch/test_ray_s3.py",  # the demo's container), so that it waits for one of them
    "tests/launch/test_multinode.py",  # and not for the elastic run (150-170 s)
    "tests/launch/test_raydata_nodes.py",
)
"""The order of the Ray tests' files in their worker. By name, the two-node tests came 2.5 to 8
minutes in, and the container cluster waited 130 and 152 s for the elastic two-node run to give
up the turn, its worker idle and both cores 64-85% busy meanwhile (docs/testing.md)."""


def ray_file_rank(nodeid: str) -> int:
    file = nodeid.split("::", 1)[0]
    return RAY_FILES_IN_ORDER.index(file) if file in RAY_FILES_IN_ORDER else len(RAY_FILES_IN_ORDER)


def starts_ray(nodeid: str) -> bool:
    """Whether a test is one of the Ray tests that run one after another in one worker."""
    file = nodeid.split("::", 1)[0]
    return file.startswith("tests/launch/") and file not in RAY_FREE_LAUNCH_FILES


@pytest.fixture(autouse=True)
def ray_tests_take_turns(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Each Ray test holds the run's turn (tests/support/turns.py), so the image's container
    cluster never starts Ray beside one."""
    if not starts_ray(request.node.nodeid):
        yield
        return
    with turns.turn(turns.folder(tmp_path_factory)):
        yield


def home_ray_files() -> dict[str, tuple[int, int]] | None:
    """~/.ray as (size, mtime) by relative path, or None when there is none."""
    home = Path.home() / ".ray"
    if not home.exists():
        return None
    return {str(p.relative_to(home)): (p.lstat().st_size, p.lstat().st_mtime_ns) for p in [home, *home.rglob("*")]}


@pytest.fixture(scope="session", autouse=True)
def home_ray_untouched() -> Iterator[None]:
    """The suite neither creates nor changes ~/.ray, where Ray keeps the user's own token (a new local
    `ray.init` with no token writes ~/.ray/auth_token)."""
    before = home_ray_files()
    yield
    after = home_ray_files()
    if after != before:
        old, new = before or {}, after or {}
        changed = sorted(k for k in {*old, *new} if old.get(k) != new.get(k))
        pytest.fail(
            f"the tests {'created' if before is None else 'changed'} {Path.home() / '.ray'} ({', '.join(changed)}): "
            "a test started Ray without a token of its own (tests/support/raycluster.py)"
        )


@pytest.fixture(scope="session")
def user_cluster() -> Iterator[raycluster.HeadNode]:
    """A cluster standing for one the user started before running the tests, with its own temp dir,
    ports and token. Every fixture that starts Ray asks for it, so sessions without Ray tests do not
    pay for it. At the session's end each of its processes must still run, with no SIGTERM, SIGINT,
    SIGHUP or SIGQUIT waiting for it, else the run fails: a test ended processes that were not its
    own (as `ray stop` does). No test talks to it, so it is stopped (SIGSTOP) while they run: idle,
    it took a tenth of a core (0.18 in its first minute) for the 20 minutes of the Ray tests. A
    stopped process still dies of SIGKILL, and holds the other signals pending, where the check
    sees them."""
    with raycluster.ray_temp_dir("rwu-") as temp, raycluster.head_node(temp) as head:
        with raycluster.frozen(temp) as procs:
            before = {p: raycluster.describe([p]) for p in procs.values()}
            yield head
            gone = [f"{line} ({why})" for p, line in before.items() if (why := raycluster.ended(p))]
        if gone:
            pytest.fail(
                f"{len(gone)} of the {len(before)} processes of the user's stand-in cluster in {temp} "
                "died or were sent a signal to end during the tests: "
                "a test stopped Ray processes that were not its own (`ray stop` ends them all)\n" + "\n".join(gone)
            )


LOCAL_RAY: list[ExitStack] = []
"""The in-process Ray of the tests that ask for `local_ray`, while it runs."""
LAST_ON_LOCAL_RAY: list[str] = []
"""The node id of the last test, in this session's order, that asks for `local_ray`."""


@pytest.fixture
def local_ray(user_cluster: raycluster.HeadNode) -> None:
    """One local Ray in this process for the Ray Train and Ray Data plane tests (tests/launch/test_ray.py,
    test_raydata.py, test_lightning_ray.py), started by the first that asks for it: 4 logical CPUs on 2,
    room for 3 training workers and the plane's decode tasks. Without a dashboard: nothing here asks for
    one. It stops after the last (`pytest_runtest_teardown`), not at the session's end: idle, with the
    workers its tasks leave, it took 6-7% of a core (a one-off measurement), through every Ray test
    after its last user."""
    if not LOCAL_RAY:
        with ExitStack() as stack:
            stack.enter_context(raycluster.in_process_ray("rwt-", num_cpus=4))
            LOCAL_RAY.append(stack.pop_all())


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    yield
    if LOCAL_RAY and (item.nodeid in LAST_ON_LOCAL_RAY or nextitem is None):
        LOCAL_RAY.pop().close()


@pytest.fixture
def ray_temp(user_cluster: raycluster.HeadNode) -> Iterator[Path]:
    """A private temp dir for a cluster that a test starts some other way (RAY_TMPDIR, a subprocess's
    ray.init): afterwards any process still using it is stopped by PID, and it is removed."""
    with raycluster.ray_temp_dir("rwn-") as temp:
        yield temp


# --- In-process runs of the CLI and the loader ---------------------------------------------------


@pytest.fixture(autouse=True)
def signal_handlers_restored() -> Iterator[None]:
    """raywds.cli.main installs SIGTERM and SIGINT handlers (exit 143, 130) in the process that
    calls it; a test that calls main in this one must not leave them to the tests after it."""
    import signal

    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    yield
    for sig, handler in previous.items():
        signal.signal(sig, handler)


@pytest.fixture
def short_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    """Loaders built in this test wait 0.05, 0.1, 0.2 s ... before each retry of an unreadable
    shard, not 1, 2, 4 s: as many retries, as many skips, less waiting (the config has no
    setting for the backoff; forked loader workers inherit the patch)."""
    import dataclasses

    from raywds.loader.settings import LoaderConfig

    policy = LoaderConfig.read_policy
    monkeypatch.setattr(
        LoaderConfig, "read_policy", lambda self, **kw: dataclasses.replace(policy(self, **kw), backoff_s=0.05)
    )


@pytest.fixture(autouse=True)
def one_torch_thread() -> None:
    """Training in this process uses one intra-op thread, as each gloo rank of the tests does. Two
    threads on a 2-core machine share it with the loader worker (and whatever else runs there):
    a step waits for a descheduled thread at every op, and the same run takes 4-5 times as long,
    more the busier the machine. Set once torch is imported (a run of tests that never import it
    does not pay for it); the README run in tests/test_cli.py keeps torch's default."""
    import sys

    torch = sys.modules.get("torch")
    if torch is not None and torch.get_num_threads() != 1:
        torch.set_num_threads(1)


@pytest.fixture(scope="session", autouse=True)
def embedded_servers_stop_at_once() -> Iterator[None]:
    """An embedded shard server's accept loop looks for stop() every 0.05 s, not every 0.5 s:
    the ~25 tests that start one each end up to 0.45 s sooner."""
    from raywds.serve import embedded

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(embedded, "STOP_POLL_S", 0.05)
        yield


FORKSERVER_USERS = {"test_train.py", "test_loader.py", "test_faults.py", "test_evaluation.py", "test_prediction.py"}
"""Test modules that start ranks or distributed loaders from this process's fork server."""


@pytest.fixture(scope="session", autouse=True)
def forkserver_started_early(request: pytest.FixtureRequest) -> None:
    """Start this process's fork server (multiprocessing's, which torch's start_processes and the
    loaders of simulated ranks use) before the first test, when tests that need it were selected:
    it imports torch and raywds (~3 s) on the other core while the first tests run, instead of
    holding up the first test that needs it. After collection, so that it has the tests' sys.path."""
    if not any(item.path.name in FORKSERVER_USERS for item in request.session.items):
        return
    import multiprocessing.forkserver

    multiprocessing.forkserver.set_forkserver_preload(FORKSERVER_PRELOAD)
    multiprocessing.forkserver.ensure_running()
