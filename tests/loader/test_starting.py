"""How a distributed rank starts its loader workers: from a fork server that has already imported
what the rank's main script imports, so that no worker imports it again."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SCRIPT = """
import multiprocessing
import heavy  # stands for Lightning: each import of it appends its process's PID to a file

from raywds.loader.starting import start_method
from raywds.world import World


def work():
    pass


if __name__ == "__main__":
    method = start_method(workers=1, world=World(rank=0, world_size=2))
    context = multiprocessing.get_context(method)
    for _ in range(3):  # three loader workers, as three epochs start them
        worker = context.Process(target=work)
        worker.start()
        worker.join()
        assert worker.exitcode == 0
    print(method)
"""


@pytest.mark.slow  # a rank and its fork server, each importing torch: about 7 s
def test_a_worker_from_the_fork_server_does_not_import_the_scripts_modules_again(tmp_path: Path) -> None:
    """A worker started from a fork server runs the rank's script again as its main module. Before
    the server preloaded the script's own imports, each of the three workers imported `heavy`
    again: four imports in all, not two (the rank's and the server's)."""
    imports = tmp_path / "imports"
    heavy = f"import os\nwith open({str(imports)!r}, 'a') as f:\n    f.write(str(os.getpid()) + ' ')\n"
    (tmp_path / "heavy.py").write_text(heavy)
    (tmp_path / "rank.py").write_text(textwrap.dedent(SCRIPT))
    out = subprocess.run(
        [sys.executable, str(tmp_path / "rank.py")], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["forkserver"], out.stdout
    pids = imports.read_text().split()
    assert len(pids) == 2 and len(set(pids)) == 2, pids  # the rank, then its fork server, once each
