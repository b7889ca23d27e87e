"""latent_attention.cu's launchers without a GPU: their arguments match each kernel's parameter list, the attention's
grid follows the entries, heads and splits (its splits merged by paged_decode_reduce only where there are several),
its shared memory is what the kernel lays out, a selection picks the _selected kernel and splits its lists (their
counts the reduce's contexts), sinks reach the attention and the reduce, and bad shapes are refused before anything
is launched."""

import pytest

pytest.importorskip("cuda.core")

from launcher_fakes import BASE, FakeLibrary, bf16, f32, i32, parameter_types, record_launches  # noqa: E402
from metrale.runtime.backend.cuda.kernels import latent_attention  # noqa: E402
from metrale.runtime.errors import InvalidArgument  # noqa: E402


# Where the fakes' contexts, selection, counts and sinks lie (distinct, so each launch argument can be told apart).
CONTEXTS, SELECTED, COUNTS, SINKS = 1 << 20, 2 << 20, 3 << 20, 4 << 20


def decode(lib, entries=3, heads=20, rank=512, rope=64, max_context=1000, partition=256, out=None, cache=None,
           splits=4, **selection):
    """A decode launch; partials for `splits` splits."""
    latent_attention.decode(lib, None, out or bf16(entries, heads * rank), bf16(entries, heads * (rank + rope)),
                            cache or bf16(4096, rank + rope), i32(entries), i32(entries, offset=CONTEXTS), i32(8, 70),
                            i32(entries), f32(latent_attention.partials_elements(entries, heads, rank, splits)),
                            heads, 16, 0.1, max_context, partition, **selection)


def selection(queries=3, width=1024, heads=20, sinks=True):
    """decode()'s (or prefill()'s) keyword arguments: lists of up to `width` tokens for `queries` queries (columns of
    rows width + 6 apart), and sinks for `heads` heads (or none)."""
    return dict(selected=i32(queries, width + 6, offset=SELECTED).columns(0, width),
                selected_counts=i32(queries, offset=COUNTS), sinks=f32(heads, offset=SINKS) if sinks else None)


@pytest.mark.parametrize("max_context, launches", [(1000, 2), (200, 1)])
def test_decode_launches_match_the_kernels(monkeypatch, max_context, launches):
    recorded = record_launches(monkeypatch, latent_attention)
    decode(FakeLibrary(), max_context=max_context)
    assert len(recorded) == launches
    (module, name), grid, block, args, shmem = recorded[0]
    assert name == "latent_decode_attention_r512_p64"
    assert [type(a) for a in args] == parameter_types(module, name, "LATENT_ENTRY")
    assert grid == (-(-max_context // 256), 2, 3) and block == 128
    assert shmem == latent_attention.shared_bytes(512, 64) == 2 * (2 * 32 * 584 + 16 * 584) + 4 * 16 * 32 * 4
    assert args[-4:] == [0, 0, 0, 0]          # no selection, no sinks
    if launches == 2:
        (module, name), grid, block, args, _ = recorded[1]
        assert name == "paged_decode_reduce" and grid == (20, 3) and block == 512
        assert [type(a) for a in args] == parameter_types(module, name)
        assert args[3] == BASE + CONTEXTS and args[6] == 0


@pytest.mark.parametrize("selected, sinks", [(True, True), (True, False), (False, True)])
def test_a_selection_and_sinks_reach_the_kernels(monkeypatch, selected, sinks):
    """A selection: the _selected kernel over the lists (1000 items in splits of 256), the reduce merging by their
    counts; sinks: their pointer to both launches."""
    recorded = record_launches(monkeypatch, latent_attention)
    chosen = selection(sinks=sinks)
    if not selected:
        chosen = dict(sinks=chosen["sinks"])
    decode(FakeLibrary(), max_context=1000, **chosen)
    [((module, name), grid, _, args, _), ((reduce_module, reduce), _, _, merged, _)] = recorded
    assert name == f"latent_decode_attention{'_selected' if selected else ''}_r512_p64" and grid == (4, 2, 3)
    assert [type(a) for a in args] == parameter_types(module, name, "LATENT_ENTRY")
    sink = BASE + SINKS if sinks else 0
    assert args[-4:] == ([BASE + SELECTED, BASE + COUNTS, 1030, sink] if selected else [0, 0, 0, sink])
    assert reduce == "paged_decode_reduce" and [type(a) for a in merged] == parameter_types(reduce_module, reduce)
    assert merged[3] == BASE + (COUNTS if selected else CONTEXTS) and merged[6] == sink


def test_prefill_is_one_split_an_entry_a_token(monkeypatch):
    recorded = record_launches(monkeypatch, latent_attention)
    latent_attention.prefill(FakeLibrary(), None, bf16(40, 16 * 512), bf16(40, 16 * 576), bf16(4096, 576), i32(3),
                             i32(3), i32(3), i32(3, 70), 16, 16, 0.1, 3, 20, 1000)
    assert len(recorded) == 1
    (module, name), grid, block, args, shmem = recorded[0]
    assert [type(a) for a in args] == parameter_types(module, name, "LATENT_ENTRY")
    assert grid == (20, 1, 3) and args[16] == 1024 and shmem == latent_attention.shared_bytes(512, 64)
    assert args[-4:] == [0, 0, 0, 0]


def test_prefill_with_a_selection_takes_a_list_a_token(monkeypatch):
    """Each of the 40 rows its own list (of up to 2048 tokens: one split of 2048), the heads their sinks."""
    recorded = record_launches(monkeypatch, latent_attention)
    latent_attention.prefill(FakeLibrary(), None, bf16(40, 16 * 512), bf16(40, 16 * 576), bf16(4096, 576), i32(3),
                             i32(3), i32(3), i32(3, 70), 16, 16, 0.1, 3, 20, 2048,
                             **selection(queries=40, width=2048, heads=16))
    [((module, name), grid, _, args, _)] = recorded
    assert name == "latent_decode_attention_selected_r512_p64" and grid == (20, 1, 3)
    assert [type(a) for a in args] == parameter_types(module, name, "LATENT_ENTRY")
    assert args[16] == 2048 and args[-4:] == [BASE + SELECTED, BASE + COUNTS, 2054, BASE + SINKS]


def test_rope_and_write_launch_matches_the_kernel(monkeypatch):
    recorded = record_launches(monkeypatch, latent_attention)
    q, out, compressed = bf16(5, 3 * 192), bf16(5, 3 * 576), bf16(5, 576)
    latent_attention.rope_and_write(FakeLibrary(), None, out.columns(512, 576), 576, q.columns(128, 192), 192,
                                    compressed.columns(0, 512), compressed.columns(512, 576), f32(64, 32), f32(64, 32),
                                    i32(5), i32(5), bf16(100, 576), 3)
    (module, name), grid, block, args, _ = recorded[0]
    assert [type(a) for a in args] == parameter_types(module, name) and grid == 5


@pytest.mark.parametrize("call", [
    lambda lib: decode(lib, rank=128, out=bf16(3, 20 * 128), cache=bf16(4096, 192)),    # a rank not built
    lambda lib: decode(lib, partition=48),                                              # not a multiple of 32
    lambda lib: decode(lib, max_context=5000),                                          # partials too small
    lambda lib: decode(lib, selected=i32(3, 1024)),                                     # a selection without counts
    lambda lib: decode(lib, **{**selection(), "selected": f32(3, 1024)}),               # positions not int32
    lambda lib: decode(lib, **{**selection(), "selected": i32(4, 1024)}),               # a list too many
    lambda lib: decode(lib, **{**selection(), "selected_counts": i32(4)}),              # a count too many
    lambda lib: decode(lib, **selection(width=512)),                                    # max_context past the lists
    lambda lib: decode(lib, sinks=f32(16)),                                             # a sink a head
    lambda lib: decode(lib, sinks=bf16(20)),                                            # sinks not float32
    lambda lib: latent_attention.prefill(lib, None, bf16(40, 16 * 512), bf16(40, 16 * 576), bf16(4096, 576), i32(3),
                                         i32(3), i32(3), i32(3, 70), 16, 16, 0.1, 3, 20, 1024,
                                         **selection(queries=3, heads=16)),             # a list a segment, not a row
])
def test_bad_shapes_are_refused_before_a_launch(monkeypatch, call):
    recorded = record_launches(monkeypatch, latent_attention)
    with pytest.raises(InvalidArgument):
        call(FakeLibrary())
    assert not recorded


class Resident(FakeLibrary):
    def __init__(self):
        super().__init__()
        self.asked = []         # the kernels whose resident CTAs were asked for

    def resident_ctas(self, kernel_name, module, threads, shared_bytes=0):
        assert shared_bytes == latent_attention.shared_bytes(512, 64)
        self.asked.append(kernel_name)
        return 264


@pytest.mark.parametrize("selected", [True, False])
def test_the_kernel_launched_plans_the_splits(monkeypatch, selected):
    recorded = record_launches(monkeypatch, latent_attention)
    lib = Resident()
    decode(lib, heads=16, max_context=1000, partition=None, splits=16, **(selection(heads=16) if selected else {}))
    name = latent_attention.kernel_name(512, 64, selected)
    assert lib.asked == [name] and recorded[0][0] == (latent_attention.MODULE, name)


@pytest.mark.parametrize("max_context", [100, 8192, 163840])
def test_the_workspace_bound_covers_every_batch_and_context(max_context):
    """The partials the memory plan holds cover every launch's: each batch up to the bound's, each context up to
    max_context, as partition_for splits it."""
    lib, heads = Resident(), 16
    bound = latent_attention.workspace_bound(lib, 64, heads, 512, 64, max_context)
    for batch in (1, 2, 7, 64):
        for context in {1, 63, 1000, max_context // 2, max_context}:
            splits = latent_attention.partition_for(lib, batch, heads, context, 512, 64)[1]
            assert latent_attention.partials_elements(batch, heads, 512, splits) <= bound
