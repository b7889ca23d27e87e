"""Checkpoint loading: Hugging Face directories and GGUF files into one Checkpoint."""

from pathlib import Path

from metrale.runtime.errors import InvalidArgument
from metrale.runtime.loading.checkpoint import Checkpoint


def load_checkpoint(path: str | Path) -> Checkpoint:
    path = Path(path)
    if path.is_dir():
        from metrale.runtime.loading.hf_dir import load_hf_dir
        return load_hf_dir(path)
    if path.suffix == ".gguf" and path.is_file():
        from metrale.runtime.loading.gguf_file import load_gguf
        return load_gguf(path)
    raise InvalidArgument(f"{path} is neither a Hugging Face model directory nor a .gguf file")


__all__ = ["Checkpoint", "load_checkpoint"]
