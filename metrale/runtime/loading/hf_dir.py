"""Loads a Hugging Face model directory: config.json and *.safetensors, sharded (with an index) or not."""

import json
from pathlib import Path

from safetensors.torch import load_file

from metrale.runtime.errors import InvalidArgument
from metrale.runtime.loading.checkpoint import Checkpoint

INDEX = "model.safetensors.index.json"


def safetensors_files(directory: Path) -> list[Path]:
    index = directory / INDEX
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [directory / name for name in shards]
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise InvalidArgument(f"{directory} has no *.safetensors files")
    return files


def load_hf_dir(directory: Path) -> Checkpoint:
    from metrale.runtime.tokenizer import Tokenizer

    config_path = directory / "config.json"
    if not config_path.exists():
        raise InvalidArgument(f"{directory} has no config.json")
    tensors = {}
    for path in safetensors_files(directory):
        tensors.update(load_file(str(path)))
    return Checkpoint(config=json.loads(config_path.read_text()), tensors=tensors, source=str(directory),
                      tokenizer=Tokenizer.from_hf_dir(directory))
