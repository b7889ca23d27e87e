"""What the CUDA model and beam tests share: tiny checkpoints at a trained model's weight scale on a CUDA
engine, their inputs, and reading bf16 results back (the fixtures over them are in conftest.py)."""

import numpy as np
import torch

from metrale.runtime.build import build_engine
from metrale.runtime.config import EngineConfig
from metrale.runtime.loading import load_checkpoint

SOURCES = [[5, 17, 99, 3, 42, 2], [7, 8, 150, 33, 61, 90, 14, 77, 101, 12, 2], [250, 2], [4, 66, 31] * 6 + [2]]
START = 2
# Weights at a trained model's scale (bf16 rounding stays bf16-sized), the LM head's logits spread enough that
# beam search has decisions clearer than bf16 noise.
WEIGHTS = dict(weight_std=0.08, norm_std=0.1)


def engine_on_cuda(directory, tmp_path):
    return build_engine(load_checkpoint(directory), EngineConfig(device="cuda", kv_blocks=512, kv_block_size=16,
                                                                 max_batch_tokens=512, max_seqs=64),
                        cache_dir=tmp_path / "cache")


def with_references(directory, tmp_path, load) -> tuple:
    """(engine, info, transformers' float32 model, its bf16 model) over one checkpoint."""
    engine, info = engine_on_cuda(directory, tmp_path)
    return (engine, info, load(directory, dtype=torch.float32).cuda().eval(),
            load(directory, dtype=torch.bfloat16).cuda().eval())


def as_float(bf16: np.ndarray) -> torch.Tensor:
    """bf16 bits (as copied back) as float32 values."""
    return torch.from_numpy((bf16.astype(np.uint32) << 16).view(np.float32))
