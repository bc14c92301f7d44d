#!/usr/bin/env bash
# On the GPU machine: assemble the real model from the parts scripts/split_gguf.sh cut (carried into build/qp/), then
#   train  STEPS MINUTES [TRAIN FLAGS...]   train (or resume) the span adapter in build/span_adapter
#   eval   OUT_JSON SAMPLES MODES [BENCH FLAGS...]   benchmark/bench_span_quality.py with that adapter for +adapter modes
# A warm machine keeps build/ between calls, so a training run cut by --max-minutes resumes in the next call.
# ADAPTER names the adapter folder (default build/span_adapter), so variants train and evaluate side by side.
set -euo pipefail
cd "$(dirname "$0")/.."
export SGLANG_PIC_CACHE=$PWD/build/picache
[ -f build/qwen.gguf ] || cat build/qp/q?? > build/qwen.gguf
adapter=${ADAPTER:-build/span_adapter}
stage=$1
shift
case $stage in
  train)
    steps=$1 minutes=$2
    shift 2
    python3 -m sglang_pic.train_span_adapter --model-path build/qwen.gguf --out "$adapter" --steps "$steps" \
      --max-minutes "$minutes" "$@"
    if [ -n "${OUT:-}" ] && [ -f "$adapter/adapter_model.safetensors" ]; then
      mkdir -p "$OUT/${adapter##*/}" && cp "$adapter"/adapter_* "$adapter"/span_adapter.json "$OUT/${adapter##*/}/"
    fi
    ;;
  eval)
    out=$1 samples=$2 modes=$3
    shift 3
    python3 benchmark/bench_span_quality.py --model-path build/qwen.gguf --device cuda --dtype bfloat16 \
      --samples "$samples" --batch-size 64 --modes "$modes" --span-adapter "$adapter" --output "$out" "$@"
    ;;
  *)
    echo "usage: $0 train STEPS MINUTES [FLAGS] | eval OUT SAMPLES MODES [FLAGS]" >&2
    exit 2
    ;;
esac
