"""What `./run-venv` leaves out of the environment, and why it matters to every Ray run."""

from __future__ import annotations

import importlib.util


def test_the_venv_holds_no_rfc3987_syntax() -> None:
    # jsonschema imports it where it is installed (Jupyter pulls it in) and it builds a parser as it
    # is imported, 1.6 s of CPU in each of the ~20 processes a Ray run starts; with it the suite's pytest
    # took 34 min instead of 22 (docs/testing.md). ./run-venv excludes it and removes it from an older .venv.
    assert importlib.util.find_spec("rfc3987_syntax") is None, "rerun ./run-venv: it uninstalls rfc3987-syntax"
