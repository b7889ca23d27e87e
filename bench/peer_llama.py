"""The peer of issue 3: the same Llama model written in plain PyTorch the way a user would (gpt-fast style).

A static KV cache per layer, [max_batch, kv_heads, max_len, head_dim], written in place at the decode position;
RMSNorm, rotary embedding (rotate-half, as the Hugging Face weights expect, with the same frequency tables as the
engine: metrale.runtime.models.rope) and F.scaled_dot_product_attention; the decode step (forward of one token per
sequence plus the greedy token choice) under torch.compile(mode="reduce-overhead", fullgraph=True), so it replays
as a CUDA graph; prefill runs eagerly. Weights come from the same Checkpoint tensors the engine loads, so both run
the same model.

Attention:
- prefill (every sequence from position 0): SDPA over the prompt's own K/V, is_causal=True, enable_gqa=True
  (flash attention with grouped-query heads; nothing repeated);
- decode (one token per sequence, all at the same position, as gpt-fast): the query heads of a KV group are laid
  out as that group's queries, q [B, kv_heads, group, head_dim], against the cache [B, kv_heads, max_len, head_dim]
  with a causal mask row for the position: every group reads its KV once, no repeat_interleave.

Used by bench/gpu_decode.py; tests/bench/test_gpu_bench_smoke.py checks it against the engine on the CPU.
"""

import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from metrale.runtime.models import family_of
from metrale.runtime.models.rope import inverse_frequencies, rope_cos_sin

COMPILE_MODES = ("reduce-overhead", "default", "none")


@dataclass
class KVCache:
    """One layer's static cache, [batch, kv_heads, max_len, head_dim] each. Passed to the forward as an argument
    (as Hugging Face passes its StaticCache), not held as module buffers: torch.compile keeps module buffers' shapes
    static, which would compile the decode step once per batch size; as inputs, the batch dimension turns dynamic
    at the second size."""
    k_cache: torch.Tensor
    v_cache: torch.Tensor

    def rows(self, batch: int) -> "KVCache":
        """The first `batch` rows: contiguous views of the same memory, marked static."""
        view = KVCache(self.k_cache[:batch], self.v_cache[:batch])
        view.mark_static()
        return view

    def mark_static(self) -> None:
        # Mutated in place at fixed addresses: CUDA graphs must take them as static inputs (as Hugging Face's
        # StaticCache marks its tensors), never copy them in.
        torch._dynamo.mark_static_address(self.k_cache)
        torch._dynamo.mark_static_address(self.v_cache)


class RMSNorm(nn.Module):
    def __init__(self, weight: torch.Tensor, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(weight, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, T, heads, head_dim]; cos, sin [T, head_dim // 2] float32. Rotate-half (Hugging Face layout)."""
    half = x.shape[-1] // 2
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half:]
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).type_as(x)


class Attention(nn.Module):
    def __init__(self, c, wqkv: torch.Tensor, wo: torch.Tensor):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.q_size, self.kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        self.wqkv = nn.Parameter(wqkv, requires_grad=False)
        self.wo = nn.Parameter(wo, requires_grad=False)

    def forward(self, x, cos, sin, input_pos, mask, cache: KVCache, rows: slice | None):
        batch, seq_len, _ = x.shape
        q, k, v = F.linear(x, self.wqkv).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = apply_rope(q.view(batch, seq_len, self.num_heads, self.head_dim), cos, sin)
        k = apply_rope(k.view(batch, seq_len, self.num_kv_heads, self.head_dim), cos, sin)
        v = v.view(batch, seq_len, self.num_kv_heads, self.head_dim)
        k, v = k.transpose(1, 2), v.transpose(1, 2)                       # [B, kvh, T, hd]
        if seq_len == 1:
            # Decode: every row of the cache (its batch is B), all at the same position input_pos [1]. Written
            # in place (a slice of the cache here would make inductor copy the whole slice every step).
            cache.k_cache[:, :, input_pos] = k
            cache.v_cache[:, :, input_pos] = v
            group = self.num_heads // self.num_kv_heads
            queries = q.view(batch, self.num_kv_heads, group, self.head_dim)
            y = F.scaled_dot_product_attention(queries, cache.k_cache, cache.v_cache, attn_mask=mask)
            y = y.reshape(batch, 1, self.q_size)
        else:
            # Prefill from position 0 (input_pos = arange(T)) into cache rows `rows`.
            cache.k_cache[rows, :, :seq_len] = k
            cache.v_cache[rows, :, :seq_len] = v
            y = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, is_causal=True, enable_gqa=True)
            y = y.transpose(1, 2).reshape(batch, seq_len, self.q_size)
        return F.linear(y, self.wo)


class FeedForward(nn.Module):
    def __init__(self, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor):
        super().__init__()
        self.w1 = nn.Parameter(w1, requires_grad=False)   # gate
        self.w3 = nn.Parameter(w3, requires_grad=False)   # up
        self.w2 = nn.Parameter(w2, requires_grad=False)   # down

    def forward(self, x):
        return F.linear(F.silu(F.linear(x, self.w1)) * F.linear(x, self.w3), self.w2)


class TransformerBlock(nn.Module):
    def __init__(self, c, take, prefix: str):
        super().__init__()
        wqkv = torch.cat([take(prefix + f"self_attn.{p}_proj.weight") for p in ("q", "k", "v")])
        self.attention = Attention(c, wqkv, take(prefix + "self_attn.o_proj.weight"))
        self.feed_forward = FeedForward(take(prefix + "mlp.gate_proj.weight"), take(prefix + "mlp.up_proj.weight"),
                                        take(prefix + "mlp.down_proj.weight"))
        self.attention_norm = RMSNorm(take(prefix + "input_layernorm.weight"), c.rms_norm_eps)
        self.ffn_norm = RMSNorm(take(prefix + "post_attention_layernorm.weight"), c.rms_norm_eps)

    def forward(self, x, cos, sin, input_pos, mask, cache, rows):
        h = x + self.attention(self.attention_norm(x), cos, sin, input_pos, mask, cache, rows)
        return h + self.feed_forward(self.ffn_norm(h))


class PeerLlama(nn.Module):
    """forward(tokens [B, T], input_pos [T], caches) -> logits [B, vocab] of each sequence's last token."""

    def __init__(self, c, tensors: dict[str, torch.Tensor], max_len: int, device, dtype):
        super().__init__()
        if c.qkv_bias or c.o_bias or c.qk_norm or c.sliding_window:
            raise ValueError("the peer is plain Llama: no attention bias, q/k norm or sliding window")
        self.config = c

        def take(name: str) -> torch.Tensor:
            return tensors[name].to(device=device, dtype=dtype)

        self.tok_embeddings = nn.Parameter(take("model.embed_tokens.weight"), requires_grad=False)
        self.layers = nn.ModuleList(TransformerBlock(c, take, f"model.layers.{i}.") for i in range(c.num_layers))
        self.norm = RMSNorm(take("model.norm.weight"), c.rms_norm_eps)
        self.output = self.tok_embeddings if c.tie_word_embeddings else nn.Parameter(take("lm_head.weight"),
                                                                                     requires_grad=False)
        self.device, self.dtype = torch.device(device), dtype
        self.set_max_len(max_len)

    def set_max_len(self, max_len: int) -> None:
        """The rope tables and the causal mask for max_len positions; caches allocated after this get max_len."""
        c = self.config
        cos, sin = rope_cos_sin(inverse_frequencies(c.rope, c.head_dim), max_len)
        self.register_buffer("rope_cos", cos.to(self.device), persistent=False)
        self.register_buffer("rope_sin", sin.to(self.device), persistent=False)
        mask = torch.tril(torch.ones(max_len, max_len, dtype=torch.bool, device=self.device))
        self.register_buffer("causal_mask", mask, persistent=False)
        self.max_len = max_len

    def allocate_caches(self, batch: int) -> list[KVCache]:
        c = self.config
        shape = (batch, c.num_kv_heads, self.max_len, c.head_dim)
        return [KVCache(torch.zeros(shape, dtype=self.dtype, device=self.device),
                        torch.zeros(shape, dtype=self.dtype, device=self.device)) for _ in range(c.num_layers)]

    def forward(self, tokens: torch.Tensor, input_pos: torch.Tensor, caches: list[KVCache],
                batch_offset: int = 0) -> torch.Tensor:
        """Decode (T = 1) uses every row of the caches; prefill (T > 1, from position 0) writes rows
        [batch_offset, batch_offset + B)."""
        batch, seq_len = tokens.shape
        x = F.embedding(tokens, self.tok_embeddings)
        cos, sin = self.rope_cos[input_pos], self.rope_sin[input_pos]
        mask = self.causal_mask[input_pos].view(1, 1, 1, self.max_len) if seq_len == 1 else None
        rows = None if seq_len == 1 else slice(batch_offset, batch_offset + batch)
        for layer, cache in zip(self.layers, caches):
            x = layer(x, cos, sin, input_pos, mask, cache, rows)
        # Only the last position of each sequence is sampled: its norm and the vocab projection.
        return F.linear(self.norm(x[:, -1]), self.output)


def decode_one_token(model: PeerLlama, tokens: torch.Tensor, input_pos: torch.Tensor,
                     caches: list[KVCache]) -> tuple[torch.Tensor, torch.Tensor]:
    """tokens [B, 1] at position input_pos [1], caches of batch B -> (greedy next tokens [B, 1], logits)."""
    logits = model(tokens, input_pos, caches)
    return logits.argmax(dim=-1, keepdim=True), logits


@dataclass
class Peer:
    model: PeerLlama
    decode: object        # decode_one_token, compiled or not
    compile_mode: str
    # Every layer's cache at full capacity, and the views of its first `batch` rows the forwards use.
    storage: list[KVCache] = field(default_factory=list)
    caches: list[KVCache] = field(default_factory=list)

    @property
    def capacity(self) -> int:
        return self.storage[0].k_cache.shape[0] if self.storage else 0

    @property
    def batch(self) -> int:
        return self.caches[0].k_cache.shape[0] if self.caches else 0

    def kv_cache_bytes(self) -> int:
        return sum(cache.k_cache.nbytes + cache.v_cache.nbytes for cache in self.storage)

    def allocate_caches(self, capacity: int, max_len: int | None = None) -> None:
        """Frees the caches, then allocates caches for `capacity` sequences of max_len (default: as before)
        tokens, all rows in use. The decode step is compiled against views of this memory, so a run allocates
        once for its largest batch and picks rows with use_rows: nothing is freed under a recorded CUDA graph."""
        self.storage, self.caches = [], []
        if self.model.device.type == "cuda":
            torch.cuda.empty_cache()
        if max_len is not None and max_len != self.model.max_len:
            self.model.set_max_len(max_len)
        self.storage = self.model.allocate_caches(capacity)
        self.use_rows(capacity)

    def use_rows(self, batch: int) -> None:
        """Forwards from now on use the first `batch` rows of every cache."""
        if not 1 <= batch <= self.capacity:
            raise ValueError(f"batch {batch} is outside the caches' capacity {self.capacity}")
        self.caches = [cache.rows(batch) for cache in self.storage]


def build_peer(checkpoint_config: dict, tensors: dict[str, torch.Tensor], max_batch: int, max_len: int,
               device="cuda", dtype=torch.bfloat16, compile_mode: str = "reduce-overhead") -> Peer:
    """The peer model on `device` with caches for max_batch sequences of max_len tokens (Peer.allocate_caches
    replaces them, Peer.use_rows picks the batch).

    compile_mode: 'reduce-overhead' (CUDA graphs: the peer of issue 3), 'default' (inductor, no graphs) or 'none'
    (eager). The decode step is compiled with torch's default dynamic-shape handling: the first batch size compiles
    static, the second recompiles with the batch dimension dynamic and later sizes reuse that graph, each recording
    its own CUDA graph (batch 1 stays a graph of its own).
    """
    if compile_mode not in COMPILE_MODES:
        raise ValueError(f"compile_mode must be one of {COMPILE_MODES}, got {compile_mode!r}")
    config = family_of(checkpoint_config).config_from_hf(checkpoint_config)
    with torch.no_grad():
        model = PeerLlama(config, tensors, max_len, device, dtype).eval()
    decode = decode_one_token
    if compile_mode != "none":
        decode = torch.compile(decode_one_token, mode=compile_mode, fullgraph=True)
    peer = Peer(model, decode, compile_mode)
    peer.allocate_caches(max_batch)
    return peer


@torch.no_grad()
def peer_prefill(peer: Peer, tokens: torch.Tensor, batch_offset: int = 0, return_logits: bool = False):
    """tokens [n, T] on the peer's device, every sequence from position 0, into cache rows
    [batch_offset, batch_offset + n); eager. Returns the greedy next tokens [n, 1] (and the last logits)."""
    model = peer.model
    n, seq_len = tokens.shape
    if batch_offset + n > peer.batch or seq_len > model.max_len:
        raise ValueError(f"{n} x {seq_len} tokens at row {batch_offset} do not fit caches of "
                         f"{peer.batch} x {model.max_len}")
    input_pos = torch.arange(seq_len, device=tokens.device)
    logits = model(tokens, input_pos, peer.caches, batch_offset)
    next_tokens = logits.argmax(dim=-1, keepdim=True)
    return (next_tokens, logits) if return_logits else next_tokens


@torch.no_grad()
def peer_decode_step(peer: Peer, tokens: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
    """One decode step of every cache row (tokens [B, 1] with B = peer.batch, input_pos [1], on the device): the
    greedy next tokens [B, 1], cloned out of the CUDA graph's memory so the next replay cannot overwrite them
    (as gpt-fast does)."""
    if tokens.shape[0] != peer.batch:
        raise ValueError(f"{tokens.shape[0]} tokens for caches of batch {peer.batch}")
    if peer.compile_mode == "reduce-overhead":
        torch.compiler.cudagraph_mark_step_begin()
    next_tokens, _ = peer.decode(peer.model, tokens, input_pos, peer.caches)
    return next_tokens.clone()


@torch.no_grad()
def check_compiled_decode(peer: Peer, tokens: torch.Tensor, position: int) -> float:
    """Relative error of the logits of one decode step at `position` through peer.decode (compiled, a graph
    replay) against the eager forward, same inputs: the compiled step computes the model, not something faster."""
    input_pos = torch.tensor([position], device=tokens.device, dtype=torch.long)
    if peer.compile_mode == "reduce-overhead":
        torch.compiler.cudagraph_mark_step_begin()
    compiled = peer.decode(peer.model, tokens, input_pos, peer.caches)[1].float().clone()
    eager = peer.model(tokens, input_pos, peer.caches).float()
    if not torch.isfinite(compiled).all():
        return float("nan")
    return ((compiled - eager).norm() / eager.norm()).item()


@dataclass
class PeerDecodeTimes:
    step_ms: list[float]      # per timed step: device time (CUDA events around the step; host clock on the CPU)
    wall_ms_per_step: float   # host wall clock over the timed steps / steps, synchronized at both ends
    last_tokens: torch.Tensor  # [B, 1]: the last step's greedy tokens
    next_position: int         # where the next step would write


class DeviceTimer:
    """CUDA events on the current stream where the device is a GPU; the host clock (synchronous work) elsewhere."""

    def __init__(self, device):
        self.cuda = torch.device(device).type == "cuda"
        self._pairs = []

    def start(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def stop(self, started) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._pairs.append((started, event))
        else:
            self._pairs.append((started, time.perf_counter()))

    def elapsed_ms(self) -> list[float]:
        """Every (start, stop) interval so far in ms, in order; waits for the device."""
        if self.cuda:
            torch.cuda.synchronize()
            return [a.elapsed_time(b) for a, b in self._pairs]
        return [(b - a) * 1e3 for a, b in self._pairs]


def synchronize(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


@torch.no_grad()
def time_peer_decode(peer: Peer, first_tokens: torch.Tensor, context: int, warmup: int, steps: int
                     ) -> PeerDecodeTimes:
    """Decodes every row in use (first_tokens [B, 1]) whose caches hold `context` tokens: warmup untimed steps (the
    compile and the graph recording of this batch size happen here), then `steps` timed ones. The token of each
    step feeds the next on the device, with no host synchronization between steps (as gpt-fast generates)."""
    device = first_tokens.device
    if context + warmup + steps > peer.model.max_len:
        raise ValueError(f"context {context} + {warmup + steps} steps pass the caches' max_len {peer.model.max_len}")
    input_pos = torch.tensor([context], device=device, dtype=torch.long)
    tokens = first_tokens
    for _ in range(warmup):
        tokens = peer_decode_step(peer, tokens, input_pos)
        input_pos += 1
    synchronize(device)
    timer = DeviceTimer(device)
    started = time.perf_counter()
    for _ in range(steps):
        event = timer.start()
        tokens = peer_decode_step(peer, tokens, input_pos)
        timer.stop(event)
        input_pos += 1
    synchronize(device)
    wall_ms = (time.perf_counter() - started) * 1e3
    return PeerDecodeTimes(timer.elapsed_ms(), wall_ms / steps, tokens, context + warmup + steps)
