"""The CPU backend's router (backend/cpu/moe.py) against transformers' router modules themselves: Mixtral's and
Qwen3-MoE's softmax top-k and DeepSeek-V3's grouped sigmoid, with experts whose scores tie exactly (duplicated rows
of the router's weight), which each must break as transformers does."""

import pytest
import torch
import transformers
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

from metrale.runtime.backend.cpu.moe import route
from metrale.runtime.backend.layer_math import MoeRouter

HIDDEN, TOKENS = 32, 64


def router_weight(experts: int, ties: bool) -> torch.Tensor:
    """Random [experts, HIDDEN]; with ties, each odd expert's row a copy of the even one before it."""
    weight = torch.randn(experts, HIDDEN, generator=torch.Generator().manual_seed(experts))
    if ties:
        weight[1::2] = weight[0::2]
    return weight


def same_choice(ours: tuple, theirs: tuple, sort: bool) -> None:
    (weights, ids), (their_weights, their_ids) = ours, theirs
    if sort:            # DeepSeek-V3 takes its top-k unsorted: compare each token's experts as a set
        ids, order = ids.sort(dim=-1)
        weights = weights.gather(1, order)
        their_ids, order = their_ids.sort(dim=-1)
        their_weights = their_weights.gather(1, order)
    assert torch.equal(ids, their_ids)
    torch.testing.assert_close(weights, their_weights.float(), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe", "qwen3_moe_normalized"])
def test_softmax_routers_match_transformers(kind, ties):
    experts, top_k = 16, 4
    if kind == "mixtral":
        module = MixtralTopKRouter(transformers.MixtralConfig(hidden_size=HIDDEN, num_local_experts=experts,
                                                              num_experts_per_tok=top_k))
    else:
        module = Qwen3MoeTopKRouter(transformers.Qwen3MoeConfig(hidden_size=HIDDEN, num_experts=experts,
                                                                num_experts_per_tok=top_k,
                                                                norm_topk_prob=kind.endswith("normalized")))
    weight = router_weight(experts, ties)
    module.weight.data.copy_(weight)
    x = torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(1))
    _, their_weights, their_ids = module(x)
    ours = route(x, MoeRouter(weight, top_k, "softmax", normalize=kind != "qwen3_moe"))
    same_choice(ours, (their_weights, their_ids), sort=False)


@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("n_group, topk_group, normalize", [(1, 1, True), (4, 2, True), (8, 3, False)])
def test_deepseek_v3_router_matches_transformers(n_group, topk_group, normalize, ties):
    experts, top_k, scaling = 32, 6, 2.5
    config = transformers.DeepseekV3Config(hidden_size=HIDDEN, n_routed_experts=experts, num_experts_per_tok=top_k,
                                           n_group=n_group, topk_group=topk_group, norm_topk_prob=normalize,
                                           routed_scaling_factor=scaling)
    module = DeepseekV3TopkRouter(config)
    weight = router_weight(experts, ties)
    bias = 0.1 * torch.randn(experts, generator=torch.Generator().manual_seed(2))
    if ties:
        bias[1::2] = bias[0::2]
    module.weight.data.copy_(weight)
    module.e_score_correction_bias.copy_(bias)
    x = torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(3))
    _, their_weights, their_ids = module(x)
    ours = route(x, MoeRouter(weight, top_k, "sigmoid", normalize, bias, n_group, topk_group, scaling))
    same_choice(ours, (their_weights, their_ids), sort=True)
