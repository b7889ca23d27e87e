"""The hyper-connection building block (layer math's hyper_collapse, hyper_expand, hyper_head on the CPU backend)
against transformers' own modules: DeepSeek-V4's, with the Sinkhorn-projected comb matrix, and Hy4's, without."""

import pytest
import torch
import transformers
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as v4
from transformers.models.hy_v4 import modeling_hy_v4 as hy

from metrale.runtime.backend.cpu.layer_math import CpuLayerMath
from metrale.runtime.backend.layer_math import HyperConnection, HyperHead

HIDDEN, TOKENS = 32, 5


def randomised(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in module.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * (0.2 if param.dim() > 1 else 0.7))
    return module.eval()


def connection(module, hc_mult: int, config, **kinds) -> HyperConnection:
    return HyperConnection(module.fn.detach(), module.base.detach(), module.scale.detach(), hc_mult,
                           config.rms_norm_eps, config.hc_eps, **kinds)


@pytest.mark.parametrize("hc_mult, iters", [(4, 20), (3, 1), (2, 5)])
def test_deepseek_v4_connection_with_its_sinkhorn_comb(hc_mult, iters):
    config = transformers.DeepseekV4Config(hidden_size=HIDDEN, hc_mult=hc_mult, hc_sinkhorn_iters=iters,
                                           hc_eps=1e-6, rms_norm_eps=1e-6)
    module = randomised(v4.DeepseekV4HyperConnection(config), seed=hc_mult)
    streams = torch.randn(1, TOKENS, hc_mult, HIDDEN, generator=torch.Generator().manual_seed(7))
    out = torch.randn(1, TOKENS, HIDDEN, generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        post, comb, collapsed = module(streams)
        after = post.unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(comb.transpose(-1, -2), streams)
    ops = CpuLayerMath("float32")
    hc = connection(module, hc_mult, config, post_magnitude=2.0, post_eps=0.0, sinkhorn_iters=iters)
    ours, mix = ops.hyper_collapse(streams.view(TOKENS, -1), hc)
    torch.testing.assert_close(ours, collapsed[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(mix.comb, comb[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ops.hyper_expand(out[0], streams.view(TOKENS, -1), mix), after.view(TOKENS, -1),
                               rtol=1e-5, atol=1e-5)
    # the comb matrices are (near) doubly stochastic: Sinkhorn's projection ran
    torch.testing.assert_close(mix.comb.sum(dim=-2), torch.ones(TOKENS, hc_mult), rtol=0, atol=1e-4)


def test_hy_v4_connection_and_head():
    config = transformers.HYV4Config(hidden_size=HIDDEN, hc_mult=4, hc_magnitude=1.7, hc_eps=1e-6, rms_norm_eps=1e-5)
    module = randomised(hy.HYV4HyperConnection(config), seed=1)
    head = randomised(hy.HYV4HyperHead(config), seed=2)
    streams = torch.randn(1, TOKENS, 4, HIDDEN, generator=torch.Generator().manual_seed(3))
    out = torch.randn(1, TOKENS, HIDDEN, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        post, collapsed = module(streams)
        after = post.unsqueeze(-1) * out.unsqueeze(-2) + streams
        collapsed_by_head = head(streams)
    ops = CpuLayerMath("float32")
    hc = connection(module, 4, config, post_magnitude=1.7, post_eps=1e-6)
    ours, mix = ops.hyper_collapse(streams.view(TOKENS, -1), hc)
    assert mix.comb is None
    torch.testing.assert_close(ours, collapsed[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ops.hyper_expand(out[0], streams.view(TOKENS, -1), mix), after.view(TOKENS, -1),
                               rtol=1e-5, atol=1e-5)
    ours_head = ops.hyper_head(streams.view(TOKENS, -1), HyperHead(head.hc_fn.detach(), head.hc_base.detach(),
                                                                   head.hc_scale.detach(), 4, 1e-5, 1e-6))
    torch.testing.assert_close(ours_head, collapsed_by_head[0], rtol=1e-5, atol=1e-5)
