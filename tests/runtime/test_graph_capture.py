"""Graph capture's host state, no GPU needed: the collector stays off while any stream captures a CUDA graph, and
the padded shapes an encoder pass and a decoder's prompts replay a graph for."""

import gc
import threading

from types import SimpleNamespace

import torch

from metrale.runtime.backend.cuda import graphs
from metrale.runtime.backend.cuda.batch import PrefillPadding
from metrale.runtime.batch import Segment, build_batch
from metrale.runtime.sequence import BlockTable


def test_the_collector_stays_off_until_the_last_overlapping_capture_ends():
    first_in, second_in, first_out = threading.Event(), threading.Event(), threading.Event()
    seen = {}

    def first():
        with graphs.no_collection():
            first_in.set()
            second_in.wait(5)
        seen["after first"] = gc.isenabled()
        first_out.set()

    def second():
        first_in.wait(5)
        with graphs.no_collection():
            second_in.set()
            first_out.wait(5)
            seen["second, first done"] = gc.isenabled()

    assert gc.isenabled()
    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert seen == {"after first": False, "second, first done": False}
    assert gc.isenabled()


def test_a_collector_turned_off_before_stays_off():
    gc.disable()
    try:
        with graphs.no_collection():
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()


def encoder_batch(lengths, sample=False):
    return build_batch([Segment(BlockTable([i]), 0, list(range(3, 3 + n)), sample) for i, n in enumerate(lengths)], 64)


def test_encoder_passes_pad_to_powers_of_two_within_the_plan():
    ctx = SimpleNamespace(shapes=SimpleNamespace(max_batch_tokens=512, max_seqs=16))
    encoder = graphs.PrefillGraphs.encoder(ctx)
    assert encoder.padding(encoder_batch([5, 30, 7])) == PrefillPadding(64, 4, 64, sampled=0)
    assert encoder.padding(encoder_batch([40] * 9)) == PrefillPadding(512, 16, 64)
    assert encoder.padding(encoder_batch([40] * 13)) is None          # 1024 rows: over the plan, eager


def test_decoder_prompts_pad_their_sampled_rows_too():
    """A decoder's prompts (a start token and a target language's, or a longer prefix) sample each segment's last
    row: those pad to a power of two with the segments, the rows from 16, the longest segment from its own length."""
    ctx = SimpleNamespace(shapes=SimpleNamespace(max_batch_tokens=512, max_seqs=16))
    prompts = graphs.PrefillGraphs.prompts(ctx)
    assert prompts.padding(encoder_batch([2] * 16, sample=True)) == PrefillPadding(32, 16, 2, sampled=16)
    assert prompts.padding(encoder_batch([2, 1, 3], sample=True)) == PrefillPadding(16, 4, 4, sampled=4)
    assert prompts.padding(encoder_batch([2, 1, 3])) == PrefillPadding(16, 4, 4, sampled=0)
    assert prompts.padding(encoder_batch([2] * 17, sample=True)) is None     # 17 segments: over max_seqs, eager
    every_row = encoder_batch([3, 2], sample=True)
    every_row.sample_rows = torch.arange(5)
    assert prompts.padding(every_row) is None            # more sampled rows than segments: not a prompt pass



def test_a_decode_step_fits_the_smallest_bucket_it_reaches_and_nothing_else_fits_one():
    sizes = (1, 2, 4, 8)
    assert graphs.decode_bucket(encoder_batch([1, 1, 1], sample=True), sizes) == 4
    assert graphs.decode_bucket(encoder_batch([1], sample=True), sizes) == 1
    assert graphs.decode_bucket(encoder_batch([1] * 9, sample=True), sizes) is None           # past every bucket
    assert graphs.decode_bucket(encoder_batch([1, 2], sample=True), sizes) is None            # a segment of two tokens
    assert graphs.decode_bucket(encoder_batch([1, 1]), sizes) is None      # rows that sample nothing
