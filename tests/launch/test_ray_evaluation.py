"""`raywds evaluate --ray` (raywds.launch.ray_evaluation) on the tests' private local Ray: three
tasks score a real run's model on the uneven shards (9 of 1 to 30 samples) with the numbers of a
plain loop over every sample (support.scoring), and a task's own error (a shard cut short) is the
CLI's one line, naming the rank."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from support.runs import small_config
from support.scoring import assert_same, plain_loop, split_samples

from raywds.cli import main as cli
from raywds.launch.local import run_local
from raywds.models.trained import load_trained

pytestmark = pytest.mark.ray


def test_three_ray_tasks_score_every_sample_once(
    uneven: Path, tmp_path: Path, local_ray: None, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    run_local(small_config(uneven, epochs=1, out=str(run)))
    args = ["evaluate", str(run), "--data", str(uneven), "--split", "train", "--out", str(tmp_path / "e")]
    assert cli.main([*args, "--ray", "--num-workers", "3", "--loader-workers", "0", "--batch-size", "7"]) == 0
    assert capsys.readouterr().out.splitlines()[-1].endswith("  samples 120")
    trained = load_trained(str(run))
    metrics = assert_same(tmp_path / "e", plain_loop(trained.model, trained, split_samples(uneven, "train")), 120)
    assert metrics["ranks"] == 3 and min(metrics["samples_per_rank"]) > 0, metrics
    manifest = json.loads((uneven / "manifest.json").read_text())
    broken = tmp_path / "broken"
    broken.mkdir()
    for shard in manifest["splits"]["train"]["shards"]:  # the largest shard cut short: its rank's error
        data = (uneven / shard["name"]).read_bytes()
        (broken / shard["name"]).write_bytes(data[: len(data) // 2] if shard["num_samples"] == 30 else data)
    (broken / "manifest.json").write_text(json.dumps(manifest))
    code = cli.main(["evaluate", str(run), "--data", str(broken), "--split", "train", "--ray", "--num-workers", "3"])
    err = capsys.readouterr().err.splitlines()
    assert code == 1 and len(err) == 1, err
    shard = re.escape(str(broken / "uneven-train-000001.tar"))
    assert re.match(rf"raywds: error: shard {shard} is \d+ bytes, its manifest entry \d+: .* \(rank 0\)$", err[0]), err
