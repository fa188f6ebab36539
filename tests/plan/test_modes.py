"""The table of modes, `MODES` in raywds.plan.modes: each mode that config text can name is one
entry, and each fills in everything the base, `Mode` (raywds.plan.epoch), leaves to it. A new mode
fails here until it is whole (docs/extending.md)."""

from __future__ import annotations

import ast
import inspect
import typing

from raywds.plan import epoch
from raywds.plan.epoch import Mode
from raywds.plan.modes import MODES, ModeName, parse


def left_to_the_modes() -> set[str]:
    """The methods of `Mode` whose body only raises NotImplementedError: each mode must have its own."""
    [base] = [node for node in ast.parse(inspect.getsource(epoch)).body if getattr(node, "name", "") == "Mode"]
    return {
        method.name
        for method in base.body  # type: ignore[attr-defined]
        if isinstance(method, ast.FunctionDef) and ast.unparse(method.body[-1]) == "raise NotImplementedError"
    }


def test_each_mode_the_config_can_name_is_one_entry_of_the_table() -> None:
    assert tuple(MODES) == typing.get_args(ModeName)
    for name, mode in MODES.items():
        assert isinstance(mode, Mode) and mode.name == name and parse(name) is mode


def test_each_mode_fills_in_what_the_base_leaves_open() -> None:
    left = left_to_the_modes()
    assert {"plan", "shards_for", "epoch_batches", "findings"} <= left
    for name, mode in MODES.items():
        missing = sorted(method for method in left if getattr(type(mode), method) is getattr(Mode, method))
        assert missing == [], f"mode {name} lacks {', '.join(missing)}"
        assert isinstance(type(mode).__dict__.get("exact"), bool), f"mode {name} does not say whether it is exact"
