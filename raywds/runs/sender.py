"""One thread per tracking tool that makes its calls in order, each until it goes through, so that
a tracking server that is slow or gone never holds the training loop (raywds.runs.tracking).

    sender = Sender("mlflow", "http://mlflow.internal:5000")
    sender.put(lambda: client.log_batch(run_id, metrics=metrics))     # returns at once
    line = sender.close(CLOSE_WAIT_S)                                  # what was not sent, or None

A call that fails is tried again 1 s, 2 s, ... up to RETRY_MAX_S apart; `close` wakes a call waiting
to be tried again, so that a server back by the run's end gets it at once, and gives the thread
the time it is told (none for a server that does not answer) before it says what is left.
"""

from __future__ import annotations

import queue
import socket
import threading
import time
from collections.abc import Callable

CLOSE_WAIT_S = 15.0
"""How long the end of a run waits for a tool's unsent calls, while its server answers."""
RETRY_MAX_S = 30.0


def cause(e: BaseException, within: float | None = None) -> str:
    """A failed call's cause in a few words (connection refused, connection lost: the server went
    away during the call, no answer in 2 s, ...), else its type and first line."""
    chain: list[BaseException] = [e]
    for link in chain:  # grows as it is walked: every error this one was raised from, or holds
        reason = getattr(link, "reason", None)  # urllib3's and urllib's errors keep the cause there
        held = [a for a in (link.__cause__, reason, link.__context__, *link.args) if isinstance(a, BaseException)]
        chain.extend(a for a in held if not any(a is seen for seen in chain))  # urllib3's ProtocolError: in args
    for link in chain:
        if isinstance(link, ConnectionRefusedError):
            return "connection refused"
        if isinstance(link, ConnectionResetError | ConnectionAbortedError | BrokenPipeError):  # RemoteDisconnected too
            return "connection lost"
        if isinstance(link, socket.gaierror):
            return "its host name does not resolve"
        if isinstance(link, TimeoutError):
            return f"no answer in {within:g} s" if within else "no answer in time"
    return f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"


class Sender:
    """One thread that makes a tool's calls in order, each until it goes through; `close` gives it
    a last while and says what is left. `where`: the tool's server, for that line."""

    def __init__(self, name: str, where: str | None = None):
        self.name, self.where = name, where
        self.calls: queue.Queue[Callable[[], object] | None] = queue.Queue()
        self.sent = self.unsent = 0
        self.error = ""
        self.deadline: float | None = None
        self.hurry = threading.Event()
        """Set by `close`: the call waiting to be tried again is tried now, or given up."""
        self.thread = threading.Thread(target=self._run, name=f"raywds-{name}", daemon=True)
        self.thread.start()

    def put(self, call: Callable[[], object]) -> None:
        self.calls.put(call)

    def _run(self) -> None:
        while (call := self.calls.get()) is not None:
            wait = 1.0
            while not self._send(call):
                if self._past(wait):
                    self.unsent += 1 + self._drop()
                    return
                if self.hurry.wait(wait):
                    self.hurry.clear()
                    if self._past(0.0):
                        self.unsent += 1 + self._drop()
                        return
                wait = min(wait * 2, RETRY_MAX_S)

    def _send(self, call: Callable[[], object]) -> bool:
        try:
            call()
        except Exception as e:  # noqa: BLE001 - whatever the client raises, training goes on
            self.error = cause(e)
            return False
        self.sent += 1
        return True

    def _past(self, wait: float) -> bool:
        return self.deadline is not None and time.monotonic() + wait > self.deadline

    def _drop(self) -> int:
        dropped = 0
        while self.calls.get() is not None:
            dropped += 1
        return dropped

    def close(self, wait_s: float = CLOSE_WAIT_S, why: str | None = None) -> str | None:
        """Wait up to `wait_s` for the calls still queued (0: try none again); a line of what was not
        sent (because of `why`, else the last error), or None."""
        self.deadline = time.monotonic() + wait_s
        self.calls.put(None)
        self.hurry.set()
        self.thread.join(wait_s + 1)
        left = self.unsent + (self.calls.qsize() if self.thread.is_alive() else 0)
        if self.thread.is_alive():
            left += 1  # the call under way
        if not left:
            return None
        to, why = f" to {self.where}" if self.where else "", why or self.error or "no answer"
        return (
            f"{self.name}: {left} of {self.sent + left} updates were not sent{to} ({why}); "
            "metrics.jsonl in the run folder holds every number"
        )
