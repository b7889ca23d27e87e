"""Hugging Face directories load lazily: safetensors files are indexed by name, each tensor read from its file only
when the model takes it (the host never holds the whole model, as a 60 GB mixture of experts needs), with the
same tensors a full read gives and sizes from the headers alone."""

import collections

from safetensors.torch import load_file

from metrale.runtime.build import build_engine
from metrale.runtime.config import EngineConfig
from metrale.runtime.loading import load_checkpoint
from metrale.runtime.loading.hf_dir import SafetensorsFiles, safetensors_files
from tiny_models import write_tiny


def test_sharded_files_read_as_a_full_read_does(tmp_path):
    directory = write_tiny("qwen3_moe", tmp_path / "moe", shard=True)
    files = safetensors_files(directory)
    assert len(files) > 1
    full = {name: tensor for path in files for name, tensor in load_file(str(path)).items()}
    lazy = load_checkpoint(directory).tensors
    assert isinstance(lazy, SafetensorsFiles) and set(lazy) == set(full) and len(lazy) == len(full)
    for name, tensor in full.items():
        assert lazy.numel(name) == tensor.numel()
        assert lazy[name].dtype == tensor.dtype and (lazy[name] == tensor).all()
    assert "no.such.tensor" not in lazy


def test_a_model_reads_each_tensor_when_it_takes_it(tmp_path, monkeypatch):
    reads = collections.Counter()
    read = SafetensorsFiles.__getitem__

    def counted(self, name):
        reads[name] += 1
        return read(self, name)

    monkeypatch.setattr(SafetensorsFiles, "__getitem__", counted)
    checkpoint = load_checkpoint(write_tiny("dots1", tmp_path / "dots1", shard=True))
    assert not reads                          # loading read headers only
    build_engine(checkpoint, EngineConfig(device="cpu", kv_blocks=16))
    assert set(reads) == set(checkpoint.tensors) and max(reads.values()) == 1
