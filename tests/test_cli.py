"""The command line as a user meets it: help, a real end-to-end run, and one-line errors.

The installed `raywds` script runs as a subprocess twice (its --help, and the README's first
command end to end); the other tests call raywds.cli.main in this process, each subprocess would
spend ~3 s importing torch again."""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from support.runs import SUMMARY, assert_charts_hold, command

from raywds.cli.main import main

ROOT = Path(__file__).resolve().parents[1]
RAYWDS = Path(sys.executable).parent / "raywds"


@dataclass
class Ran:
    returncode: int | str | None
    stdout: str
    stderr: str


def _like_a_fresh_interpreter() -> None:
    """Python's own warning filters and printing, not pytest's: a warning reaches stderr as it
    would in a `raywds` process (and in its forked loader workers, through the captured fds)."""
    warnings.resetwarnings()
    warnings.filterwarnings("default", category=DeprecationWarning, module="__main__", append=True)
    for category in (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning):
        warnings.filterwarnings("ignore", category=category, append=True)
    warnings.showwarning = lambda message, category, filename, lineno, file=None, line=None: sys.stderr.write(
        warnings.formatwarning(message, category, filename, lineno, line)
    )


@pytest.fixture
def raywds(capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Callable[..., Ran]:
    """`raywds ARGS` run in this process by raywds.cli.main: its exit code (argparse's SystemExit
    included) and everything written to fds 1 and 2, its loader workers' output too; other
    libraries' log warnings reach stderr as Python's last-resort handler prints them. The working
    folder is the test's own; conftest puts main's SIGTERM handler back after the test."""
    monkeypatch.chdir(tmp_path)
    root, last_resort = logging.getLogger(), logging.lastResort or logging.StreamHandler()

    def run(*args: str) -> Ran:
        capfd.readouterr()
        root.addHandler(last_resort)  # pytest's own handlers there keep Python from using it
        try:
            with warnings.catch_warnings():
                _like_a_fresh_interpreter()
                try:
                    code: int | str | None = main(list(args))
                except SystemExit as e:
                    code = e.code
        finally:
            root.removeHandler(last_resort)
        out, err = capfd.readouterr()
        return Ran(code, out, err)

    return run


def test_the_installed_script_lists_every_command() -> None:
    out = subprocess.run([str(RAYWDS), "--help"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0
    for name in ("demo", "convert", "serve", "plan", "report", "train", "ray"):
        assert re.search(rf"^\s+{name}\s", out.stdout, re.M), name


@pytest.mark.parametrize("command", ["demo", "convert", "serve", "plan", "report", "train", "ray"])
def test_each_command_has_help(raywds: Callable[..., Ran], command: str) -> None:
    out = raywds(command, "--help")
    assert out.returncode == 0 and out.stdout.startswith(f"usage: raywds {command}")


def test_missing_input_directory_is_one_line_exit_1(raywds: Callable[..., Ran], tmp_path: Path) -> None:
    out = raywds("convert", str(tmp_path / "no-such-tree"), str(tmp_path / "out"))
    assert out.returncode == 1
    assert out.stderr.count("\n") == 1 and "Traceback" not in out.stderr
    assert f"{tmp_path / 'no-such-tree'} does not exist" in out.stderr


def test_train_without_manifest_says_what_to_run(raywds: Callable[..., Ran], tmp_path: Path) -> None:
    out = raywds("train", "--data", str(tmp_path))
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert f"no manifest at {tmp_path}/manifest.json: run `raywds convert" in out.stderr


def test_convert_then_train_from_the_command_line(raywds: Callable[..., Ran], tree: Path, tmp_path: Path) -> None:
    out = raywds("convert", str(tree), str(tmp_path / "shards"), "--maxcount", "30", "--workers", "2")
    assert out.returncode == 0, out.stderr
    assert "train: 120 samples in 4 shards" in out.stdout and "val: 50 samples in 2 shards" in out.stdout
    out = raywds(
        "train",
        "--data",
        str(tmp_path / "shards"),
        "--model",
        "demo",
        "--epochs",
        "1",
        "--batch-size",
        "16",
        "--image-size",
        "28",
        "--loader-workers",
        "1",
        "--out",
        str(tmp_path / "run"),
    )
    assert out.returncode == 0, out.stderr
    match = SUMMARY.search(out.stdout)
    assert match and match.group(1) == "1" and match.group(4) == "128", out.stdout
    assert (tmp_path / "run" / "checkpoint.pt").is_file() and (tmp_path / "run" / "metrics.jsonl").is_file()
    verdict = out.stdout[match.end() :].strip().splitlines()  # the doctor's, after the summary
    assert verdict and all(line.startswith("doctor: ") for line in verdict), out.stdout
    assert raywds("doctor", str(tmp_path / "run")).stdout.splitlines()[0] == verdict[0].removeprefix("doctor: ")


@pytest.mark.slow
def test_run_local_demo_end_to_end(tmp_path: Path) -> None:
    """The README's first command, shortened to 12 batches of 32 at 32 px (the flags any run takes):
    generate, convert, serve, train, summary."""
    out = command(
        [
            str(ROOT / "run-local"),
            "--epochs",
            "1",
            "--batches-per-epoch",
            "12",
            "--image-size",
            "32",
            "--demo-dir",
            str(tmp_path / "demo"),
            "--out",
            str(tmp_path / "run"),
        ]
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert re.search(r"serving .* at http://127\.0\.0\.1:\d+ \((nginx|embedded|docker)\)", out.stdout)
    match = SUMMARY.search(out.stdout)
    assert match and match.group(4) == str(12 * 32), out.stdout
    assert float(match.group(2)) > 0.3, out.stdout  # 10 classes: chance is 0.1 (seeds 0-4 reach 0.8-0.9)


@pytest.mark.slow
def test_a_missing_token_file_and_an_address_nobody_answers_are_one_line_each(tmp_path: Path) -> None:
    """Before Ray starts or joins anything: a RAY_AUTH_TOKEN_PATH with no file there (Ray's words were
    a paragraph in a traceback), and a cluster address where nothing listens (ray.init tried it for
    80-110 s before its own traceback). One line each, exit 1."""
    from raywds.serve import free_port

    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_TOKEN")}
    env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(tmp_path / "no-token-here"), PYTHONUNBUFFERED="1")
    nobody = f"127.0.0.1:{free_port('127.0.0.1')}"
    lines = []
    for address in ([], ["--address", nobody]):
        args = [sys.executable, "-m", "raywds", "ray", *address, "--data", str(tmp_path), "--epochs", "1"]
        ran = subprocess.run(args, env=env, capture_output=True, text=True, timeout=120)
        assert ran.returncode == 1 and "Traceback" not in ran.stderr, ran.stderr[-3000:]
        lines += [line for line in ran.stderr.splitlines() if line.startswith("raywds: ")]
    assert lines == [
        "raywds: error: Ray cannot start or join a cluster: RAY_AUTH_TOKEN_PATH is set but file cannot be opened "
        f"or is empty: {tmp_path / 'no-token-here'}; give every process the cluster's token (RAY_AUTH_TOKEN_PATH, "
        "else ~/.ray/auth_token; `ray get-auth-token --generate` writes one for a new cluster), see docs/cluster.md",
        f"raywds: error: no Ray cluster answers at {nobody} (Connection refused): check --address (or RAY_ADDRESS) "
        "and that the cluster is up (`ray status` on its head)",
    ], lines


def test_plan_prints_ranks_and_a_verdict(raywds: Callable[..., Ran], shards: Path) -> None:
    out = raywds(
        "plan", "--data", str(shards), "--gpus-per-node", "2", "--workers", "2", "--batch-size", "8", "--mode", "split"
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("split mode: 2 ranks x 2 loader workers, batch 8 per rank, 120 samples")
    assert "shards each worker opens:" in out.stdout and out.stdout.rstrip().splitlines()[-1].startswith("verdict: OK")
    out = raywds(
        "plan",
        "--num-shards",
        "8",
        "--samples-per-shard",
        "16",
        "--gpus-per-node",
        "3",
        "--workers",
        "4",
        "--mode",
        "split",
    )
    assert (
        out.returncode == 1
        and "verdict: REFUSED: split mode needs at least one shard per (rank, loader worker)" in out.stdout
    )
    assert out.stderr.startswith("raywds: error: split mode needs at least one shard")


def test_plan_shuffle_report_on_real_shards(raywds: Callable[..., Ran], shards: Path) -> None:
    out = raywds(
        "plan",
        "--data",
        str(shards),
        "--gpus-per-node",
        "1",
        "--batch-size",
        "8",
        "--shuffle-report",
        "--report-batches",
        "5",
    )
    assert out.returncode == 0, out.stderr
    row = re.search(r"^these shards\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+(-?[\d.]+)$", out.stdout, re.M)
    assert row, out.stdout
    classes, ideal = float(row.group(1)), float(row.group(2))
    assert ideal == pytest.approx(10 * (1 - 0.9**8), abs=0.05)  # a uniformly random batch of 8 from 10 classes
    assert abs(classes - ideal) <= 1, out.stdout  # shuffled before sharding: batches mix as random ones do


def test_training_refuses_a_plan_that_would_leave_workers_idle(
    raywds: Callable[..., Ran], shards: Path, tmp_path: Path
) -> None:
    out = raywds(
        "train",
        "--data",
        str(shards),
        "--model",
        "demo",
        "--mode",
        "split",
        "--loader-workers",
        "9",
        "--out",
        str(tmp_path),
    )
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert (
        "raywds: error: split mode needs at least one shard per (rank, loader worker): 8 shards < 1 ranks x 9 workers"
        in out.stderr
    )


def test_stop_with_max_steps_then_resume_from_the_command_line(
    raywds: Callable[..., Ran], shards: Path, tmp_path: Path
) -> None:
    common = [
        "train",
        "--data",
        str(shards),
        "--model",
        "demo",
        "--epochs",
        "1",
        "--batch-size",
        "8",
        "--image-size",
        "24",
        "--loader-workers",
        "1",
        "--mode",
        "split",
        "--out",
        str(tmp_path / "run"),
    ]
    out = raywds(*common, "--max-steps", "4")
    assert out.returncode == 0, out.stderr
    assert "stopped at step 4 inside epoch 1  samples seen 32  (continue with --resume)" in out.stdout
    out = raywds(*common, "--resume", str(tmp_path / "run"))
    assert out.returncode == 0, out.stderr
    match = SUMMARY.search(out.stdout)
    assert match and match.group(1) == "1" and match.group(4) == "120", out.stdout


def test_a_missing_shard_read_in_a_loader_worker_is_one_clear_line(
    raywds: Callable[..., Ran], shards: Path, tmp_path: Path
) -> None:
    import shutil

    shutil.copytree(shards, tmp_path / "holed")
    missing = sorted((tmp_path / "holed").glob("imagenet-train-*.tar"))[3]
    missing.unlink()
    out = raywds(
        "train",
        "--data",
        str(tmp_path / "holed"),
        "--model",
        "demo",
        "--mode",
        "split",
        "--epochs",
        "1",
        "--batch-size",
        "8",
        "--image-size",
        "16",
        "--loader-workers",
        "1",
        "--out",
        str(tmp_path / "run"),
    )
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    assert out.stderr == f"raywds: error: shard {missing}: cannot open it: No such file or directory\n"


def test_report_draws_a_png_from_a_run(raywds: Callable[..., Ran], shards: Path, tmp_path: Path) -> None:
    out = raywds(
        "train",
        "--data",
        str(shards),
        "--model",
        "demo",
        "--epochs",
        "2",
        "--batch-size",
        "16",
        "--image-size",
        "24",
        "--loader-workers",
        "1",
        "--out",
        str(tmp_path / "run"),
    )
    assert out.returncode == 0, out.stderr
    out = raywds("report", str(tmp_path / "run"))
    assert out.returncode == 0 and out.stdout.strip() == f"raywds: wrote {tmp_path / 'run' / 'report.png'} (2 epochs)"
    png = (tmp_path / "run" / "report.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 20_000
    out = raywds("report", str(tmp_path))
    assert out.returncode == 1 and "no metrics.jsonl in" in out.stderr


def test_tensorboard_charts_what_metrics_jsonl_holds(raywds: Callable[..., Ran], shards: Path, tmp_path: Path) -> None:
    """--tensorboard: the event files hold metrics.jsonl's numbers; the global step of progress
    rows goes on across a resume, whose run adds an event file; a fresh run removes an earlier
    run's, as it empties metrics.jsonl; and `raywds report` reads the folder as before."""
    pytest.importorskip("tensorboard", reason="--tensorboard needs the tensorboard extra")
    run = tmp_path / "run"
    (run / "tensorboard").mkdir(parents=True)
    (run / "tensorboard" / "events.out.tfevents.0000000001.earlier").write_bytes(b"an earlier run's, unreadable")
    common = [
        "train",
        "--data",
        str(shards),
        "--model",
        "demo",
        "--epochs",
        "2",
        "--batches-per-epoch",
        "3",
        "--val-every",
        "2",
        "--batch-size",
        "16",
        "--image-size",
        "24",
        "--loader-workers",
        "1",
        "--log-every",
        "0",
        "--tensorboard",
        "--out",
        str(run),
    ]
    out = raywds(*common, "--max-steps", "4")
    assert out.returncode == 0, out.stderr
    assert "stopped at step 4 inside epoch 2" in out.stdout
    out = raywds(*common, "--resume", str(run))
    assert out.returncode == 0, out.stderr
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r.get("kind") == "progress"] == [1, 2, 3, 4, 5, 6]
    assert [("val_top1" in r) for r in rows if "train_loss" in r] == [False, True]
    assert len(list((run / "tensorboard").iterdir())) == 2, "one event file for each of the two runs"
    assert_charts_hold(run / "tensorboard", rows, num_ranks=1)
    out = raywds("report", str(run))
    assert out.returncode == 0 and "(2 epochs)" in out.stdout, out.stderr


def test_tensorboard_without_the_package_is_one_line_before_training(
    raywds: Callable[..., Ran], shards: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("tensorboard", "torch.utils.tensorboard"):  # as where the package is not installed
        monkeypatch.setitem(sys.modules, name, None)
    small = ["--model", "demo", "--epochs", "1", "--batches-per-epoch", "1", "--batch-size", "8", "--image-size", "24"]
    out = raywds("train", "--data", str(shards), *small, "--loader-workers", "0", "--out", str(tmp_path / "plain"))
    assert out.returncode == 0, "without --tensorboard nothing imports it: " + out.stderr
    out = raywds("train", "--data", str(shards), *small, "--tensorboard", "--out", str(tmp_path / "run"))
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    assert re.fullmatch(
        r"raywds: error: --tensorboard needs the tensorboard package, which does not import here \(.+\): "
        r"pip install 'raywds\[tensorboard\]', or leave out --tensorboard\n",
        out.stderr,
    ), out.stderr
    assert list((tmp_path / "run").iterdir()) == [], "a refused run writes nothing into its new folder"


def test_ray_serve_flag_hands_workers_an_http_url(shards: Path) -> None:
    from raywds.cli.commands import _data
    from raywds.cli.main import build_parser, command_options
    from raywds.data.manifest import read_manifest

    args = build_parser().parse_args(["ray", "--data", str(shards), "--serve", "--server-backend", "embedded"])
    source, _, ray = command_options(args)
    with _data(source, serve=ray.serve) as url:
        assert url.startswith("http://127.0.0.1:")
        assert read_manifest(url).num_samples("train") == 120


MINIMAL = {
    "convert": ["tree", "out"],
    "verify": ["s"],
    "audit": ["a", "--data", "d"],
    "report": ["r"],
    "doctor": ["r"],
    "evaluate": ["m", "--data", "d"],
    "predict": ["m", "--data", "d", "--out", "o"],
    "export": ["m", "--out", "o"],
}
"""What each command needs besides its name to parse."""


def test_each_command_takes_one_typed_object_per_group_of_its_flags() -> None:
    """raywds.cli makes each command's options once, one object per group of its flags
    (raywds.cli.options.COMMAND_FLAGS), and the command's parameters are typed as those objects."""
    import inspect

    from raywds.cli.commands import COMMANDS
    from raywds.cli.main import build_parser, command_options
    from raywds.cli.options import COMMAND_FLAGS

    assert sorted(COMMANDS) == sorted(COMMAND_FLAGS)
    for name, takes in COMMANDS.items():
        built = command_options(build_parser().parse_args([name, *MINIMAL.get(name, [])]))
        wanted = [p.annotation for p in inspect.signature(takes).parameters.values()]
        assert [type(b).__name__ for b in built] == wanted, name


def test_the_flags_arrive_in_the_options_under_their_own_names() -> None:
    from raywds.cli.main import build_parser, command_options
    from raywds.cli.options import Source, Training
    from raywds.launch.rayoptions import RayOptions

    argv = ["ray", "--demo", "--epochs", "2", "--keep-checkpoints", "5", "--worker-resource", "trainer=1"]
    source, training, ray = command_options(build_parser().parse_args(argv))
    assert source == Source(demo=True)
    assert training == Training({"epochs": 2}), "only the training flags given"
    assert ray == RayOptions(keep_checkpoints=5, worker_resource=[("trainer", 1.0)])
    cfg = source.config_for("http://127.0.0.1:1", training)
    assert (cfg.epochs, cfg.model) == (2, "demo"), "the flag over the demo recipe"
    (serve,) = command_options(build_parser().parse_args(["serve", "shards", "--local", "--no-pull"]))
    assert (serve.shards, serve.host, serve.port, serve.local, serve.no_pull) == ("shards", "0.0.0.0", 8080, True, True)
    (plan, training) = command_options(build_parser().parse_args(["plan", "--workers", "3"]))[:2]
    assert (training.loader_workers, training.mode, training.batch_size) == (3, "resample", 64), "the config's defaults"


def test_plan_takes_the_plan_section_and_refuses_what_training_refuses() -> None:
    """`raywds plan` takes the plan part's own section (Schedule), the one the training config is
    composed of: its flags are exactly the section's fields, with their defaults, and a plan that
    training would refuse is refused in the same words."""
    import dataclasses

    from raywds.cli.main import build_parser, command_options
    from raywds.errors import ConfigError
    from raywds.plan.modes import Schedule
    from raywds.train.config import TrainConfig

    (_, training) = command_options(build_parser().parse_args(["plan"]))[:2]
    assert type(training) is Schedule
    assert dataclasses.asdict(training) == {
        f.name: getattr(TrainConfig(data="x"), f.name) for f in dataclasses.fields(Schedule)
    }
    with pytest.raises(ConfigError) as trained:
        TrainConfig(data="x", mode="split", batches_per_epoch=3)
    with pytest.raises(ConfigError) as planned:
        command_options(build_parser().parse_args(["plan", "--mode", "split", "--batches-per-epoch", "3"]))
    assert str(planned.value) == str(trained.value)


def test_error_lines_of_processes_sharing_a_pipe_stay_whole() -> None:
    """The ranks of a run share one stderr pipe, unbuffered under torchrun's PYTHONUNBUFFERED: each
    `raywds: error:` line is one write, so two ranks' lines never join (print wrote the text and its
    newline apart, and a SIGTERM's two rank lines arrived as one)."""
    import time

    start = time.time() + 3  # every writer imported by then: they write at once
    code = (
        f"import time\nfrom raywds.cli.main import said_error\ntime.sleep(max(0, {start} - time.time()))\n"
        "for i in range(3000): said_error('x' * 60 + str(i))"
    )
    read, write = os.pipe()
    procs = [
        subprocess.Popen([sys.executable, "-u", "-c", code], stderr=write, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        for _ in range(3)
    ]
    os.close(write)
    with os.fdopen(read) as pipe:
        text = pipe.read()
    assert all(p.wait(60) == 0 for p in procs)
    lines = text.splitlines()
    whole = [line for line in lines if re.fullmatch(r"raywds: error: x{60}\d+", line)]
    assert len(lines) == len(whole) == 9000, [line for line in lines if line not in whole][:3]


SAYS_MORE_AT_EXIT = """
import atexit, os, signal, sys, time
atexit.register(lambda: os.write(2, b"shutting down: a library's last words\\n"))  # as Ray's core worker does
from raywds.cli.commands import COMMANDS
from raywds.cli.main import main

def stopped_midway(*options):  # a command that a SIGTERM stops where it is
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(60)

COMMANDS["demo"] = stopped_midway
sys.argv[0] = "raywds"
sys.exit(main())
"""


def test_a_stopped_commands_line_is_the_last_thing_it_says(tmp_path: Path) -> None:
    """After `raywds: error: demo stopped on SIGTERM` nothing more reaches stdout or stderr: a
    stopped `convert --ray` driver's core worker logged, in C++, a line for each task under way whose
    failure it could not report, after the command's one line (a loaded CI run)."""
    args = [sys.executable, "-c", SAYS_MORE_AT_EXIT, "demo", "--out", str(tmp_path / "tree")]
    run = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert run.returncode == 128 + signal.SIGTERM, run.stderr[-2000:]
    assert run.stderr.splitlines() == ["raywds: error: demo stopped on SIGTERM"], run.stderr[-2000:]
    assert run.stdout == ""
