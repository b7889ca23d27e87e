#!/usr/bin/env bash
# Everything GPU on the lent H200, in parts that each fit one 10-minute call; a short summary last.
#   tests    the gpu-marked tests (kernels against torch references, models against transformers, graphs,
#            the sampler) and the API tests with their workers on the CUDA backend: models, then api   (~8 min warm;
#            past one 10-minute call on a fresh machine, whose cubins compile cold: run models, then api, there)
#   models   the gpu-marked tests alone                                                     (~6 min cold)
#   api      the API tests with their workers on the CUDA backend alone                     (~4 min)
#   api-models  the API tests again with a hybrid (Nemotron-H), a mixture of experts (dots.llm1) and a latent
#            attention model (DeepSeek-V3) served                                                      (~4 min)
#   load     tests/service/test_load.py with its worker process on the CUDA backend: 64 clients for 60 s with faults,
#            sequential-replay equality, no leaked block, RSS and device memory flat, SIGTERM drain      (~3 min)
#   kernels  bench/gpu_attention.py, bench/gpu_skinny_gemm.py and bench/gpu_gemm_algos.py (cuBLASLt's candidate
#            algorithms for NLLB-200's decode linears)                                                (~1 min)
#   smollm2  bench/gpu_decode.py at the default model's shape, with the peer, gRPC and transformers (~2 min)
#   llama    bench/gpu_decode.py at the Llama-3-8B shape, every batch, prefill, peer and gRPC (~4 min)
#   long-prefill  bench/gpu_decode.py at the Llama-3-8B shape with 32k positions: prefill of 1 x 8k and 8 x 4k, and
#            one 32k prompt whole (time to first token) and in the worker's chunks of 2k, on the engine and through
#            gRPC; then the prefill attention kernels alone against SDPA (bench/gpu_attention.py --prefill-only)
#                                                                                                        (~4 min)
#   prefill-variants  the prefill attention kernels against SDPA with each bench/variants/prefill_attention_hopper/
#            NAME.cu (carry bench/variants) timed and checked beside the package's                      (~2 min)
#   long-decode-8k  bench/gpu_decode.py at the Llama-3-8B shape with 8k contexts: batches 1 and 16 with the peer and
#            gRPC; batch 64 (the two KV caches do not fit side by side) the engine with gRPC, then the peer alone;
#            then the decode attention kernel alone against copy bandwidth, up to 64 x 32k (bench/gpu_attention.py
#            --decode-only)                                                                              (~9 min)
#   long-decode-32k  the same with 32k contexts: batch 1 with the peer, batch 16 the engine then the peer alone
#            (64 x 32k is 275 GB of KV, past one H200)                                                    (~8 min)
#   profile  bench/gpu_profile.py at both shapes, batches 1 and 256: where a step's time goes (~2 min)
#   prefix   bench/prefix_cache.py at the Llama-3-8B shape: 64 requests sharing a 4,096-token system prompt, each
#            with a 64-token question, --prefix-cache on against off                                    (~3 min)
#   beam     bench/beam_generate.py at the NLLB-200-600M shape, batches 1, 16 and 64, next to transformers
#   search   bench/gpu_beam_candidates.py (the device search's candidates alone) and the NLLB beam step's kernel
#            table at 16 requests (bench/beam_generate.py --kernels, PDL off)                              (~1 min)
#   ssm      bench/gpu_ssm.py at the Nemotron-H-8B shape: decode at batches 1, 32, 128 with 1k and 8k contexts against
#            the floor with the SSM state, transformers' eager generate, the 8k prefill and its kernels          (~7 min)
#   ssm-kernels  bench/gpu_ssm_kernels.py: the Mamba2 conv and scan alone at Nemotron-H-8B's mixer, decode batches and
#            prompts, with each bench/variants/ssm/NAME.cu (carry bench/variants) timed beside the package's  (~1 min)
#   ssm-profile  bench/gpu_profile.py at the Nemotron-H-8B shape, batches 1 and 128, and an 8k prefill's kernels (~3 min)
#   ssm-prefix  bench/prefix_cache.py at the Nemotron-H-8B shape: 16 requests sharing a 4,096-token system prompt,
#            resumed from the SSM snapshot (--prefix-cache on) against computed again (off)                   (~3 min)
#   moe-kernels  bench/gpu_moe_kernels.py: a Qwen3-30B-A3B layer's MoE kernels alone at decode batches and a prefill,
#            with each bench/variants/moe/NAME.cu (carry bench/variants) timed beside the package's          (~1 min)
#   moe      bench/gpu_moe.py at the Qwen3-30B-A3B shape: transformers' generate at batch 1, the engine loaded from
#            safetensors shards (where the disk holds them), decode at batches 1, 8, 64, 256 against the floor of the
#            experts routed to, through Steps too, the 8 x 1k prefill, the MoE kernels' shares            (~9 min)
#   moe-fp8  the FP8 experts' kernel tests (a scale a row and 128 x 128 blocks, against the bf16 experts of their
#            dequantized weights), then bench/gpu_moe.py at the Qwen3-30B-A3B shape under --quantize fp8: decode at
#            batches 1, 8, 64, 256 against the FP8 floor, through Steps too, the 8 x 1k prefill     (~8 min)
#   mla      bench/gpu_moe.py at the DeepSeek-V2-Lite shape (multi-head latent attention, 64 experts, top-6): decode at
#            batches 1, 64, 256 with 1k and 8k contexts against the floor of the experts routed to, the dense weights
#            and the latent cache; the 8 x 1k prefill; an 8k prompt whole and in chunks of 1k              (~10 min)
#   mla-kernels  bench/gpu_latent_attention.py: the latent decode attention alone, against copy bandwidth (~1 min)
#   hy4      bench/gpu_moe.py at a Hy4 shape (its published widths, 12 of its 34 layers: sparse latent attention, 256
#            experts, hyper-connections): decode at batches 1 and 64 with 4k contexts against the floor (dense
#            weights, the experts routed to, the index keys and the kept tokens' latents), the kernels' shares (~5 min)
#   hy4-32k  the same with 32k contexts (~7 min)
#   dsa-kernels  bench/gpu_sparse_attention.py: the indexer's scores and top-k and the attention over the chosen
#            tokens, beside dense latent attention over the same cache, batches 1 and 64 at 4k and 32k (~1 min)
#   serving  bench/serving.py: the reference gateway and a Llama-3-8B-shaped worker under Poisson arrivals at several
#            rates (throughput, TTFT and ITL p50/p99), and the gateway at saturation against the step benchmark (~6 min)
#   fp8      --quantize fp8: the FP8 tests, bench/gpu_fp8_gemm.py (the FP8 linears beside bf16's; again with weights
#            in 128 x 128 blocks, as DeepSeek's and Qwen3's releases hold them), then
#            bench/gpu_decode.py at the Llama-3-8B shape with FP8 weights: decode at batches 1, 64, 256 against the
#            FP8 floor and the bf16 peer, through gRPC, and the 8 x 1k prefill against the FP8 GEMM rate; the decode
#            attention kernel alone over an FP8 cache (bench/gpu_attention.py --decode-only --kv-dtype fp8)  (~8 min)
#   tp       tensor parallel on the CUDA backend: a one-rank group over NCCL on one GPU and, where two GPUs are seen,
#            two ranks against the one-device engine (tests/runtime/cuda/test_tensor_parallel_cuda.py); then, with two
#            GPUs, the API tests against two-rank CUDA workers                                         (~3 min)
#   tp-figures  bench/gpu_tensor_parallel.py: the Llama-3-8B shape at 1 and 2 ranks (decode batches 1 and 64 on the
#            engine and through Steps, prefill 1 x 4096, NCCL's share of a step), then the Llama-3-70B shape at 2 ranks
#            (about 77 GiB a rank with batch 64's KV: nvidia-h200-x2, not H100s)                           (~9 min)
#   mha      bench/gpu_mha_attention.py: the multi-head decode attention kernels at NLLB's beam step shapes, with each
#            bench/variants/decode_attention_mha/NAME.cu (carry bench/variants) timed beside the package's  (~1 min)
# Usage (from the repository root, with .whl carried):
#   bash bench/gpu_check.sh [tests|models|api|api-models|load|kernels|smollm2|llama|long-prefill|prefill-variants|
#     long-decode-8k|long-decode-32k|profile|prefix|beam|search|ssm|ssm-kernels|ssm-profile|ssm-prefix|moe-kernels|
#     moe|moe-fp8|mla|mla-kernels|hy4|hy4-32k|dsa-kernels|fp8|tp|tp-figures|mha|serving]...
# (default: tests). Logs and JSON land in $OUT (default /tmp/gpu-check).
set -uo pipefail
source scripts/device_env.sh || exit 1
OUT=${OUT:-/tmp/gpu-check}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee "$OUT/gpu.txt"
summary=()
run_pytest() {  # name, pytest args...
  local name=$1; shift
  python3 -m pytest -q -p no:cacheprovider -o addopts="" --tb=short "$@" > "$OUT/$name.log" 2>&1
  summary+=("$name: $(grep -E '[0-9]+ (passed|failed)' "$OUT/$name.log" | tail -1)")
  summary+=("$(grep -E '^(FAILED|ERROR)' "$OUT/$name.log" | cut -c1-160 | head -20)")
}
run_bench() {  # name, module, args...
  local name=$1; shift
  python3 -m "$@" --json "$OUT/$name.json" > "$OUT/$name.txt" 2> "$OUT/$name.err" || summary+=("$name: FAILED (see $name.err)")
  summary+=("== $name" "$(grep -v '^# \[' "$OUT/$name.txt")")
}
for part in "${@:-tests}"; do
  case $part in
    tests|models|api)
      [[ $part == api ]] || run_pytest kernels-and-models -m gpu tests/runtime
      [[ $part == models ]] || run_pytest api-on-cuda --worker-device cuda tests/service/test_forward_api.py \
        tests/service/test_errors.py tests/service/test_concurrency.py tests/service/test_generate.py \
        tests/service/test_faults.py tests/service/test_metrics.py tests/service/test_run_ahead.py \
        tests/service/test_beam_api.py tests/service/test_fault_isolation.py tests/service/test_limits.py \
        tests/service/test_prefix_cache_api.py ;;
    tp)
      run_pytest tp -m gpu -s tests/runtime/cuda/test_tensor_parallel_cuda.py
      if (( $(nvidia-smi -L | wc -l) >= 2 )); then
        run_pytest api-on-cuda-tp --worker-device cuda --worker-tensor-parallel 2 tests/service/test_forward_api.py \
          tests/service/test_errors.py tests/service/test_concurrency.py tests/service/test_faults.py \
          tests/service/test_run_ahead.py tests/service/test_beam_api.py tests/service/test_fault_isolation.py
      fi ;;
    tp-figures)
      run_bench tp-llama3-8b bench.gpu_tensor_parallel --shape llama3-8b --ranks 1,2 --time-budget 300
      run_bench tp-llama3-70b bench.gpu_tensor_parallel --shape llama3-70b --ranks 2 --time-budget 240 ;;
    api-models)
      run_pytest api-on-cuda-hybrid --worker-device cuda --worker-model nemotron_h tests/service/test_forward_api.py \
        tests/service/test_errors.py tests/service/test_beam_api.py tests/service/test_run_ahead.py \
        tests/service/test_prefix_cache_api.py
      run_pytest api-on-cuda-moe --worker-device cuda --worker-model dots1 tests/service/test_forward_api.py \
        tests/service/test_errors.py tests/service/test_run_ahead.py
      run_pytest api-on-cuda-mla --worker-device cuda --worker-model deepseek_v3 tests/service/test_forward_api.py \
        tests/service/test_errors.py tests/service/test_beam_api.py tests/service/test_run_ahead.py \
        tests/service/test_prefix_cache_api.py ;;
    load)
      run_pytest load-on-cuda --worker-device cuda -s tests/service/test_load.py
      summary+=("$(grep -E '^load on' "$OUT/load-on-cuda.log")") ;;
    kernels)
      python3 -m bench.gpu_attention > "$OUT/attention.txt" 2>&1; summary+=("== attention" "$(cat "$OUT/attention.txt")")
      python3 -m bench.gpu_skinny_gemm > "$OUT/skinny_gemm.txt" 2>&1
      summary+=("== skinny gemm" "$(cat "$OUT/skinny_gemm.txt")")
      python3 -m bench.gpu_gemm_algos --tokens 4,16,64,256 --algos 24 > "$OUT/gemm_algos.txt" 2>&1 \
        || summary+=("kernels: FAILED (see gemm_algos.txt)")
      summary+=("== gemm algos" "$(grep -v '^# gpu' "$OUT/gemm_algos.txt")") ;;
    fp8)
      run_pytest fp8 -m gpu -s tests/runtime/cuda/test_fp8_linear.py tests/runtime/cuda/test_fp8_models.py \
        tests/runtime/cuda/test_fp8_kv_kernels.py tests/runtime/cuda/test_fp8_kv_models.py
      summary+=("$(grep -E 'largest relative error' "$OUT/fp8.log")")
      python3 -m bench.gpu_fp8_gemm > "$OUT/fp8_gemm.txt" 2>&1 || summary+=("fp8: FAILED (see fp8_gemm.txt)")
      summary+=("== fp8 gemm" "$(grep -v '^# gpu' "$OUT/fp8_gemm.txt")")
      python3 -m bench.gpu_fp8_gemm --blocks --skinny 1,16 --rows 64,1024,8192 > "$OUT/fp8_gemm_blocks.txt" 2>&1 \
        || summary+=("fp8: FAILED (see fp8_gemm_blocks.txt)")
      summary+=("== fp8 gemm, weights in 128 x 128 blocks" "$(grep -v '^# gpu' "$OUT/fp8_gemm_blocks.txt")")
      run_bench llama3-8b-fp8 bench.gpu_decode --shape llama3-8b --batches 1,64,256 --prefill 8x1024 \
        --engine-config '{"quantize": "fp8"}'
      python3 -m bench.gpu_attention --decode-only --kv-dtype fp8 > "$OUT/fp8_kv_attention.txt" 2>&1 \
        || summary+=("fp8 kv attention: FAILED (see fp8_kv_attention.txt)")
      summary+=("== fp8 kv decode attention" "$(grep -v '^# gpu' "$OUT/fp8_kv_attention.txt")") ;;
    smollm2)
      run_bench smollm2 bench.gpu_decode --shape smollm2-135m --batches 1,32 --prefill '' --hf-generate ;;
    llama)
      run_bench llama3-8b bench.gpu_decode --shape llama3-8b ;;
    long-prefill)
      run_bench long-prefill bench.gpu_decode --shape llama3-8b --max-positions 32768 --batches 1 --steps 4 \
        --warmup 1 --prefill 1x8192,8x4096 --chunked-prefill 32768x2048 --prefill-reps 3 --prefill-warmup 1 \
        --skip-peer --max-batch-tokens 32768
      python3 -m bench.gpu_attention --prefill-only > "$OUT/prefill_attention.txt" 2>&1
      summary+=("== prefill attention" "$(cat "$OUT/prefill_attention.txt")") ;;
    prefill-variants)
      variants=()
      for f in bench/variants/prefill_attention_hopper/*.cu; do
        [ -e "$f" ] && variants+=(--variant "$(basename "$f" .cu)=$f")
      done
      python3 -m bench.gpu_attention --prefill-only "${variants[@]}" > "$OUT/prefill_variants.txt" 2>&1 \
        || summary+=("prefill-variants: FAILED (see prefill_variants.txt)")
      summary+=("== prefill attention variants" "$(grep -v '^# gpu' "$OUT/prefill_variants.txt")") ;;
    long-decode-8k)
      long=(bench.gpu_decode --shape llama3-8b --max-positions 32768 --context 8192 --steps 16 --warmup 3 --prefill ''
            --max-batch-tokens 32768)
      run_bench long-decode-8k "${long[@]}" --batches 1,16
      run_bench long-decode-8k-b64 "${long[@]}" --batches 64 --skip-peer
      run_bench long-decode-8k-b64-peer "${long[@]}" --batches 64 --skip-engine --skip-grpc
      python3 -m bench.gpu_attention --decode-only > "$OUT/decode_attention.txt" 2>&1
      summary+=("== decode attention" "$(cat "$OUT/decode_attention.txt")") ;;
    long-decode-32k)
      long=(bench.gpu_decode --shape llama3-8b --max-positions 32768 --context 32640 --steps 16 --warmup 3 --prefill ''
            --max-batch-tokens 32768)
      run_bench long-decode-32k "${long[@]}" --batches 1
      run_bench long-decode-32k-b16 "${long[@]}" --batches 16 --skip-peer
      run_bench long-decode-32k-b16-peer "${long[@]}" --batches 16 --skip-engine --skip-grpc ;;
    prefix)
      run_bench prefix-cache bench.prefix_cache --device cuda --shape llama3-8b --requests 64 --system 4096 \
        --question 64 --decode-steps 16 --reps 3 ;;
    ssm)
      run_bench ssm bench.gpu_ssm --shape nemotron-h-8b ;;
    moe)
      run_bench moe bench.gpu_moe --shape qwen3-30b-a3b --checkpoint-dir /tmp/metrale-moe-checkpoint
      rm -rf /tmp/metrale-moe-checkpoint ;;
    moe-fp8)
      run_pytest moe-fp8-kernels -m gpu tests/runtime/cuda/test_moe_kernels.py -k fp8
      run_bench moe-fp8 bench.gpu_moe --shape qwen3-30b-a3b --quantize fp8 --hf-steps 0 --chunked-prefill '' ;;
    mla)
      run_bench mla-1k bench.gpu_moe --shape deepseek-v2-lite --batches 1,64,256 --context 1024 --hf-steps 4 \
        --checkpoint-dir /tmp/metrale-mla-checkpoint
      run_bench mla-8k bench.gpu_moe --shape deepseek-v2-lite --batches 1,64,256 --context 8192 --hf-steps 0 \
        --prefill '' --chunked-prefill '' --skip-grpc
      rm -rf /tmp/metrale-mla-checkpoint ;;
    hy4)
      run_bench hy4-4k bench.gpu_moe --shape hy4-12l --batches 1,64 --context 4096 --hf-steps 0 --prefill '' \
        --chunked-prefill '' --skip-grpc ;;
    hy4-32k)
      run_bench hy4-32k bench.gpu_moe --shape hy4-12l --batches 1,64 --context 32768 --hf-steps 0 --prefill '' \
        --chunked-prefill '' --skip-grpc ;;
    dsa-kernels)
      python3 -m bench.gpu_sparse_attention > "$OUT/sparse_attention.txt" 2>&1 || summary+=("dsa-kernels: FAILED")
      summary+=("== sparse attention" "$(grep -v '^# gpu' "$OUT/sparse_attention.txt")") ;;
    mla-kernels)
      python3 -m bench.gpu_latent_attention > "$OUT/latent_attention.txt" 2>&1 || summary+=("mla-kernels: FAILED")
      summary+=("== latent attention" "$(grep -v '^# gpu' "$OUT/latent_attention.txt")") ;;
    ssm-kernels|moe-kernels)
      family=${part%-kernels}
      variants=()
      for f in bench/variants/$family/*.cu; do
        [ -e "$f" ] && variants+=(--variant "$(basename "$f" .cu)=$f")
      done
      python3 -m "bench.gpu_${family}_kernels" "${variants[@]}" > "$OUT/${family}_kernels.txt" 2>&1 \
        || summary+=("$part: FAILED (see ${family}_kernels.txt)")
      summary+=("== $family kernels" "$(grep -v '^# gpu' "$OUT/${family}_kernels.txt")") ;;
    ssm-profile)
      python3 -m bench.gpu_profile --shape nemotron-h-8b --batches 1,128 --steps 20 --prefill 1x8192 \
        > "$OUT/profile-nemotron-h-8b.txt" 2>&1 || summary+=("ssm-profile: FAILED (see profile-nemotron-h-8b.txt)")
      summary+=("== profile nemotron-h-8b" "$(grep -A3 '^## ' "$OUT/profile-nemotron-h-8b.txt")") ;;
    ssm-prefix)
      run_bench ssm-prefix bench.prefix_cache --device cuda --shape nemotron-h-8b --requests 16 --system 4096 \
        --question 64 --decode-steps 16 --reps 3 --max-seqs 32 ;;
    beam)
      python3 -m bench.beam_generate --shape nllb-600m --device cuda --batches 1,16,64 --reps 7 \
        --json "$OUT/beam.json" > "$OUT/beam.txt" 2> "$OUT/beam.err" || summary+=("beam: FAILED (see beam.err)")
      summary+=("== beam" "$(grep -v '^# \[' "$OUT/beam.txt")") ;;
    search)
      python3 -m bench.gpu_beam_candidates > "$OUT/beam_candidates.txt" 2>&1 \
        || summary+=("search: FAILED (see beam_candidates.txt)")
      summary+=("== beam candidates" "$(grep -v '^#' "$OUT/beam_candidates.txt")")
      python3 -m bench.beam_generate --shape nllb-600m --device cuda --pdl off --batches 16 --reps 3 --kernels 40 \
        > "$OUT/beam_kernels.txt" 2>&1 || summary+=("search: FAILED (see beam_kernels.txt)")
      summary+=("== beam step kernels (PDL off)" "$(grep -A24 'kernels of one step' "$OUT/beam_kernels.txt")") ;;
    serving)
      run_bench serving bench.serving --shape llama3-8b --device cuda --rates 2,8,32,inf --requests 256 \
        --max-model-len 4096 --max-seqs 256 --max-batch-tokens 8192 ;;
    mha)
      variants=()
      for f in bench/variants/decode_attention_mha/*.cu; do
        [ -e "$f" ] && variants+=(--variant "$(basename "$f" .cu)=$f")
      done
      python3 -m bench.gpu_mha_attention "${variants[@]}" > "$OUT/mha_attention.txt" 2>&1 \
        || summary+=("mha: FAILED (see mha_attention.txt)")
      summary+=("== mha attention" "$(grep -v '^# gpu' "$OUT/mha_attention.txt")") ;;
    profile)
      for shape in smollm2-135m llama3-8b; do
        python3 -m bench.gpu_profile --shape "$shape" --batches 1,256 --steps 20 > "$OUT/profile-$shape.txt" 2>&1
        summary+=("== profile $shape" "$(grep -A3 '^## ' "$OUT/profile-$shape.txt")")
      done ;;
    *) echo "unknown part $part"; exit 2 ;;
  esac
done
echo "== summary"
printf '%s\n' "${summary[@]}" | grep -v '^$'
