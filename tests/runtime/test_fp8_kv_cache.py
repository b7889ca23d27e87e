"""--kv-dtype fp8 on the CPU backend: attention K and V cached in e4m3 with a scale per KV head (the checkpoint's
k_scale / v_scale, else 1). Against transformers whose attention sees K and V rounded the same way (value over its
head's scale, to nearest e4m3, saturated, times the scale) for every token, as the cache holds them; what the cache
takes in memory; the checks on scales; the backends that refuse it."""

import json
from types import SimpleNamespace

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from metrale.runtime.backend.cpu.fp8_kv import Fp8Kv, kv_plane, store_kv
from metrale.runtime.backend.cpu.runner import CpuRunner
from metrale.runtime.backend.cuda.runner import CudaRunner
from metrale.runtime.build import build_engine
from metrale.runtime.cache.manager import blocks_that_fit
from metrale.runtime.cache.specs import PagedKv, PagedKvFp8, PagedLatent, with_kv_dtype
from metrale.runtime.config import EngineConfig
from metrale.runtime.errors import InvalidArgument
from metrale.runtime.loading import load_checkpoint
from engine_runs import greedy_logits
from test_fp8_checkpoint import assert_greedy_matches
from tiny_models import write_tiny, write_tiny_m2m100

E4M3_MAX = 448.0
# The reference's K and V scales by layer: [2, kv_heads] (K's, V's); set by each test before its forward.
REFERENCE_SCALES: dict[int, torch.Tensor] = {}


def rounded(x: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [batch, kv_heads, tokens, head_dim] as an FP8 cache gives it back."""
    scales = scales.view(1, -1, 1, 1)
    return (x.float() / scales).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float() * scales


def fp8_kv_attention(module, query, key, value, attention_mask, **kwargs):
    scales = REFERENCE_SCALES.get(module.layer_idx, torch.ones(2, key.shape[1]))
    return sdpa_attention_forward(module, query, rounded(key, scales[0]), rounded(value, scales[1]), attention_mask,
                                  **kwargs)


AttentionInterface.register("fp8_kv", fp8_kv_attention)
AttentionMaskInterface.register("fp8_kv", sdpa_mask)         # the masks sdpa takes (Mistral's sliding window too)


def reference(directory, scales: list[torch.Tensor]):
    REFERENCE_SCALES.clear()
    REFERENCE_SCALES.update(enumerate(scales))
    return transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32,
                                                             attn_implementation="fp8_kv").eval()


@pytest.mark.parametrize("name", ["llama3_untied", "qwen3", "mistral", "nemotron_h", "falcon_h1"])
def test_an_fp8_kv_cache_matches_transformers_on_the_rounded_kv(name, tmp_path):
    """No scales in the checkpoint: 1 for every head (the hybrids' attention layers too). Greedy logits within 1e-4
    of the reference's, and visibly apart from the model's own float32 cache."""
    directory = write_tiny(name, tmp_path)
    model = reference(directory, [])
    engine, info = build_engine(load_checkpoint(directory), EngineConfig(device="cpu", kv_blocks=16, kv_dtype="fp8"))
    ours = assert_greedy_matches(engine, info.vocab_size, model, name)
    plain, _ = build_engine(load_checkpoint(directory), EngineConfig(device="cpu", kv_blocks=16))
    prompt = torch.randint(3, info.vocab_size, (12,), generator=torch.Generator().manual_seed(3)).tolist()
    exact = greedy_logits(plain, prompt, 0)[0][0]
    assert float((ours[0] - exact).abs().max() / exact.abs().max()) > 1e-4


def test_the_checkpoint_s_scales_per_kv_head(tmp_path):
    """k_scale / v_scale as a kv_cache_scheme publishes them: one per KV head in one layer, one for all in the
    other; small enough that some values saturate at 448 x scale."""
    directory = write_tiny("qwen2", tmp_path)
    config = json.loads((directory / "config.json").read_text())
    kv_heads = config["num_key_value_heads"]
    assert kv_heads == 2
    tensors = load_file(directory / "model.safetensors")
    per_head = torch.tensor([0.003, 0.5])
    tensors["model.layers.0.self_attn.k_scale"] = per_head
    tensors["model.layers.0.self_attn.v_scale"] = per_head.flip(0).view(kv_heads, 1, 1)
    tensors["model.layers.1.self_attn.k_scale"] = torch.tensor(0.004)
    tensors["model.layers.1.self_attn.v_scale"] = torch.tensor([0.03])
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    scales = [torch.stack([per_head, per_head.flip(0)]), torch.tensor([[0.004], [0.03]]).expand(2, kv_heads)]
    engine, info = build_engine(load_checkpoint(directory), EngineConfig(device="cpu", kv_blocks=16, kv_dtype="fp8"))
    layer = engine.cache.layers[0]
    assert isinstance(layer, Fp8Kv) and torch.equal(layer.scales.squeeze(-1), scales[0])
    assert_greedy_matches(engine, info.vocab_size, reference(directory, scales), "per-head scales")
    assert float(layer.values.float().abs().max()) == E4M3_MAX           # some values saturated


def test_values_round_to_nearest_and_saturate():
    spec = PagedKvFp8(num_kv_heads=2, head_dim=4, scales=((1.0, 0.5), (2.0, 0.25)))
    kv = Fp8Kv(spec, num_blocks=2, block_size=4)
    k = torch.tensor([[[1.0, 1.0625, 1.07, 1000.0], [0.3, -0.3, 300.0, -1e9]]])        # [1 token, 2 heads, 4]
    v = torch.tensor([[[0.0, -2.0, 7.0, 1e-6], [0.01, 0.02, 0.03, 1e3]]])
    store_kv(kv, torch.tensor([5]), k, v)
    keys, values = kv_plane(kv, 0, torch.tensor([1]))[0, 1], kv_plane(kv, 1, torch.tensor([1]))[0, 1]
    assert keys[0].tolist() == [1.0, 1.0, 1.125, 448.0]                       # e4m3: 3 mantissa bits; saturated
    assert keys[1].tolist() == [0.3125, -0.3125, 224.0, -224.0]               # 0.6 -> 0.625, over scale 0.5
    assert values[0].tolist() == [0.0, -2.0, 7.0, 0.0] and values[1, 3].item() == 112.0     # under 2^-9: 0
    assert torch.equal(kv.values[:, 0], torch.zeros_like(kv.values[:, 0]))    # nothing else written


def test_an_fp8_cache_takes_a_byte_a_value():
    specs = (PagedKv(4, 64), PagedLatent(96))
    fp8 = with_kv_dtype(specs, "fp8")
    assert fp8 == (PagedKvFp8(4, 64, ((1.0,) * 4,) * 2), PagedLatent(96))    # latent caches keep the model's dtype
    assert with_kv_dtype(specs, "auto") == specs
    kv_only, memory = (PagedKv(4, 64),) * 3, 1000 * 3 * 16 * 2 * 4 * 64 * 4      # 1000 float32 blocks
    assert blocks_that_fit(kv_only, 16, 4, memory, 0, 512) == 1000
    assert blocks_that_fit(with_kv_dtype(kv_only, "fp8"), 16, 4, memory, 0, 512) == 4000
    with pytest.raises(InvalidArgument, match="kv_dtype"):
        with_kv_dtype(specs, "int8")


def test_beam_and_fork_copies_carry_fp8_blocks():
    runner = CpuRunner(torch.float32)
    layers = runner.allocate_cache(with_kv_dtype((PagedKv(2, 4),), "fp8"), 3, 4, 0)
    store_kv(layers[0], torch.arange(4), torch.randn(4, 2, 4), torch.randn(4, 2, 4))
    runner.copy_block_prefixes(layers, [(0, 2, 3)])
    assert torch.equal(layers[0].values[:, 2, :3].float(), layers[0].values[:, 0, :3].float())
    assert torch.equal(layers[0].values[:, 2, 3].float(), torch.zeros(2, 2, 4))


def with_scales(name: str, directory, scales: dict) -> None:
    """The tiny checkpoint `name` written to directory with layer 0's attention holding `scales` (name -> tensor)."""
    write_tiny(name, directory)
    tensors = load_file(directory / "model.safetensors")
    tensors.update({f"model.layers.0.self_attn.{key}": t for key, t in scales.items()})
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.parametrize("scales, message", [
    ({"k_scale": torch.tensor([1.0, 2.0, 3.0])}, "layer 0 has a K or V scale but no v_scale"),
    ({"k_scale": torch.tensor([1.0, 2.0, 3.0]), "v_scale": torch.tensor(1.0)}, "one per KV head \\(2 here\\)"),
    ({"k_scale": torch.tensor(0.0), "v_scale": torch.tensor(1.0)}, "one positive scale"),
])
def test_bad_kv_scales_are_refused_for_an_fp8_cache_only(scales, message, tmp_path):
    with_scales("qwen2", tmp_path, scales)                                  # 2 KV heads
    with pytest.raises(InvalidArgument, match=message):
        build_engine(load_checkpoint(tmp_path), EngineConfig(device="cpu", kv_blocks=16, kv_dtype="fp8"))
    build_engine(load_checkpoint(tmp_path), EngineConfig(device="cpu", kv_blocks=16))     # unused: not checked


def test_older_kv_scale_names_are_read(tmp_path):
    """AutoFP8's k_proj.k_scale and llm-compressor's older k_proj.output_scale (and their V twins)."""
    with_scales("qwen2", tmp_path, {"k_proj.k_scale": torch.tensor(0.5), "v_proj.output_scale": torch.tensor([0.25])})
    engine, _ = build_engine(load_checkpoint(tmp_path), EngineConfig(device="cpu", kv_blocks=16, kv_dtype="fp8"))
    assert engine.cache.layers[0].scales.squeeze(-1).tolist() == [[0.5, 0.5], [0.25, 0.25]]
    assert engine.cache.layers[1].scales.squeeze(-1).tolist() == [[1.0, 1.0], [1.0, 1.0]]


@pytest.mark.parametrize("name, message", [("deepseek_v3", "this model caches none"),
                                           ("m2m100", "encoder's attention")])
def test_models_without_an_fp8_cache_refuse_it(name, message, tmp_path):
    """Latent attention caches no K and V; an encoder-decoder's encoder works in the decoder's cache blocks."""
    directory = write_tiny_m2m100(tmp_path) if name == "m2m100" else write_tiny(name, tmp_path)
    with pytest.raises(InvalidArgument, match=message):
        build_engine(load_checkpoint(directory), EngineConfig(device="cpu", kv_blocks=16, kv_dtype="fp8"))


def test_a_backend_that_cannot_read_an_fp8_cache_refuses_it_at_start(tmp_path, monkeypatch):
    """As the CUDA backend does before sm_89 (it has no e4m3 conversions there), before any weight is uploaded."""
    monkeypatch.setattr(CpuRunner, "kv_dtypes", ("auto",))
    monkeypatch.setattr(CpuRunner, "plan", lambda *args: pytest.fail("planned"))
    with pytest.raises(InvalidArgument, match="--kv-dtype fp8 does not run on the cpu backend \\(it runs auto\\)"):
        build_engine(load_checkpoint(write_tiny("qwen2", tmp_path)),
                     EngineConfig(device="cpu", kv_blocks=16, kv_dtype="fp8"))
    with pytest.raises(InvalidArgument, match="kv_dtype"):
        EngineConfig(kv_dtype="int8")


class FakeCuda:
    """The cuda device CudaRunner.allocate_cache uses: an address for the pool, and the uploads it makes."""

    def __init__(self):
        self.uploads, self.stream = [], SimpleNamespace(sync=lambda: None)

    def allocate(self, nbytes: int) -> int:
        self.nbytes = nbytes
        return 1 << 32

    def copy_to_device(self, tensor, host, stream) -> None:
        self.uploads.append((tensor, host.copy()))


def cuda_runner(arch: str) -> CudaRunner:
    return CudaRunner(SimpleNamespace(cuda=FakeCuda(), lib=SimpleNamespace(arch=arch), collectives=None))


@pytest.mark.parametrize("arch, kv_dtypes", [("sm_80", ("auto",)), ("sm_89", ("auto", "fp8")),
                                             ("sm_90a", ("auto", "fp8"))])
def test_the_cuda_backend_reads_an_fp8_cache_from_sm_89(arch, kv_dtypes):
    """Its e4m3 conversions are Ada's and later."""
    assert cuda_runner(arch).kv_dtypes == kv_dtypes


def test_cuda_fp8_layers_lie_at_equal_strides_with_their_scales_past_the_tuners_scratch():
    """copy_kv_prefixes needs the K/V layers at equal strides; the GEMM tuner may scribble over kv_pool before any
    sequence holds a block, so the scales (and the state table) lie after it, uploaded once."""
    from metrale.runtime.backend.cuda.tensor import Fp8KvTensor
    from metrale.runtime.cache.specs import RecurrentState

    runner = cuda_runner("sm_90a")
    scales = ((0.5, 0.25), (2.0, 4.0))
    specs = (PagedKvFp8(2, 64, scales), RecurrentState(((4, 8),)), PagedKvFp8(2, 64, scales))
    layers = runner.allocate_cache(specs, 10, 16, 3)
    first, state, second = layers
    assert isinstance(first, Fp8KvTensor) and first.dtype == "float8_e4m3" and first.shape == (2, 10, 16, 2, 64)
    assert second.ptr - first.ptr == -(-first.nbytes // 256) * 256                   # equal strides, then the state
    pool = runner.resources.kv_pool
    assert state[0].ptr > second.ptr and state[0].ptr + state[0].nbytes <= pool.ptr + pool.nbytes
    for layer in (first, second):
        assert layer.scales.shape == (2, 2) and layer.scales.ptr >= pool.ptr + pool.nbytes
    uploads = {tensor.ptr: host for tensor, host in runner.cuda.uploads}
    assert uploads[first.scales.ptr].tolist() == [[0.5, 0.25], [2.0, 4.0]]
    assert first.scales.ptr != second.scales.ptr
