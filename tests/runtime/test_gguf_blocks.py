"""BlockWeight: GGUF blocks parsed bit for bit as gguf.quants.dequantize reads them, its rows as load_gguf leaves
them, and the dequantized tensor wherever a checkpoint tensor is used as one."""

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType, GGUFReader

from metrale.runtime.errors import InvalidArgument
from metrale.runtime.loading.gguf_blocks import KINDS, BlockWeight, kind_of
from metrale.runtime.loading.gguf_file import load_gguf
from block_bytes import quantize, random_blocks
from tiny_gguf import tiny_model, write_tiny_gguf

# A tiny model whose rows are whole K super-blocks of 256.
K_SIZES = dict(hidden_size=256, intermediate_size=512)


def _weights(rows: int, columns: int) -> np.ndarray:
    """Rows of every shape a block meets: random, all zero, one sign only, a single outlier, tiny values."""
    generator = np.random.default_rng(0)
    weight = generator.normal(0.0, 1.0, (rows, columns)).astype(np.float32)
    weight[1] = 0.0
    weight[2] = np.abs(weight[2])
    weight[3] = -np.abs(weight[3])
    weight[4, 5] = 40.0
    weight[5] *= 1e-6
    return weight


def _written(tmp_path, kind: str, weight: np.ndarray):
    """weight quantized to kind (gguf.quants.quantize, or block_bytes' K quantizer where gguf has none), written to
    a GGUF file and read back: the reader's tensor."""
    path = tmp_path / f"{kind}.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("weight", quantize(weight, kind), raw_dtype=GGMLQuantizationType[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return GGUFReader(str(path)).tensors[0]


def _blocks(kind: str, weight: np.ndarray) -> BlockWeight:
    return BlockWeight.from_gguf(kind, quantize(weight, kind), *weight.shape)


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().view(torch.int32)


@pytest.mark.parametrize("kind", KINDS)
def test_dequantize_is_gguf_quants_bit_for_bit(tmp_path, kind):
    tensor = _written(tmp_path, kind, _weights(8, 512))
    blocks = BlockWeight.from_gguf(kind, np.asarray(tensor.data), 8, 512)
    expected = torch.from_numpy(gguf.quants.dequantize(np.asarray(tensor.data), tensor.tensor_type).reshape(8, 512))
    ours = blocks.dequantize()
    assert ours.dtype == torch.float32 and ours.shape == (8, 512)
    assert torch.equal(_bits(ours), _bits(expected))       # -0.0 and +0.0 told apart


@pytest.mark.parametrize("kind", KINDS)
def test_random_blocks_dequantize_as_gguf_quants_bit_for_bit(kind):
    """Every code, 6-bit scale and min and fifth bit a block can hold, not only those a quantizer writes."""
    data = random_blocks(kind, 6, 768, seed=len(kind))
    expected = gguf.quants.dequantize(data, GGMLQuantizationType[kind]).reshape(6, 768)
    assert torch.equal(_bits(BlockWeight.from_gguf(kind, data, 6, 768).dequantize()), _bits(torch.from_numpy(expected)))


@pytest.mark.parametrize("kind", KINDS)
def test_fields_hold_the_block_layout(kind):
    """Codes, scales and mins as the class says: a value is scale q + min (4 and 5 bits) or d q (Q8_0), in column
    order."""
    blocks = _blocks(kind, _weights(8, 256))
    codes = blocks.unpacked_codes()
    scales = blocks.scales.repeat_interleave(32, dim=1)
    if kind == "Q8_0":
        assert blocks.codes.dtype == torch.int8 and blocks.codes.shape == (8, 256) and blocks.mins is None
        rebuilt = codes.float() * scales
    else:
        assert blocks.codes.dtype == torch.uint8 and blocks.codes.shape == (8, 128)
        assert blocks.mins.shape == blocks.scales.shape == (8, 8)
        assert codes.dtype == torch.uint8 and int(codes.max()) < 2 ** blocks.bits
        assert (blocks.high_bits is None) == (blocks.bits == 4)
        assert blocks.bits == 4 or int(codes.max()) >= 16        # the fifth bits are read
        rebuilt = codes.float() * scales + blocks.mins.repeat_interleave(32, dim=1)
    assert torch.equal(rebuilt, blocks.dequantize())
    if kind in ("Q4_0", "Q5_0"):
        assert torch.equal(blocks.mins, -2 ** (blocks.bits - 1) * blocks.scales)


@pytest.mark.parametrize("quant", KINDS)
def test_load_gguf_keeps_blocks_with_llama_cpp_rows_undone(tmp_path, quant):
    model = tiny_model("llama_untied", **K_SIZES)
    path = write_tiny_gguf(tmp_path / "tiny.gguf", "llama_untied", model, GGMLQuantizationType[quant])
    tensors = load_gguf(path).tensors
    for name, weight in model.state_dict().items():
        ours = tensors[name]
        if weight.dim() != 2:
            assert isinstance(ours, torch.Tensor), name
            continue
        assert isinstance(ours, BlockWeight) and ours.kind == quant, name
        # Quantization is per row, so the file's permuted rows, dequantized and put back, are the HF rows'.
        expected = gguf.quants.dequantize(quantize(weight.numpy(), quant), GGMLQuantizationType[quant])
        assert torch.equal(_bits(ours.dequantize()), _bits(torch.from_numpy(expected))), name


@pytest.mark.parametrize("kind", ["Q6_K", "Q2_K", "Q3_K", "F16"])
def test_kinds_with_groups_of_16_are_dequantized(kind):
    assert kind_of(GGMLQuantizationType[kind], (64, 256)) is None
    assert kind_of(GGMLQuantizationType.Q4_K, (64, 256)) == "Q4_K"
    assert kind_of(GGMLQuantizationType.Q4_K, (256,)) is None


def test_a_q4_k_m_mix_keeps_q4_k_blocks_and_dequantizes_q6_k(tmp_path):
    """As llama.cpp's Q4_K_M: Q4_K weights with some in Q6_K."""
    model = tiny_model("llama_tied", **K_SIZES)
    path = write_tiny_gguf(tmp_path / "tiny.gguf", "llama_tied", model, GGMLQuantizationType.Q4_K,
                           {"down_proj": GGMLQuantizationType.Q6_K})
    tensors = load_gguf(path).tensors
    weight = model.state_dict()["model.layers.0.mlp.down_proj.weight"].numpy()
    expected = gguf.quants.dequantize(quantize(weight, "Q6_K"), GGMLQuantizationType.Q6_K)
    ours = tensors["model.layers.0.mlp.down_proj.weight"]
    assert type(ours) is torch.Tensor and ours.dtype == torch.float32
    assert torch.equal(ours, torch.from_numpy(expected))
    up = tensors["model.layers.0.mlp.up_proj.weight"]
    assert isinstance(up, BlockWeight) and up.kind == "Q4_K"


def test_cat_of_one_kind_stays_in_blocks():
    first, second = _blocks("Q4_1", _weights(8, 64)), _blocks("Q4_1", _weights(8, 64)[:4] * 3)
    joined = torch.cat([first, second])
    assert isinstance(joined, BlockWeight) and joined.shape == (12, 64)
    assert torch.equal(joined.dequantize(), torch.cat([first.dequantize(), second.dequantize()]))
    assert isinstance(torch.cat([first, second], dim=-2), BlockWeight)
    # anything else is the dequantized tensors' cat
    other_kind = _blocks("Q8_0", _weights(8, 64)[:4])
    for mixed in (torch.cat([first, other_kind]), torch.cat([first, second.dequantize()]),
                  torch.cat([first, first], dim=1)):
        assert type(mixed) is torch.Tensor
    assert torch.equal(torch.cat([first, other_kind]), torch.cat([first.dequantize(), other_kind.dequantize()]))


def test_select_rows_keeps_blocks():
    blocks = _blocks("Q8_0", _weights(8, 64))
    ids = torch.tensor([5, 0, 5, 7])
    chosen = blocks.select_rows(ids)
    assert isinstance(chosen, BlockWeight) and torch.equal(chosen.dequantize(), blocks.dequantize()[ids])


def test_it_behaves_as_its_dequantized_tensor():
    blocks = _blocks("Q4_0", _weights(8, 64))
    dense = blocks.dequantize()
    assert blocks.shape == (8, 64) and blocks.dim() == 2 and blocks.numel() == 512 and len(blocks) == 8
    assert blocks.dtype == torch.float32 and blocks.size(1) == 64 and blocks.size() == (8, 64)
    # methods, attributes and the CUDA backend's upload (bf16, then its bits as int16)
    assert type(blocks.float()) is torch.Tensor and torch.equal(blocks.float(), dense)
    assert torch.equal(blocks.to(torch.bfloat16).contiguous().view(torch.int16),
                       dense.to(torch.bfloat16).view(torch.int16))
    assert blocks.is_contiguous() and torch.equal(blocks.T, dense.T)
    # operators, both ways round
    assert torch.equal(blocks * 0.5, dense * 0.5) and torch.equal(0.5 * blocks, dense * 0.5)
    assert torch.equal(blocks - dense, torch.zeros_like(dense)) and torch.equal(dense - blocks, torch.zeros_like(dense))
    assert torch.equal(blocks + 1, dense + 1) and torch.equal(-blocks, -dense) and torch.equal(blocks / 2, dense / 2)
    assert torch.equal(blocks[2:5], dense[2:5]) and torch.equal(blocks[torch.tensor([3, 1])], dense[[3, 1]])
    # torch functions
    x = torch.randn(3, 64)
    assert torch.equal(F.linear(x, blocks), F.linear(x, dense)) and torch.equal(x @ blocks.T, x @ dense.T)
    assert torch.equal(torch.stack([blocks, blocks]), torch.stack([dense, dense]))
    assert torch.equal(F.pad(blocks, (0, 0, 0, 2)), F.pad(dense, (0, 0, 0, 2)))
    assert torch.equal(blocks, dense)


@pytest.mark.parametrize("kind, data, rows, columns", [
    ("Q6_K", np.zeros(210, dtype=np.uint8), 1, 256),           # a kind kept as blocks only by others
    ("Q4_K", np.zeros(144, dtype=np.uint8), 1, 128),           # not whole super-blocks of 256 a row
    ("Q8_0", np.zeros(33, dtype=np.uint8), 1, 32),             # a block is 34 bytes
    ("Q4_1", np.zeros(20, dtype=np.uint8), 1, 48),             # not whole blocks a row
])
def test_bad_blocks_are_invalid_argument(kind, data, rows, columns):
    with pytest.raises(InvalidArgument):
        BlockWeight.from_gguf(kind, data, rows, columns)


def test_fields_that_do_not_fit_are_invalid_argument():
    scales = torch.ones(4, 2)
    with pytest.raises(InvalidArgument, match="do not fit"):
        BlockWeight("Q4_1", torch.zeros(4, 64, dtype=torch.uint8), scales, scales)     # Q4 codes: two a byte
    with pytest.raises(InvalidArgument, match="mins"):
        BlockWeight("Q8_0", torch.zeros(4, 64, dtype=torch.int8), scales, scales)
    with pytest.raises(InvalidArgument, match="not one of"):
        BlockWeight("Q6_K", torch.zeros(4, 32, dtype=torch.uint8), scales, scales)
    with pytest.raises(InvalidArgument, match="high bits"):
        BlockWeight("Q5_1", torch.zeros(4, 32, dtype=torch.uint8), scales, scales)      # its fifth bits missing
    with pytest.raises(InvalidArgument, match="high bits"):
        BlockWeight("Q4_K", torch.zeros(4, 32, dtype=torch.uint8), scales, scales, torch.zeros(4, 8, dtype=torch.uint8))
