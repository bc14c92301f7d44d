#!/usr/bin/env bash
# Split the real model's GGUF (Qwen2.5-Coder-0.5B, 491 MB) into build/qwen_parts/p0..p7 for the GPU machine, whose
# calls carry at most 64 MiB each: a warm machine keeps carried files between calls, so one part per call, back to
# back (a machine goes back after 30 s idle), gets the model there. p0 is smaller: it travels with the wheels.
# There, assemble and convert once (transformers + the gguf wheel from device_bundle.sh):
#   cat build/qwen_parts/p? > build/qwen.gguf && sha256sum build/qwen.gguf
#   python3 -c "from pathlib import Path; from sglang_pic.model_loader.gguf_convert import convert_gguf as c;
#               print(c(Path('build/qwen.gguf'), Path('build/qwen_cache')))"
set -euo pipefail
cd "$(dirname "$0")/.."
gguf=$(python3 -c "from sglang_pic.model_loader.default_model import assemble_gguf; print(assemble_gguf())")
rm -rf build/qwen_parts && mkdir -p build/qwen_parts
first=$((40 * 2**20))
head -c "$first" "$gguf" >build/qwen_parts/p0
tail -c +$((first + 1)) "$gguf" | split -b $((62 * 2**20)) -d -a 1 --numeric-suffixes=1 - build/qwen_parts/p
ls -l build/qwen_parts >&2
cat build/qwen_parts/p? | sha256sum >&2
