#!/usr/bin/env bash
# On the GPU machine, after the pip lines of scripts/device_bundle.sh (which also fetches .whl/bench, SGLang's
# client and the packages its bench_serving imports): the serving runs of docs/results.md's bench_serving rows, each
# phase against a fresh server on the dummy Llama-3-8B shape (benchmark/make_config.py), with its step trace,
# bench_serving's JSON line and the server log under OUT. Usage:
#   bash scripts/gpu_serving.sh OUT BACKEND PHASE...
# Phases: cold (the issue's command, then the step breakdown), rates (4, 8, 16, 32 req/s, or those RATES lists; 400
# prompts each, cache flushed between), gsp (generated-shared-prefix 32 x 16, 2,048-token system prompt), long
# (input 256, output 2,048).
# SERVER_ARGS adds server flags (e.g. "--max-running-requests 512"); TAG names the run's files (default: BACKEND);
# BREAKDOWN_ARGS adds flags of bench_serving_breakdown.py (fp8 weights: "--weight-bytes 1.13 --tflops 1580
# --attention-tflops 790"; an H100: "--hbm-tbps 3.35").
set -u
cd "$(dirname "$0")/.."
out=$1 backend=$2
tag=${TAG:-$2}
shift 2
mkdir -p "$out"
# The client's wheels (scripts/device_bundle.sh puts them in .whl/bench). sglang/utils.py imports IPython.display,
# which the image lacks and bench_serving never uses: a stub module stands in for it.
if [ -d .whl/bench ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target build/bench_site .whl/bench/*.whl
  python3 -c "import IPython" 2> /dev/null || { mkdir -p build/bench_site/IPython && touch build/bench_site/IPython/__init__.py \
    && echo "HTML = display = None" > build/bench_site/IPython/display.py; }
  export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD/build/bench_site
fi
MODEL=${MODEL:-build/llama3-8b-dummy}
M8B=(--model-path "$MODEL" --load-format dummy --dtype bfloat16)
URL=http://127.0.0.1:30000
bench() {
  python3 -m sglang.bench_serving --backend sglang --base-url $URL --tokenizer "$MODEL" --disable-tqdm "$@"
}

serve() {  # a fresh server for phase $1; returns once it answers /health
  python3 -m sglang_pic.launch_server "${M8B[@]}" --attention-backend "$backend" --port 30000 ${SERVER_ARGS:-} \
    --step-trace "$out/steps_${tag}_$1.jsonl" > "$out/server_${tag}_$1.log" 2>&1 &
  PID=$!
  until curl -sf $URL/health > /dev/null; do
    kill -0 $PID 2> /dev/null || { echo "server for $1 died"; tail -20 "$out/server_${tag}_$1.log"; return 1; }
    sleep 2
  done
}

stop() { kill $PID; wait $PID 2> /dev/null; }

for phase in "$@"; do
  res="$out/bench_${tag}_${phase}.jsonl"
  serve "$phase" || continue
  case $phase in
    cold)
      bench --dataset-name random-ids --random-input-len 1024 --random-output-len 256 --random-range-ratio 0.5 \
        --num-prompts 800 --seed 1 --output-file "$res" > "$out/bench_${tag}_cold.txt" 2>&1
      stop
      python3 benchmark/bench_serving_breakdown.py "$out/steps_${tag}_cold.jsonl" --bench-result "$res" \
        --model-config "$MODEL" --tflops 790 --hbm-tbps 4.25 ${BREAKDOWN_ARGS:-} \
        --out "$out/serving_breakdown_${tag}.json" > "$out/breakdown_${tag}.txt" 2>&1
      tail -40 "$out/breakdown_${tag}.txt"
      ;;
    rates)
      for rate in ${RATES:-4 8 16 32}; do
        curl -sf -X POST $URL/flush_cache > /dev/null
        bench --dataset-name random-ids --random-input-len 1024 --random-output-len 256 --random-range-ratio 0.5 \
          --num-prompts 400 --seed $rate --request-rate $rate --output-file "$res" >> "$out/bench_${tag}_rates.txt" 2>&1
      done
      stop
      ;;
    gsp)
      bench --dataset-name generated-shared-prefix --gsp-num-groups 32 --gsp-prompts-per-group 16 \
        --gsp-system-prompt-len 2048 --seed 1 --output-file "$res" > "$out/bench_${tag}_gsp.txt" 2>&1
      stop
      ;;
    long)
      bench --dataset-name random-ids --random-input-len 256 --random-output-len 2048 --random-range-ratio 0.5 \
        --num-prompts 400 --seed 1 --output-file "$res" > "$out/bench_${tag}_long.txt" 2>&1
      stop
      ;;
  esac
  grep -E "Successful requests|Benchmark duration|Total token throughput|Output token throughput|Mean TTFT|P99 TTFT|Median TPOT|P99 TPOT" \
    "$out/bench_${tag}_${phase}.txt" | sed "s/^/$tag $phase: /"
done
