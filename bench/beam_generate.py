"""BeamGenerate next to transformers' generate on an M2M100 (NLLB-200) shape with random weights, in one run:
sentences/s and target tokens/s for batches of translation requests, and how many top hypotheses agree.

Each request: a random source of --source-len tokens ending in </s>, a target-language token as decoder prefix,
--beams beams and exactly --new-tokens new tokens (min_new_tokens = max_new_tokens), as issue 4's figure asks.

python -m bench.beam_generate --shape nllb-600m --device cuda --batches 1,16,64     (the figure, on a GPU)
python -m bench.beam_generate --shape tiny --device cpu --batches 1,4 --reps 1      (smoke test)
"""

import argparse
import dataclasses
import json
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import transformers

from bench.decode_tables import TimedRow
from bench.gpu_ceilings import copy_bandwidth
from bench.gpu_profile import kernel_table
from bench.phases import host_profile, log
from bench.timeline import host_costs, timeline
from metrale.runtime.beam.params import BeamParams, BeamRequest
from metrale.runtime.build import build_engine
from metrale.runtime.config import EngineConfig
from metrale.runtime.streams import StreamThreads
from metrale.runtime.loading import load_checkpoint

SHAPES = {
    "nllb-600m": dict(d_model=1024, encoder_layers=12, decoder_layers=12, encoder_attention_heads=16,
                      decoder_attention_heads=16, encoder_ffn_dim=4096, decoder_ffn_dim=4096, vocab_size=256206),
    "tiny": dict(d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                 decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, vocab_size=256),
}
PAD, EOS, START = 1, 2, 2


@dataclass
class Row(TimedRow):
    batch: int
    impl: str
    step_ms: list[float] = field(default_factory=list)     # ms per call
    note: str = ""

    @property
    def p50(self) -> float:
        """Seconds per call."""
        return self.p50_ms / 1e3


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="nllb-600m", choices=sorted(SHAPES))
    parser.add_argument("--device", default="cuda", choices=("cpu", "cuda"))
    parser.add_argument("--pdl", default="on", choices=("on", "off"),
                        help="CUDA: programmatic dependent launch (off: each kernel's own time, for kernel tables)")
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--source-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--beams", type=int, default=4)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--json", default=None)
    parser.add_argument("--profile", type=int, default=0,
                        help="print where the host's time goes (cProfile, top N by own time) in one call per batch")
    parser.add_argument("--profile-sort", default="tottime", help="pstats order of --profile: tottime or cumulative")
    parser.add_argument("--kernels", type=int, default=0,
                        help="print the device's busiest N kernels and copies of one call per batch (CUPTI)")
    parser.add_argument("--host-costs", action="store_true",
                        help="print the host time of the call's functions, by the host's clock (5 calls per batch)")
    parser.add_argument("--timeline", type=int, default=0,
                        help="print the first N lines of one call's host phases and device activity, in time order")
    parser.add_argument("--streams", type=int, default=1,
                        help="split each call's requests over this many device streams, run at once")
    parser.add_argument("--prompt-by-token", action="store_true",
                        help="run the decoder prompts a token a forward (decode graphs), not in one prefill graph")
    args = parser.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32

    config = transformers.M2M100Config(**SHAPES[args.shape], max_position_embeddings=1024, scale_embedding=True,
                                       pad_token_id=PAD, bos_token_id=0, eos_token_id=EOS,
                                       decoder_start_token_id=START, dropout=0.0, attention_dropout=0.0,
                                       activation_dropout=0.0)
    torch.manual_seed(0)
    reference = transformers.M2M100ForConditionalGeneration(config).to(dtype).eval()
    with tempfile.TemporaryDirectory() as directory:
        reference.save_pretrained(directory)
        engine, _ = build_engine(load_checkpoint(Path(directory)),
                                 EngineConfig(device=args.device, num_streams=args.streams,
                                              programmatic_launch=args.pdl == "on"))
    threads = StreamThreads(args.streams, on_thread_start=engine.bind_stream) if args.streams > 1 else None
    if args.prompt_by_token:
        for ctx in engine.runner.streams:
            ctx.prompt_graphs = None
    reference.to(args.device)
    log(f"{args.shape}: {sum(p.numel() for p in reference.parameters()) / 1e6:.0f} M parameters, {dtype}, "
        f"{args.device}")

    bandwidth = copy_bandwidth(args.device, 1 << 30) if args.device == "cuda" else None
    rows, agreement, floors = [], {}, {}
    generator = torch.Generator().manual_seed(1)
    for batch in batches:
        sources = torch.randint(4, config.vocab_size - 1, (batch, args.source_len), generator=generator)
        sources[:, -1] = EOS
        target_language = config.vocab_size - 1
        params = BeamParams(num_beams=args.beams, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens)
        requests = [BeamRequest(i, src_tokens=tuple(s.tolist()), decoder_prefix=(target_language,), params=params)
                    for i, s in enumerate(sources)]
        theirs = Row(batch, "transformers")
        decoder_input = torch.tensor([[START, target_language]] * batch, device=args.device)

        def ours_call():
            if threads is None:
                return engine.beam_generate(requests, (EOS,), PAD)
            parts = [requests[i::args.streams] for i in range(args.streams)]
            futures = [threads.submit(i, [], lambda part=part: engine.beam_generate(part, (EOS,), PAD))
                       for i, part in enumerate(parts) if part]
            found = {r.request_id: r for future in futures for r in future.result()[0]}
            return [found[r.request_id] for r in requests]

        def generate():
            with torch.no_grad():
                return reference.generate(sources.to(args.device),
                                          attention_mask=torch.ones_like(sources).to(args.device),
                                          decoder_input_ids=decoder_input, num_beams=args.beams,
                                          max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                                          do_sample=False, eos_token_id=EOS, pad_token_id=PAD)

        ours = Row(batch, "metrale")
        ours.step_ms, theirs.step_ms = timed_interleaved([ours_call, generate], args.reps, args.device)
        ours_top = [r.hypotheses[0][0] for r in ours_call()]
        if args.profile:
            log(f"profile, batch {batch}:\n" + host_profile(ours_call, args.profile, args.profile_sort))
        if args.kernels:
            log(f"device, one call of batch {batch} ({args.new_tokens} steps):\n"
                + kernel_table(ours_call, args.kernels))
        if args.host_costs:
            log(f"host, batch {batch}:\n" + host_costs(ours_call, timeline_marks(engine), 5))
        if args.timeline:
            log(f"timeline, one call of batch {batch}:\n" + timeline(ours_call, timeline_marks(engine), args.timeline))
        their_top = generate()[:, 2:].tolist()
        agreement[batch] = sum(a == b for a, b in zip(ours_top, their_top))
        if bandwidth:
            floors[batch] = floor_bytes(reference, batch, args) / bandwidth
        rows += [ours, theirs]
        log(f"batch {batch}: ours {ours.p50:.3f} s, transformers "
            f"{theirs.p50:.3f} s")

    print(f"# beam_generate: {args.shape} ({dtype}, random weights) on {device_name(args.device)}; "
          f"{args.source_len}-token sources, {args.beams} beams, exactly {args.new_tokens} new tokens; p50 of "
          f"{args.reps} calls of each, taking turns, after a warm-up; {time.strftime('%Y-%m-%d %H:%M %Z')}"
          + (f"; copy bandwidth {bandwidth / 1e12:.2f} TB/s" if bandwidth else ""))
    print(format_table(rows, args.new_tokens, agreement, floors))
    result = {"args": vars(args), "rows": [dataclasses.asdict(r) for r in rows], "agreement": agreement,
              "floor_s": floors}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return {**result, "row_objects": rows}


def timeline_marks(engine) -> list[tuple[object, str]]:
    """The host functions of a call's fixed part (before the search's first step) and of its steps."""
    from metrale.runtime import engine as engine_module
    from metrale.runtime import forwards as forwards_module
    from metrale.runtime.backend.cuda import beam_search, graphs, stream_context
    from metrale.runtime.backend.cuda import runner as cuda_runner
    from metrale.runtime.beam import call, search
    from metrale.runtime.models import m2m100
    runner_type = type(engine.runner)
    context = stream_context.StreamContext
    marks = [(call.BeamCall, "run"), (call.BeamCall, "_encode"), (call.BeamCall, "_prefill"),
             (call.BeamCall, "_forward_by_token"), (call.BeamCall, "_forward_whole"),
             (call, "build_decode_batch"), (call, "search_start"), (call, "run_device_search"),
             (search.BeamGroup, "__init__"), (engine_module.Engine, "_reserve_beam_blocks"),
             (forwards_module.Forwards, "beam_forward"), (forwards_module.Forwards, "beam_encode"),
             (engine_module.Engine, "_quiesce"), (m2m100.M2M100ForConditionalGeneration, "encode"),
             (m2m100.M2M100ForConditionalGeneration, "forward"), (runner_type, "run_forward"),
             (runner_type, "run_encoder"), (runner_type, "device_search"), (context, "prepare"),
             (context, "copy_to_device"), (context, "beam_candidates"), (stream_context, "pack_batch"),
             (beam_search.CudaDeviceSearch, "__init__"), (beam_search.CudaDeviceSearch, "step"),
             (beam_search.CudaDeviceSearch, "_read"), (cuda_runner, "state_arrays"), (call, "build_batch"),
             (forwards_module, "build_batch"),
             (context, "upload_lists"), (graphs.DecodeGraphs, "run"), (graphs.DecodeGraphs, "replay"),
             (graphs.PrefillGraphs, "run"),
             (beam_search.CudaDeviceSearch, "_upload"), (stream_context.StreamCandidates, "host")]
    return [(owner, name) for owner, name in marks if hasattr(owner, name)]


def timed_interleaved(calls: list, reps: int, device: str) -> list[list[float]]:
    """ms per call of each of `calls`, after a warm-up call of each: the calls take turns, rep after rep, so that a
    change in the host's speed during the run (transformers' time is host-bound and has varied 2x between runs on
    the same machine) falls on all of them alike."""
    for call in calls:
        call()      # warm-up
    times = [[] for _ in calls]
    for _ in range(reps):
        for call, own in zip(calls, times):
            if device == "cuda":
                torch.cuda.synchronize()
            started = time.perf_counter()
            call()
            if device == "cuda":
                torch.cuda.synchronize()
            own.append((time.perf_counter() - started) * 1e3)
    return times


def floor_bytes(model, batch: int, args) -> int:
    """The bytes a call must read at least (DESIGN.md §6): the encoder's weights and the cross-attention K/V
    projections once, then per new token the rest of the decoder's weights, the LM head (the shared embedding) and
    each beam's self- and cross-attention K/V."""
    c = model.config
    size = {name: p.numel() * p.element_size() for name, p in model.named_parameters()}
    once = [name for name in size if name.startswith("model.encoder.") or ".encoder_attn.k_proj." in name
            or ".encoder_attn.v_proj." in name]
    encoder = sum(size[name] for name in once)
    decoder = sum(n for name, n in size.items() if name.startswith("model.decoder.") and name not in once)
    decoder += size["model.shared.weight"]
    kv_per_token = 2 * c.decoder_layers * c.d_model * 2                  # K and V, bf16, every decoder layer
    rows = batch * args.beams
    kv = sum(rows * kv_per_token * (2 + step + args.source_len) for step in range(args.new_tokens))
    return encoder + args.new_tokens * decoder + kv


def format_table(rows: list[Row], new_tokens: int, agreement: dict, floors: dict) -> str:
    lines = [f"{'batch':>5}  {'impl':<12}  {'p50 s':>8}  {'min-max s':>13}  {'sentences/s':>11}  {'tokens/s':>9}  "
             f"{'x transformers':>14}  {'x floor':>7}  {'same top':>8}"]
    reference = {r.batch: r for r in rows if r.impl == "transformers"}
    for r in rows:
        if not r.ok:
            lines.append(f"{r.batch:>5}  {r.impl:<12}  {'-':>8}  {'-':>13}  {'-':>11}  {'-':>9}  {'-':>14}  {'-':>7}  "
                         f"{'-':>8}  {r.note}")
            continue
        speedup = reference[r.batch].p50 / r.p50 if r.impl != "transformers" else 1.0
        same = f"{agreement[r.batch]}/{r.batch}" if r.impl != "transformers" and r.batch in agreement else "-"
        floor = f"{r.p50 / floors[r.batch]:.1f}" if r.batch in floors else "-"
        spread = f"{min(r.step_ms) / 1e3:.3f}-{max(r.step_ms) / 1e3:.3f}"
        lines.append(f"{r.batch:>5}  {r.impl:<12}  {r.p50:>8.3f}  {spread:>13}  {r.batch / r.p50:>11.1f}  "
                     f"{r.batch * new_tokens / r.p50:>9.0f}  {speedup:>14.2f}  {floor:>7}  {same:>8}")
    return "\n".join(lines)


def device_name(device: str) -> str:
    return torch.cuda.get_device_name() if device == "cuda" else "cpu"


if __name__ == "__main__":
    main()
