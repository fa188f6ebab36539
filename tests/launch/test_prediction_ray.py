"""`raywds predict --ray` (raywds.launch.ray_prediction) on the tests' private local Ray: a real
run's model predicts the uneven shards (9 train shards of 1 to 30 samples, 4 val shards) as two
ranks in Ray tasks (`--data-plane loader`) and as Ray Data read tasks feeding a pool of model
replicas (`--data-plane ray`): every key once, one part per shard, the same predictions both ways."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pyarrow.dataset as pads
import pytest
from support.data import tar_keys
from support.runs import small_config

from raywds.cli import main as cli
from raywds.launch.local import run_local

pytestmark = pytest.mark.ray


def test_both_data_planes_predict_every_key_once(
    uneven: Path, tmp_path: Path, local_ray: None, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    run_local(small_config(uneven, epochs=1, loader_workers=0, out=str(run)))
    keys = sorted(tar_keys(uneven, "train") + tar_keys(uneven, "val"))
    tables = {}
    for plane in ("loader", "ray"):
        out = tmp_path / plane
        args = ["predict", str(run), "--data", str(uneven), "--out", str(out), "--batch-size", "7"]
        code = cli.main([*args, "--ray", "--data-plane", plane, "--num-workers", "2", "--loader-workers", "0"])
        said = capsys.readouterr()
        assert code == 0, said.err
        line = said.out.splitlines()[-1]
        assert line.startswith(f"raywds: predicted 170 samples (0 errors) in 13 parts into {out} ("), line
        rows = pads.dataset(str(out)).to_table().to_pylist()
        counted = Counter(r["key"] for r in rows)
        assert sorted(counted.elements()) == keys and max(counted.values()) == 1, plane
        assert len(list(out.glob("*.parquet"))) == 13
        tables[plane] = {r["key"]: r for r in rows}
    for key, row in tables["loader"].items():
        other = tables["ray"][key]
        assert [row[c] for c in ("shard", "label", "top_classes")] == [
            other[c] for c in ("shard", "label", "top_classes")
        ]
        assert row["top_probs"] == pytest.approx(other["top_probs"], abs=1e-6)
