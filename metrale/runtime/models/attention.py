"""A layer's attention as the hybrids write it: one packed QKV linear (optional bias), paged self-attention with
their rotary table (or an identity one) and softmax scale, the output linear."""

from metrale.runtime.backend.layer_math import LayerMath, RopeTable


def packed_attention(ops: LayerMath, h, layer: dict, meta, kv, rope: RopeTable, num_heads: int, num_kv_heads: int,
                     head_dim: int, scale: float):
    """h [T, hidden] -> [T, hidden]; layer: qkv_proj (q, k, v rows), o_proj, and qkv_bias / o_bias where present."""
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    qkv = ops.linear(h, layer["qkv_proj"], layer.get("qkv_bias"))
    q, k, v = qkv[:, :q_size], qkv[:, q_size:q_size + kv_size], qkv[:, q_size + kv_size:]
    o = ops.self_attention(q, k, v, rope, meta, kv, num_kv_heads, head_dim, scale, None)
    return ops.all_reduce(ops.linear(o, layer["o_proj"], layer.get("o_bias")))      # a rank's heads' partial sum
