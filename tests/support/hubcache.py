"""A Hugging Face Hub cache laid out as `huggingface_hub` lays it out, for timm's weights without
network: HF_HOME/hub/models--timm--NAME.TAG/{refs/main, snapshots/REV/model.safetensors}."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file

REVISION = "0123456789abcdef0123456789abcdef01234567"


def put(hf_home: Path, repo: str, state: dict[str, torch.Tensor]) -> Path:
    """Store `state` as `repo`'s model.safetensors in the cache at `hf_home`; returns the file."""
    folder = hf_home / "hub" / f"models--{repo.replace('/', '--')}"
    (folder / "refs").mkdir(parents=True, exist_ok=True)
    (folder / "refs" / "main").write_text(REVISION)
    snapshot = folder / "snapshots" / REVISION
    snapshot.mkdir(parents=True, exist_ok=True)
    path = snapshot / "model.safetensors"
    save_file({k: v.contiguous() for k, v in state.items()}, str(path))
    return path
