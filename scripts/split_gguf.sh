#!/usr/bin/env bash
# Split the real model's GGUF (Qwen2.5-Coder-0.5B, 491 MB) into build/qp/q00..q13 for the GPU machine, whose calls
# carry at most 64 MiB each, the working tree (about 27 MB with the shipped span adapter) included: a warm machine
# keeps carried files between calls, so one 35 MiB part per call, back to back (a machine goes back after 30 s
# idle), gets the model there. The wheels (.whl, scripts/device_bundle.sh) travel in a call of their own, before the
# parts.
# There, scripts/gpu_span_quality.sh assembles build/qwen.gguf and runs the span-quality benchmark on it.
set -euo pipefail
cd "$(dirname "$0")/.."
gguf=$(python3 -c "from sglang_pic.model_loader.default_model import assemble_gguf; print(assemble_gguf())")
rm -rf build/qp && mkdir -p build/qp
split -b $((35 * 2**20)) -d -a 2 "$gguf" build/qp/q
ls -l build/qp >&2
sha256sum "$gguf" >&2
