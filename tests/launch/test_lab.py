"""notebooks/ray-demo.ipynb in a real Jupyter Lab, driven by headless Chromium through Selenium: every
cell but the last (Run > Run All Above Selected Cell, with the last selected), then the page shows no
error, the worker plan, the top-1 line, the finished progress bar, the metrics table and the plot;
then the kernel is shut down as Jupyter does, and the shard server and the Ray cluster the notebook
started must be gone with it, though its last cell, which stops them, never ran. The
server, its kernel, the kernel's Ray cluster and the browser are stopped by PID at the end, pass or
fail; the finished page is saved as a screenshot in the test's tmp dir (RAYWDS_LAB_SCREENSHOT=PATH
copies it there, as for docs/images/lab-notebook.png).

    ./run-tests tests/launch/test_lab.py          # needs /usr/bin/chromium and /usr/bin/chromedriver
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from support.raycluster import cluster_processes, describe, is_running, token_env, worker_roles, write_token

from raywds.serve import free_port

pytestmark = [pytest.mark.browser, pytest.mark.ray]

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOK = ROOT / "notebooks" / "ray-demo.ipynb"
JUPYTER = Path(sys.executable).parent / "jupyter"
CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
RUN_ALL_TIMEOUT_S = 240.0
"""Every cell of the one-epoch notebook but the last, from the click to the last number: under a minute
on 2 busy cores (the whole test call, page load included, took 58 to 67 s)."""
STDERR = "application/vnd.jupyter.stderr"
SETTINGS = {
    # Every cell in the DOM, so that the page can be read whole (Lab 4 leaves cells out of view out).
    "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none"},
    # No news or update checks: the test talks to nothing but its own server.
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {"fetchNews": "false", "checkForUpdates": False},
}


def need_browser() -> None:
    """Skip where Chromium or its driver is missing, except under RAYWDS_REQUIRE_BROWSER=1 (set by
    .ci/run, which installs them): there their absence is a failure."""
    missing = [str(p) for p in (CHROMIUM, CHROMEDRIVER) if not p.exists()]
    if missing:
        message = f"{', '.join(missing)} missing (apt-get install chromium chromium-driver)"
        if os.environ.get("RAYWDS_REQUIRE_BROWSER"):
            pytest.fail(message)
        pytest.skip(message)


# --- processes: each started in a session of its own and ended by its process group -------------


def group_members(pgid: int) -> list[int]:
    """The running processes whose process group is `pgid`."""
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            raw = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = raw[raw.rindex(")") + 2 :].split()
        if int(fields[2]) == pgid and fields[0] not in "ZXx":
            members.append(int(entry))
    return members


def end_group(pgid: int, grace_s: float = 10.0) -> None:
    """SIGTERM to the process group `pgid` (one this test started with start_new_session, so its
    leader's PID), SIGKILL to what is left after `grace_s`; AssertionError if any outlive it."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
        if not group_members(pgid):
            return
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait_s
        while group_members(pgid) and time.monotonic() < deadline:
            time.sleep(0.1)
    left = group_members(pgid)
    assert not left, f"processes of group {pgid} outlived SIGKILL: {left}"


def end_processes_naming(directory: Path) -> None:
    """End, by PID, every process that names `directory` or holds a file under it open, and their
    children: a kernel (its connection file is in the runtime dir) the server did not stop."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        procs = list(cluster_processes(directory).values())
        for pid, started in procs:
            if is_running((pid, started)):
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + 10.0
        while any(is_running(p) for p in procs) and time.monotonic() < deadline:
            time.sleep(0.1)
    left = list(cluster_processes(directory).values())
    assert not left, f"processes using {directory} outlived SIGKILL:\n{describe(left)}"


# --- Jupyter Lab ---------------------------------------------------------------------------------


@dataclasses.dataclass
class Lab:
    url: str
    token: str
    notebooks: Path
    """The folder it serves: a copy of notebooks/, so that saving never touches the repository's."""
    runtime_dir: Path
    log: Path
    process: subprocess.Popen[bytes]

    def api(self, method: str, path: str, timeout_s: float = 10.0) -> Any:
        request = urllib.request.Request(
            f"{self.url}{path}", method=method, headers={"Authorization": f"token {self.token}"}
        )
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            body = response.read()
        return json.loads(body) if body else None

    def log_tail(self, num_chars: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-num_chars:]


def lab_env(tmp_path: Path, ray_temp: Path) -> dict[str, str]:
    """The server's environment, which its kernels inherit: Jupyter's and IPython's dirs under
    `tmp_path`, and for the notebook a private local Ray cluster in `ray_temp` with a token of its
    own, one epoch, and its runs under `tmp_path`."""
    env = token_env(write_token(ray_temp))
    for name, sub in (
        ("JUPYTER_CONFIG_DIR", "config"),
        ("JUPYTER_DATA_DIR", "data"),
        ("JUPYTER_RUNTIME_DIR", "runtime"),
        ("JUPYTERLAB_SETTINGS_DIR", "settings"),
        ("JUPYTERLAB_WORKSPACES_DIR", "workspaces"),
        ("IPYTHONDIR", "ipython"),
    ):
        env[name] = str(tmp_path / "jupyter" / sub)
    env.update(
        RAY_ADDRESS="local",  # a private cluster, never one a user started
        RAY_TMPDIR=str(ray_temp),
        RAY_TRAIN_ENABLE_PRINT_PATCH="0",
        RAYWDS_NOTEBOOK_EPOCHS="1",
        RAYWDS_NOTEBOOK_RUNS=str(tmp_path / "runs"),
    )
    env.pop("JUPYTER_PLATFORM_DIRS", None)
    return env


@contextmanager
def jupyter_lab(tmp_path: Path, env: dict[str, str]) -> Iterator[Lab]:
    """`jupyter lab` on 127.0.0.1, a free port and a random token, serving a copy of notebooks/,
    in `env` (lab_env); afterwards it is asked to shut down (its kernels with it), then its
    process group and any kernel left are ended by PID."""
    notebooks = tmp_path / "notebooks"
    shutil.copytree(ROOT / "notebooks", notebooks, ignore=shutil.ignore_patterns(".ipynb_checkpoints"))
    for name, values in SETTINGS.items():
        path = Path(env["JUPYTERLAB_SETTINGS_DIR"]) / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(values))
    port, token = free_port("127.0.0.1"), secrets.token_hex(24)
    log = tmp_path / "lab.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            [
                str(JUPYTER),
                "lab",
                "--no-browser",
                "--ip=127.0.0.1",
                f"--port={port}",
                "--ServerApp.port_retries=0",
                f"--IdentityProvider.token={token}",
                f"--ServerApp.root_dir={notebooks}",
                "--KernelManager.shutdown_wait_time=30",  # time for the kernel's atexit: Ray's shutdown
                "--ServerApp.terminals_enabled=False",
                *(["--allow-root"] if os.geteuid() == 0 else []),  # CI's containers run as root
            ],
            cwd=notebooks,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    server = Lab(f"http://127.0.0.1:{port}", token, notebooks, Path(env["JUPYTER_RUNTIME_DIR"]), log, process)
    try:
        wait_ready(server)
        yield server
    finally:
        try:
            if process.poll() is None:
                try:
                    server.api("POST", "/api/shutdown")  # stops the kernels as a user's Ctrl-C would
                    process.wait(timeout=60)
                except (OSError, subprocess.TimeoutExpired):
                    pass
            end_group(process.pid)
            if process.poll() is None:
                process.kill()
            process.wait(timeout=10)
        finally:
            end_processes_naming(server.runtime_dir)


@pytest.fixture
def lab(tmp_path: Path, ray_temp: Path) -> Iterator[Lab]:
    with jupyter_lab(tmp_path, lab_env(tmp_path, ray_temp)) as server:
        yield server


def wait_ready(lab: Lab, timeout_s: float = 90.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if lab.process.poll() is not None:
            pytest.fail(f"jupyter lab exited {lab.process.returncode}:\n{lab.log_tail()}")
        try:
            lab.api("GET", "/api/status", timeout_s=2.0)
            return
        except (OSError, ValueError):
            time.sleep(0.2)
    pytest.fail(f"jupyter lab did not answer at {lab.url} within {timeout_s:.0f} s:\n{lab.log_tail()}")


# --- Chromium ------------------------------------------------------------------------------------


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[Any]:
    need_browser()
    with chromium(tmp_path) as driver:
        yield driver


@contextmanager
def chromium(tmp_path: Path) -> Iterator[Any]:
    """Headless Chromium under the system chromedriver, both in a process group of their own that
    is ended afterwards; its profile and HOME under `tmp_path`."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    home = tmp_path / "chrome-home"
    home.mkdir()
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in (
        "--headless=new",
        "--no-sandbox",
        "--disable-dev-shm-usage",
        "--disable-gpu",
        "--window-size=1280,1800",
        f"--user-data-dir={tmp_path / 'chrome-profile'}",
    ):
        options.add_argument(flag)
    service = Service(
        str(CHROMEDRIVER),
        log_output=str(tmp_path / "chromedriver.log"),
        env={**os.environ, "HOME": str(home)},
        popen_kw={"start_new_session": True},
    )
    driver = None
    try:
        driver = webdriver.Chrome(service=service, options=options)
        driver.set_script_timeout(30)
        yield driver
    finally:
        try:
            if driver is not None:
                driver.quit()
        finally:
            if service.process is not None:
                end_group(service.process.pid)


# --- reading the page ----------------------------------------------------------------------------

READ_CELLS = """
return Array.from(document.querySelectorAll('.jp-Notebook .jp-Cell.jp-CodeCell')).map(cell => ({
  prompt: (cell.querySelector('.jp-InputArea-prompt') || {innerText: ''}).innerText.trim(),
  outputs: Array.from(cell.querySelectorAll('.jp-OutputArea-output')).map(o => ({
    mime: o.getAttribute('data-mime-type') || '',
    text: o.innerText
  })),
  images: Array.from(cell.querySelectorAll('.jp-OutputArea-output img')).map(img => img.getAttribute('src') || ''),
  tables: cell.querySelectorAll('.jp-OutputArea-output table tr').length,
  bars: Array.from(cell.querySelectorAll('.jp-OutputArea-output .widget-hbox')).map(b => b.innerText)
}));
"""


READ_STATUS = "return Array.from(document.querySelectorAll('.jp-StatusBar-TextItem')).map(e => e.innerText).join(' ')"


def kernel_idle(lab: Lab) -> bool:
    """The notebook's kernel has started and waits for code (the server's view)."""
    sessions = lab.api("GET", "/api/sessions")
    return any((s.get("kernel") or {}).get("execution_state") == "idle" for s in sessions)


def read_cells(driver: Any) -> list[dict[str, Any]]:
    return driver.execute_script(READ_CELLS)


def errors_in(cells: list[dict[str, Any]]) -> list[str]:
    """The stderr outputs (error outputs included) that hold a traceback. Ray's workers print
    there too: with the user's stand-in cluster on the same machine, this also holds Ray Train's
    PlacementGroupCleaner to finding its own cluster (raywds.launch.cluster.worker_setup)."""
    return [
        text for text in (o["text"] for c in cells for o in c["outputs"] if o["mime"] == STDERR) if "Traceback" in text
    ]


def page_text(cells: list[dict[str, Any]]) -> str:
    """Every cell's prompt and outputs, for a failure's message."""
    return "\n".join(f"{c['prompt']} " + "\n".join(o["text"][-1500:] for o in c["outputs"]) for c in cells)


SCROLL = """
const outputs = Array.from(document.querySelectorAll('.jp-Notebook .jp-Cell .jp-OutputArea-output'));
const bar = document.querySelector('.jp-Notebook .jp-OutputArea-output .widget-hbox');
const target = bar || outputs[outputs.length - 1];
if (target) { target.closest('.jp-Cell').scrollIntoView({block: 'start'}); }
"""


def shot(driver: Any, path: Path) -> Path:
    """A screenshot of the notebook from the cell with the progress bar (else the last output) down."""
    driver.execute_script(SCROLL)
    time.sleep(0.5)
    driver.save_screenshot(str(path))
    return path


def run_all_above_the_last(driver: Any, lab: Lab, tmp_path: Path) -> list[dict[str, Any]]:
    """Open the notebook, select its last cell (the one that stops the shard server and Ray), click
    Run > Run All Above Selected Cell and wait until every other code cell has its number; fail early
    on a traceback, and with a screenshot and the page's outputs on timeout."""
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support import expected_conditions as ready
    from selenium.webdriver.support.ui import WebDriverWait

    num_code_cells = sum(1 for c in json.loads(NOTEBOOK.read_text())["cells"] if c["cell_type"] == "code")
    driver.get(f"{lab.url}/lab/tree/{NOTEBOOK.name}?token={lab.token}")
    wait = WebDriverWait(driver, 90)
    wait.until(lambda d: len(read_cells(d)) == num_code_cells)
    wait.until(lambda d: kernel_idle(lab) and "| Idle" in d.execute_script(READ_STATUS))  # else nothing runs
    ActionChains(driver).key_down(Keys.CONTROL).send_keys("b").key_up(Keys.CONTROL).perform()  # hide the file browser
    last = driver.find_elements(By.CSS_SELECTOR, ".jp-Notebook .jp-Cell")[-1]
    last.find_element(By.CSS_SELECTOR, ".jp-InputPrompt").click()
    wait.until(
        lambda d: "jp-mod-selected" in last.get_attribute("class") or "jp-mod-active" in last.get_attribute("class")
    )
    menu = (By.XPATH, "//div[contains(@class, 'lm-MenuBar-itemLabel') and normalize-space()='Run']")
    wait.until(ready.element_to_be_clickable(menu)).click()
    item = (By.XPATH, "//li[contains(@class, 'lm-Menu-item') and normalize-space()='Run All Above Selected Cell']")
    wait.until(ready.element_to_be_clickable(item)).click()
    deadline = time.monotonic() + RUN_ALL_TIMEOUT_S
    while True:
        cells = read_cells(driver)
        if errors_in(cells):
            pytest.fail(f"a cell failed (screenshot {shot(driver, tmp_path / 'failed.png')}):\n{page_text(cells)}")
        if all(re.fullmatch(r"\[\d+\]:", c["prompt"]) for c in cells[:-1]):
            return cells
        if time.monotonic() > deadline:
            pytest.fail(
                f"Run All Above did not finish in {RUN_ALL_TIMEOUT_S:.0f} s (prompts {[c['prompt'] for c in cells]}; "
                f"screenshot {shot(driver, tmp_path / 'timeout.png')}):\n{page_text(cells)}\n"
                f"--- jupyter lab's log\n{lab.log_tail()}"
            )
        time.sleep(1.0)


KERNEL_SHUTDOWN_CPU_S = 3.0
"""The CPU seconds a kernel may use from the shutdown request to its exit. With Ray stopped first:
0.1 in this test, 1.10 for a kernel that jupyter_client shuts down (median of 3,
benchmarks/kernel_shutdown.py). Without: 28.9 in this test, 5.48 in the benchmark."""


@contextmanager
def cpu_of_kernel(kernel_id: str) -> Iterator[list[float]]:
    """The CPU seconds the kernel `kernel_id` uses while the block runs, up to its exit (sampled
    every 50 ms, so its last 50 ms may go uncounted): in the list's one item, after the block."""
    import psutil

    found = [
        p
        for p in psutil.process_iter(["cmdline", "ppid"])
        if any(f"kernel-{kernel_id}.json" in a for a in p.info["cmdline"] or [])
    ]
    pids = {p.pid for p in found}
    roots = [p for p in found if p.info["ppid"] not in pids]  # not a process the kernel forked
    assert len(roots) == 1, f"not one process of kernel {kernel_id}: {found}"
    kernel = roots[0]
    start = sum(kernel.cpu_times()[:2])
    spent = [0.0]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            try:
                spent[0] = sum(kernel.cpu_times()[:2]) - start
            except psutil.NoSuchProcess:
                return
            time.sleep(0.05)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        yield spent
        psutil.wait_procs([kernel], timeout=30)
    finally:
        done.set()
        sampler.join(5)


def refuses(url: str) -> bool:
    host, port = re.fullmatch(r"http://([^:/]+):(\d+)", url).groups()  # type: ignore[union-attr]
    try:
        socket.create_connection((host, int(port)), timeout=2).close()
        return False
    except OSError:
        return True


def test_the_notebook_in_jupyter_lab_shows_the_run_and_its_kernels_stop_stops_what_it_started(
    tmp_path: Path, lab: Lab, browser: Any, ray_temp: Path
) -> None:
    last_cell = [c for c in json.loads(NOTEBOOK.read_text())["cells"] if c["cell_type"] == "code"][-1]
    assert "server.stop()" in "".join(last_cell["source"]) and "ray.shutdown()" in "".join(last_cell["source"])
    started = time.monotonic()
    cells = run_all_above_the_last(browser, lab, tmp_path)
    seconds = time.monotonic() - started
    screenshot = shot(browser, tmp_path / "lab-notebook.png")
    if os.environ.get("RAYWDS_LAB_SCREENSHOT"):
        shutil.copy(screenshot, os.environ["RAYWDS_LAB_SCREENSHOT"])
    text = "\n".join(o["text"] for c in cells for o in c["outputs"])
    where = f"(the run took {seconds:.0f} s; screenshot {screenshot}):\n{page_text(cells)}"
    assert not errors_in(cells), f"tracebacks on the page {where}"
    assert cells[-1]["prompt"] in ("[ ]:", ""), f"the last cell ran {where}"
    assert "training on 2 CPU (gloo) workers" in text, f"no worker plan {where}"
    assert re.search(r"\d+ s, top-1 \d\.\d{3}", text), f"no top-1 line {where}"
    bars = [b for c in cells for b in c["bars"]]
    assert any("100%" in b for b in bars), f"no finished progress bar: {bars} {where}"
    assert max(c["tables"] for c in cells) == 2, f"no metrics table of a header and the one epoch {where}"
    pngs = [src for c in cells for src in c["images"] if src.startswith("data:image/png;base64,")]
    assert any(len(src) > 20_000 for src in pngs), f"no plot: {[len(s) for s in pngs]} {where}"
    assert list((tmp_path / "runs" / "ray").glob("nb-*/report.png"))
    url = re.search(r"^\w+ (http://\S+)$", text, re.M)
    assert url, f"no `backend url` line {where}"
    # The kernel shut down as Lab's Kernel > Shut Down Kernel does it (the server asks the kernel to
    # end and waits for it): what the notebook started ends with it.
    assert not refuses(url[1]) and cluster_processes(ray_temp), "the server and Ray are up before the shutdown"
    sessions = lab.api("GET", "/api/sessions")
    with cpu_of_kernel(sessions[0]["kernel"]["id"]) as spent:
        for session in sessions:
            lab.api("DELETE", f"/api/kernels/{session['kernel']['id']}", timeout_s=60)
    # ipykernel signals its process group (the notebook's GCS and raylet) before it exits and runs
    # atexit's ray.shutdown(): the driver's two threads then polled a GCS that was gone, both cores
    # busy, 25 to 35 CPU s here, unless raywds stops Ray first (raywds.launch.kernel)
    assert spent[0] < KERNEL_SHUTDOWN_CPU_S, f"the kernel took {spent[0]:.1f} CPU s to shut down"
    deadline = time.monotonic() + 30
    while (not refuses(url[1]) or cluster_processes(ray_temp)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert refuses(url[1]), f"the shard server at {url[1]} outlived the kernel"
    left = cluster_processes(ray_temp)
    assert not left, f"the notebook's Ray cluster outlived the kernel:\n{describe(left.values())}"
    # The cluster was the notebook's own: no preemption watcher (no autoscaler drains its node) and no
    # idle workers prestarted (none could serve a run whose every process has raywds's runtime env).
    roles = worker_roles(ray_temp)
    assert {"TrainController", "RayTrainWorker", "_AutoscalingCoordinatorActor"} <= set(roles), roles
    assert "PreemptionWatcher" not in roles and "" not in roles, roles
