"""Tiny random checkpoints of each supported architecture, written with transformers, for the tests."""

from pathlib import Path

import torch
import transformers
from safetensors.torch import load_file, save_file

BASE = dict(vocab_size=256, hidden_size=128, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2)

# name -> (config class, model class, config overrides)
TINY = {
    "llama_tied": ("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=True)),
    "llama3_untied": ("LlamaConfig", "LlamaForCausalLM", dict(
        tie_word_embeddings=False, num_key_value_heads=1,
        rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                             high_freq_factor=4.0, original_max_position_embeddings=64))),
    "llama_attention_bias": ("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=False,
                                                                      attention_bias=True)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(tie_word_embeddings=False, sliding_window=16)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=False)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(tie_word_embeddings=True, head_dim=64)),
}


# Mixtures of experts: BASE's attention with every router's kind (softmax normalised or not; DeepSeek-V3's sigmoid
# over groups with its correction bias, scaling and shared experts), dense layers among the mixtures.
TINY_MOE = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(
        tie_word_embeddings=False, num_local_experts=8, num_experts_per_tok=2, intermediate_size=64)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        tie_word_embeddings=False, head_dim=32, num_hidden_layers=3, num_experts=8, num_experts_per_tok=3,
        moe_intermediate_size=48, norm_topk_prob=True, mlp_only_layers=[2])),
    "qwen3_moe_sparse_step": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        tie_word_embeddings=True, head_dim=32, num_hidden_layers=4, num_experts=6, num_experts_per_tok=2,
        moe_intermediate_size=48, norm_topk_prob=False, decoder_sparse_step=2)),
    "dots1": ("Dots1Config", "Dots1ForCausalLM", dict(
        tie_word_embeddings=False, head_dim=32, num_hidden_layers=3, n_routed_experts=16, num_experts_per_tok=4,
        moe_intermediate_size=32, n_shared_experts=2, n_group=4, topk_group=2, first_k_dense_replace=1,
        routed_scaling_factor=2.5, norm_topk_prob=True, sliding_window=None)),
}


# Multi-head latent attention: DeepSeek-V2-Lite's layout (the query projected directly, greedy softmax routing),
# V2's (the query's low-rank projection, routing over groups by their best score, YaRN), V3's (sigmoid routing over
# groups with its correction bias, YaRN with both mscales) and MiniCPM3 (dense, its scalings away from 1). Heads of
# 32 + 16 query-key dims (the rotary part interleaved in DeepSeek's) and 16 value dims: all unequal, as the CUDA
# prefill kernel builds them.
MLA = dict(num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=16,
           v_head_dim=16)
YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=128, beta_fast=32,
            beta_slow=1, mscale=0.9, mscale_all_dim=0.8)
TINY_MLA = {
    "deepseek_v2_lite": ("DeepseekV2Config", "DeepseekV2ForCausalLM", dict(
        MLA, tie_word_embeddings=False, num_hidden_layers=3, q_lora_rank=None, n_routed_experts=8,
        num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=2, first_k_dense_replace=1,
        topk_method="greedy", routed_scaling_factor=1.0)),
    "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM", dict(
        MLA, tie_word_embeddings=False, num_hidden_layers=3, q_lora_rank=48, n_routed_experts=8,
        num_experts_per_tok=3, moe_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1,
        topk_method="group_limited_greedy", n_group=4, topk_group=2, routed_scaling_factor=1.5,
        rope_parameters=YARN)),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        MLA, tie_word_embeddings=False, num_hidden_layers=3, q_lora_rank=48, n_routed_experts=16,
        num_experts_per_tok=4, moe_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1, n_group=4,
        topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True, rope_parameters=YARN)),
    # rms_norm_eps away from the 1e-6 its latent norms keep
    "minicpm3": ("MiniCPM3Config", "MiniCPM3ForCausalLM", dict(
        MLA, num_hidden_layers=2, q_lora_rank=48, tie_word_embeddings=True, scale_emb=3.0, scale_depth=1.4,
        dim_model_base=64, rms_norm_eps=1e-5)),
}


# DeepSeek sparse attention over MLA: an indexer keeping 8 tokens a query (so a 20-token prompt's later tokens and
# every decode step drop some), of 16 heads (with 8, a query whose head weights are all negative scores every token
# no head likes 0, ties that torch.topk breaks differently for other prompt lengths). DeepSeek-V3.2 (V3 with an indexer in every layer) and Hy4 (indexers in layers 0, 1
# and 5, the layers between reusing the last one's choice; attention sinks and gates; a clamped SwiGLU in its routed
# experts; 4 hyper-connection streams).
DSA = dict(MLA, q_lora_rank=48, index_topk=8, index_n_heads=16, index_head_dim=32, rope_parameters=YARN)
TINY_SPARSE = {
    "deepseek_v32": ("DeepseekV32Config", "DeepseekV32ForCausalLM", dict(
        DSA, tie_word_embeddings=False, num_hidden_layers=3, n_routed_experts=16, num_experts_per_tok=4,
        moe_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1, n_group=4, topk_group=2,
        routed_scaling_factor=2.5, norm_topk_prob=True)),
    "hy_v4": ("HYV4Config", "HYV4ForCausalLM", dict(
        DSA, tie_word_embeddings=False, num_hidden_layers=6, n_routed_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=32, n_shared_experts=1, routed_scaling_factor=2.0, hc_mult=4, swiglu_limit=1.0,
        rms_norm_eps=1e-5, pad_token_id=0)),
}


# State-space models (and hybrids): the Mamba2 mixer's shape shared by each; chunk_size 8, so that a 20-token
# prompt's scan crosses chunks.
# Attention heads of 32 (the CUDA kernels' smallest head_dim).
MIXER = dict(n_groups=2, conv_kernel=4, chunk_size=8, vocab_size=256, hidden_size=64, max_position_embeddings=512,
             bos_token_id=1, eos_token_id=2, pad_token_id=0)
TINY_SSM = {
    "mamba2": ("Mamba2Config", "Mamba2ForCausalLM", dict(num_heads=8, head_dim=16, state_size=16,
                                                         num_hidden_layers=3, layer_norm_epsilon=1e-5)),
    "nemotron_h": ("NemotronHConfig", "NemotronHForCausalLM", dict(
        layers_block_type=["mamba", "attention", "mlp", "mamba", "mlp"], num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, intermediate_size=96, mamba_num_heads=8, mamba_head_dim=16,
        ssm_state_size=16)),
    # Its mixture-of-experts blocks: ReLU² experts routed over groups, a shared expert, MLP biases.
    "nemotron_h_moe": ("NemotronHConfig", "NemotronHForCausalLM", dict(
        layers_block_type=["mamba", "moe", "attention", "moe", "mlp"], num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, intermediate_size=96, mamba_num_heads=8, mamba_head_dim=16, ssm_state_size=16,
        n_routed_experts=8, num_experts_per_tok=3, moe_intermediate_size=48, moe_shared_expert_intermediate_size=64,
        n_group=4, topk_group=2, routed_scaling_factor=1.7, norm_topk_prob=True, mlp_bias=True)),
    # Its µP multipliers all away from 1, the mixer's gated norm on (before the gate) and biases on.
    "falcon_h1": ("FalconH1Config", "FalconH1ForCausalLM", dict(
        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, intermediate_size=96, mamba_d_ssm=128,
        mamba_n_heads=8, mamba_d_state=16, mamba_n_groups=2, mamba_d_conv=4, mamba_chunk_size=8,
        mamba_rms_norm=True, mamba_norm_before_gate=True, mamba_proj_bias=True, projectors_bias=True,
        attention_bias=True, embedding_multiplier=1.5, lm_head_multiplier=0.7, key_multiplier=0.9,
        attention_in_multiplier=1.2, attention_out_multiplier=0.8, ssm_in_multiplier=1.1, ssm_out_multiplier=0.6,
        ssm_multipliers=[1.3, 0.9, 1.1, 0.8, 1.2], mlp_multipliers=[1.4, 0.7], rms_norm_eps=1e-5)),
    # As its released checkpoints: no norm in the mixer (the gate alone), tied embeddings.
    "falcon_h1_tied": ("FalconH1Config", "FalconH1ForCausalLM", dict(
        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, intermediate_size=96, mamba_d_ssm=128,
        mamba_n_heads=8, mamba_d_state=16, mamba_n_groups=1, mamba_chunk_size=8, mamba_rms_norm=False,
        tie_word_embeddings=True, embedding_multiplier=2.0, lm_head_multiplier=0.5)),
    # Granite 4.0-H's dense form, without positions in attention (as released) and its multipliers away from 1.
    "granite_hybrid": ("GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM", dict(
        layer_types=["mamba", "attention", "mamba"], num_hidden_layers=3, num_attention_heads=2,
        num_key_value_heads=1, shared_intermediate_size=96, num_local_experts=0, mamba_n_heads=8, mamba_d_head=16,
        mamba_d_state=16, mamba_chunk_size=8, position_embedding_type="nope", tie_word_embeddings=True,
        attention_multiplier=0.2, embedding_multiplier=3.0, residual_multiplier=0.5, logits_scaling=2.5)),
    # Its mixture-of-experts form: experts beside every layer's shared MLP, the multipliers folded into both.
    "granite_hybrid_moe": ("GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM", dict(
        layer_types=["mamba", "attention", "mamba"], num_hidden_layers=3, num_attention_heads=2,
        num_key_value_heads=1, intermediate_size=48, shared_intermediate_size=96, num_local_experts=6,
        num_experts_per_tok=2, mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16, mamba_chunk_size=8,
        position_embedding_type="nope", attention_multiplier=0.2, embedding_multiplier=3.0, residual_multiplier=0.5,
        logits_scaling=2.5)),
    "granite_hybrid_rope": ("GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM", dict(
        layer_types=["attention", "mamba"], num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
        shared_intermediate_size=96, num_local_experts=0, mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16,
        mamba_chunk_size=8, position_embedding_type="rope", attention_bias=True, mamba_proj_bias=True)),
}


def write_tiny(name: str, directory: Path, seed: int = 0, shard: bool = False, weight_std: float = 0.15,
               norm_std: float = 0.5, **widths) -> Path:
    """A random model of architecture `name` (TINY, TINY_MOE, TINY_MLA, TINY_SPARSE or TINY_SSM) saved as
    safetensors in directory; weights scaled so the logits are far from uniform. shard=True writes several files
    with an index. widths: config values over the architecture's (a test that needs wider weights)."""
    ssm = name in TINY_SSM
    config_class, model_class, overrides = {**TINY, **TINY_MOE, **TINY_MLA, **TINY_SPARSE, **TINY_SSM}[name]
    config = getattr(transformers, config_class)(**{**(MIXER if ssm else BASE), **overrides, **widths})
    torch.manual_seed(seed)
    model = getattr(transformers, model_class)(config).eval()
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            param.normal_(0.0, weight_std if param.dim() > 1 else norm_std).add_(1.0 if param.dim() == 1 else 0.0)
            # A scan whose state lasts: per-token decay exp(dt * A) between ~0.5 and ~0.97, dt spread around 0.7.
            if param_name.endswith("A_log"):
                param.uniform_(-3.0, -0.5)
            elif param_name.endswith("dt_bias"):
                param.normal_(0.0, 1.0)
        for buffer_name, buffer in model.named_buffers():      # DeepSeek-V3's router: a bias that changes choices
            if buffer_name.endswith("e_score_correction_bias"):
                buffer.normal_(0.0, 0.1)
    model.save_pretrained(directory, max_shard_size="40KB" if shard else "1GB")
    return directory


def restack_experts(source: Path, target: Path) -> Path:
    """source's checkpoint (a mixture saved an expert at a time, as write_tiny's "<module>.experts.<e>.gate_proj",
    up_proj and down_proj) with each layer's experts stacked as transformers 5 holds them: experts.gate_up_proj [E,
    2 W, H] (each expert's gate rows, then its up rows) and experts.down_proj [E, H, W], in target."""
    tensors, restacked, experts = load_file(source / "model.safetensors"), {}, {}
    for key, tensor in tensors.items():
        prefix, _, rest = key.partition("mlp.experts.")
        if rest:                # "<e>.gate_proj.weight": this layer's experts, gathered
            expert, name, _ = rest.split(".")
            experts.setdefault(prefix, {})[(int(expert), name)] = tensor
        else:
            restacked[key] = tensor
    for prefix, weights in experts.items():
        count = 1 + max(e for e, _ in weights)
        restacked[prefix + "mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([weights[e, "gate_proj"], weights[e, "up_proj"]]) for e in range(count)])
        restacked[prefix + "mlp.experts.down_proj"] = torch.stack([weights[e, "down_proj"] for e in range(count)])
    target.mkdir()
    save_file(restacked, target / "model.safetensors", metadata={"format": "pt"})
    (target / "config.json").write_text((source / "config.json").read_text())
    return target


def load_reference(directory: Path):
    return transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()


M2M100 = dict(vocab_size=256, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
              decoder_attention_heads=2, encoder_ffn_dim=128, decoder_ffn_dim=96, max_position_embeddings=128,
              scale_embedding=True, pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2,
              dropout=0.0, attention_dropout=0.0, activation_dropout=0.0)


def write_tiny_m2m100(directory: Path, seed: int = 0, weight_std: float = 0.15, norm_std: float = 0.5) -> Path:
    """A random M2M100 (NLLB's architecture) saved as safetensors, initialised as write_tiny does."""
    torch.manual_seed(seed)
    model = transformers.M2M100ForConditionalGeneration(transformers.M2M100Config(**M2M100)).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, weight_std if param.dim() > 1 else norm_std).add_(1.0 if param.dim() == 1 else 0.0)
    model.save_pretrained(directory)
    return directory


def load_m2m100_reference(directory: Path):
    return transformers.M2M100ForConditionalGeneration.from_pretrained(directory, dtype=torch.float32).eval()
