"""build_engine: the weights' arena it plans, the KV pool's size where no block count is given, and what Info
reports of the architecture."""

import pytest

from metrale.runtime.backend.cpu import CpuRunner
from metrale.runtime.backend.cpu.layer_math import CpuLayerMath
from metrale.runtime.backend.cuda.device import ALIGNMENT
from metrale.runtime.backend.cuda.vocab_parts import head_rows
from metrale.runtime.build import _weight_bytes, build_engine
from metrale.runtime.config import EngineConfig
from metrale.runtime.loading import load_checkpoint
from metrale.runtime.models import family_of
from metrale.runtime.parallel.group import Shard
from metrale.runtime.parallel.sharding import ShardedTensors
from tiny_models import TINY, TINY_MLA, TINY_MOE, TINY_SPARSE, TINY_SSM, write_tiny, write_tiny_m2m100


class ArenaTally(CpuLayerMath):
    """The CPU layer math, counting the bytes the CUDA backend's uploads take from its weights arena."""

    def __init__(self, group=None):
        super().__init__(group=group)
        self.taken = 0

    def _take(self, tensor, size):
        self.taken += -(-tensor.numel() * size // ALIGNMENT) * ALIGNMENT
        return tensor

    def upload(self, tensor):
        return self._take(super().upload(tensor), 2)

    def upload_float32(self, tensor):
        return self._take(super().upload_float32(tensor), 4)

    def upload_lm_head(self, tensor):
        """The rows the CUDA backend uploads (its padding; a rank's part)."""
        return self._take(head_rows(tensor, None if self.group is None else self.group.shard), 2)


class Ranks:
    """A tensor-parallel group as the uploads see it: the rank's shard."""

    def __init__(self, shard):
        self.shard, self.size = shard, shard.size


@pytest.mark.parametrize("name", [*TINY, *TINY_MOE, *TINY_MLA, *TINY_SPARSE, *TINY_SSM, "m2m100"])
def test_the_weights_arena_holds_every_upload_of_the_model(name, tmp_path):
    directory = write_tiny_m2m100(tmp_path) if name == "m2m100" else write_tiny(name, tmp_path)
    checkpoint = load_checkpoint(directory)
    family = family_of(checkpoint.config)
    config = family.config_from_hf(checkpoint.config)
    tally = ArenaTally()
    family.model_class(config, checkpoint.tensors, tally, config.max_position_embeddings)
    planned = _weight_bytes(checkpoint.tensors, checkpoint.numel, config, config.max_position_embeddings,
                            family.model_class)
    assert tally.taken <= planned < 3 * tally.taken


@pytest.mark.parametrize("name", ["llama_tied", "llama3_untied", "mixtral", "deepseek_v2"])
@pytest.mark.parametrize("rank, size", [(0, 1), (0, 2), (1, 2)])
def test_a_tensor_parallel_ranks_weights_arena_holds_its_uploads(name, rank, size, tmp_path):
    """Its shard of every tensor, and the LM head's part of the vocabulary beside a tied table (in a group of one
    rank too)."""
    checkpoint = load_checkpoint(write_tiny(name, tmp_path))
    family = family_of(checkpoint.config)
    shard = Shard(rank, size)
    config, splits = family.tensor_parallel(family.config_from_hf(checkpoint.config), shard)
    tensors = ShardedTensors(checkpoint.tensors, splits, shard)
    tally = ArenaTally(Ranks(shard))
    family.model_class(config, tensors, tally, config.max_position_embeddings)
    planned = _weight_bytes(tensors, tensors.numel, config, config.max_position_embeddings, family.model_class, size)
    assert tally.taken <= planned < 3 * tally.taken


def test_the_kv_pool_takes_the_backends_default_share_unless_given(tmp_path, monkeypatch):
    checkpoint = load_checkpoint(write_tiny("llama_tied", tmp_path / "llama"))
    asked = []
    monkeypatch.setattr(CpuRunner, "available_cache_bytes", lambda self, fraction: asked.append(fraction) or 1 << 24)
    engine, info = build_engine(checkpoint, EngineConfig(device="cpu"))
    # 16 MiB over a block of 2 (K, V) x 2 layers x 16 tokens x 2 heads x 32 dims x 4 bytes
    assert asked == [0.25] and engine.cache.blocks.num_blocks == (1 << 24) // (2 * 2 * 16 * 2 * 32 * 4)
    build_engine(checkpoint, EngineConfig(device="cpu", kv_memory_fraction=0.5))
    assert asked[-1] == 0.5
    build_engine(checkpoint, EngineConfig(device="cpu", kv_blocks=7))
    assert len(asked) == 2


def test_info_reports_the_architectures_own_properties(tmp_path):
    _, info = build_engine(load_checkpoint(write_tiny("llama_tied", tmp_path / "llama")),
                           EngineConfig(device="cpu", kv_blocks=8))
    assert (info.hc_mult, info.is_mla, info.has_ssm) == (0, False, False)
