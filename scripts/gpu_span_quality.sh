#!/usr/bin/env bash
# On the GPU machine: assemble the real model from the parts scripts/split_gguf.sh cut (carried one per call into
# build/qp/), then run benchmark/bench_span_quality.py there with the modes given (more flags after them, e.g.
# --split tuning --tasks needle). The converted model is kept under build/ (SGLANG_PIC_CACHE), which a warm machine
# keeps between calls. Usage:
#   bash scripts/gpu_span_quality.sh OUT_JSON SAMPLES MODES [BENCH FLAGS...]
set -euo pipefail
cd "$(dirname "$0")/.."
export SGLANG_PIC_CACHE=$PWD/build/picache
[ -f build/qwen.gguf ] || cat build/qp/q?? > build/qwen.gguf
sha256sum build/qwen.gguf
out=$1 samples=$2 modes=$3
shift 3
python3 benchmark/bench_span_quality.py --model-path build/qwen.gguf --device cuda --dtype bfloat16 \
  --samples "$samples" --batch-size 64 --modes "$modes" --output "$out" "$@"
