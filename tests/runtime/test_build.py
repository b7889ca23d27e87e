"""build_engine: the KV pool's size where no block count is given, and what Info reports of the architecture."""

from metrale.runtime.backend.cpu import CpuRunner
from metrale.runtime.build import build_engine
from metrale.runtime.config import EngineConfig
from metrale.runtime.loading import load_checkpoint
from tiny_models import write_tiny


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
