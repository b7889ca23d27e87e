"""Runs each bench script's main with tiny sizes, so the scripts keep working; timings are not checked (§6)."""

from pathlib import Path

import gguf
import pytest

from tiny_gguf import tiny_model, write_tiny_gguf
from tiny_models import write_tiny

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def bench(monkeypatch):
    # The scripts run as `python -m bench.<name>` from the repository root, which is not always on sys.path here.
    monkeypatch.syspath_prepend(str(ROOT))
    import bench.beam_generate
    import bench.beam_host
    import bench.cpu_decode
    import bench.engine_host
    import bench.fp8_accuracy
    import bench.gguf_accuracy
    import bench.grpc_overhead
    import bench.prefix_cache
    import bench.serving

    return bench


def test_prefix_cache_reports_both_modes(bench, tmp_path, capsys):
    model = write_tiny("llama_tied", tmp_path / "llama")
    result = bench.prefix_cache.main(["--model", str(model), "--requests", "3", "--system", "40", "--question", "3",
                                      "--decode-steps", "1", "--reps", "1", "--json", str(tmp_path / "out.json")])
    rows = {row["cache"]: row for row in result["rows"]}
    # on: the system prompt's two full blocks served to each request; off: every token computed
    assert rows["on"]["computed_tokens"] == 3 * (40 + 3 - 32) and rows["off"]["computed_tokens"] == 3 * 43
    assert "off/on" in capsys.readouterr().out and (tmp_path / "out.json").exists()


def test_grpc_overhead_measures_every_size(bench, capsys):
    rows = bench.grpc_overhead.main(["--sizes", "1,3", "--iterations", "5", "--warmup", "1"])
    assert [(r.server, r.rpc, r.num_sequences) for r in rows] == [
        (server, rpc, n) for server in ("worker", "echo") for n in (1, 3) for rpc in ("Decode", "Steps")]
    assert all(0 < r.p50_us <= r.p99_us for r in rows)
    assert "sequences" in capsys.readouterr().out


def test_stub_engine_answers_one_token_per_decode_token(bench):
    from metrale.runtime.config import EngineConfig
    from metrale.runtime.step import DecodeToken, PrefillSlice, Step

    from bench.stub_model import StubEngine

    step = Step(decode=(DecodeToken(5, 1), DecodeToken(7, 2)), prefill=(PrefillSlice(9, (1, 2), is_last_chunk=False),))
    out = StubEngine(EngineConfig(device="cpu")).step(step)
    assert [(o.seq_id, o.token, o.logprob) for o in out.outputs] == [(5, 0, 0.0), (7, 0, 0.0)]


def test_cpu_decode_reports_engine_and_grpc_per_batch(bench, tmp_path, capsys):
    model = write_tiny("llama_tied", tmp_path / "llama")
    rows = bench.cpu_decode.main(["--model", str(model), "--batches", "1,2", "--steps", "2", "--warmup", "1",
                                  "--prompt-len", "4", "--copy-mb", "1"])
    assert [(r.batch, r.weights, r.path) for r in rows] == [
        (batch, "float32", path) for batch in (1, 2) for path in ("engine", "grpc")]
    assert all(r.floor_ms > 0 and r.tokens_per_s > 0 for r in rows)
    out = capsys.readouterr().out
    assert "x floor" in out and "copy bandwidth" in out


def test_cpu_decode_runs_a_ggufs_blocks_beside_it_dequantized(bench, tmp_path, capsys):
    model = write_tiny_gguf(tmp_path / "tiny.gguf", "llama_tied", tiny_model("llama_tied"),
                            gguf.GGMLQuantizationType.Q4_1)
    rows = bench.cpu_decode.main(["--model", str(model), "--batches", "1", "--steps", "2", "--warmup", "1",
                                  "--prompt-len", "4", "--copy-mb", "1"])
    assert [(r.weights, r.path) for r in rows] == [(weights, path) for weights in ("blocks", "float32")
                                                   for path in ("engine", "grpc")]
    # the blocks' floor counts their packed bytes: 4-bit codes and two bf16 a group of 32, under a third of float32
    assert rows[0].floor_ms < rows[2].floor_ms / 3
    assert "blocks" in capsys.readouterr().out


def test_gguf_accuracy_compares_blocks_and_bfloat16_with_float32(bench, tmp_path, capsys):
    model = write_tiny_gguf(tmp_path / "tiny.gguf", "llama_tied", tiny_model("llama_tied"),
                            gguf.GGMLQuantizationType.Q8_0)
    rows = bench.gguf_accuracy.main(["--model", str(model), "--steps", "3", "--prompts", "2"])
    assert [r.run for r in rows] == ["blocks", "bfloat16"] * 2
    assert all(0 < r.max_error < 0.1 and r.steps == 4 for r in rows)
    assert "max rel" in capsys.readouterr().out


def test_fp8_accuracy_scores_both_runs(bench, tmp_path, capsys):
    model = write_tiny_gguf(tmp_path / "tiny.gguf", "llama_tied", tiny_model("llama_tied"),
                            gguf.GGMLQuantizationType.Q8_0)
    result = bench.fp8_accuracy.main(["--model", str(model), "--device", "cpu", "--steps", "3", "--prompts", "2",
                                      "--text-tokens", "40"])
    assert result["steps"] == 8 and 0 <= result["agree"] <= 8
    assert all(1 < p < 256 for p in result["perplexity"].values())
    assert "perplexity" in capsys.readouterr().out
    kv = bench.fp8_accuracy.main(["--model", str(model), "--device", "cpu", "--steps", "3", "--prompts", "1",
                                  "--text-tokens", "40", "--quantize", "none", "--kv-dtype", "fp8"])
    assert kv["steps"] == 4 and kv["perplexity"]["base"] == result["perplexity"]["base"]


def test_beam_generate_reports_both_sides_and_agreement(bench, tmp_path, capsys):
    result = bench.beam_generate.main(["--shape", "tiny", "--device", "cpu", "--batches", "1,3", "--reps", "1",
                                       "--source-len", "6", "--new-tokens", "5", "--json", str(tmp_path / "out.json")])
    rows = result["row_objects"]
    assert [(r.batch, r.impl) for r in rows] == [(1, "metrale"), (1, "transformers"), (3, "metrale"),
                                                 (3, "transformers")]
    assert all(len(r.step_ms) == 1 and r.step_ms[0] > 0 for r in rows)
    # float32 on the CPU: the same top hypothesis as transformers for every request.
    assert result["agreement"] == {1: 1, 3: 3}
    assert "sentences/s" in capsys.readouterr().out and (tmp_path / "out.json").exists()


def test_beam_host_times_the_loop_without_a_model(bench, capsys):
    rows = bench.beam_host.main(["--batches", "1,3", "--reps", "2", "--new-tokens", "4", "--source-len", "5"])
    assert [r.batch for r in rows] == [1, 3] and all(len(r.step_ms) == 2 and r.p50 > 0 for r in rows)
    assert "host ms a step" in capsys.readouterr().out


def test_engine_host_times_the_engine_and_grpc_over_an_emulated_device(bench, capsys):
    rows = bench.engine_host.main(["--batches", "1,3", "--device-ms", "0,2", "--context", "40", "--steps", "4",
                                   "--warmup", "2"])
    assert [(r.path, r.batch) for r in rows] == [("engine", 1), ("engine", 3), ("gRPC", 1), ("gRPC", 3)]
    assert all(len(r.step_ms) == 4 and len(r.idle_ms) == 4 for r in rows)
    # the device's steps of 2 ms run one after another: of the 4 timed answers' steps, at least the last 3 start
    # within the timed run (a step's answer may come sooner than 2 ms after its request: its guess ran ahead)
    assert all(sum(r.step_ms) >= 3 * 2.0 for r in rows if r.batch == 3)
    assert "host share" in capsys.readouterr().out


def test_serving_reports_every_rate_and_the_step_benchmark(bench, tmp_path, capsys):
    model = write_tiny("llama_tied", tmp_path / "llama")
    result = bench.serving.main(["--model", str(model), "--requests", "6", "--rates", "50,inf", "--input", "12,0.5",
                                 "--output", "4,0.5", "--max-model-len", "64", "--step-steps", "2",
                                 "--saturation", "3x8x12"])
    assert [row["rate"] for row in result["rows"]] == [50.0, float("inf")]
    assert result["saturated"]["tokens_in_window"] > 0 and result["saturated"]["batch"] == 3
    assert all(row["output_tokens"] > 0 and row["ttft_p50_ms"] > 0 for row in result["rows"])
    assert result["step"]["tokens_per_s"] > 0 and "at saturation" in capsys.readouterr().out


def test_kernel_parts_name_the_costliest_unmatched_kernels(bench):
    from bench.kernel_parts import OTHERS_NAMED, tally

    kernels = [("moe_route", 1.0), ("Attention_x", 2.0), ("mystery", 5.0), ("odd", 0.5), ("odd", 0.5), ("rare", 0.1),
               ("tiny", 0.05), ("gemm_a", 3.0)]
    totals = tally(kernels, (("routing", ("moe_route",)), ("attention", ("attention",)), ("GEMMs", ("gemm",))))
    assert OTHERS_NAMED == 3
    assert totals == {"routing": 1.0, "attention": 2.0, "GEMMs": 3.0, "other: mystery": 5.0, "other: odd": 1.0,
                      "other: rare": 0.1, "other": 0.05}
