"""The GPU bench (bench/gpu_decode.py) and its peer (bench/peer_llama.py) on the CPU with a tiny shape: the run's
code paths, the peer against the engine, the peer's decode step under torch.compile's tracing, the accounting
and the tables. No timing is checked (§6); the GPU figures come from running the script on the H200."""

import json
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def bench(monkeypatch):
    # The scripts run as `python -m bench.<name>` from the repository root, which is not always on sys.path here.
    monkeypatch.syspath_prepend(str(ROOT))
    import bench.decode_tables
    import bench.gpu_decode
    import bench.gpu_moe
    import bench.gpu_ssm
    import bench.gpu_tensor_parallel
    import bench.model_shapes
    import bench.peer_llama

    return bench


def tiny_run_args(tmp_path, *more):
    return ["--shape", "tiny", "--device", "cpu", "--batches", "1,2", "--context", "8", "--steps", "2",
            "--warmup", "1", "--prefill", "1x16,2x8", "--prefill-reps", "1", "--prefill-warmup", "1",
            "--copy-mb", "1", "--gemm-size", "32", "--peer-compile", "none", "--json", str(tmp_path / "out.json"),
            *more]


def test_gpu_decode_runs_every_phase_on_the_cpu(bench, tmp_path, capsys):
    result = bench.gpu_decode.main(tiny_run_args(tmp_path, "--chunked-prefill", "24x8"))
    assert result["errors"] == []
    decode = result["decode_rows"]
    assert [(r.batch, r.impl) for r in decode] == [
        (1, "metrale"), (1, "grpc"), (1, "steps"), (1, "grpc-sync"), (1, "peer"),
        (2, "metrale"), (2, "grpc"), (2, "steps"), (2, "grpc-sync"), (2, "peer")]
    assert all(r.ok and len(r.step_ms) == 2 and r.floor_ms > 0 and r.tokens_per_s > 0 for r in decode)
    assert all(len(r.other_ms) == 2 for r in decode if r.impl == "metrale")   # host clock of each step
    prefill = result["prefill_rows"]
    assert [(r.label, r.impl) for r in prefill] == [("1x16", "metrale"), ("1x16", "grpc"), ("1x16", "peer"),
                                                     ("2x8", "metrale"), ("2x8", "grpc"), ("2x8", "peer")]
    assert all(r.ok and r.fraction_of_gemm > 0 for r in prefill)
    chunked = result["chunked_prefill"]      # one prompt whole and in chunks, on the engine and through gRPC
    assert chunked["tokens"] == 24 and chunked["chunk"] == 8
    assert all(chunked[k] > 0 for k in ("whole", "chunked", "grpc whole", "grpc chunked"))
    # Same model on both sides (engine float32 on the CPU, peer bf16).
    assert result["check"]["finite"] and result["check"]["relative_error"] < 5e-2
    out = capsys.readouterr().out
    assert out.startswith("# gpu_decode:") and "x floor" in out and "x GEMM" in out and "host %" in out
    written = json.loads((tmp_path / "out.json").read_text())
    assert len(written["decode"]) == 10 and written["copy_bandwidth_bytes_per_s"] > 0


def test_gpu_ssm_runs_every_phase_on_the_cpu(bench, tmp_path, capsys):
    result = bench.gpu_ssm.main(["--shape", "hybrid-tiny", "--device", "cpu", "--batches", "1,2", "--contexts", "8,20",
                                 "--steps", "2", "--warmup", "1", "--prefill", "32", "--prefill-reps", "1",
                                 "--hf-steps", "2", "--copy-mb", "1", "--gemm-size", "32"])
    assert result["errors"] == []
    for rows in result["decode_rows"].values():
        assert [(r.batch, r.impl) for r in rows] == [(1, "metrale"), (1, "steps"), (1, "hf-eager"), (2, "metrale"),
                                                     (2, "steps")]
        assert all(r.ok and r.floor_ms > 0 for r in rows)
    assert result["prefill_rows"][0].ok and result["state_bytes_per_seq"] > 0
    out = capsys.readouterr().out
    assert out.startswith("# gpu_ssm:") and "## 20-token contexts" in out and "x GEMM" in out


def test_gpu_decode_skip_peer_and_engine_config(bench, tmp_path):
    result = bench.gpu_decode.main(tiny_run_args(tmp_path, "--skip-peer", "--skip-grpc", "--prefill", "",
                                                 "--engine-config", '{"cuda_graph_batch_sizes": [1, 2]}',
                                                 "--max-positions", "1024", "--chunked-prefill", "600x128"))
    assert [(r.batch, r.impl) for r in result["decode_rows"]] == [(1, "metrale"), (2, "metrale")]
    assert result["prefill_rows"] == []
    chunked = result["chunked_prefill"]      # past the tiny shape's 512 positions, with --max-positions
    assert chunked["tokens"] == 600 and chunked["chunk"] == 128 and chunked["whole"] > 0 and chunked["chunked"] > 0
    assert result["engine_config"]["cuda_graph_batch_sizes"] == (1, 2)
    with pytest.raises(SystemExit, match="no field"):
        bench.gpu_decode.main(tiny_run_args(tmp_path, "--engine-config", '{"no_such_field": 1}'))


def test_peer_float32_matches_the_engine_in_prefill_and_decode(bench):
    from metrale.runtime.build import build_engine
    from metrale.runtime.config import EngineConfig
    from metrale.runtime.sampling import OutputOptions
    from metrale.runtime.step import DecodeToken, PrefillSlice, Step

    gd, pl = bench.gpu_decode, bench.peer_llama
    checkpoint = gd.random_checkpoint(gd.SHAPES["tiny"], seed=3)
    engine, _ = build_engine(checkpoint, EngineConfig(device="cpu", kv_blocks=16, max_model_len=64))
    peer = pl.build_peer(checkpoint.config, checkpoint.tensors, max_batch=3, max_len=64, device="cpu",
                         dtype=torch.float32, compile_mode="none")
    prompts = gd.random_tokens(3, 11, 256, seed=4)
    out = engine.step(Step(prefill=tuple(PrefillSlice(i, tuple(row), output=OutputOptions(return_logits=True))
                                         for i, row in enumerate(prompts.tolist()))))
    ours = torch.stack([o.logits for o in out.outputs])
    # Two prompts in one call and one at row offset 2: rows land where they belong.
    first, theirs = pl.peer_prefill(peer, prompts[:2], return_logits=True)
    last, theirs_last = pl.peer_prefill(peer, prompts[2:], batch_offset=2, return_logits=True)
    theirs = torch.cat([theirs, theirs_last])
    assert ((ours - theirs).norm() / ours.norm()).item() < 1e-4
    tokens = torch.cat([first, last])
    assert tokens.squeeze(1).tolist() == [o.token for o in out.outputs]
    position = torch.tensor([11])
    for _ in range(3):
        out = engine.step(Step(decode=tuple(DecodeToken(i, t) for i, t in enumerate(tokens.squeeze(1).tolist()))))
        ours = torch.stack([o.logits for o in out.outputs])
        theirs = peer.model(tokens, position, peer.caches)
        assert ((ours - theirs).norm() / ours.norm()).item() < 1e-4
        tokens = pl.peer_decode_step(peer, tokens, position)
        assert tokens.squeeze(1).tolist() == [o.token for o in out.outputs]
        position += 1


def test_peer_decode_step_traces_whole_and_goes_dynamic(bench):
    """fullgraph tracing as torch.compile does it on the GPU (here with the aot_eager backend: no inductor, no
    graphs): no graph break, the in-place cache writes kept, and one dynamic graph for every batch after the
    second size, on views of one allocation."""
    from torch._dynamo.utils import counters

    gd, pl = bench.gpu_decode, bench.peer_llama
    checkpoint = gd.random_checkpoint(gd.SHAPES["tiny"], seed=5)
    peer = pl.build_peer(checkpoint.config, checkpoint.tensors, max_batch=4, max_len=32, device="cpu",
                         dtype=torch.float32, compile_mode="none")
    torch._dynamo.reset()
    counters.clear()
    peer.decode = torch.compile(pl.decode_one_token, backend="aot_eager", fullgraph=True)
    eager = pl.build_peer(checkpoint.config, checkpoint.tensors, max_batch=4, max_len=32, device="cpu",
                          dtype=torch.float32, compile_mode="none")
    for batch in (1, 2, 3, 4):
        prompts = gd.random_tokens(batch, 8, 256, seed=batch)
        tokens = []
        for p in (peer, eager):
            p.use_rows(batch)
            tokens.append(pl.peer_prefill(p, prompts))
        for step in range(2):
            position = torch.tensor([8 + step])
            tokens = [pl.peer_decode_step(p, t, position) for p, t in zip((peer, eager), tokens)]
            assert torch.equal(tokens[0], tokens[1])
        for a, b in zip(peer.caches, eager.caches):
            assert torch.allclose(a.k_cache, b.k_cache, atol=1e-6) and torch.allclose(a.v_cache, b.v_cache,
                                                                                      atol=1e-6)
    assert counters["stats"]["unique_graphs"] <= 2      # batch 1, then one dynamic graph for 2, 3 and 4
    torch._dynamo.reset()


def test_time_peer_decode_counts_steps(bench):
    gd, pl = bench.gpu_decode, bench.peer_llama
    checkpoint = gd.random_checkpoint(gd.SHAPES["tiny"], seed=6)
    peer = pl.build_peer(checkpoint.config, checkpoint.tensors, max_batch=2, max_len=32, device="cpu",
                         dtype=torch.bfloat16, compile_mode="none")
    first = pl.peer_prefill(peer, gd.random_tokens(2, 8, 256, seed=7))
    times = pl.time_peer_decode(peer, first, context=8, warmup=1, steps=3)
    assert len(times.step_ms) == 3 and times.wall_ms_per_step > 0
    with pytest.raises(ValueError, match="max_len"):
        pl.time_peer_decode(peer, first, context=30, warmup=1, steps=3)


def test_accounting_of_the_llama3_8b_shape(bench):
    gd = bench.gpu_decode
    shape = gd.SHAPES["llama3-8b"]
    shapes = bench.model_shapes.tensor_shapes(shape)
    params = sum(torch.Size(s).numel() for s in shapes.values())
    assert params == 8_030_261_248                          # Llama-3-8B
    # A decode step reads every weight but the embedding table (one row per token).
    assert gd.decode_weight_bytes(shape) == 2 * (params - 128256 * 4096)
    assert gd.kv_bytes_per_token(shape) == 32 * 2 * 8 * 128 * 2
    matmul = params - 2 * 128256 * 4096 - (2 * 32 + 1) * 4096
    attention = 2 * 32 * 32 * 128 * 4096 * 4097
    assert gd.prefill_flops(shape, 1, 4096) == 2 * matmul * 4096 + 2 * 128256 * 4096 + attention
    smollm = gd.SHAPES["smollm2-135m"]
    assert "lm_head.weight" not in bench.model_shapes.tensor_shapes(smollm)
    assert gd.decode_weight_bytes(smollm) == 2 * sum(torch.Size(s).numel()
                                                     for s in bench.model_shapes.tensor_shapes(smollm).values())


def test_tables_show_failures_and_ratios(bench):
    gd = bench.decode_tables
    rows = [gd.DecodeRow(1, "metrale", 4.0, [5.0, 5.0, 6.0], [4.5]), gd.DecodeRow(1, "peer", 4.0, [5.5, 5.5],
                                                                                  [5.6]),
            gd.DecodeRow(1, "steps", 4.0, [6.25], [1.0], idle_ms=[float("nan"), 0.5, 0.3, 0.4]),
            gd.DecodeRow(8, "metrale", 4.2, note="failed: DeviceFault: boom"), gd.DecodeRow(8, "peer", 4.2, [6.0])]
    table = gd.format_decode_table(rows).splitlines()
    assert len(table) == 6
    assert table[1].split()[:3] == ["1", "metrale", "5.000"] and table[1].split()[-4:] == ["1.25", "0.91", "-", "-"]
    # the host's share: 1 - 5.0 / 6.25; the device's idle time between steps, the first round's NaN left out
    assert table[3].split()[-4:] == ["1.56", "1.14", "20.0", "0.400"]
    assert "failed: DeviceFault: boom" in table[4]
    prefill = [gd.PrefillRow(1, 4096, "metrale", 1e12, 1e15, [2.0]), gd.PrefillRow(1, 4096, "peer", 1e12, 1e15, [],
                                                                                   note="skipped: time budget")]
    lines = gd.format_prefill_table(prefill).splitlines()
    assert lines[1].split() == ["1x4096", "metrale", "2.00", "2048000", "500.0", "0.50", "-"]
    assert "skipped: time budget" in lines[2]


def test_gpu_decode_times_transformers_generate(bench, tmp_path):
    result = bench.gpu_decode.main(tiny_run_args(tmp_path, "--skip-peer", "--skip-grpc", "--prefill", "",
                                                 "--batches", "1", "--hf-generate", "--steps", "3"))
    assert result["errors"] == []
    hf = [r for r in result["decode_rows"] if r.impl == "hf-eager"]
    assert len(hf) == 1 and hf[0].ok and hf[0].p50_ms > 0 and hf[0].floor_ms > 0


def test_gpu_moe_runs_every_phase_on_the_cpu(bench, tmp_path, capsys):
    result = bench.gpu_moe.main(["--shape", "moe-tiny", "--device", "cpu", "--batches", "1,2", "--context", "8",
                                 "--steps", "2", "--warmup", "1", "--prefill", "2x16", "--prefill-reps", "1",
                                 "--hf-steps", "2", "--copy-mb", "1", "--gemm-size", "32", "--chunked-prefill", "40x16",
                                 "--checkpoint-dir", str(tmp_path / "shards")])
    assert result["errors"] == []
    assert [(r.batch, r.impl) for r in result["decode_rows"]] == [(1, "metrale"), (1, "steps"), (1, "hf-eager"),
                                                                  (2, "metrale"), (2, "steps")]
    # Each layer of the tiny shape routes a token to 2 of its 8 experts: a batch of 1 hits 2 a layer, of 2 at most 4.
    assert result["experts_hit"][1] == 2 * 2 and 2 * 2 <= result["experts_hit"][2] <= 2 * 4
    assert result["load"]["note"].startswith("from 1 safetensors shards")
    out = capsys.readouterr().out
    assert out.startswith("# gpu_moe:") and "x GEMM" in out and "hf-eager" in out
    assert result["chunked_prefill"]["whole"] > 0 and result["chunked_prefill"]["chunked"] > 0


def test_gpu_moe_quantized_holds_its_steps_to_the_fp8_floor(bench):
    """--quantize fp8: the engine quantizes at load (the CPU backend multiplies the weights dequantized), and the
    floor counts the weights as the CUDA backend keeps them: e4m3 with a float32 scale a row, the router, norms and
    vocab projection bf16. Latent attention's shapes are refused (some of their projections stay bf16)."""
    from bench.moe_shapes import MOE_SHAPES, decode_step_bytes, dense_decode_bytes, expert_bytes
    from metrale.runtime.loading.fp8 import is_linear_weight, is_stacked_experts

    shape = MOE_SHAPES["moe-tiny"]
    result = bench.gpu_moe.main(["--shape", "moe-tiny", "--device", "cpu", "--batches", "2", "--context", "8",
                                 "--steps", "2", "--warmup", "1", "--prefill", "", "--chunked-prefill", "",
                                 "--hf-steps", "0", "--copy-mb", "1", "--gemm-size", "32", "--skip-grpc",
                                 "--quantize", "fp8"])
    assert result["errors"] == [] and result["engine_config"]["quantize"] == "fp8"
    row, = result["decode_rows"]
    mean_context = 8 + 1 + (2 + 1) / 2
    floor = decode_step_bytes(shape, 2, mean_context, result["experts_hit"][2], fp8=True)
    assert row.floor_ms == pytest.approx(floor / result["copy_bandwidth_bytes_per_s"] * 1e3)
    # The counts against the bench's own random checkpoint, tensor by tensor: what --quantize fp8 quantizes takes a
    # byte a value and 4 a row, the rest 2 a value; the embedding table is read a row a token, so not counted.
    tensors = bench.gpu_moe.host_checkpoint(bench.gpu_moe.random_hf_model(shape, "cpu", 0), shape).tensors
    held = {name: t.numel() + 4 * (t.numel() // t.shape[-1]) if is_linear_weight(name, t) or is_stacked_experts(name, t)
            else 2 * t.numel() for name, t in tensors.items() if "embed_tokens" not in name}
    experts = sum(size for name, size in held.items() if ".experts." in name)
    assert experts == shape.moe_layers * shape.experts * expert_bytes(shape, fp8=True)
    assert sum(held.values()) - experts == dense_decode_bytes(shape, fp8=True)
    with pytest.raises(SystemExit):
        bench.gpu_moe.parse_args(["--shape", "mla-tiny", "--quantize", "fp8"])


def test_gpu_moe_runs_a_latent_attention_shape_on_the_cpu(bench, capsys):
    """DeepSeek-V2's layout (the first layer dense, the others mixtures with shared experts): the routing counted
    over the mixture layers alone, the latent cache's bytes beside a plain cache's."""
    result = bench.gpu_moe.main(["--shape", "mla-tiny", "--device", "cpu", "--batches", "1", "--context", "8",
                                 "--steps", "2", "--warmup", "1", "--prefill", "2x16", "--prefill-reps", "1",
                                 "--hf-steps", "2", "--copy-mb", "1", "--gemm-size", "32", "--chunked-prefill",
                                 "40x16", "--skip-grpc"])
    assert result["errors"] == []
    assert result["experts_hit"][1] == 2 * 2           # 2 mixture layers, top-2 of 8 each
    out = capsys.readouterr().out
    assert "the latent cache: 288 bytes a token" in out and "in the worker's chunks of 16" in out


def test_gpu_moe_runs_hy4s_shape_on_the_cpu(bench, capsys):
    """Hy4's layout (sparse latent attention, hyper-connection streams, the first layer dense): the decode floor
    reads the kept tokens' latents and the index keys whole, and the run loads transformers' own model."""
    from bench.moe_shapes import MOE_SHAPES, cache_read_bytes, kv_bytes_per_token

    shape = MOE_SHAPES["hy4-tiny"]
    result = bench.gpu_moe.main(["--shape", "hy4-tiny", "--device", "cpu", "--batches", "1", "--context", "12",
                                 "--steps", "2", "--warmup", "1", "--prefill", "", "--hf-steps", "2", "--copy-mb", "1",
                                 "--gemm-size", "32", "--chunked-prefill", "", "--skip-grpc"])
    assert result["errors"] == []
    assert result["experts_hit"][1] == 2 * 2           # 2 mixture layers, top-2 of 8 each
    # 3 latent layers of 32 + 16 and 2 indexer layers (0 and 1) of 32, bf16; 8 latents a layer past 8 tokens
    assert kv_bytes_per_token(shape) == 2 * 3 * 48 + 2 * 2 * 32
    assert cache_read_bytes(shape, 1, 20) == 2 * 3 * 48 * 8 + 2 * 2 * 32 * 20
    assert "hf-eager" in capsys.readouterr().out


def test_gpu_decode_skip_engine(bench, tmp_path):
    result = bench.gpu_decode.main(tiny_run_args(tmp_path, "--skip-engine", "--prefill", "1x16"))
    assert result["errors"] == []
    assert [(r.batch, r.impl) for r in result["decode_rows"]] == [(1, "peer"), (2, "peer")]
    assert all(r.ok and len(r.step_ms) == 2 for r in result["decode_rows"])
    assert [(r.label, r.impl) for r in result["prefill_rows"] if r.ok] == [("1x16", "peer")]


def test_gpu_tensor_parallel_runs_one_and_two_ranks_on_the_cpu(bench, tmp_path, capsys):
    """Rank 1 spawned, drawing the same weights as rank 0 (the check's logits agree), every row timed, the tables
    printed with the speed-up column."""
    rows, errors = bench.gpu_tensor_parallel.main([
        "--device", "cpu", "--shape", "tiny", "--ranks", "1,2", "--batches", "1,2", "--context", "8", "--steps", "2",
        "--warmup", "1", "--prefill", "1x16", "--prefill-reps", "1", "--prefill-warmup", "1", "--copy-mb", "8",
        "--gemm-size", "64", "--json", str(tmp_path / "tp.json")])
    assert [(r.ranks, r.row.impl) for r in rows if r.row.ok] == [
        (ranks, impl) for ranks in (1, 2) for impl in ("metrale", "metrale", "steps", "metrale", "steps")]
    assert errors[1] == 0.0 and errors[2] < 5e-2
    out = capsys.readouterr().out
    assert "speed-up" in out and "WARNING" not in out
    assert json.loads((tmp_path / "tp.json").read_text())["check_errors"]["2"] == errors[2]


def test_drawn_weights_come_the_same_in_any_order(bench):
    """A tensor-parallel rank takes only some tensors, in its own order: each is the same as a whole draw's."""
    shape = bench.model_shapes.SHAPES["tiny"]
    names = list(bench.model_shapes.tensor_shapes(shape))
    forward = bench.model_shapes.drawn_checkpoint(shape, seed=3).tensors
    backward = bench.model_shapes.drawn_checkpoint(shape, seed=3).tensors
    taken = {name: backward[name] for name in reversed(names)}
    assert all(torch.equal(forward[name], taken[name]) for name in names)
    assert not torch.equal(forward[names[2]], bench.model_shapes.drawn_checkpoint(shape, seed=4).tensors[names[2]])
