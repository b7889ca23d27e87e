"""beam.cu against a float64 torch reference: each row's best `count` of log_softmax of bf16 logits (the LM head's
output) with its banned ids at -inf, best first and ties to the lower id; a row with NaN gives ids -1. Outputs are
poisoned before the launch. bf16 logits tie often at NLLB's vocabulary: the ties' order is checked too."""

import numpy as np
import pytest
import torch

pytest.importorskip("cuda.core")

from metrale.runtime.backend.cuda.kernels.beam import beam_candidates, pack_banned  # noqa: E402
from metrale.runtime.backend.cuda.tensor import DeviceTensor  # noqa: E402
from metrale.runtime.backend.cuda.testing import BareStreamContext  # noqa: E402
from metrale.runtime.errors import InvalidArgument  # noqa: E402

pytestmark = pytest.mark.gpu
POISON = 12345.0


def reference(logits: torch.Tensor, banned: list[list[int]], count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 values and ids [N, count]: value descending, then id ascending."""
    log_probs = torch.log_softmax(logits.double(), dim=-1)
    vocab = logits.shape[1]
    for row, ids in enumerate(banned):
        inside = [i for i in ids if 0 <= i < vocab]
        log_probs[row, inside] = -float("inf")
    order = torch.stack([torch.from_numpy(np.lexsort((np.arange(vocab), -row.numpy()))) for row in log_probs])
    ids = order[:, :count]
    return log_probs.gather(1, ids), ids


def run(kernel_library, stream, logits: torch.Tensor, banned: list[list[int]], count: int):
    """logits: bf16."""
    n, vocab = logits.shape
    # A column view of wider rows, as the stream's logits are (rows padded for the LM head's GEMM).
    wide = torch.full((n, vocab + 3), 7.0, dtype=torch.bfloat16, device="cuda")
    wide[:, :vocab] = logits.cuda()
    device_logits = wide[:, :vocab]
    offsets, ids_flat = pack_banned(banned)
    packed = torch.from_numpy(np.concatenate([offsets, ids_flat])).cuda()
    ids = torch.full((n, count), -7, dtype=torch.int32, device="cuda")
    values = torch.full((n, count), POISON, dtype=torch.float32, device="cuda")
    torch.cuda.synchronize()
    beam_candidates(kernel_library, stream, DeviceTensor.from_torch(device_logits),
                    DeviceTensor(packed.data_ptr(), (n + 1,), "int32"),
                    DeviceTensor(packed.data_ptr() + 4 * (n + 1), (packed.numel() - n - 1,), "int32"),
                    DeviceTensor.from_torch(ids), DeviceTensor.from_torch(values))
    stream.sync()
    assert (wide[:, vocab:] == 7.0).all()           # nothing written past the row
    return values.cpu(), ids.cpu().long(), device_logits.cpu()


@pytest.mark.parametrize("vocab, count", [(1000, 1), (1000, 8), (1023, 96), (256206, 12), (256206, 128),
                                          (32000, 1024)])
def test_candidates_match_float64(kernel_library, stream, vocab, count):
    generator = torch.Generator().manual_seed(vocab + count)
    logits = (torch.randn(6, vocab, generator=generator) * 3.0).bfloat16()
    top = logits.argmax(dim=1)
    banned = [[], [int(top[1])],                                       # the maximum itself
              torch.randint(0, vocab, (50,), generator=generator).tolist() + [-1, vocab, vocab + 5],
              [3, 3, 3, 9],                                            # duplicates
              torch.topk(logits[4], 40).indices.tolist(),               # the whole head
              [2, 1000000]]
    values, ids, written = run(kernel_library, stream, logits, banned, count)
    want_values, want_ids = reference(logits, banned, count)
    assert (values - want_values).abs().max() < 2e-5
    # bf16 values are equal or at least an ulp apart: the same ids, ties in id order
    assert torch.equal(ids, want_ids)
    assert all(not (set(ids[row].tolist()) & {i for i in bans if 0 <= i < vocab}) for row, bans in enumerate(banned))
    # logits are scratch: -inf at the banned ids, untouched elsewhere
    expected = logits.clone()
    for row, bans in enumerate(banned):
        expected[row, [i for i in bans if 0 <= i < vocab]] = -float("inf")
    assert torch.equal(written, expected)


def test_ties_go_to_the_lower_id_and_nan_rows_give_no_candidate(kernel_library, stream):
    logits = torch.randn(3, 4096, generator=torch.Generator().manual_seed(3)).bfloat16()
    logits[0, [4000, 17, 2500, 900]] = 9.0                          # a four-way tie at the top
    logits[1, 5] = float("nan")
    logits[2] = -float("inf")
    values, ids, _ = run(kernel_library, stream, logits, [[], [], []], 6)
    assert ids[0, :4].tolist() == [17, 900, 2500, 4000]
    assert ids[1].tolist() == [-1] * 6 and ids[2].tolist() == [-1] * 6
    assert torch.isnan(values[1:]).all()


def test_launcher_refuses_a_count_over_the_vocabulary(kernel_library, stream):
    with pytest.raises(InvalidArgument, match="count"):
        run(kernel_library, stream, torch.randn(2, 16).bfloat16(), [[], []], 17)


def state_bans(prompt: list[int], ngram: int, short: bool, eos: tuple[int, ...]) -> list[int]:
    """transformers' processors at the first searched token: EOS while short of min_new_tokens, and the tokens
    that would repeat an n-gram of the prompt."""
    banned = set(eos) if short else set()
    if ngram and len(prompt) >= ngram:
        last = prompt[len(prompt) - ngram + 1:]
        banned |= {prompt[w + ngram - 1] for w in range(len(prompt) - ngram + 1) if prompt[w:w + ngram - 1] == last}
    return sorted(banned)


# The warp maxima's floor (count + bans <= 32), and top_logprobs_of's search: for more (40), and where too many
# values reach the floor (tied: four distinct values in a row).
@pytest.mark.parametrize("count, tied", [(8, False), (16, False), (40, False), (8, True)], ids=str)
def test_device_search_candidates_match_float64(kernel_library, stream, count, tied):
    """beam_state_parts and beam_state_merge, the device search's candidates, against float64: NLLB's vocabulary
    split across blocks, bans computed on the device from each beam's tokens (a banned EOS the row's maximum)."""
    from metrale.runtime.backend.cuda.beam_search import CudaDeviceSearch, state_arrays
    from metrale.runtime.backend.cuda.kernels.beam import beam_state_candidates
    from metrale.runtime.beam.candidates import HostCandidates
    from metrale.runtime.beam.on_device import SearchStart

    vocab, eos = 256206, (2, 7)
    prompts = [[5, 9, 11, 5, 9, 40, 5, 9], [3, 3, 3, 3], [100, 200, 2, 7]]
    beams, ngram, min_new = [4, 2, 1], [3, 2, 0], [5, 0, 3]
    R, TB = len(prompts), sum(beams)
    i32 = lambda values: np.asarray(values, dtype=np.int32)
    poisoned = HostCandidates(torch.full((R, count), POISON), torch.full((R, count), -7))
    search = SearchStart(
        num_beams=i32(beams), beam_base=i32([0, 4, 6]), prompt_len=i32([len(p) for p in prompts]),
        max_length=i32([len(p) + 8 for p in prompts]), min_new=i32(min_new), ngram=i32(ngram),
        early_stopping=i32([0] * R), best_length=i32([-1] * R), source_len=i32([0] * R), prompts=prompts,
        divisors=np.ones((R, 9), dtype=np.float32), eos=i32(eos), cross_tables=[[]] * R, tables=[[0]] * TB,
        block_ids=i32(range(8)), holders=i32([1] + [0] * 7), free=i32(range(7, 0, -1)),
        prompt_candidates=[(poisoned, r) for r in range(R)], keep_stride=count, block_size=16, max_len=16,
        table_width=1, encoder_decoder=False)
    region = torch.empty(8 << 20, dtype=torch.uint8, device="cuda")
    ctx = BareStreamContext(kernel_library, stream)
    state = CudaDeviceSearch(ctx, search, state_arrays(search, ctx.shapes.max_blocks_per_seq), forward=None,
                             kv_cache=[], region=DeviceTensor.from_torch(region))
    generator = torch.Generator().manual_seed(count)
    if tied:
        logits = torch.randint(0, 4, (TB, vocab), generator=generator).bfloat16()
    else:
        logits = (torch.randn(TB, vocab, generator=generator) * 3.0).bfloat16()
    logits[0, 2] = 40.0                                     # a banned EOS as the row's maximum
    wide = torch.zeros(TB, 256256, dtype=torch.bfloat16, device="cuda")   # rows padded as the LM head's are
    wide[:, :vocab] = logits.cuda()
    device_logits = wide[:, :vocab]
    torch.cuda.synchronize()
    beam_state_candidates(kernel_library, stream, DeviceTensor.from_torch(device_logits), state.state, TB, 0, 0,
                          count, state.scratch)
    ids = torch.from_numpy(ctx.copy_to_host(state.views["cand_ids"])).long()
    values = torch.from_numpy(ctx.copy_to_host(state.views["cand_values"]))
    banned = [state_bans(p, n, m > 0, eos) for p, n, m, k in zip(prompts, ngram, min_new, beams) for _ in range(k)]
    assert banned[0] == [2, 7, 11, 40] and banned[4] == [3]
    want_values, want_ids = reference(logits, banned, count)
    assert (values - want_values).abs().max() < 2e-5
    assert torch.equal(ids, want_ids)       # ties (many, in bf16) go to the lower id


def test_beam_seed_gives_each_beam_its_requests_prompt_row(kernel_library, stream):
    """beam_seed (beam_step.cu) against torch indexing: each beam's row of the prompt pass's candidates, into the
    device search's first candidates (poisoned before); a row count or dtype that does not match is refused."""
    from metrale.runtime.backend.cuda.kernels.beam_step import beam_seed

    n, count = 5, 10
    rows = torch.tensor([3, 3, 0, 4, 4, 4, 1], dtype=torch.int32, device="cuda")
    ids = torch.randint(0, 256206, (n, count), dtype=torch.int32, device="cuda")
    values = torch.randn(n, count, device="cuda")
    cand_ids = torch.full((len(rows), count), -7, dtype=torch.int32, device="cuda")
    cand_values = torch.full((len(rows), count), POISON, device="cuda")
    views = [DeviceTensor.from_torch(t) for t in (cand_ids, cand_values, ids, values, rows)]
    beam_seed(kernel_library, stream, *views)
    stream.sync()
    assert torch.equal(cand_ids, ids[rows.long()]) and torch.equal(cand_values, values[rows.long()])
    with pytest.raises(InvalidArgument, match="beam_seed"):
        beam_seed(kernel_library, stream, *views[:4], DeviceTensor.from_torch(rows[:3]))
    with pytest.raises(InvalidArgument, match="beam_seed"):
        beam_seed(kernel_library, stream, views[0], views[0], *views[2:])
