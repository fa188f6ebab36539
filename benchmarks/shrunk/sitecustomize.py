"""Run by every Python interpreter that has this folder on PYTHONPATH (benchmarks/plane_train_bench.py):
once raywds's trainer is imported, every model it builds first average-pools its input by
RAYWDS_BENCH_SHRINK (the loader still makes and hands over the full crops), so that a 224 px
run on a CPU is bound by its data, not by the network."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
from typing import Any

TRAINER = "raywds.train.trainer"


def _shrunk(build: Any, factor: int) -> Any:
    def build_model(*args: Any, **kwargs: Any) -> Any:
        from torch import nn

        return nn.Sequential(nn.AvgPool2d(factor), build(*args, **kwargs))

    return build_model


class _AfterImport(importlib.abc.MetaPathFinder):
    def __init__(self, factor: int):
        self.factor = factor

    def find_spec(self, name: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name != TRAINER:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module: Any) -> None:
            run(module)
            module.build_model = _shrunk(module.build_model, self.factor)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


if int(os.environ.get("RAYWDS_BENCH_SHRINK", "1")) > 1:
    sys.meta_path.insert(0, _AfterImport(int(os.environ["RAYWDS_BENCH_SHRINK"])))
