"""The turn the Ray tests and the image's container cluster take (tests/support/turns.py): one
holder at a time across processes, and a waiter gets it after the holder's current turn, not
after a run of them."""

from __future__ import annotations

import multiprocessing
import shutil
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from support import turns


def take_turns(log: Path, name: str, times: int, hold_s: float) -> None:
    """Take the turn `times` times in a row, as the Ray worker takes one a test; log each."""
    for _ in range(times):
        with log.open("a") as out:
            out.write(f"{name} waits\n")
        with turns.turn():
            with log.open("a") as out:
                out.write(f"{name} in\n")
            time.sleep(hold_s)
            with log.open("a") as out:
                out.write(f"{name} out\n")


@pytest.fixture
def run_id(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    run = f"test-{uuid.uuid4().hex}"
    monkeypatch.setenv("PYTEST_XDIST_TESTRUNUID", run)
    yield run
    shutil.rmtree(turns.folder() or "/nonexistent", ignore_errors=True)


def test_one_holder_at_a_time_and_a_waiter_goes_before_the_holders_next_turn(run_id: str, tmp_path: Path) -> None:
    log, where = tmp_path / "log", turns.folder()
    assert where is not None and where.name == f"raywds-turns-{run_id}"
    image = multiprocessing.get_context("fork").Process(target=take_turns, args=(log, "image", 1, 0.3))
    with turns.turn():
        image.start()
        deadline = time.monotonic() + 30
        while not log.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.5)  # the other process waits for the turn meanwhile
        assert log.read_text().splitlines() == ["image waits"], "the other process took the turn while this one held it"
    with turns.turn():  # at once, as the Ray worker's next test: the waiter has had its turn by now
        assert log.read_text().splitlines() == ["image waits", "image in", "image out"]
    image.join(30)
    assert image.exitcode == 0


def test_without_xdist_there_is_nothing_to_wait_for(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTEST_XDIST_TESTRUNUID", raising=False)
    assert turns.folder() is None
    with turns.turn(), turns.turn():  # one process: taking it twice does not wait
        pass
