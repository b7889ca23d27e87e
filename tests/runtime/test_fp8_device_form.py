"""Which FP8 weights the CUDA backend keeps in FP8 (fp8_matrix.py), that their linears are never split along K, and
the stream buffer their quantized inputs take, without a GPU."""

import json

import torch

from metrale.runtime.backend.cuda.fp8_matrix import Fp8Matrix, kept_as_fp8
from metrale.runtime.backend.cuda.linears import k_splits
from metrale.runtime.backend.cuda.tensor import DeviceTensor
from metrale.runtime.build import _memory_shapes
from metrale.runtime.config import EngineConfig
from metrale.runtime.loading.fp8 import Fp8Weight, quantize_rows
from metrale.runtime.models import family_of
from tiny_models import write_tiny


def test_one_scale_a_row_in_e4m3_is_kept_on_fp8_hardware():
    weight = quantize_rows(torch.randn(48, 64))
    assert kept_as_fp8(weight, "sm_90a") and kept_as_fp8(weight, "sm_89")
    assert not kept_as_fp8(weight, "sm_80")                                   # no FP8 conversions or tensor cores
    assert not kept_as_fp8(quantize_rows(torch.randn(48, 40)), "sm_90a")      # K not a multiple of 16
    blocks = Fp8Weight(weight.data, torch.ones(48, 2), 32)                    # a scale a block of 32 columns
    assert not kept_as_fp8(blocks, "sm_90a")
    e5m2 = Fp8Weight(weight.data.float().to(torch.float8_e5m2), weight.scales, 64)
    assert not kept_as_fp8(e5m2, "sm_90a")
    assert not kept_as_fp8(torch.randn(48, 64), "sm_90a")


def test_an_fp8_linear_is_never_split_along_k():
    bf16 = DeviceTensor(1 << 20, (4096, 4096), "bfloat16")
    fp8 = Fp8Matrix(DeviceTensor(1 << 20, (4096, 4096), "float8_e4m3"), DeviceTensor(1 << 24, (4096,), "float32"))
    assert k_splits(64, bf16) > 1 and k_splits(64, fp8) == 1


def test_fp8_weights_give_each_stream_a_buffer_for_the_widest_input(tmp_path):
    hf = json.loads((write_tiny("llama3_untied", tmp_path) / "config.json").read_text())
    c = family_of(hf).config_from_hf(hf)
    engine = EngineConfig(device="cpu", max_batch_tokens=64)
    assert _memory_shapes(c, engine, 512).fp8_width == 0
    assert _memory_shapes(c, engine, 512, fp8=True).fp8_width == max(c.hidden_size, c.intermediate_size,
                                                                      c.num_heads * c.head_dim)
