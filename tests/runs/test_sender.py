"""A tracking call that fails says why in a few words (raywds.runs.sender.cause), whatever library
made the call and however it wrapped the error: here real calls through MLflow's own HTTP client to
servers on loopback that refuse, reset or never answer."""

from __future__ import annotations

import socket
import struct
import threading
from collections.abc import Iterator

import pytest
from mlflow.utils.rest_utils import MlflowHostCreds, http_request

from raywds.runs.sender import cause


@pytest.fixture
def listening() -> Iterator[socket.socket]:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    yield server
    server.close()


def mlflow_call_error(port: int, timeout: float = 5.0) -> BaseException:
    """The error MLflow's client raises for one call to the server at `port`, without retrying."""
    with pytest.raises(Exception) as failed:
        http_request(MlflowHostCreds(f"http://127.0.0.1:{port}"), "/health", "GET", max_retries=0, timeout=timeout)
    return failed.value


def serve(server: socket.socket, answer: str) -> None:
    """Accept connections and read each request, then reset it or leave it unanswered."""

    def run() -> None:
        while True:
            try:
                connection, _ = server.accept()
            except OSError:
                return
            connection.recv(65536)
            if answer == "reset":  # an RST, as from a server killed mid-call
                connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                connection.close()

    threading.Thread(target=run, daemon=True).start()


def test_a_server_that_resets_the_call_is_connection_lost(listening: socket.socket) -> None:
    """urllib3 keeps the reset inside a ProtocolError's arguments, under a MaxRetryError, under
    requests' ConnectionError, under MlflowException: a loaded CI run printed that whole text."""
    serve(listening, "reset")
    error = mlflow_call_error(listening.getsockname()[1])
    assert "ProtocolError" in str(error)
    assert cause(error) == "connection lost"


def test_a_server_that_is_not_there_is_connection_refused(listening: socket.socket) -> None:
    port = listening.getsockname()[1]
    listening.close()
    assert cause(mlflow_call_error(port)) == "connection refused"


def test_a_server_that_never_answers_is_no_answer_in_time(listening: socket.socket) -> None:
    serve(listening, "silence")
    assert cause(mlflow_call_error(listening.getsockname()[1], timeout=0.5), within=0.5) == "no answer in 0.5 s"
