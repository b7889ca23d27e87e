#!/usr/bin/env bash
# Installs the worker and its test dependencies (Python, and the Node.js test client's). torch is pinned first to
# the CPU build the machine has on disk, so no other requirement can pull a CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install --quiet torch==2.13.0
python -m pip install --quiet -e '.[test]'
# The Node.js client test's packages (@grpc/grpc-js, @grpc/proto-loader), from npm, as locked.
npm ci --prefix tests/node --no-audit --no-fund --loglevel=error
