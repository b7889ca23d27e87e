"""FP8 checkpoints as published (fp8_schemes.py says which configs): float8 weights, each with its scales, one for
the whole weight, one a row, or one a block (128 x 128 in DeepSeek's and Qwen3's releases). A model takes each as an
Fp8Weight, which stands in for the dequantized tensor (weight x its scale, float32) and keeps its FP8 form through
row picks and stacks up to the backend's upload. And --quantize fp8: a checkpoint's linear weights made Fp8Weights
as they are read."""

import math
from collections.abc import Iterator, Mapping

import torch

from metrale.runtime.errors import InvalidArgument
from metrale.runtime.loading.checkpoint import shape_of
from metrale.runtime.loading.deferred_weight import DeferredWeight
from metrale.runtime.loading.fp8_schemes import ASIDE, WEIGHT_SCALES, Fp8Scheme, fp8_scheme

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
# The block columns of the scales a GPU keeps (cuda/fp8_matrix.py's BLOCK: DeepSeek's and Qwen3's 128 x 128).
KEPT_BLOCK = 128
# The multiple of 16 columns a GPU keeps a weight with a scale a row in (cuda/fp8_matrix.py's K_MULTIPLE).
KEPT_K_MULTIPLE = 16


def dequantized(tensors: Mapping[str, torch.Tensor], quantization: dict) -> Mapping[str, torch.Tensor]:
    """The checkpoint's tensors with its FP8 weights as Fp8Weights, for a quantization_config (InvalidArgument where
    the scheme is not FP8 weights with their scales)."""
    return Fp8Tensors(tensors, fp8_scheme(quantization))


class TensorsAsRead(Mapping):
    """name -> a checkpoint's tensor as read() makes it (a subclass's), over the names kept() keeps."""

    def __init__(self, tensors: Mapping[str, torch.Tensor]):
        self.tensors = tensors
        self.names = [name for name in tensors if self.kept(name)]

    def kept(self, name: str) -> bool:
        return True

    def read(self, name: str, tensor: torch.Tensor):
        return tensor

    def __getitem__(self, name: str):
        return self.read(name, self.tensors[name])

    def __contains__(self, name) -> bool:
        return name in self.tensors and self.kept(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)

    def shape(self, name: str) -> tuple[int, ...]:
        """The tensor's shape as read, from the mapping beneath without reading it where that can say."""
        return shape_of(self.tensors, name)

    def numel(self, name: str) -> int:
        return math.prod(self.shape(name))

    def holds_fp8(self, name: str) -> bool:
        """Whether the tensor is read as an FP8 weight (as the checkpoint holds it)."""
        return getattr(self.tensors, "holds_fp8", lambda name: False)(name)


class Fp8Tensors(TensorsAsRead):
    """Each float8 weight with its scale (weight_scale_inv or weight_scale) as an Fp8Weight, dequantized where it is
    not 2-D; the weights' scales and the static input scales (which no backend takes) hidden."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], scheme: Fp8Scheme):
        self.scheme, self.block = scheme, scheme.block
        super().__init__(tensors)

    def kept(self, name: str) -> bool:
        return not name.endswith(ASIDE) and not any(name.endswith(".weight" + s) for s in WEIGHT_SCALES)

    def scale_name(self, name: str) -> str | None:
        """The name of weight `name`'s scale, None where it has none."""
        return next((name + s for s in WEIGHT_SCALES if name + s in self.tensors), None)

    def holds_fp8(self, name: str) -> bool:
        """A 2-D e4m3 weight with one scale, one a row (a block as wide as the weight too), or one a block of
        KEPT_BLOCK columns (a whole number of them a row), by the headers: what a Hopper GPU keeps in FP8."""
        scale, shape = self.scale_name(name), self.shape(name)
        if scale is None or len(shape) != 2 or self.scheme.fmt != "e4m3":
            return False
        scale_shape = self.shape(scale)
        if math.prod(scale_shape) == 1:
            return True
        if self.block is None:
            return scale_shape in ((shape[0],), (shape[0], 1))
        # One block across the columns is one scale a row.
        one_block = shape[1] <= self.block[1] and shape[1] % KEPT_K_MULTIPLE == 0
        return one_block or (self.block[1] == KEPT_BLOCK and shape[1] % KEPT_BLOCK == 0)

    def read(self, name: str, tensor: torch.Tensor):
        if tensor.dtype not in FP8_DTYPES:
            return tensor
        scale = self.scale_name(name)
        if scale is None:
            names = " or ".join(name + suffix for suffix in WEIGHT_SCALES)
            raise InvalidArgument(f"{name} is {tensor.dtype} without a scale ({names})")
        if tensor.dim() == 2:
            return Fp8Weight.of_checkpoint(tensor, self.tensors[scale], self.block)
        return dequantize(tensor, self.tensors[scale], self.block)


# --quantize fp8: which checkpoint tensors are a linear layer's weight. Every 2-D floating weight whose name does not
# name one of these: embeddings and the LM head (a table and the logits; M2M100's is "model.shared"), norms, MoE
# routers (".gate.weight": their choice is a ranking of close scores), the indexer's head weights (taken in float32).
NOT_LINEAR = ("embed", "lm_head", "norm", ".gate.weight", "router", "weights_proj", "model.shared.weight")
E4M3_MAX = 448.0


def to_e4m3(x: torch.Tensor) -> torch.Tensor:
    """x (already over its scale) rounded to nearest e4m3, ties to even, saturated at +-E4M3_MAX."""
    return x.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


class QuantizedTensors(TensorsAsRead):
    """Each linear weight as an Fp8Weight (e4m3, one scale a row: its largest magnitude over E4M3_MAX), and a
    mixture's stacked experts as an Fp8Experts of the same, quantized as they are read; the rest as they are."""

    def read(self, name: str, tensor: torch.Tensor):
        if is_linear_weight(name, tensor):
            return quantize_rows(tensor)
        if is_stacked_experts(name, tensor):
            return quantize_experts(tensor)
        return tensor


def widest_fp8_input(tensors: Mapping, quantize: bool) -> int:
    """The most columns (a linear's input width) of a weight that may be FP8 on the device, 0 if none: every linear
    weight --quantize fp8 quantizes (quantize), or that the checkpoint holds in FP8. A bound from names and shapes;
    nothing is read. A model's FP8 upload keeps its checkpoint weight's columns (rows are picked and joined,
    anything else dequantizes), so its input is never wider."""
    held = getattr(tensors, "holds_fp8", lambda name: False)
    widths = [shape[1] for name in tensors if len(shape := shape_of(tensors, name)) == 2
              and ((quantize and is_linear_name(name)) or held(name))]
    return max(widths, default=0)


def is_linear_name(name: str) -> bool:
    """A name --quantize fp8 may quantize (the tensor must also be a 2-D floating weight: is_linear_weight)."""
    return name.endswith(".weight") and not any(key in name for key in NOT_LINEAR)


# A mixture's experts as transformers 5 holds them, stacked [experts, rows, columns] under one name a projection.
STACKED_EXPERTS = ("experts.gate_up_proj", "experts.up_proj", "experts.down_proj")


def is_stacked_experts(name: str, tensor) -> bool:
    """Whether --quantize fp8 quantizes this checkpoint tensor as stacked experts (floating, of 16 bits or more)."""
    return (name.endswith(STACKED_EXPERTS) and isinstance(tensor, torch.Tensor) and tensor.dim() == 3
            and tensor.dtype.is_floating_point and tensor.element_size() >= 2)


def is_linear_weight(name: str, tensor) -> bool:
    """Whether --quantize fp8 quantizes this checkpoint tensor: a linear layer's 2-D weight, floating (of 16 bits or
    more) or in GGUF's blocks (quantized from its dequantized values); never one already FP8."""
    if not is_linear_name(name):
        return False
    if isinstance(tensor, DeferredWeight):
        return not isinstance(tensor, Fp8Weight) and len(tensor.shape) == 2
    return (isinstance(tensor, torch.Tensor) and tensor.dim() == 2 and tensor.dtype.is_floating_point
            and tensor.element_size() >= 2)


def quantize_rows(weight: torch.Tensor) -> "Fp8Weight":
    """weight [rows, columns] as e4m3 with one float32 scale a row: amax / E4M3_MAX (1 for a row of zeros), each
    element weight / scale rounded to nearest."""
    values = weight.float()
    scale = values.abs().amax(dim=1, keepdim=True) / E4M3_MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return Fp8Weight(to_e4m3(values / scale), scale, weight.shape[1])


def quantize_experts(weight: torch.Tensor) -> "Fp8Experts":
    """Stacked experts [experts, rows, columns] as quantize_rows quantizes each expert's matrix (one at a time: the
    host holds one expert's float32 copy, not the layer's)."""
    each = [quantize_rows(expert) for expert in weight]
    return Fp8Experts(torch.stack([w.data for w in each]), torch.stack([w.scales for w in each]), weight.shape[2])


def dequantize(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None) -> torch.Tensor:
    """weight (float8) x its scale -> float32. scale: one value for the whole weight; or for a 2-D weight [out, in],
    one a row ([out] or [out, 1]) or one a block ([ceil(out / block[0]), ceil(in / block[1])]); a weight of more
    dimensions takes a scale that broadcasts over it (one a matrix of a stack, or one for all)."""
    scale = scale.float()
    if scale.numel() == 1:
        return weight.float() * scale.reshape(())
    if weight.dim() == 2:
        return Fp8Weight.of_checkpoint(weight, scale, block).dequantize()
    try:
        torch.broadcast_shapes(weight.shape, scale.shape)
    except RuntimeError:
        raise InvalidArgument(f"a {tuple(weight.shape)} fp8 weight's {tuple(scale.shape)} scales do not broadcast "
                              f"over it") from None
    return weight.float() * scale


class Fp8Weight(DeferredWeight):
    """A 2-D FP8 weight [rows, columns]: data float8 (e4m3 or e5m2) and scales float32 [rows, ceil(columns /
    block)], element (r, c) being data[r, c] x scales[r, c // block]. A checkpoint's 128 x 128 block scales are held
    a row each (each of a block's rows repeats its block's), a per-tensor scale as one block of the whole width, so
    rows can be picked (weight[ids], ids an int64 tensor) and stacked (torch.cat of Fp8Weights of one block and
    width) as they are. dequantize() is dequantize()'s above, bit for bit."""

    OWN = ("data", "scales", "block", "shape")

    def __init__(self, data: torch.Tensor, scales: torch.Tensor, block: int):
        rows, columns = data.shape
        if data.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2) or scales.dtype != torch.float32 \
                or block < 1 or tuple(scales.shape) != (rows, -(-columns // block)):
            raise InvalidArgument(f"an FP8 weight {tuple(data.shape)} {data.dtype} with scales {tuple(scales.shape)} "
                                  f"{scales.dtype} in blocks of {block} columns does not fit together")
        self.data, self.scales, self.block, self.shape = data, scales, block, torch.Size((rows, columns))

    @classmethod
    def of_checkpoint(cls, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None
                      ) -> "Fp8Weight":
        """A checkpoint's 2-D weight and its scale (as dequantize() takes them): one for the whole weight, one a row
        ([rows] or [rows, 1], where the checkpoint has no blocks), or one a block."""
        rows, columns = weight.shape
        scale = scale.float()
        if scale.numel() == 1:
            return cls(weight, scale.reshape(1, 1).expand(rows, 1).contiguous(), columns)
        if block is None and tuple(scale.shape) in ((rows,), (rows, 1)):
            return cls(weight, scale.reshape(rows, 1).contiguous(), columns)
        _check_blocks(weight, scale, block)
        return cls(weight, scale.repeat_interleave(block[0], 0)[:rows].contiguous(), block[1])

    def dequantize(self) -> torch.Tensor:
        scale = self.scales.repeat_interleave(self.block, 1)[:, :self.shape[1]]
        return self.data.float() * scale

    def __getitem__(self, index):
        if isinstance(index, torch.Tensor) and index.dim() == 1 and index.dtype == torch.int64:
            return Fp8Weight(self.data[index], self.scales[index], self.block)
        return self.dequantize()[index]

    def __mul__(self, other):
        """A number times the weight stays FP8, its scales multiplied (a model's folded constant: DeepSeek's o_proj
        times its residual scale, 1.0); anything else is the dequantized tensor's product."""
        if isinstance(other, (int, float)) and not isinstance(other, bool):
            return Fp8Weight(self.data, self.scales * other, self.block)
        return super().__mul__(other)

    __rmul__ = __mul__

    def __repr__(self) -> str:
        return f"Fp8Weight({self.data.dtype}, {list(self.shape)}, blocks of {self.block})"

    def joins(self, other: DeferredWeight) -> bool:
        return (other.data.dtype, other.block, other.shape[1]) == (self.data.dtype, self.block, self.shape[1])

    @classmethod
    def joined(cls, weights: list["Fp8Weight"]) -> "Fp8Weight":
        return cls(torch.cat([w.data for w in weights]), torch.cat([w.scales for w in weights]), weights[0].block)

    @classmethod
    def stacked(cls, weights: list["Fp8Weight"]) -> "Fp8Experts":
        return Fp8Experts(torch.stack([w.data for w in weights]), torch.stack([w.scales for w in weights]),
                          weights[0].block)


class Fp8Experts(DeferredWeight):
    """A mixture's experts' FP8 weights stacked (torch.stack of Fp8Weights of one block and shape): data [experts,
    rows, columns] and scales [experts, rows, ceil(columns / block)], each expert as its Fp8Weight. rows(order) picks
    every expert's rows in one order (the CUDA backend's interleaved gate and up rows) in the form."""

    OWN = ("data", "scales", "block", "shape")

    def __init__(self, data: torch.Tensor, scales: torch.Tensor, block: int):
        experts, rows, columns = data.shape
        if scales.dtype != torch.float32 or block < 1 or tuple(scales.shape) != (experts, rows, -(-columns // block)):
            raise InvalidArgument(f"FP8 experts {tuple(data.shape)} with scales {tuple(scales.shape)} "
                                  f"{scales.dtype} in blocks of {block} columns do not fit together")
        self.data, self.scales, self.block, self.shape = data, scales, block, data.shape

    def dim(self) -> int:
        return 3

    def numel(self) -> int:
        return self.data.numel()

    def dequantize(self) -> torch.Tensor:
        """Expert by expert (Fp8Weight.dequantize's values): no float32 copy of every scale a value at once."""
        return torch.stack([Fp8Weight(data, scales, self.block).dequantize()
                            for data, scales in zip(self.data, self.scales)])

    def rows(self, order: torch.Tensor) -> "Fp8Experts":
        return Fp8Experts(self.data[:, order], self.scales[:, order], self.block)

    def __repr__(self) -> str:
        return f"Fp8Experts({self.data.dtype}, {list(self.shape)}, blocks of {self.block})"


def _check_blocks(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None) -> None:
    """scale: one a block of weight's."""
    if block is None or weight.dim() != 2:
        raise InvalidArgument(f"a {tuple(weight.shape)} fp8 weight with {tuple(scale.shape)} scales: not one, one a "
                              f"row, nor one a block (the config gives no block size)")
    rows, cols = weight.shape
    expected = (-(-rows // block[0]), -(-cols // block[1]))
    if tuple(scale.shape) != expected:
        raise InvalidArgument(f"a {tuple(weight.shape)} fp8 weight in {block} blocks has {expected} scales, "
                              f"not {tuple(scale.shape)}")
