"""copy_prefixes without a GPU: a sparse attention model's paged layers (its latents, then its index keys, each kind
at equal strides) are copied in one copy_kv_prefixes launch a kind."""

import pytest

pytest.importorskip("cuda.core")

from launcher_fakes import FakeLibrary, bf16, fp8_kv, i32, parameter_types, record_launches  # noqa: E402
from metrale.runtime.backend.cuda.kernels import rope_kv  # noqa: E402
from metrale.runtime.errors import InvalidArgument  # noqa: E402

LATENT, INDEX = (64, 16, 48), (64, 16, 32)       # [blocks, block_size, width]


def layers(latents: int, index: int) -> list:
    latent_bytes, index_bytes = 2 * 64 * 16 * 48, 2 * 64 * 16 * 32
    tensors = [bf16(*LATENT, offset=i * latent_bytes) for i in range(latents)]
    return tensors + [bf16(*INDEX, offset=latents * latent_bytes + i * index_bytes) for i in range(index)]


def test_each_kind_of_paged_layer_is_one_launch(monkeypatch):
    recorded = record_launches(monkeypatch, rope_kv)
    rope_kv.copy_prefixes(FakeLibrary(), None, layers(3, 2), i32(4, 3), 4)
    assert [(grid, args[0]) for _, grid, _, args, _ in recorded] == [((4, 3, 1), 1 << 32),
                                                                      ((4, 2, 1), (1 << 32) + 3 * 2 * 64 * 16 * 48)]
    assert all([type(a) for a in args] == parameter_types(module, name) for (module, name), _, _, args, _ in recorded)
    assert recorded[0][3][4] == 2 * 48 and recorded[1][3][4] == 2 * 32      # each launch's slot bytes


def test_fp8_kv_layers_copy_in_bytes(monkeypatch):
    recorded = record_launches(monkeypatch, rope_kv)
    shape = (2, 64, 16, 2, 64)
    layer_bytes = 2 * 64 * 16 * 2 * 64
    rope_kv.copy_prefixes(FakeLibrary(), None, [fp8_kv(*shape, offset=i * layer_bytes) for i in range(3)],
                          i32(4, 3), 4)
    [(_, grid, _, args, _)] = recorded
    assert grid == (4, 3, 2) and args[1:5] == [layer_bytes, layer_bytes // 2, 16, 2 * 64]


def test_one_kind_is_one_launch_and_unequal_strides_are_refused(monkeypatch):
    recorded = record_launches(monkeypatch, rope_kv)
    rope_kv.copy_prefixes(FakeLibrary(), None, layers(4, 0), i32(4, 3), 2)
    assert len(recorded) == 1
    with pytest.raises(InvalidArgument):
        rope_kv.copy_kv_prefixes(FakeLibrary(), None, layers(2, 2), i32(4, 3), 2)
