#!/usr/bin/env bash
# Fetch into .whl/flashinfer/ what --attention-backend flashinfer needs on the GPU machine, which has no network:
# flashinfer-python (pure Python plus the CUDA headers and sources it JIT-compiles with the image's nvcc). Its
# import-time dependencies einops, nvidia-ml-py, tabulate, click and ninja are in the image; apache-tvm-ffi comes
# with scripts/device_bundle.sh. 0.6.18.post1 is the newest release whose wheel (18 MB) fits a device call whole
# beside the engine's bundle; the 0.7 wheels (34-101 MB) carry prebuilt kernels this backend never loads.
# Compiled kernels go to build/ficache (FLASHINFER_WORKSPACE_BASE): build/ is ignored, so a warm machine keeps
# them between the calls of one lease; the engine logs the time FlashInfer took to get ready at start.
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=0.6.18.post1
mkdir -p .whl/flashinfer
find .whl/flashinfer -name "flashinfer_python-*.whl" ! -name "flashinfer_python-${VERSION}-*" -delete
python3 -m pip download -q --no-deps --only-binary=:all: -d .whl/flashinfer "flashinfer-python==${VERSION}"
echo "FlashInfer in .whl/flashinfer: $(du -sh .whl/flashinfer | cut -f1)" >&2
echo "Carry .whl (after scripts/device_bundle.sh) and add to the device command's pip line:" >&2
echo 'python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/flashinfer/*.whl && export FLASHINFER_WORKSPACE_BASE=$PWD/build/ficache MAX_JOBS=16 && python3 -c "import flashinfer" || exit;'
