#!/usr/bin/env bash
# Every GPU-marked test in one device call, after the pip lines of scripts/device_bundle.sh and
# scripts/flashinfer_bundle.sh: one pytest per file (a file's time limit cannot cut the others short), each log
# and a summary under ${OUT:-build/gpu_tests}. The whole test/ folder is not collected on the GPU machine: some
# modules import SGLang's client packages, which the bundle does not carry.
set -u
cd "$(dirname "$0")/.."
out=${OUT:-build/gpu_tests}
mkdir -p "$out"
export FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-$PWD/build/ficache}
# GPU_TEST_FILES picks a subset (names without .py), to split the run over two calls of the per-call limit.
FILES=(${GPU_TEST_FILES:-test_gpu_engine test_kernels_gpu test_flashinfer_gpu test_tensor_parallel test_sampling test_span_adapter
       test_process_failures test_fp8_weights test_fp8_quant_kernel test_fp8_gemv test_norm_act_kernels test_row_lora_kernel})
for f in "${FILES[@]}"; do
  timeout "${GPU_TEST_LIMIT_S:-300}" python3 -m pytest -q -m gpu -p no:cacheprovider -rfEs "test/$f.py" \
    > "$out/$f.log" 2>&1
  echo "$f: rc=$? $(tail -1 "$out/$f.log")" | tee -a "$out/summary.txt"
done
