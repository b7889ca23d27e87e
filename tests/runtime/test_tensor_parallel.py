"""Tensor parallel on the CPU backend: ranks in processes of their own, joined over gloo, each holding its shard of
a tiny checkpoint, give the tokens and logits of the one-device engine (and so of transformers, test_models.py)."""

import os
import socket
import subprocess
import sys
import threading
import time
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from metrale.runtime.build import build_engine, build_follower
from metrale.runtime.config import EngineConfig
from metrale.runtime.batch import Segment, build_batch
from metrale.runtime.sequence import BlockTable
from metrale.runtime.errors import CollectiveFailed, InvalidArgument, RankLost
from metrale.runtime.loading import load_checkpoint
from metrale.runtime.parallel.follower import follow
from metrale.runtime.parallel.group import GlooGroup, Shard
from metrale.runtime.parallel.leader import RENEW, STOP, LeaderRunner
from metrale.runtime.parallel.sharding import COLUMNS, HEADS, ROWS, Segments, ShardedTensors
from fp8_checkpoints import write_fp8
from tensor_parallel_rank import CONFIG, steps
from tiny_models import restack_experts, write_tiny, write_tiny_m2m100

RANK_SCRIPT = Path(__file__).parents[1] / "tensor_parallel_rank.py"
# The ranks import this checkout's package, whichever one pip installed.
RANK_ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[2]),
                                                         os.environ.get("PYTHONPATH", "")])}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(directory: Path, size: int, out: Path, *extra: str) -> tuple[dict, list[int]]:
    """Rank 0's saved outcome and every rank's exit status."""
    port = free_port()
    ranks = [subprocess.Popen([sys.executable, str(RANK_SCRIPT), str(directory), str(rank), str(size), str(port),
                               str(out), *extra], stderr=subprocess.PIPE, text=True, env=RANK_ENV)
             for rank in range(size)]
    errors = [rank.communicate(timeout=300)[1] for rank in ranks]
    assert ranks[0].returncode == 0, errors[0][-3000:]
    return torch.load(out), [rank.returncode for rank in ranks]


# What each family's plan splits, two ranks against one device:
# - Llama's: heads 4 and KV heads 2 split in two, or one KV head that both ranks hold; tied and untied embeddings
#   (the LM head's vocabulary split, the embedding whole); row-split biases (added once); Qwen3's per-head norms;
#   Mistral's window.
# - mixtures: each expert's width (Mixtral's w1 / w3 / w2; Qwen3-MoE with a dense layer among them, its experts also
#   stacked as transformers 5 holds them; dots.llm1's grouped sigmoid router and shared experts).
# - M2M100's encoder and decoder: self- and cross-attention heads, feed-forward widths, biased projections.
# - Mamba2 mixers: in_proj's and the conv's segments by heads and groups, the scan's and the gated norm's per-head
#   tensors, the states a rank's heads'; alone, among Nemotron-H's attention, ReLU² MLP and ReLU² experts, and beside
#   Falcon-H1's attention (its µP multipliers folded into each rank's part; as released, one group of B and C, which
#   every rank then holds), and among Granite 4.0-H's attention, shared MLP and stacked experts (at two groups: as
#   released, its one group's gated norm would span the ranks).
# - latent attention by query heads, the latent whole on every rank: DeepSeek-V2-Lite's direct query, V2's and V3's
#   low-rank one with their routers, MiniCPM3's dense layers and scalings, V3.2's sparse attention (the indexer whole,
#   so every rank chooses the same tokens), Hy4's gates, sinks and hyper-connections (whole).
WIDTHS = {"granite_hybrid": dict(mamba_n_groups=2), "granite_hybrid_moe": dict(mamba_n_groups=2)}


@pytest.mark.parametrize("name", [
    "llama_tied", "llama3_untied", "llama_attention_bias", "qwen2", "qwen3", "mistral",
    "mixtral", "qwen3_moe", "qwen3_moe stacked", "dots1",
    "m2m100",
    "mamba2", "nemotron_h", "nemotron_h_moe", "falcon_h1", "falcon_h1_tied", "granite_hybrid", "granite_hybrid_moe",
    "deepseek_v2_lite", "deepseek_v2", "deepseek_v3", "minicpm3", "deepseek_v32", "hy_v4"])
def test_two_ranks_give_the_one_device_tokens_and_logits(name, tmp_path):
    family, _, stacked = name.partition(" ")
    directory = (write_tiny_m2m100(tmp_path / family) if family == "m2m100"
                 else write_tiny(family, tmp_path / family, **WIDTHS.get(family, {})))
    if stacked:
        directory = restack_experts(directory, tmp_path / "stacked")
    tensor_parallel, codes = run_ranks(directory, 2, tmp_path / "rank0.pt")
    assert codes == [0, 0]
    engine, _ = build_engine(load_checkpoint(directory), CONFIG)
    tokens, logits = steps(engine)
    assert tensor_parallel["tokens"] == tokens
    for i, (ours, want) in enumerate(zip(tensor_parallel["logits"], logits)):
        assert ours.shape == want.shape
        assert float((ours - want).abs().max() / want.abs().max()) < 1e-5, f"output {i}"


def test_an_fp8_kv_cache_takes_each_rank_s_heads_scales(tmp_path):
    """k_scale / v_scale a KV head (one layer) and one for all (the other): each rank's cache holds its own heads'
    scales, and the tokens and logits are the one device's with the same FP8 cache."""
    directory = write_tiny("qwen2", tmp_path / "qwen2")                       # 2 KV heads
    tensors = load_file(directory / "model.safetensors")
    tensors.update({"model.layers.0.self_attn.k_scale": torch.tensor([0.003, 0.5]),
                    "model.layers.0.self_attn.v_scale": torch.tensor([0.05, 0.004]).view(2, 1, 1),
                    "model.layers.1.self_attn.k_scale": torch.tensor(0.004),
                    "model.layers.1.self_attn.v_scale": torch.tensor([0.03])})
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    config = replace(CONFIG, kv_dtype="fp8")
    f32 = torch.tensor([[0.003, 0.05], [0.5, 0.004], [0.004, 0.03]]).tolist()          # as the checkpoint holds them
    for rank in (0, 1):
        specs = build_follower(load_checkpoint(directory), config, ShardOnly(rank, 2))[2]
        assert [specs[0].scales, specs[1].scales] == [((f32[rank][0],), (f32[rank][1],)), ((f32[2][0],), (f32[2][1],))]
    tensor_parallel, codes = run_ranks(directory, 2, tmp_path / "rank0.pt", "kv_dtype=fp8")
    assert codes == [0, 0]
    tokens, logits = steps(build_engine(load_checkpoint(directory), config)[0])
    assert tensor_parallel["tokens"] == tokens
    for i, (ours, want) in enumerate(zip(tensor_parallel["logits"], logits)):
        assert float((ours - want).abs().max() / want.abs().max()) < 1e-5, f"output {i}"


def test_a_forward_that_fails_partway_on_one_rank_fails_that_step_alone(tmp_path):
    """Rank 1's model raises in its third forward, after that forward's first collective (a bug there): rank 0's
    step fails alone (CollectiveFailed, a StepFailed: what it changed is undone), every rank leaves that forward's
    collectives and they make new ones, and the step run again gives the one device's tokens and logits, as does
    every step after it."""
    directory = write_tiny("llama_tied", tmp_path / "llama_tied")
    outcome, codes = run_ranks(directory, 2, tmp_path / "rank0.pt", "fail=3")
    assert codes == [0, 0] and outcome["failures"] == ["CollectiveFailed"]
    tokens, logits = steps(build_engine(load_checkpoint(directory), CONFIG)[0])
    assert outcome["tokens"] == tokens
    for i, (ours, want) in enumerate(zip(outcome["logits"], logits)):
        assert float((ours - want).abs().max() / want.abs().max()) < 1e-5, f"output {i}"


def test_a_rank_that_dies_fails_the_step_as_a_lost_rank(tmp_path):
    """Rank 1 ends at rank 0's fourth call (after the cache, the warm-up and the first prefill): rank 0's next
    step gets RankLost (a DeviceFault: the worker stops serving), not a hang and not a bug's StepFailed."""
    directory = write_tiny("llama_tied", tmp_path / "llama_tied")
    outcome, codes = run_ranks(directory, 2, tmp_path / "rank0.pt", "3")
    assert codes == [0, 3]
    assert outcome["error"].startswith("RankLost: tensor-parallel "), outcome["error"]


class ShardOnly:
    """A group as build_engine's checks see it, before any collective."""

    def __init__(self, rank: int, size: int):
        self.shard = Shard(rank, size)


# KV heads that neither the ranks divide nor divide them; a Mamba2 mixer's groups fewer than the ranks under its gated
# norm (a group's statistics would span ranks: Granite 4.0-H as released).
@pytest.mark.parametrize("name, widths, size, message", [
    ("llama3_untied", dict(hidden_size=96, num_attention_heads=6, num_key_value_heads=3), 2, "num_key_value_heads (3)"),
    ("falcon_h1", {}, 4, "mamba n_groups (2) is not a multiple of --tensor-parallel 4 (fewer groups than ranks split "
                         "only without the mixer's gated norm)"),
    ("granite_hybrid", {}, 2, "mamba n_groups (1) is not a multiple of --tensor-parallel 2 (fewer groups")])
def test_what_cannot_be_split_is_refused_at_load(name, widths, size, message, tmp_path):
    directory = write_tiny(name, tmp_path / name, **widths)
    with pytest.raises(InvalidArgument, match="tensor.parallel") as caught:
        build_engine(load_checkpoint(directory), EngineConfig(device="cpu", kv_blocks=8), group=ShardOnly(0, size))
    assert message in str(caught.value)


def test_a_checkpoint_s_fp8_weights_are_refused(tmp_path):
    """A published FP8 checkpoint's weights and their block scales would split apart: refused at load (--quantize
    fp8 quantizes each rank's part of a bf16 checkpoint instead)."""
    directory = write_fp8("llama_tied", tmp_path, block=(128, 128))
    with pytest.raises(InvalidArgument, match="tensor parallel splits plain tensors, not model.layers.0.self_attn."):
        build_engine(load_checkpoint(directory), EngineConfig(device="cpu", kv_blocks=8), group=ShardOnly(0, 2))


def test_a_rank_holds_its_rows_or_columns_and_the_bias_once():
    weight, bias = torch.arange(24.0).view(4, 6), torch.arange(4.0)
    tensors = {"a.q_proj.weight": weight, "a.o_proj.weight": weight, "a.o_proj.bias": bias, "a.norm.weight": bias,
               "a.k_scale": bias.view(4, 1, 1), "b.k_scale": torch.tensor(0.5)}
    splits = {"q_proj.weight": COLUMNS, "o_proj.weight": ROWS, "o_proj.bias": ROWS, "k_scale": HEADS}
    first, second = (ShardedTensors(tensors, splits, Shard(rank, 2)) for rank in (0, 1))
    assert torch.equal(torch.cat([first["a.q_proj.weight"], second["a.q_proj.weight"]]), weight)
    assert torch.equal(torch.cat([first["a.o_proj.weight"], second["a.o_proj.weight"]], dim=1), weight)
    assert torch.equal(first["a.o_proj.bias"], bias) and not second["a.o_proj.bias"].any()
    assert first["a.norm.weight"] is bias
    # A value a KV head goes by heads, however shaped; one for all stays whole. Fewer heads than ranks: each rank
    # holds the head its query heads read (sharding.kv_heads), ranks 0-1 head 0, ranks 2-3 head 1.
    assert torch.equal(torch.cat([first["a.k_scale"], second["a.k_scale"]]), bias)
    two = {"a.k_scale": torch.tensor([0.5, 0.25])}
    assert [ShardedTensors(two, splits, Shard(rank, 4))["a.k_scale"].tolist() for rank in range(4)] == \
        [[0.5], [0.5], [0.25], [0.25]]
    assert ShardedTensors(two, splits, Shard(3, 4)).shape("a.k_scale") == (1,)
    assert first["b.k_scale"] is second["b.k_scale"] is tensors["b.k_scale"]
    assert [first.numel(n) for n in tensors] == [12, 12, 4, 4, 2, 1]
    with pytest.raises(InvalidArgument, match=r"a.q_proj.weight's rows \(4\) is not a multiple of --tensor-parallel 3"):
        ShardedTensors(tensors, splits, Shard(0, 3))["a.q_proj.weight"]


def test_stacked_experts_split_as_each_expert_would():
    """transformers 5's stacked experts: gate_up [E, 2 W, H] each half (the gate's rows, the up's) by rows,
    down [E, H, W] by columns, up alone [E, W, H] by rows: each rank's expert e is expert e's own split."""
    gate, up, down = torch.randn(3, 4, 6), torch.randn(3, 4, 6), torch.randn(3, 6, 4)
    tensors = {"m.experts.gate_up_proj": torch.cat([gate, up], dim=1), "m.experts.down_proj": down,
               "m.experts.up_proj": up}
    splits = {"experts.gate_up_proj": Segments((4, 4), dim=1), "experts.up_proj": COLUMNS,
              "experts.down_proj": ROWS}
    for rank in (0, 1):
        shard = ShardedTensors(tensors, splits, Shard(rank, 2))
        rows = slice(2 * rank, 2 * rank + 2)
        assert torch.equal(shard["m.experts.gate_up_proj"], torch.cat([gate[:, rows], up[:, rows]], dim=1))
        assert torch.equal(shard["m.experts.down_proj"], down[..., rows])
        assert torch.equal(shard["m.experts.up_proj"], up[:, rows])
        assert [shard.shape(name) for name in tensors] == [(3, 4, 6), (3, 6, 2), (3, 2, 6)]


class Recorded:
    """A runner that records what it is asked: stream bindings and calls, in order."""

    queues_work = False

    def __init__(self):
        self.calls = []

    def bind_stream(self, stream):
        self.calls.append(("bind", stream))

    def run_forward(self, forward, batch, replayable):
        self.calls.append(("forward", batch))

    def queue_sample(self, logits, rows):
        return SimpleNamespace(result=lambda: "sampled")


def a_batch():
    return build_batch([Segment(BlockTable([3]), 0, (5, 6), True)], 4)


class Mailbox:
    """Rank 0's messages to the others, in memory: what the leader sends, a follower receives."""

    def __init__(self, shard, timeout_s: float = 60.0):
        self.shard, self.sent, self.lost = shard, [], None
        self.timeout, self.aborted = timedelta(seconds=timeout_s), threading.Event()

    def send(self, message):
        self.sent.append(message)

    def receive(self):
        return self.sent.pop(0)

    def check(self):
        GlooGroup.check(self)

    def lose(self, why):
        self.lost = why
        self.aborted.set()          # as NCCL's abort ends the device's wait for the lost rank's part

    interrupted, reported, renewed, generation, announced = False, False, 0, 0, 0

    def announce_renewal(self):
        self.announced += 1

    reports = 0

    def renewing(self):
        return False

    def report_failure(self):
        self.reported, self.reports = True, self.reports + 1

    def failure_reported(self):
        return self.reported

    def interrupt(self):
        self.interrupted = True
        self.aborted.set()

    def drop_collectives(self):
        pass

    def renew_collectives(self):
        self.renewed += 1
        self.generation += 1
        self.interrupted = self.reported = False


def test_a_follower_runs_each_call_on_the_stream_of_rank_0_s_caller():
    """Rank 0's calls from two stream threads: each reaches the other rank with its caller's stream, which that rank
    binds before it runs the call."""
    leader = LeaderRunner(Recorded(), Mailbox(Shard(0, 2)))
    mailbox, batch = leader.group, a_batch()

    def on_stream(stream):
        leader.bind_stream(stream)
        leader.run_forward(None, batch, False)
    for stream in (1, 0, 1):
        thread = threading.Thread(target=on_stream, args=(stream,))
        thread.start()
        thread.join()
    mailbox.send(STOP)
    follower = Recorded()
    follow(mailbox, None, follower, ())
    assert [call[0] for call in follower.calls] == ["bind", "forward"] * 3
    assert [call[1] for call in follower.calls[::2]] == [1, 0, 1]


def test_once_a_rank_is_lost_every_call_and_every_sampling_under_way_is_rank_lost():
    """A sampling queued before the loss was waited for on the device until the collectives were left: its tokens
    are not the model's, so its result is RankLost too."""
    leader = LeaderRunner(Recorded(), Mailbox(Shard(0, 2)))
    queued = leader.queue_sample(None, [])
    leader.group.lost = "metrale-rank-1 ended (exit code -9)"
    with pytest.raises(RankLost, match="exit code -9"):
        queued.result()
    with pytest.raises(RankLost):
        leader.run_forward(None, a_batch(), False)
    assert leader.group.sent == []


class FakeCommunicator:
    """nccl4py's Communicator as NcclCollectives makes and aborts it, without a GPU: what each was made with."""

    made = []

    def __init__(self, size, rank, unique_id):
        self.size, self.rank, self.unique_id, self.aborted, self.ptr = size, rank, bytes(unique_id), False, 0
        FakeCommunicator.made.append(self)

    @classmethod
    def init(cls, size, rank, unique_id):
        return cls(size, rank, unique_id)

    def abort(self):
        self.aborted = True


def test_the_ranks_nccl_communicators_meet_under_each_generation_and_the_old_one_is_aborted(monkeypatch):
    """Rank 0's unique id reaches the other rank through the store, a new one at each renewal (after a failed call,
    on rank 0 alone here), when every rank aborts the old communicator first (its operations waiting for a rank that
    stopped partway would hold the streams), after letting go of what captured it (NCCL's abort waits for those
    graphs); leaving the collectives at the failure aborts nothing yet (the others abort theirs at the renewal). A
    failure reported by rank 1 is seen by rank 0 under that generation only; a lost rank aborts the communicator
    too."""
    from nccl.core import UniqueId

    from metrale.runtime.backend.cuda import collectives

    ids = iter(UniqueId.from_bytes(bytes([n]) * 128) for n in range(1, 10))
    monkeypatch.setattr(collectives, "get_unique_id", lambda: next(ids))
    monkeypatch.setattr(collectives, "Communicator", FakeCommunicator)
    FakeCommunicator.made = []
    address, made, released, left = f"127.0.0.1:{free_port()}", {}, [], {}

    def rank(r):
        group = GlooGroup(Shard(r, 2), address, timeout_s=20)
        nccl = collectives.NcclCollectives(group, SimpleNamespace(set_current=lambda: None))
        nccl.before_abort.append(lambda: released.append((r, [c.aborted for c in FakeCommunicator.made
                                                              if c.rank == r])))
        if r == 0:
            group.drop_collectives()
            left[r] = [c.aborted for c in FakeCommunicator.made if c.rank == r]
        group.renew_collectives()
        if r == 1:
            group.report_failure()
        made[r] = group
    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    zero, one = ([c for c in FakeCommunicator.made if c.rank == r] for r in (0, 1))     # each rank's, in order
    assert [c.size for c in zero + one] == [2] * 4
    assert [c.unique_id for c in zero] == [c.unique_id for c in one] and zero[0].unique_id != zero[1].unique_id
    assert [c.aborted for c in zero + one] == [True, False, True, False] and not any(left[0])
    assert sorted(r for r, _ in released) == [0, 1] and not any(any(before) for _, before in released)
    assert made[0].failure_reported() and made[0].generation == 1
    made[0].renew_collectives, made[0].generation = None, 2      # a later generation's: not that failure
    assert not made[0].failure_reported()
    group = made[1]
    group.lose("metrale-rank-0 ended (exit code -9)")
    deadline = time.monotonic() + 10
    while not all(c.aborted for c in one) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert all(c.aborted for c in one)
    with pytest.raises(RankLost, match="exit code -9"):
        group.check()


class Hanging(Recorded):
    """A CUDA-like runner whose sampling waits on the device for a rank that hangs: until the collectives are
    aborted."""

    queues_work = True

    def __init__(self, aborted):
        super().__init__()
        self.aborted = aborted

    def queue_sample(self, logits, rows):
        return SimpleNamespace(result=lambda: self.aborted.wait(30) and "garbage")


def test_a_wait_on_the_device_past_the_collectives_timeout_loses_the_ranks():
    """A rank that hangs (alive, never done): NCCL waits for its part without end. Rank 0's wait for a sampling passes
    the collectives' timeout, the ranks are lost (the abort ends the wait), the sampling is RankLost and so is every
    call after it."""
    group = Mailbox(Shard(0, 2), timeout_s=0.3)
    leader = LeaderRunner(Hanging(group.aborted), group)
    started = time.monotonic()
    with pytest.raises(RankLost, match="passed 0.3 s"):
        leader.queue_sample(None, []).result()
    assert time.monotonic() - started < 5
    with pytest.raises(RankLost):
        leader.run_forward(None, a_batch(), False)
    leader.watch.stop()


def test_each_stream_holds_the_ranks_vocabulary_parts_side_by_side():
    """The CUDA backend's logits rows: as wide as every rank's part of the vocabulary (each padded to 64 rows), with
    the buffer the parts are gathered into, also for a group of one; one device's as before."""
    from metrale.runtime.backend.cuda.stream_context import padded_vocab, stream_buffers, vocab_part
    from metrale.runtime.backend.runner import MemoryShapes

    shapes = MemoryShapes(hidden=64, q_size=0, kv_size=0, intermediate=128, vocab=1000, max_batch_tokens=32,
                          max_seqs=8, max_blocks_per_seq=4, head_dim=16, kv_block_size=16)
    one = stream_buffers(None, shapes)
    assert one["logits"] == ((8, padded_vocab(1000)), "bfloat16") and "logits_parts" not in one
    for ranks in (1, 2, 3):
        buffers = stream_buffers(None, shapes, ranks)
        part = vocab_part(1000, ranks)
        assert part % 64 == 0 and ranks * part >= 1000 > (ranks - 1) * part
        assert buffers["logits"] == ((8, ranks * part), "bfloat16")
        assert buffers["logits_parts"] == ((ranks * 8 * part,), "bfloat16")


def test_a_failure_reported_by_another_rank_fails_the_waiting_step_alone_and_the_ranks_renew():
    """Rank 1's part of the step failed (a bug there) and it said so: rank 0's wait on the device for that part, which
    NCCL would hold without end, is interrupted (the collectives aborted); the sampling fails as a StepFailed (the
    engine undoes the step), rank 0 sends RENEW and renews, and the next call goes on."""
    group = Mailbox(Shard(0, 2), timeout_s=30)
    leader = LeaderRunner(Hanging(group.aborted), group)
    queued = leader.queue_sample(None, [])
    group.reported = True
    started = time.monotonic()
    with pytest.raises(CollectiveFailed, match="another tensor-parallel rank's part"):
        queued.result()
    assert time.monotonic() - started < 5 and group.lost is None
    assert group.sent == [RENEW] and group.renewed == group.announced == 1 and not group.interrupted
    leader.run_forward(None, a_batch(), False)
    assert [message[0] for message in group.sent] == [RENEW[0], "forward"]
    leader.watch.stop()


class GatherPlan:
    """What the CUDA layer math's gathered logits queue, recorded without a GPU: the LM head's linear (its output),
    the gather (its buffer and count) and rank 0's column copies (destination, source)."""

    def __init__(self):
        self.linears, self.gathers, self.copies = [], [], []


@pytest.mark.parametrize("rank", [0, 1])
def test_a_ranks_logits_go_to_its_place_and_rank_0_lays_the_parts_side_by_side(rank, monkeypatch):
    """Rows 3 of a 1000-token vocabulary over 2 ranks (parts of 512 rows): the rank's product goes to its place in the
    gathered buffer (after rank 0's [3, 512]), the in-place gather counts one part's elements, and rank 0 copies part
    r into columns [512 r, 512 (r + 1)) of its logits rows (of the logits buffer's stride); the vocab's columns come
    back."""
    pytest.importorskip("cuda.core")
    from metrale.runtime.backend.cuda import layer_math
    from metrale.runtime.backend.cuda.tensor import DeviceTensor

    plan, base = GatherPlan(), 1 << 32
    monkeypatch.setattr(layer_math, "linear_into", lambda lib, gemm, ctx, out, x, weight: plan.linears.append(out))
    ctx = SimpleNamespace(stream="stream", logits=DeviceTensor(base, (8, 1024), "bfloat16"),
                          logits_parts=DeviceTensor(base + (1 << 20), (2 * 8 * 512,), "bfloat16"))
    resources = SimpleNamespace(
        cuda=SimpleNamespace(copy_columns=lambda dst, src, stream: plan.copies.append((dst, src))), lib=None,
        gemm=None, bound=SimpleNamespace(context=ctx), shapes=SimpleNamespace(vocab=1000), shard=Shard(rank, 2),
        collectives=SimpleNamespace(all_gather=lambda parts, count, stream: plan.gathers.append((parts, count))))
    math = layer_math.CudaLayerMath(resources)
    out = math.logits(DeviceTensor(base + (1 << 24), (3, 64), "bfloat16"), DeviceTensor(0, (512, 64), "bfloat16"))
    parts = ctx.logits_parts.ptr
    assert plan.linears == [DeviceTensor(parts + rank * 3 * 512 * 2, (3, 512), "bfloat16")]
    assert plan.gathers == [(ctx.logits_parts, 3 * 512)]
    expected = [(DeviceTensor(base + r * 512 * 2, (3, 512), "bfloat16", 1024),
                 DeviceTensor(parts + r * 3 * 512 * 2, (3, 512), "bfloat16")) for r in (0, 1)]
    assert plan.copies == (expected if rank == 0 else [])
    assert out == DeviceTensor(base, (3, 1000), "bfloat16", 1024)


class Queuing(Recorded):
    """A runner whose forwards and samplings are queued on a device (CUDA's)."""

    queues_work = True


def test_a_sampling_of_a_forward_queued_before_the_collectives_were_renewed_is_a_failed_step():
    """Another stream's call failed and the ranks renewed the collectives after this forward was queued (before or
    after its sampling was): the renewal's abort ended that work partway, so its tokens are not the model's. On a
    device that does not queue work (the CPU's), a forward is done when it returns, and its sampling stands."""
    for renewed_before_sampling in (True, False):
        leader = LeaderRunner(Queuing(), Mailbox(Shard(0, 2)))
        leader.run_forward(None, a_batch(), False)
        if renewed_before_sampling:
            leader.group.renew_collectives()
        queued = leader.queue_sample(None, [])
        if not renewed_before_sampling:
            leader.group.renew_collectives()
        with pytest.raises(CollectiveFailed):
            queued.result()
        leader.run_forward(None, a_batch(), False)
        assert leader.queue_sample(None, []).result() == "sampled"
        leader.watch.stop()
    cpu = LeaderRunner(Recorded(), Mailbox(Shard(0, 2)))
    cpu.run_forward(None, a_batch(), False)
    queued = cpu.queue_sample(None, [])
    cpu.group.renew_collectives()
    assert queued.result() == "sampled"


class FailingOnce(Recorded):
    def run_forward(self, forward, batch, replayable):
        super().run_forward(forward, batch, replayable)
        if len([c for c in self.calls if c[0] == "forward"]) == 1:
            raise RuntimeError("a bug in this rank's forward")

    def copy_block_prefixes(self, layers, copies):
        self.calls.append(("copy", copies))


def test_a_follower_whose_part_failed_reports_it_and_runs_no_collectives_until_renewed():
    """Its collectives would pair with the rest of the failed call's on rank 0: another stream's forward sent meanwhile
    is left to fail there too; a cache copy (no collectives) still runs; after RENEW the next forward runs."""
    mailbox = Mailbox(Shard(1, 2))
    batch = a_batch()
    mailbox.sent = [("forward", 0, batch, False), ("forward", 1, batch, False), ("copy_blocks", 0, [(1, 2, 3)]),
                    RENEW, ("forward", 0, batch, False), STOP]
    follower = FailingOnce()
    follow(mailbox, None, follower, ())
    assert [c[0] for c in follower.calls if c[0] != "bind"] == ["forward", "copy", "forward"]
    assert mailbox.reports == 1 and mailbox.renewed == 1


def test_a_communicator_whose_init_never_ends_is_a_lost_rank(monkeypatch):
    """NCCL's init waits for every rank without end: one that died after the store's meeting must not hold this one
    past the collectives' timeout."""
    from nccl.core import UniqueId

    from metrale.runtime.backend.cuda import collectives

    never = threading.Event()
    monkeypatch.setattr(collectives, "get_unique_id", lambda: UniqueId.from_bytes(bytes(128)))
    monkeypatch.setattr(collectives, "Communicator", SimpleNamespace(init=lambda *args: never.wait()))
    group = GlooGroup(Shard(0, 1), f"127.0.0.1:{free_port()}", timeout_s=0.5)
    started = time.monotonic()
    with pytest.raises(RankLost, match="not made within 0.5 s"):
        collectives.NcclCollectives(group, SimpleNamespace(set_current=lambda: None))
    assert time.monotonic() - started < 5
    never.set()
