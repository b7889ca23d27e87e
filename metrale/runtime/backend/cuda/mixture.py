"""A mixture of experts on the CUDA backend (CudaLayerMath.moe): the router's logits, the routing and grouping, the
experts' grouped GEMMs and the weighted combine, every buffer from the bound stream's context."""

from metrale.runtime.backend.cuda import kernels
from metrale.runtime.backend.cuda.linears import linear_into
from metrale.runtime.backend.cuda.resources import CudaResources
from metrale.runtime.backend.cuda.tensor import DeviceTensor
from metrale.runtime.backend.layer_math import Experts, MoeRouter


def moe(lib, resources: CudaResources, x: DeviceTensor, router: MoeRouter, experts: Experts,
        shared: DeviceTensor | None = None) -> DeviceTensor:
    """The router's logits (a float32 GEMM), moe.cu's routing with its grouping (one launch), the two grouped GEMMs
    with the activation between them (a gated one in the first's epilogue, relu2 activation.cu's), and the weighted
    combine (with the shared experts' output): no host round trip."""
    ctx, mo = resources.bound.context, kernels.moe
    tokens, hidden = x.shape
    num_experts, top_k, width = router.num_experts, router.top_k, experts.width
    entries = tokens * top_k
    logits = ctx.new(tokens, mo.logits_width(num_experts), "float32").columns(0, num_experts)
    linear_into(lib, resources.gemm, ctx, logits, x, router.weight)
    rows = mo.tile_rows(entries, num_experts)
    take = ctx.ring.take
    routed = mo.Routed(take((tokens, top_k), "int32"), take((tokens, top_k), "float32"),
                       take((num_experts + 1,), "int32"), take((entries,), "int32"), take((entries,), "int32"),
                       take((mo.max_tiles(entries, num_experts, rows), 2), "int32"), take((1,), "int32"), rows)
    mo.route(lib, ctx.stream, routed, logits, top_k, router.scoring == "softmax", router.normalize,
             router.correction_bias, router.n_group, router.topk_group, router.scaling, ctx.moe_done,
             router.group_score, router.float32_logits)
    activated = ctx.new(entries, width)
    if experts.activation == "silu":            # silu(gate) * up in the GEMM's epilogue
        mo.grouped_gemm(lib, ctx.stream, activated, x, experts.up, routed, gather_div=top_k, gated=True,
                        limit=experts.limit)
    else:
        up = ctx.new(entries, width)
        mo.grouped_gemm(lib, ctx.stream, up, x, experts.up, routed, gather_div=top_k)
        kernels.activation.relu_squared(lib, ctx.stream, activated, up)
    expert_out = ctx.new(entries, hidden)
    mo.grouped_gemm(lib, ctx.stream, expert_out, activated, experts.down, routed, gather_div=0)
    out = ctx.new(tokens, hidden)
    mo.combine(lib, ctx.stream, out, expert_out, routed, shared)
    return out
