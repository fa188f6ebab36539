"""What raywds tells a user to do works: the advice for a shard that changed under the index --data
made (`raywds verify` on the run's --data) runs and names the shard and the stale index; `--help`
names every form --data, --val-data and convert's SRC and OUT take."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from support import foreign

from raywds.cli.main import main
from raywds.data import stores
from raywds.data.dataset import manifest_for
from raywds.data.http import ReadPolicy
from raywds.errors import ShardMismatch


def test_the_advice_for_a_shard_changed_under_a_cached_index_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A run's --data names shards (a brace list), indexed into the cache. One shard is then
    overwritten by another of its size with its time kept (`cp -p`, `rsync -t`): the index is
    reused as it is. Another grows while a run reads it: the read stops with the advice, and the
    advice, `raywds verify` on the run's --data, names both shards and the index to remove."""
    monkeypatch.setenv("RAYWDS_INDEX_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "same"
    names = foreign.equal_size_shards(folder, num_shards=3)
    data = str(folder / "same-{0000..0002}.tar")
    assert main(["verify", data]) == 1, "no index of these shards yet"
    assert capsys.readouterr().err.startswith(f"raywds: error: {data} names shards that have no manifest, and ")
    manifest = manifest_for(data)
    [index] = list((tmp_path / "cache").glob("*/manifest.json"))
    made = index.stat().st_mtime_ns
    capsys.readouterr()
    assert main(["verify", data]) == 0
    assert capsys.readouterr().out == f"raywds: 3 shards in {data} match the manifest\n"

    kept = os.stat(folder / names[0])
    shutil.copy(folder / names[1], folder / names[0])
    os.utime(folder / names[0], ns=(kept.st_atime_ns, kept.st_mtime_ns))
    assert list(manifest_for(data).shards("train")) == list(manifest.shards("train"))
    assert index.stat().st_mtime_ns == made, "the same size and time: the index is reused"

    grown = folder / "same-0002.tar"
    listed = manifest.shards("train")[2].num_bytes
    with grown.open("ab") as f:
        f.write(bytes(512))
    with pytest.raises(ShardMismatch) as read:
        stores.open_shard(str(grown), ReadPolicy(), size=listed)
    assert str(read.value) == (
        f"shard {grown} is {listed + 512} bytes, its manifest entry {listed}: it changed after the manifest was made; "
        "run `raywds verify` on the run's --data (or `raywds index` again for shards raywds did not write)"
    )
    assert main(["verify", data]) == 1
    assert capsys.readouterr().err.splitlines() == [
        f"raywds: error: 3 problems in 3 shards of {data}:",
        "same-0000.tar: first sample k00016, manifest says k00000",
        f"same-0002.tar: {listed + 512} bytes, manifest says {listed}",
        f"{index.parent}: the index of these shards that runs read, made before they changed: remove that folder "
        "and the next run indexes them again",
    ]


def help_text(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    """`raywds ARGS --help` as one line of words (argparse wraps it at the terminal's width)."""
    with pytest.raises(SystemExit):
        main([*args, "--help"])
    return " ".join(capsys.readouterr().out.split())


@pytest.mark.parametrize("command", ["train", "ray"])
def test_help_names_every_form_data_and_val_data_take(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    said = help_text(capsys, command)
    data = said.split("--data DATA ", 1)[1].split(" --demo ", 1)[0]
    val = said.split("--val-data VAL_DATA ", 1)[1].split(" --index-cache ", 1)[0]
    for text in (data, val):
        for form in ("manifest.json", "http(s)", "s3://", "gs://", "brace list", "glob", "pipe:"):
            assert form in text, (form, text)


def test_help_names_the_places_convert_reads_and_writes(capsys: pytest.CaptureFixture[str]) -> None:
    summary = help_text(capsys)
    convert = summary.split(" convert ", 1)[1].split(" verify ", 1)[0]
    assert convert == (
        "ImageNet tree or ImageFolder (a folder, s3://, gs:// or an http listing) -> WebDataset shards + "
        "manifest.json, into a folder, s3:// or gs://"
    )
    said = help_text(capsys, "convert")
    src = said.split(" src ", 1)[1].split(" out ", 1)[0]
    out = said.split(" out ", 1)[1].split(" options: ", 1)[0]
    assert all(form in src for form in ("s3://", "gs://", "http(s)://", "brace list", "glob", "--data")), src
    assert all(form in out for form in ("s3://", "gs://")), out
