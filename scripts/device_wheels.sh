#!/usr/bin/env bash
# Builds .whl/: the wheels the lent GPU machine lacks (it has Python 3.12, torch, cuda-core, cuda-bindings, NVRTC,
# cuBLAS, NCCL's library and transformers 5.17, and no network). Carry .whl in every device call; scripts/device_env.sh
# installs it. nccl4py: the NCCL bindings tensor parallel calls (the library itself is the image's, torch's).
# transformers 5.25 (and what it takes beyond the image: huggingface-hub 2 with httpx2, kernels, newer tokenizers,
# safetensors, regex and hf-xet) as the tests' reference on the CPU: 5.17's Mamba2 normalises its gated RMSNorm over
# the whole width instead of per group (n_groups > 1), as mamba_ssm does not; 5.25 rotates Hy4's rotary dims in
# interleaved pairs.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
python -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 \
  --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
  --platform any -d .whl \
  grpcio==1.85.3 grpcio-health-checking==1.85.1 grpcio-reflection==1.85.1 grpcio-status==1.85.3 \
  grpcio-tools==1.85.1 protobuf==7.36.2 googleapis-common-protos==1.76.0 \
  structlog==26.1.0 prometheus-client==0.26.0 gguf==0.19.0 nvmath-python==1.0.0 nccl4py==0.6.0 \
  pytest==9.0.3 pluggy iniconfig packaging hypothesis==6.155.2 sortedcontainers attrs pyyaml tqdm \
  transformers==5.25.0 huggingface-hub==2.4.0 httpx2==2.16.2 httpcore2 truststore kernels==0.19.1 tomlkit \
  tokenizers==0.23.3 safetensors==0.8.0 regex==2026.5.9 hf-xet==1.8.0 click
ls .whl
