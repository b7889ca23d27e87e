"""Loads a Hugging Face model directory: config.json and *.safetensors, sharded (with an index) or not; or, where
there are none, PyTorch's pytorch_model.bin (sharded or not), read with weights_only=True (no code runs)."""

import json
import pickle
from pathlib import Path

import torch
from safetensors.torch import load_file

from metrale.runtime.errors import InvalidArgument
from metrale.runtime.loading.checkpoint import Checkpoint

INDEX = "model.safetensors.index.json"
TORCH_INDEX = "pytorch_model.bin.index.json"


def _indexed(directory: Path, index: str) -> list[Path] | None:
    path = directory / index
    if not path.exists():
        return None
    return [directory / name for name in sorted(set(json.loads(path.read_text())["weight_map"].values()))]


def safetensors_files(directory: Path) -> list[Path]:
    return _indexed(directory, INDEX) or sorted(directory.glob("*.safetensors"))


def torch_files(directory: Path) -> list[Path]:
    return _indexed(directory, TORCH_INDEX) or sorted(directory.glob("pytorch_model*.bin"))


def load_tensors(directory: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    if files := safetensors_files(directory):
        for path in files:
            tensors.update(load_file(str(path)))
    elif files := torch_files(directory):
        for path in files:
            try:
                tensors.update(torch.load(path, map_location="cpu", weights_only=True))
            except pickle.UnpicklingError as error:
                raise InvalidArgument(f"{path} holds more than tensors, and is not loaded (weights_only): "
                                      f"{error}") from None
    else:
        raise InvalidArgument(f"{directory} has no *.safetensors or pytorch_model.bin files")
    return tensors


def load_hf_dir(directory: Path) -> Checkpoint:
    from metrale.runtime.tokenizer import Tokenizer

    config_path = directory / "config.json"
    if not config_path.exists():
        raise InvalidArgument(f"{directory} has no config.json")
    return Checkpoint(config=json.loads(config_path.read_text()), tensors=load_tensors(directory), source=str(directory),
                      tokenizer=Tokenizer.from_hf_dir(directory))
