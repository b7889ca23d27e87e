"""Model families, dispatched by the config's `architectures` entry."""

from dataclasses import dataclass
from typing import Callable

from metrale.runtime.errors import InvalidArgument
from metrale.runtime.models import deepseek, dots1, falcon_h1, granite_hybrid, hy_v4, hybrid, llama, m2m100, \
    mamba2, mistral, mixtral, nemotron_h, qwen2, qwen3, qwen3_moe


@dataclass(frozen=True)
class Family:
    config_from_hf: Callable[[dict], object]
    model_class: type
    # (config, Shard) -> a rank's config and the checkpoint's splits (parallel/sharding.py); None: the family runs
    # on one device.
    tensor_parallel: Callable | None = None


ARCHITECTURES: dict[str, Family] = {
    "LlamaForCausalLM": Family(llama.config_from_hf, llama.LlamaForCausalLM, llama.tensor_parallel),
    "MistralForCausalLM": Family(mistral.config_from_hf, llama.LlamaForCausalLM, llama.tensor_parallel),
    "Qwen2ForCausalLM": Family(qwen2.config_from_hf, llama.LlamaForCausalLM, llama.tensor_parallel),
    "Qwen3ForCausalLM": Family(qwen3.config_from_hf, llama.LlamaForCausalLM, llama.tensor_parallel),
    "MixtralForCausalLM": Family(mixtral.config_from_hf, llama.LlamaForCausalLM, llama.tensor_parallel),
    "Qwen3MoeForCausalLM": Family(qwen3_moe.config_from_hf, llama.LlamaForCausalLM, llama.tensor_parallel),
    "Dots1ForCausalLM": Family(dots1.config_from_hf, llama.LlamaForCausalLM, llama.tensor_parallel),
    "M2M100ForConditionalGeneration": Family(m2m100.config_from_hf, m2m100.M2M100ForConditionalGeneration,
                                             m2m100.tensor_parallel),
    "Mamba2ForCausalLM": Family(mamba2.config_from_hf, hybrid.HybridForCausalLM, hybrid.tensor_parallel),
    "NemotronHForCausalLM": Family(nemotron_h.config_from_hf, hybrid.HybridForCausalLM, hybrid.tensor_parallel),
    "FalconH1ForCausalLM": Family(falcon_h1.config_from_hf, falcon_h1.FalconH1ForCausalLM,
                                  falcon_h1.tensor_parallel),
    "GraniteMoeHybridForCausalLM": Family(granite_hybrid.config_from_hf, granite_hybrid.GraniteHybridForCausalLM,
                                          granite_hybrid.tensor_parallel),
    "DeepseekV2ForCausalLM": Family(deepseek.config_from_hf, deepseek.DeepseekForCausalLM, deepseek.tensor_parallel),
    "DeepseekV3ForCausalLM": Family(deepseek.config_from_hf, deepseek.DeepseekForCausalLM, deepseek.tensor_parallel),
    "DeepseekV32ForCausalLM": Family(deepseek.config_from_hf, deepseek.DeepseekForCausalLM, deepseek.tensor_parallel),
    "MiniCPM3ForCausalLM": Family(deepseek.config_from_hf, deepseek.DeepseekForCausalLM, deepseek.tensor_parallel),
    "HYV4ForCausalLM": Family(hy_v4.config_from_hf, hy_v4.HyV4ForCausalLM, hy_v4.tensor_parallel),
}


def family_of(hf_config: dict) -> Family:
    names = hf_config.get("architectures") or []
    for name in names:
        if name in ARCHITECTURES:
            return ARCHITECTURES[name]
    raise InvalidArgument(f"architecture {names} is not supported; supported: {sorted(ARCHITECTURES)}")
