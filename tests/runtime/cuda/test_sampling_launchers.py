"""sampling.cu's host side, without a GPU: the per-row parameter packer against the kernels' struct, the penalty
lists' packer, and the launchers' argument checks against the kernels' parameter lists."""

import re

import numpy as np
import pytest

pytest.importorskip("cuda.core")

from metrale.runtime.backend.cuda.compiler import kernel_sources  # noqa: E402
from metrale.runtime.backend.cuda.kernels import sampling as sampling_launchers  # noqa: E402
from metrale.runtime.backend.cuda.kernels.sampling import (  # noqa: E402
    ENTRY_WORDS, FLAG_GREEDY, FLAG_LOGPROBS, FLAG_PENALISED, PARAM_WORDS, PARAMS_DTYPE, apply_penalties,
    pack_penalties, pack_sampling_params, sample_rows)
from metrale.runtime.backend.cuda.launch import kernel_arg  # noqa: E402
from metrale.runtime.backend.cuda.sampler import OUT_WORDS, Wanted, read_outputs  # noqa: E402
from metrale.runtime.errors import DeviceFault  # noqa: E402
from metrale.runtime.sampling.params import MAX_TOP_LOGPROBS  # noqa: E402
from metrale.runtime.backend.cuda.tensor import DeviceTensor  # noqa: E402
from metrale.runtime.errors import InvalidArgument  # noqa: E402
from metrale.runtime.sampling import OutputOptions, SampleRow, SamplingParams  # noqa: E402

WIDTH = 20            # columns of the top-n outputs, as test_sampling_kernel.py's


def test_params_layout_matches_the_kernel_struct():
    body = re.search(r"struct SampleParams \{(.*?)\};", kernel_sources()["sampling"], re.S).group(1)
    fields = []
    for line in body.splitlines():
        declaration = line.split("//")[0].strip().rstrip(";")
        if declaration:
            kind, names = declaration.split(None, 1) if not declaration.startswith("unsigned") else \
                ("unsigned", declaration.split(None, 2)[2])
            fields += [(kind, name.strip()) for name in names.split(",")]
    assert [name for _, name in fields if not name.startswith("reserved")] == list(PARAMS_DTYPE.names)
    sizes = {"double": 8, "float": 4, "int": 4, "unsigned": 4}
    offset = 0
    for kind, name in fields:
        if not name.startswith("reserved"):
            assert PARAMS_DTYPE.fields[name][1] == offset, name
            assert PARAMS_DTYPE.fields[name][0].itemsize == sizes[kind], name
        offset += sizes[kind] * (2 if name.startswith("reserved") else 1)
    assert offset == PARAMS_DTYPE.itemsize == 4 * PARAM_WORDS


def test_pack_sampling_params():
    rows = [SampleRow(SamplingParams(temperature=0.7, top_k=50, top_p=0.9, min_p=0.05, presence_penalty=0.5),
                      OutputOptions(logprobs=True, top_logprobs=7), seed=2**64 - 3, position=2**33 + 5,
                      history=[], output_tokens=[]),
            SampleRow(SamplingParams(), OutputOptions(), seed=0, position=0, history=[], output_tokens=[])]
    packed = pack_sampling_params(rows)
    assert packed.shape == (2, PARAM_WORDS) and packed.dtype == np.int32
    fields = packed.view(PARAMS_DTYPE).reshape(2)
    assert fields["top_p_limit"][0] == np.nextafter(0.9, -1.0) and fields["top_p_limit"][1] >= 1.0
    assert fields["temperature"][0] == np.float32(0.7) and fields["min_p"][0] == np.float32(0.05)
    assert fields["top_k"][0] == 50 and fields["presence_penalty"][0] == np.float32(0.5)
    assert (int(fields["seed_hi"][0]) << 32 | int(fields["seed_lo"][0])) == 2**64 - 3
    assert (int(fields["position_hi"][0]) << 32 | int(fields["position_lo"][0])) == 2**33 + 5
    assert fields["flags"].tolist() == [FLAG_PENALISED | FLAG_LOGPROBS, FLAG_GREEDY]
    assert fields["top_logprobs"].tolist() == [7, 0]


def test_pack_sampling_params_shares_each_pair_of_params_and_options():
    """Rows that share parameter objects, and equal ones that do not, pack as each row alone packs."""
    shared, options = SamplingParams(temperature=0.8, top_p=0.5, seed=3), OutputOptions(logprobs=True)
    params = [shared, SamplingParams(), shared, SamplingParams(temperature=0.8, top_p=0.5, seed=3),
              SamplingParams(repetition_penalty=1.3, top_k=2**40)]
    rows = [SampleRow(p, options if i % 2 else OutputOptions(top_logprobs=i), seed=(i * 2**61 + 5) % 2**64,
                      position=2**32 * i + 7, history=[], output_tokens=[]) for i, p in enumerate(params)]
    rows.append(SampleRow(rows[0].params, rows[0].options, seed=1, position=2, history=[], output_tokens=[]))
    cache = {}
    together = pack_sampling_params(rows, cache)
    assert together.tolist() == [pack_sampling_params([row])[0].tolist() for row in rows]
    assert len(cache) == 5 and pack_sampling_params(rows[::-1], cache).tolist() == together.tolist()[::-1]
    fields = together.view(PARAMS_DTYPE).reshape(len(rows))
    assert fields["top_k"][4] == 2**31 - 1 and fields["position_hi"].tolist() == [0, 1, 2, 3, 4, 0]


def outputs_image(tokens, logprobs, top_ids, top_logprobs) -> np.ndarray:
    """The outputs region as sample_rows leaves it: tokens, logprobs, then the top-n ids and logprobs, a row each."""
    n = len(tokens)
    host = np.zeros(n * OUT_WORDS, dtype=np.int32)
    host[:n] = tokens
    host[n:2 * n] = np.asarray(logprobs, dtype=np.float32).view(np.int32)
    host[2 * n:2 * n + n * MAX_TOP_LOGPROBS] = np.asarray(top_ids, dtype=np.int32).reshape(-1)
    host[2 * n + n * MAX_TOP_LOGPROBS:] = np.asarray(top_logprobs, dtype=np.float32).view(np.int32).reshape(-1)
    return host


@pytest.mark.parametrize("flags", [(True, True, True), (False, False, False), (True, False, True)])
def test_read_outputs_gives_each_row_what_it_asked_for(flags):
    options = [OutputOptions(logprobs=flags[0], top_logprobs=2), OutputOptions(logprobs=flags[1]),
               OutputOptions(logprobs=flags[2], top_logprobs=MAX_TOP_LOGPROBS, return_logits=True)]
    rows = [SampleRow(SamplingParams(), o, 0, 4, [], ()) for o in options]
    top_ids = np.arange(3 * MAX_TOP_LOGPROBS).reshape(3, MAX_TOP_LOGPROBS) + 100
    top_logprobs = -np.arange(3 * MAX_TOP_LOGPROBS, dtype=np.float32).reshape(3, MAX_TOP_LOGPROBS) / 8
    wanted = Wanted(rows)
    result = read_outputs(outputs_image([7, 8, 9], [-0.5, -1.5, -2.5], top_ids, top_logprobs), wanted)
    assert result.tokens == [7, 8, 9]
    assert [lp if flag else "nan" for lp, flag in zip(result.logprobs, flags)] == \
        [lp if flag else "nan" for lp, flag in zip([-0.5, -1.5, -2.5], flags)]
    assert all(np.isnan(lp) for lp, flag in zip(result.logprobs, flags) if not flag)
    assert result.top_logprobs[0] == (top_ids[0, :2].tolist(), top_logprobs[0, :2].tolist())
    assert result.top_logprobs[1] is None
    assert result.top_logprobs[2] == (top_ids[2].tolist(), top_logprobs[2].tolist())
    assert wanted.raw == [2] and result.logits == [None, None, None]      # the sampler copies row 2's logits


def test_read_outputs_refuses_a_row_with_nothing_to_sample():
    rows = [SampleRow(SamplingParams(), OutputOptions(), 0, 4, [], ())] * 2
    zeros = np.zeros((2, MAX_TOP_LOGPROBS))
    with pytest.raises(DeviceFault, match="no finite maximum"):
        read_outputs(outputs_image([3, -1], [0.0, 0.0], zeros, zeros), Wanted(rows))


def test_pack_penalties_lists_each_token_once():
    params = SamplingParams(temperature=1.0, repetition_penalty=1.2, frequency_penalty=0.5,
                            logit_bias=((9, 1.0), (3, 2.0), (9, -0.5)))
    rows = [SampleRow(SamplingParams(), OutputOptions(), 0, 0, [1, 2], [2]),
            SampleRow(params, OutputOptions(), 0, 0, history=[4, 3, 3, 12, -1], output_tokens=[3, 3, 5])]
    lists = pack_penalties(rows, vocab_size=10)
    assert lists.entry_offsets.tolist() == [0, 0, 4]
    assert lists.entries.shape == (4, ENTRY_WORDS)
    # (id, output count, in history, first bias, number of biases); history ids past the vocabulary are skipped
    assert lists.entries.tolist() == [[3, 2, 1, 0, 1], [4, 0, 1, 1, 0], [5, 1, 0, 1, 0], [9, 0, 0, 1, 2]]
    assert lists.biases.tolist() == [2.0, 1.0, -0.5]


class FakeLibrary:
    def get(self, kernel_name, module):
        return module, kernel_name


def kernel_parameter_types(kernel: str) -> list[type]:
    match = re.search(rf'void __launch_bounds__\(\w+\) {kernel}\(([^)]*)\)', kernel_sources()["sampling"])
    types = []
    for parameter in match.group(1).split(","):
        declaration = " ".join(parameter.split())
        types.append(np.uint64 if "*" in declaration else np.int64 if declaration.startswith("long long")
                     else np.int32)
    return types


def test_launchers_check_shapes_and_pass_what_the_kernels_take(monkeypatch):
    launched = []

    def record(stream, kernel, grid, block, *args, shmem=0):
        converted = [kernel_arg(a) for a in args]
        assert [type(a) for a in converted] == kernel_parameter_types(kernel[1]), kernel[1]
        launched.append((kernel[1], grid, block))

    monkeypatch.setattr(sampling_launchers, "launch_kernel", record)
    base = 1 << 32

    def tensor(shape, dtype, offset=0):
        return DeviceTensor(base + offset, shape, dtype)

    logits, params = tensor((4, 1000), "float32"), tensor((4, PARAM_WORDS), "int32")
    tokens, logprobs = tensor((4,), "int32"), tensor((4,), "float32")
    top_ids, top_values = tensor((4, WIDTH), "int32"), tensor((4, WIDTH), "float32")
    lib = FakeLibrary()
    sample_rows(lib, None, logits, params, tokens, logprobs, top_ids, top_values, 5)
    sample_rows(lib, None, logits, params, tokens, logprobs, None, None, 0, processed=logits)
    apply_penalties(lib, None, logits, logits, params, tensor((5,), "int32"), tensor((0, ENTRY_WORDS), "int32"),
                    tensor((0,), "float32"))
    sampling_launchers.widen_rows(lib, None, logits, tensor((4, 1000), "bfloat16"))
    assert launched == [("sample_rows", 4, 1024), ("sample_rows", 4, 1024), ("apply_penalties", 4, 1024),
                        ("widen_rows", (4, 1), 256)]
    bad_calls = [
        lambda: sample_rows(lib, None, tensor((4, 1000), "bfloat16"), params, tokens, logprobs, None, None, 0),
        lambda: sample_rows(lib, None, logits, tensor((3, PARAM_WORDS), "int32"), tokens, logprobs, None, None, 0),
        lambda: sample_rows(lib, None, logits, tensor((4, PARAM_WORDS), "int32", 4), tokens, logprobs, None, None,
                            0),
        lambda: sample_rows(lib, None, logits, params, tensor((5,), "int32"), logprobs, None, None, 0),
        lambda: sample_rows(lib, None, logits, params, tokens, logprobs, None, None, 3),
        lambda: sample_rows(lib, None, logits, params, tokens, logprobs, top_ids, top_values, 21),
        lambda: sample_rows(lib, None, tensor((4, (1 << 20) + 1), "float32"), params, tokens, logprobs, None,
                            None, 0),
        lambda: apply_penalties(lib, None, logits, logits, params, tensor((4,), "int32"),
                                tensor((0, ENTRY_WORDS), "int32"), tensor((0,), "float32")),
        lambda: sampling_launchers.widen_rows(lib, None, logits, logits),
        lambda: sampling_launchers.widen_rows(lib, None, tensor((3, 1000), "float32"), tensor((4, 1000), "bfloat16")),
    ]
    for call in bad_calls:
        with pytest.raises(InvalidArgument):
            call()
    assert len(launched) == 4
