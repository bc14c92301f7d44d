#!/usr/bin/env bash
# On the GPU machine: assemble the real model from the parts scripts/split_gguf.sh cut (carried one per call into
# build/qp/), then run benchmark/bench_span_quality.py there with the modes given. Usage:
#   bash scripts/gpu_span_quality.sh OUT_JSON SAMPLES MODES
set -euo pipefail
cd "$(dirname "$0")/.."
[ -f build/qwen.gguf ] || cat build/qp/q?? > build/qwen.gguf
sha256sum build/qwen.gguf
python3 benchmark/bench_span_quality.py --model-path build/qwen.gguf --device cuda --dtype bfloat16 \
  --samples "$2" --batch-size 64 --modes "$3" --output "$1"
