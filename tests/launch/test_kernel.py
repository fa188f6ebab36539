"""raywds.launch.kernel in a real ipykernel, started and shut down by jupyter_client as Jupyter's
server does: the callback runs when the kernel is asked to shut down, while the processes that
ipykernel then signals still run; a second call adds nothing; a callback that fails still lets
the kernel shut down by itself. Outside a kernel it does nothing. No Ray: what the callback is
for (ray.shutdown) is checked in test_lab.py, through the notebook in Jupyter Lab."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from raywds.launch.kernel import stop_ray_with_the_kernel

CODE = """
import pathlib, signal, subprocess
from raywds.launch.kernel import stop_ray_with_the_kernel
# In the kernel's process group, as ray.init's GCS and raylet are, and deaf to SIGINT as Ray makes them:
# Jupyter interrupts the whole group before it asks the kernel to shut down.
child = subprocess.Popen(["sleep", "60"], preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
calls = []
def stop():
    calls.append(1)
    pathlib.Path({marker!r}).write_text(repr((child.poll(), len(calls))))
    child.terminate()  # and reaped, as ray.shutdown() stops the cluster's processes
    child.wait()
    if {fails!r}:
        raise RuntimeError("a callback that fails")
print("hooked", stop_ray_with_the_kernel(stop), stop_ray_with_the_kernel(stop))
"""


def test_outside_a_kernel_nothing_is_hooked() -> None:
    assert stop_ray_with_the_kernel(lambda: None) is False


@pytest.mark.parametrize("fails", [False, True])
def test_the_callback_runs_before_the_kernel_signals_its_processes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fails: bool
) -> None:
    from jupyter_client.manager import start_new_kernel

    for name in ("JUPYTER_CONFIG_DIR", "JUPYTER_DATA_DIR", "JUPYTER_RUNTIME_DIR", "IPYTHONDIR"):
        monkeypatch.setenv(name, str(tmp_path / name.lower()))  # nothing in HOME
    marker = tmp_path / "called"
    manager, client = start_new_kernel(kernel_name="python3", cwd=str(tmp_path), startup_timeout=120)
    try:
        printed: list[str] = []

        def collect(message: dict) -> None:
            if message["msg_type"] == "stream":
                printed.append(message["content"]["text"])

        reply = client.execute_interactive(
            CODE.format(marker=str(marker), fails=fails), timeout=120, output_hook=collect
        )
        assert reply["content"]["status"] == "ok", json.dumps(reply["content"])[-2000:]
        assert "hooked True True" in "".join(printed)
        client.stop_channels()
        process = manager.provisioner.process  # type: ignore[union-attr]
        manager.shutdown_kernel(now=False)  # a shutdown request, then a wait for the kernel to exit
        status = process.returncode
    finally:
        if manager.is_alive():
            manager.shutdown_kernel(now=True)
    # the sleep still ran (poll() None) when the callback ran, once; the kernel then exited by itself
    assert marker.read_text() == "(None, 1)"
    assert status == 0, f"the kernel exited with {status}: it did not shut down by itself"
