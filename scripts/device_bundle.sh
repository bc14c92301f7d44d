#!/usr/bin/env bash
# Fetch into .whl/ the wheels the GPU machine's image lacks for the engine's HTTP server and its tests, then print
# the line to put in front of a device command. That machine has no network: it runs Python 3.12 on manylinux
# x86_64 with torch, triton, pytest, hypothesis, requests and prometheus-client already there (see the device
# docs' package list). Wheels are fetched with --no-deps, so every dependency is pinned below, one version each
# (two versions of a package make the install there fail). The pins match the CPU development environment where
# the server tests pass; the last group shadows older copies in the image that the newer server stack needs
# (httpx2 wants anyio>=4.10 and idna>=3.18, pydantic wants typing-extensions>=4.14.1).
# gguf lets transformers there dequantize the real model's GGUF (benchmark/README.md: carrying it in parts); xgrammar
# (with apache-tvm-ffi) compiles the grammars of constrained decoding.
set -euo pipefail
cd "$(dirname "$0")/.."

PINS=(
  pyzmq==27.3.0
  orjson==3.11.4
  fastapi==0.165.0
  opentelemetry-api==1.45.2
  starlette==1.10.0
  uvicorn==0.54.0
  pydantic==2.13.4
  pydantic-core==2.46.4
  annotated-types==0.7.0
  typing-inspection==0.4.2
  openai==3.57.0
  httpx2==2.16.2
  httpcore2==2.16.2
  truststore==0.10.5
  jiter==0.19.0
  sniffio==1.3.1
  annotated-doc==0.0.7
  anyio==4.16.0
  idna==3.20
  typing-extensions==4.16.0
  h11==0.16.0
  click==8.5.1
  gguf==0.19.0
  xgrammar==0.2.9
  apache-tvm-ffi==0.1.15.post2
)

# .whl/bench: SGLang's client for scripts/gpu_serving.sh (its bench_serving), with the imports the image lacks.
BENCH_PINS=(
  sglang==0.5.9
  pybase64==1.5.1
  datasets==5.2.0
  dill==0.4.1
  multiprocess==0.70.19
)

PLATFORMS=()
for tag in manylinux1 manylinux2014 manylinux_2_17 manylinux_2_24 manylinux_2_27 manylinux_2_28 manylinux_2_31 \
  manylinux_2_34 manylinux_2_35 manylinux_2_39; do
  PLATFORMS+=(--platform "${tag}_x86_64")
done

mkdir -p .whl
for pin in "${PINS[@]}"; do
  # Wheel names spell a project with underscores and in any case; drop other versions of this one.
  stem=$(echo "${pin%%==*}" | tr '-' '_')
  find .whl -maxdepth 1 -iname "${stem}-*.whl" ! -iname "${stem}-${pin##*==}-*" -delete
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${PLATFORMS[@]}" -d .whl "${PINS[@]}"
mkdir -p .whl/bench
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${PLATFORMS[@]}" -d .whl/bench "${BENCH_PINS[@]}"

echo "wheels in .whl/: $(ls .whl/*.whl | wc -l) files, $(du -sh .whl | cut -f1)" >&2
echo "Carry .whl and start the device command with:" >&2
echo 'python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site && python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . && python3 -c "import zmq, orjson, fastapi, uvicorn, openai, sglang_pic.kernels.shared_decode_plan" || exit;'
