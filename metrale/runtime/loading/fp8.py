"""FP8 checkpoints as published (config.json's quantization_config, quant_method "fp8": DeepSeek-V3/V3.2, Kimi-K2,
Qwen3's FP8 releases): float8 weights, each with a float32 weight_scale_inv, one a weight_block_size block (128 x
128 in those releases) or one for the whole tensor; dequantized (weight x its block's scale, float32) when a model
takes the weight. Every other quantization scheme is refused at load, by name."""

from collections.abc import Iterator, Mapping

import torch

from metrale.runtime.errors import InvalidArgument

SCALE = "_scale_inv"


def dequantized(tensors: Mapping[str, torch.Tensor], quantization: dict) -> Mapping[str, torch.Tensor]:
    """The checkpoint's tensors with its FP8 weights dequantized, for a quantization_config (InvalidArgument where
    the scheme is not FP8 with inverse scales)."""
    method = quantization.get("quant_method")
    if method != "fp8":
        raise InvalidArgument(f"quantization scheme {method!r} is not supported (fp8 with weight_scale_inv is)")
    if quantization.get("fmt", "e4m3") not in ("e4m3", "e5m2"):
        raise InvalidArgument(f"fp8 format {quantization['fmt']!r} is not supported (e4m3, e5m2 are)")
    block = quantization.get("weight_block_size")
    if block is not None and (len(block) != 2 or min(block) < 1):
        raise InvalidArgument(f"weight_block_size {block} must be two positive sizes")
    return Fp8Tensors(tensors, tuple(block) if block else None)


class Fp8Tensors(Mapping):
    """name -> tensor, each float8 weight with a scale dequantized as it is read; the scales themselves hidden."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], block: tuple[int, int] | None):
        self.tensors, self.block = tensors, block
        self.names = [name for name in tensors if not name.endswith(SCALE)]

    def __getitem__(self, name: str) -> torch.Tensor:
        tensor = self.tensors[name]
        if tensor.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) and name + SCALE in self.tensors:
            return dequantize(tensor, self.tensors[name + SCALE], self.block)
        return tensor

    def __contains__(self, name) -> bool:
        return name in self.tensors and not name.endswith(SCALE)

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)

    def numel(self, name: str) -> int:
        numel = getattr(self.tensors, "numel", None)
        return numel(name) if numel is not None else self.tensors[name].numel()


def dequantize(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] | None) -> torch.Tensor:
    """weight [out, in] (float8) x its scale: scale_inv [ceil(out / block[0]), ceil(in / block[1])] one a block, or
    one for the whole weight (a single value) -> float32."""
    scale = scale_inv.float()
    if scale.numel() > 1:
        if block is None or weight.dim() != 2:
            raise InvalidArgument(f"a {tuple(weight.shape)} fp8 weight with {tuple(scale.shape)} scales needs 2-D "
                                  f"blocks (weight_block_size)")
        rows, cols = weight.shape
        expected = (-(-rows // block[0]), -(-cols // block[1]))
        if tuple(scale.shape) != expected:
            raise InvalidArgument(f"a {tuple(weight.shape)} fp8 weight in {block} blocks has {expected} scales, "
                                  f"not {tuple(scale.shape)}")
        scale = scale.repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
    return weight.float() * scale.reshape(scale.shape if scale.numel() > 1 else ())
