"""Which FP8 weights the CUDA backend keeps in FP8 (fp8_matrix.py), that their linears are never split along K, and
the stream buffer their quantized inputs take, without a GPU."""

import json

import torch

from metrale.runtime.backend.cuda.fp8_matrix import Fp8Matrix, kept_as_fp8
from metrale.runtime.backend.cuda.linears import k_splits
from metrale.runtime.backend.cuda.tensor import DeviceTensor
from metrale.runtime.build import _memory_shapes
from metrale.runtime.config import EngineConfig
from metrale.runtime.loading.deferred_weight import DeferredWeight
from metrale.runtime.loading.fp8 import Fp8Weight, is_linear_weight, quantize_rows
from metrale.runtime.models import family_of
from tiny_models import write_tiny


class NeverDequantized(DeferredWeight):
    """A GGUF-like weight that fails if anything makes it dequantize itself."""

    def __init__(self):
        self.shape = torch.Size((48, 64))

    def dequantize(self):
        raise AssertionError("dequantized")


def test_one_scale_a_row_in_e4m3_is_kept_on_hopper_with_cublas_12_9():
    weight = quantize_rows(torch.randn(48, 64))
    assert kept_as_fp8(weight, "sm_90a", 130100) and kept_as_fp8(weight, "sm_100a", 120900)
    assert not kept_as_fp8(weight, "sm_89", 130100)                        # no OUTER_VEC_32F scales on Ada
    assert not kept_as_fp8(weight, "sm_90a", 120800)                       # nor before cuBLAS 12.9
    assert not kept_as_fp8(quantize_rows(torch.randn(48, 40)), "sm_90a", 130100)      # K not a multiple of 16
    blocks = Fp8Weight(weight.data, torch.ones(48, 2), 32)                  # a scale a block of 32 columns
    assert not kept_as_fp8(blocks, "sm_90a", 130100)
    e5m2 = Fp8Weight(weight.data.float().to(torch.float8_e5m2), weight.scales, 64)
    assert not kept_as_fp8(e5m2, "sm_90a", 130100)
    assert not kept_as_fp8(torch.randn(48, 64), "sm_90a", 130100)
    assert not kept_as_fp8(NeverDequantized(), "sm_90a", 130100)


def test_quantize_fp8_leaves_tables_as_they_are():
    assert not any(is_linear_weight(name, torch.randn(8, 16)) for name in (
        "model.shared.weight", "model.embed_tokens.weight", "lm_head.weight", "model.layers.0.mlp.gate.weight"))
    assert is_linear_weight("model.layers.0.mlp.shared_experts.up_proj.weight", torch.randn(8, 16))


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
