"""The turn the Ray tests and the image's container cluster take (tests/support/turns.py): one
holder at a time across processes, and a waiter gets it after the holder's current turn, not
after a run of them."""

from __future__ import annotations

import fcntl
import multiprocessing
import time
from pathlib import Path

import pytest
from support import turns


def take_turns(log: Path, name: str, times: int, hold_s: float) -> None:
    """Take the turn `times` times in a row, as the Ray worker takes one a test; log each."""
    for _ in range(times):
        with log.open("a") as out:
            out.write(f"{name} waits\n")
        with turns.turn(log.parent):
            with log.open("a") as out:
                out.write(f"{name} in\n")
            time.sleep(hold_s)
            with log.open("a") as out:
                out.write(f"{name} out\n")


def waiting(where: Path) -> bool:
    """Whether another process waits for the turn in `where` (it holds the gate meanwhile)."""
    with open(where / turns.GATE, "a") as gate:
        try:
            fcntl.flock(gate, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(gate, fcntl.LOCK_UN)
        return False


def test_one_holder_at_a_time_and_a_waiter_goes_before_the_holders_next_turn(tmp_path: Path) -> None:
    log = tmp_path / "log"
    image = multiprocessing.get_context("fork").Process(target=take_turns, args=(log, "image", 1, 0.3))
    with turns.turn(tmp_path):
        image.start()
        deadline = time.monotonic() + 30
        while not waiting(tmp_path) and time.monotonic() < deadline:  # however slowly it gets there
            time.sleep(0.01)
        time.sleep(0.3)  # it waits for the turn meanwhile
        assert log.read_text().splitlines() == ["image waits"], "the other process took the turn while this one held it"
    with turns.turn(tmp_path):  # at once, as the Ray worker's next test: the waiter has had its turn by now
        assert log.read_text().splitlines() == ["image waits", "image in", "image out"]
    image.join(30)
    assert image.exitcode == 0


def test_a_runs_workers_share_its_folder_and_without_xdist_there_is_nothing_to_wait_for(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw0")
    assert turns.folder(tmp_path_factory) == tmp_path_factory.getbasetemp().parent
    monkeypatch.delenv("PYTEST_XDIST_WORKER")
    assert turns.folder(tmp_path_factory) is None
    with turns.turn(None), turns.turn(None):  # one process: taking it twice does not wait
        pass
