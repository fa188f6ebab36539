"""The table of `raywds predict --ray` data planes, `PLANES` in raywds.launch.ray_prediction: each
choice of `--data-plane` (`PredictPlane`) is one entry, and each entry takes what the others take.
Starts no Ray: it reads the table (docs/extending.md)."""

from __future__ import annotations

import inspect
import typing

from raywds.infer.predictoptions import PredictPlane


def test_each_predict_plane_is_one_entry_taking_what_the_others_take() -> None:
    from raywds.launch.ray_prediction import PLANES

    assert tuple(PLANES) == typing.get_args(PredictPlane)
    signatures = {name: inspect.signature(run) for name, run in PLANES.items()}
    first = signatures["loader"]
    assert list(first.parameters) == ["job", "reading", "setup", "num_workers"]
    assert {name: s for name, s in signatures.items() if s != first} == {}
