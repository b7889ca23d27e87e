"""Which FP8 checkpoint a config.json's quantization_config describes, read into one Fp8Scheme; every other scheme is
refused by name. Two families of configs publish FP8 weights:

- quant_method "fp8": DeepSeek-V3/V3.2, Kimi-K2 and Qwen3's FP8 releases (e4m3 weights, a float32
  weight_scale_inv for each weight_block_size block, 128 x 128), and the AutoFP8 / vLLM serialization (a
  weight_scale for the whole weight or one for each row; activation_scheme "static" adds an input_scale);
- quant_method "compressed-tensors" with format "float-quantized" (or "naive-quantized", weights alone):
  llm-compressor's FP8 (the RedHatAI / neuralmagic "-FP8" and "-FP8-dynamic" models): 8-bit float weights with a
  weight_scale by tensor, by channel (one a row) or by block (block_structure), inputs quantized per token at run
  time or with a static input_scale; format "dense" quantizes no weight (a checkpoint of KV cache scales alone).

Either way each FP8 weight is multiplied by its scale to dequantize (an "inverse" scale is one to multiply by), so
both read as the same Fp8Weight. The activations' schemes are not followed: the CUDA backend quantizes each input
per token as it runs (a static input_scale is ignored, a finer choice than it), and the CPU backend multiplies the
dequantized weights. A kv_cache_scheme's k_scale and v_scale are the scales of an FP8 KV cache (--kv-dtype fp8), where
the family reads them (the Llama family)."""

from dataclasses import dataclass

from metrale.runtime.errors import InvalidArgument

# Scales a quantized checkpoint holds beside its weights, by name suffix; the weight's own scale first.
WEIGHT_SCALES = ("_scale_inv", "_scale")
ASIDE = (".input_scale",)
FLOAT_STRATEGIES = ("tensor", "channel", "block")
COMPRESSED_FORMATS = ("float-quantized", "naive-quantized", "dense")


@dataclass(frozen=True)
class Fp8Scheme:
    """fmt: "e4m3" or "e5m2"; block: the (rows, columns) a scale covers where scales come in blocks, else None."""
    fmt: str = "e4m3"
    block: tuple[int, int] | None = None


def fp8_scheme(quantization: dict) -> Fp8Scheme:
    """The scheme of a quantization_config (InvalidArgument naming what is not FP8 weights with their scales)."""
    method = _mapping(quantization, "quantization_config").get("quant_method")
    if method == "fp8":
        return _fp8(quantization)
    if method == "compressed-tensors":
        return _compressed_tensors(quantization)
    raise InvalidArgument(f"quantization scheme {method!r} is not supported (fp8, and compressed-tensors' "
                          f"float-quantized FP8, are)")


def _fp8(quantization: dict) -> Fp8Scheme:
    fmt = quantization.get("fmt", "e4m3")
    if fmt not in ("e4m3", "e5m2"):
        raise InvalidArgument(f"fp8 format {fmt!r} is not supported (e4m3, e5m2 are)")
    activations = quantization.get("activation_scheme", "dynamic")
    if activations not in ("dynamic", "static"):
        raise InvalidArgument(f"fp8 activation_scheme {activations!r} is not supported (dynamic, static are)")
    return Fp8Scheme(fmt, _block(quantization.get("weight_block_size"), "weight_block_size"))


def _compressed_tensors(quantization: dict) -> Fp8Scheme:
    """float-quantized (FP8 weights and inputs), naive-quantized (FP8 weights alone: compressed-tensors stores them
    the same way), or dense (no weight quantized: a checkpoint of KV cache scales alone)."""
    fmt = quantization.get("format")
    if fmt not in COMPRESSED_FORMATS:
        raise InvalidArgument(f"compressed-tensors format {fmt!r} is not supported ({', '.join(COMPRESSED_FORMATS)} "
                              f"of 8-bit float weights are)")
    status = quantization.get("quantization_status", "compressed")
    if status != "compressed":
        raise InvalidArgument(f"compressed-tensors quantization_status {status!r} is not supported (a compressed "
                              f"checkpoint's is 'compressed')")
    _check_kv_cache_scheme(quantization.get("kv_cache_scheme"))
    groups = {name: _mapping(group, f"compressed-tensors group {name!r}")
              for name, group in _mapping(quantization.get("config_groups") or {}, "config_groups").items()}
    quantized = {name: group for name, group in groups.items() if group.get("weights")}
    if fmt == "dense":
        if quantized:
            raise InvalidArgument(f"compressed-tensors format 'dense' with quantized weights (groups "
                                  f"{', '.join(quantized)}) is not supported")
        return Fp8Scheme()
    if not quantized:
        raise InvalidArgument(f"compressed-tensors format {fmt!r} without a config group of quantized weights")
    blocks = {_group_block(name, group) for name, group in quantized.items()}
    if len(blocks) > 1:
        raise InvalidArgument(f"compressed-tensors config_groups with different weight blocks "
                              f"{sorted(map(str, blocks))} are not supported (one block size for the checkpoint is)")
    return Fp8Scheme("e4m3", blocks.pop())


def _group_block(name: str, group: dict) -> tuple[int, int] | None:
    """A config group's weight block (None: a scale for the whole weight or for each row), after checking that it
    quantizes weights to 8-bit floats symmetrically and its activations, if at all, to 8-bit floats."""
    what = f"compressed-tensors group {name!r}"
    weights = _mapping(group["weights"], f"{what}'s weights")
    _check_8_bit_float(weights, f"{what}: weights")
    strategy = weights.get("strategy")
    if strategy not in FLOAT_STRATEGIES:
        raise InvalidArgument(f"{what}: weight strategy {strategy!r} is not supported ({', '.join(FLOAT_STRATEGIES)} "
                              f"are)")
    if group.get("input_activations"):
        _check_8_bit_float(_mapping(group["input_activations"], f"{what}'s input_activations"),
                           f"{what}: input activations")
    if group.get("output_activations"):
        raise InvalidArgument(f"{what}: quantized output activations are not supported")
    if strategy != "block":
        return None
    if weights.get("block_structure") is None:
        raise InvalidArgument(f"{what}: weight strategy 'block' without a block_structure")
    return _block(weights["block_structure"], f"{what}'s block_structure")


def _check_kv_cache_scheme(scheme) -> None:
    """A kv_cache_scheme's scales are an FP8 cache's only as 8-bit symmetric floats (each value over its scale)."""
    if scheme:
        _check_8_bit_float(_mapping(scheme, "kv_cache_scheme"), "compressed-tensors kv_cache_scheme")


def _check_8_bit_float(scheme: dict, what: str) -> None:
    if (scheme.get("num_bits"), scheme.get("type")) != (8, "float"):
        raise InvalidArgument(f"{what} of {scheme.get('num_bits')}-bit {scheme.get('type')} are not supported "
                              f"(8-bit float ones are)")
    if not scheme.get("symmetric", True):
        raise InvalidArgument(f"{what} asymmetric (with a zero point) are not supported")


def _mapping(value, what: str) -> dict:
    if not isinstance(value, dict):
        raise InvalidArgument(f"{what} must be a JSON object, not {value!r}")
    return value


def _block(block, what: str) -> tuple[int, int] | None:
    if block is None:
        return None
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b >= 1 for b in block)):
        raise InvalidArgument(f"{what} {block!r} must be two positive sizes")
    return tuple(block)
