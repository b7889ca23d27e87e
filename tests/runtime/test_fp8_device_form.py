"""Which FP8 weights the CUDA backend keeps in FP8 (fp8_matrix.py), that their linears are never split along K, and
the stream buffer their quantized inputs take, without a GPU."""

import json
from collections.abc import Mapping

import pytest
import torch
from safetensors.torch import load_file

from metrale.runtime.backend.cuda.fp8_matrix import Fp8Matrix, device_scales, kept_as_fp8
from metrale.runtime.backend.cuda.linears import k_splits
from metrale.runtime.backend.cuda.tensor import DeviceTensor
from metrale.runtime.build import _memory_shapes
from metrale.runtime.config import EngineConfig
from metrale.runtime.loading.deferred_weight import DeferredWeight
from metrale.runtime.loading import load_checkpoint
from metrale.runtime.loading.checkpoint import shape_of
from metrale.runtime.loading.fp8 import Fp8Weight, is_linear_weight, quantize_rows, widest_fp8_input
from metrale.runtime.loading.hf_dir import load_tensors
from metrale.runtime.models import family_of
from metrale.runtime.parallel.group import Shard
from metrale.runtime.parallel.sharding import COLUMNS, ROWS, ShardedTensors
from fp8_checkpoints import write_compressed, write_fp8
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


def test_a_scale_a_row_per_128_columns_is_kept_where_k_is_a_multiple_of_128():
    """A release's 128 x 128 block scales, as Fp8Weight holds them (a block's scale on each of its rows): kept, the
    device's scales [K / 128, N], a column block's together."""
    data = torch.randn(300, 384).to(torch.float8_e4m3fn)
    scales = torch.rand(3, 3) + 0.5
    weight = Fp8Weight.of_checkpoint(data, scales, (128, 128))
    assert kept_as_fp8(weight, "sm_90a", 130100) and not kept_as_fp8(weight, "sm_89", 130100)
    assert torch.equal(device_scales(weight), scales.repeat_interleave(128, 0)[:300].T)
    rows = quantize_rows(torch.randn(48, 64))
    assert torch.equal(device_scales(rows), rows.scales[:, 0])                # a scale a row: [N]
    ragged = Fp8Weight.of_checkpoint(torch.randn(300, 320).to(torch.float8_e4m3fn), torch.ones(3, 3), (128, 128))
    assert not kept_as_fp8(ragged, "sm_90a", 130100)                         # K = 320: a partial last block


def test_a_mixture_s_experts_stack_in_fp8_and_are_kept_interleaved():
    """torch.stack of FP8 experts (as models/moe.py stacks them) stays FP8, and so does the CUDA backend's
    interleaving of their gate and up rows; kept on Hopper with one scale a row."""
    from metrale.runtime.backend.cuda.kernels.moe import interleave_gate_up
    from metrale.runtime.loading.fp8 import Fp8Experts

    experts = [torch.cat([quantize_rows(torch.randn(16, 64)), quantize_rows(torch.randn(16, 64))]) for _ in range(3)]
    stacked = torch.stack(experts)
    assert isinstance(stacked, Fp8Experts) and stacked.shape == (3, 32, 64)
    assert torch.equal(stacked.dequantize(), torch.stack([e.dequantize() for e in experts]))
    interleaved = interleave_gate_up(stacked)
    assert isinstance(interleaved, Fp8Experts)
    assert torch.equal(interleaved.dequantize(), interleave_gate_up(stacked.dequantize()))
    assert kept_as_fp8(interleaved, "sm_90a", 0) and not kept_as_fp8(interleaved, "sm_89", 0)
    assert device_scales(interleaved).shape == (3, 32)
    assert torch.equal(stacked.to(torch.bfloat16), stacked.dequantize().bfloat16())     # the CPU backend's upload
    mixed = [experts[0], Fp8Weight(experts[1].data, torch.ones(32, 2), 32)]            # unlike blocks: dequantized
    assert isinstance(torch.stack(mixed), torch.Tensor)


def test_a_release_s_experts_in_128_x_128_blocks_stack_and_are_kept_where_k_is_a_multiple_of_128():
    """Experts as DeepSeek's and Qwen3's FP8 releases hold them (a block's scale on each of its rows): stacked in
    FP8, interleaved rows and all, their device scales [E, K / 128, N] (an expert's column block's N together)."""
    from metrale.runtime.backend.cuda.kernels.moe import interleave_gate_up
    from metrale.runtime.loading.fp8 import Fp8Experts

    def expert(rows: int, columns: int) -> Fp8Weight:
        return Fp8Weight.of_checkpoint(torch.randn(rows, columns).to(torch.float8_e4m3fn),
                                       torch.rand(-(-rows // 128), -(-columns // 128)) + 0.5, (128, 128))

    experts = [expert(160, 256) for _ in range(3)]
    stacked = interleave_gate_up(torch.stack(experts))
    assert isinstance(stacked, Fp8Experts) and stacked.shape == (3, 160, 256)
    assert torch.equal(stacked.dequantize(), interleave_gate_up(torch.stack([e.dequantize() for e in experts])))
    assert kept_as_fp8(stacked, "sm_90a", 0) and not kept_as_fp8(stacked, "sm_89", 0)
    scales = device_scales(stacked)
    assert scales.shape == (3, 2, 160) and scales.is_contiguous()
    assert torch.equal(scales, stacked.scales.transpose(1, 2))
    assert not kept_as_fp8(torch.stack([expert(160, 320) for _ in range(2)]), "sm_90a", 0)  # a partial last block
    narrow = torch.stack([expert(160, 128) for _ in range(2)])               # one block across: a scale a row
    assert kept_as_fp8(narrow, "sm_90a", 0) and device_scales(narrow).shape == (2, 160)


@pytest.mark.parametrize("strategy, kept", [("tensor", True), ("channel", True), ("block", False)])
def test_published_fp8_with_a_scale_a_row_or_for_all_stays_fp8(strategy, kept, tmp_path):
    """llm-compressor's FP8 by tensor or channel reaches a Hopper device in FP8 (one scale a row); block scales go
    dequantized."""
    tensors = load_checkpoint(write_compressed("llama3_untied", tmp_path, strategy, torch.bfloat16)).tensors
    weights = [tensors[key] for key in tensors if key.endswith("proj.weight")]
    assert weights and all(kept_as_fp8(w, "sm_90a", 130100) == kept for w in weights)


def test_quantize_fp8_leaves_tables_as_they_are():
    assert not any(is_linear_weight(name, torch.randn(8, 16)) for name in (
        "model.shared.weight", "model.embed_tokens.weight", "lm_head.weight", "model.layers.0.mlp.gate.weight"))
    assert is_linear_weight("model.layers.0.mlp.shared_experts.up_proj.weight", torch.randn(8, 16))


def test_an_fp8_linear_is_never_split_along_k():
    bf16 = DeviceTensor(1 << 20, (4096, 4096), "bfloat16")
    fp8 = Fp8Matrix(DeviceTensor(1 << 20, (4096, 4096), "float8_e4m3"), DeviceTensor(1 << 24, (4096,), "float32"))
    assert k_splits(64, bf16) > 1 and k_splits(64, fp8) == 1


def test_fp8_weights_give_each_stream_a_buffer_for_the_widest_input(tmp_path):
    """The buffer is as wide as the widest linear input that may be FP8, from the files' headers (no tensor read):
    for a latent-attention model that is a linear's columns, far under the layer's activation sums."""
    engine = EngineConfig(device="cpu", max_batch_tokens=64)
    for name in ("llama3_untied", "deepseek_v3"):
        directory = write_tiny(name, tmp_path / name)
        hf = json.loads((directory / "config.json").read_text())
        c = family_of(hf).config_from_hf(hf)
        tensors = load_tensors(directory)
        linears = [w for key, w in load_file(directory / "model.safetensors").items() if is_linear_weight(key, w)]
        widest = widest_fp8_input(Unread(tensors), quantize=True)
        assert widest == max(w.shape[1] for w in linears)
        assert widest_fp8_input(tensors, quantize=False) == 0
        assert _memory_shapes(c, engine, 512).fp8_width == 0
        assert _memory_shapes(c, engine, 512, widest).fp8_width == widest
    assert widest < _memory_shapes(c, engine, 512).latent_width                  # deepseek_v3's
    # A checkpoint's own FP8 weights count where a GPU keeps them in FP8 (one scale a row), and nothing else: block
    # scales upload dequantized, so they need no buffer.
    held = load_checkpoint(write_compressed("deepseek_v3", tmp_path / "held", "channel")).tensors
    fp8_keys = [key for key in held if key.endswith("proj.weight")]              # write_compressed's rule
    assert all(held.holds_fp8(key) == (key in fp8_keys) for key in held)
    assert widest_fp8_input(held, quantize=False) == max(shape_of(held, key)[1] for key in fp8_keys)
    blocks = load_checkpoint(write_fp8("deepseek_v3", tmp_path / "blocks")).tensors
    assert widest_fp8_input(blocks, quantize=False) == 0
    # Blocks of 128 columns are kept where K is a whole number of them.
    blocks = load_checkpoint(write_fp8("qwen3", tmp_path / "blocks128", block=(128, 128))).tensors
    kept = [key for key in blocks if key.endswith("proj.weight") and shape_of(blocks, key)[1] % 128 == 0]
    assert kept and all(blocks.holds_fp8(key) == (key in kept) for key in blocks)
    assert widest_fp8_input(blocks, quantize=False) == max(shape_of(blocks, key)[1] for key in kept)


class Unread(Mapping):
    """A checkpoint's tensors that fail if one is read: shapes come from its headers."""

    def __init__(self, tensors):
        self.tensors = tensors

    def __getitem__(self, name):
        raise AssertionError(f"{name} read")

    def __iter__(self):
        return iter(self.tensors)

    def __len__(self):
        return len(self.tensors)

    def shape(self, name):
        return self.tensors.shape(name)


def test_a_sharded_tensor_has_its_part_s_shape(tmp_path):
    directory = write_tiny("llama3_untied", tmp_path)
    tensors = load_tensors(directory)
    splits = {"q_proj.weight": COLUMNS, "o_proj.weight": ROWS, "o_proj.bias": ROWS}
    sharded = ShardedTensors(tensors, splits, Shard(rank=1, size=2))
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.o_proj.weight",
                 "model.norm.weight"):
        assert sharded.shape(name) == tuple(sharded[name].shape)
        assert sharded.numel(name) == sharded[name].numel()
