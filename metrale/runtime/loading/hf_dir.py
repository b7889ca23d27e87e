"""Loads a Hugging Face model directory: config.json and *.safetensors, sharded (with an index) or not, each tensor
read from its file when the model takes it (so the host never holds the whole model); or, where there are none,
PyTorch's pytorch_model.bin (sharded or not), read with weights_only=True (no code runs). FP8 checkpoints' weights
are dequantized as they are read (fp8.py)."""

import json
import math
import pickle
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
from safetensors import safe_open

from metrale.runtime.errors import InvalidArgument
from metrale.runtime.loading import fp8
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


class SafetensorsFiles(Mapping):
    """name -> tensor over a model's safetensors files, read when asked for (each time: a model takes each tensor
    once, uploads it and lets it go); shape() and numel() from the files' headers without reading any tensor."""

    def __init__(self, files: list[Path]):
        self._handles = [safe_open(str(path), framework="pt") for path in files]
        self._where = {name: handle for handle in self._handles for name in handle.keys()}

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._where[name].get_tensor(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, name) -> bool:
        return name in self._where

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._where[name].get_slice(name).get_shape())

    def numel(self, name: str) -> int:
        return math.prod(self.shape(name))


def load_tensors(directory: Path) -> Mapping[str, torch.Tensor]:
    if files := safetensors_files(directory):
        return SafetensorsFiles(files)
    tensors = {}
    if files := torch_files(directory):
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
    config, tensors = json.loads(config_path.read_text()), load_tensors(directory)
    if quantization := config.get("quantization_config"):       # weights dequantized as the model takes them
        tensors = fp8.dequantized(tensors, quantization)
    return Checkpoint(config=config, tensors=tensors, source=str(directory), tokenizer=Tokenizer.from_hf_dir(directory))
