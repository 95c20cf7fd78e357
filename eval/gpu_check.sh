#!/usr/bin/env bash
# GPU check of specd on a real GPU, in stages (GPU_CHECK_STAGES, comma list). The default is issue 43's
# check, under 10 minutes in all (each stage has its own time cap, GPU_CHECK_<STAGE>_S; the default caps
# add up to 580 s):
#
#   kernels  tests/test_kernels.py, tests/test_batch_invariant.py and tests/test_graphs.py compiled for
#            the GPU (no interpreter) against their torch references, rows bitwise across batch sizes,
#            CUDA-graph capture; then `eval.gpu_step kernels`: the invariant GEMM / RMSNorm / attention
#            against cuBLAS / torch / tree attention at Llama-3.1-8B shapes (time, GB/s, row bits)
#   graphs   `eval.gpu_step graphs`: the engine's target step as its start-up captured it (--cuda-graphs
#            on, the default buckets, both ops variants); replay == the eager step (bitwise, same padded
#            inputs), real rows vs the unpadded eager step (bitwise with the invariant ops), eager vs
#            replayed step time; then tests/test_graphs_engine.py on the GPU: engines whose start-up
#            captures real CUDA graphs (target, draft model, feature head) == the eager engine, greedy;
#            the identity and speed stages' engines run their CUDA graphs too
#   identity `eval.gpu_step identity`: the engine (device cuda, bf16) greedy, every speculative mode
#            (chain / tree / head / ngram / auto) == plain per prompt, batch 1 and 8, invariant on / off
#   speed    `eval.gpu_step speed`: plain / auto / head / ngram tokens/s at batch 1, 4 and 16
#   shape8b  `eval.gpu_step shape8b`: a random-weight Llama-3.1-8B-shaped bf16 step at 1, 8, 32 rows and
#            a 33-node tree against its bandwidth floor, eager and graphed, cuBLAS and invariant
#
# Older stages, run when named: engine (eval.bench_real on the demo pair, fp32), aot (python -m
# specd_kernels.aot --check), timing (eval/gpu_check.py's tree-attention table), server (websocket vs
# in-process), real (eval.bench_real on the built-in model, bf16, Spec-Bench).
#
#   GPU_CHECK_STAGES=kernels,graphs eval/gpu_check.sh
#
# What the device needs beside this checkout (nothing can be fetched there; ../shared does not travel):
#  - the shared data and models: $SPECD_SHARED, else ../shared, else .gpu_carry/shared (a copy of
#    ../shared/data/spec_bench and ../shared/models/stories260K* in a folder .git/info/exclude ignores,
#    named in the call's carry); without them the stages that need prompts are skipped and the one
#    test that loads stories260K is deselected
#  - the built-in model (SmolLM2-135M-Instruct Q4_1 GGUF, 94 MiB, over one call's 64 MiB): $SPECD_GGUF,
#    else the parts .gpu_carry/gguf*/SmolLM2-135M-Instruct.Q4_1.gguf.part* (sent over several calls on one
#    warm machine, e.g. `split -b 32M`; joined and checked against its sha256 here), else the specd
#    model cache; with it graphs / identity / speed run on it with models/smollm2-draft and
#    models/smollm2-head, without it on the demo pair (models/demo; no head modes)
#  - wheels under .whl/ (packages the image lacks: gguf for the GGUF) are installed to /tmp/site first
# Python: $PY if set, else the first of .venv/bin/python, python3 whose torch sees a CUDA device and which
# has triton and pytest (the image's own torch / triton versions; nothing is installed over them). Only
# if none does is a .venv created from pyproject.toml (needs network: not on the lent device).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${GPU_CHECK_OUT:-eval/out}
mkdir -p "$OUT"
unset TRITON_INTERPRET
STAGES=",${GPU_CHECK_STAGES:-kernels,graphs,identity,speed,shape8b},"
want() { [[ $STAGES == *",$1,"* ]]; }
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi

has_cuda_stack() {
    "$1" -c 'import torch, triton, pytest; assert torch.cuda.is_available()' >/dev/null 2>&1
}

PYBIN=""
for cand in ${PY:-} .venv/bin/python python3 python; do
    if command -v "$cand" >/dev/null 2>&1 && has_cuda_stack "$cand"; then PYBIN=$cand; break; fi
done
if [ -z "$PYBIN" ]; then
    echo "== no python with CUDA torch + triton + pytest found; creating/installing .venv"
    test -x .venv/bin/python || python3 -m venv .venv || exit 1
    .venv/bin/python -m pip install -q --upgrade pip
    .venv/bin/python -m pip install -q -e '.[dev]' || exit 1
    PYBIN=.venv/bin/python
    has_cuda_stack "$PYBIN" || { echo "torch in .venv does not see a CUDA device"; exit 1; }
fi
echo "== python: $PYBIN ($("$PYBIN" -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, torch.cuda.get_device_name())'))"
echo "== commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')$(git diff --quiet 2>/dev/null || echo ' + local changes')"

export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>&1 | tee "$OUT/gpu_smi.txt"

if [ -z "${SPECD_SHARED:-}" ]; then
    for d in ../shared .gpu_carry/shared; do
        if [ -d "$d/data" ] || [ -d "$d/models" ]; then SPECD_SHARED=$(cd "$d" && pwd); export SPECD_SHARED; break; fi
    done
fi
PROMPTS=${GPU_CHECK_PROMPTS:-${SPECD_SHARED:-/nonexistent}/data/spec_bench/question.jsonl}
echo "== shared data: ${SPECD_SHARED:-none}; prompts: $([ -f "$PROMPTS" ] && echo "$PROMPTS" || echo none)"

# the built-in model: $SPECD_GGUF, carried parts, or the model cache (checked against its sha256)
GGUF=${SPECD_GGUF:-}
if [ -z "$GGUF" ] && ls .gpu_carry/gguf*/SmolLM2-135M-Instruct.Q4_1.gguf.part* >/dev/null 2>&1; then
    GGUF=/tmp/SmolLM2-135M-Instruct.Q4_1.gguf
    "$PYBIN" - "$GGUF" <<'PY'  # the parts in the order of their names (split's .partaa, .partab, ...)
import glob, os, shutil, sys
parts = sorted(glob.glob(".gpu_carry/gguf*/SmolLM2-135M-Instruct.Q4_1.gguf.part*"), key=os.path.basename)
with open(sys.argv[1], "wb") as out:
    for p in parts:
        with open(p, "rb") as f:
            shutil.copyfileobj(f, out)
PY
fi
if [ -z "$GGUF" ]; then
    GGUF=$("$PYBIN" -c 'from specd.model.builtin import builtin_gguf; print(builtin_gguf())' 2>/dev/null)
fi
if [ -n "$GGUF" ] && [ -f "$GGUF" ] && "$PYBIN" -c "
import sys; from specd.model.builtin import SHA256, _sha256; sys.exit(_sha256(sys.argv[1]) != SHA256)" "$GGUF"; then
    MODEL_ARGS=(--target "$GGUF" --draft models/smollm2-draft --head models/smollm2-head)
    echo "== built-in model: $GGUF (sha256 ok)"
else
    MODEL_ARGS=(--target models/demo/target --draft models/demo/draft)
    echo "== built-in model not found (SPECD_GGUF, .gpu_carry/gguf*/ parts, the cache): the demo pair, no head"
fi

status=0
run_stage() {  # run_stage NAME SECONDS CMD...: the command under a time cap, its output in $OUT/gpu_NAME.log
    local name=$1 cap=$2
    shift 2
    echo "== $name (cap ${cap}s): $*"
    local t0=$SECONDS
    timeout "$cap" "$@" 2>&1 | tee "$OUT/gpu_$name.log"
    local rc=${PIPESTATUS[0]}
    echo "== $name: rc=$rc in $((SECONDS - t0)) s"
    [ "$rc" -eq 0 ] || status=1
}

if want kernels; then
    sel=()
    [ -d "${SPECD_SHARED:-/nonexistent}/models/stories260K" ] || sel=(-k "not model_forward")
    run_stage kernels_tests "${GPU_CHECK_KERNELS_S:-120}" "$PYBIN" -m pytest -q -p no:cacheprovider \
        tests/test_kernels.py tests/test_batch_invariant.py tests/test_graphs.py "${sel[@]}"
    run_stage kernels_timing "${GPU_CHECK_KERNEL_TIMING_S:-45}" "$PYBIN" -m eval.gpu_step kernels
fi
if want graphs; then
    run_stage graphs "${GPU_CHECK_GRAPHS_S:-80}" "$PYBIN" -m eval.gpu_step graphs "${MODEL_ARGS[@]}"
    if [ -d "${SPECD_SHARED:-/nonexistent}/models/stories260K" ]; then  # the engine's wiring, real CUDA graphs
        run_stage graphs_engine "${GPU_CHECK_GRAPHS_ENGINE_S:-80}" "$PYBIN" -m pytest -q -p no:cacheprovider \
            tests/test_graphs_engine.py
    else
        echo "== graphs_engine: skipped (tests/test_graphs_engine.py needs the shared stories260K pair)"
    fi
fi
if want identity; then
    if [ -f "$PROMPTS" ]; then
        run_stage identity "${GPU_CHECK_IDENTITY_S:-120}" "$PYBIN" -m eval.gpu_step identity "${MODEL_ARGS[@]}" \
            --prompts "$PROMPTS" --num-prompts "${GPU_CHECK_IDENTITY_PROMPTS:-32}" --max-tokens 48 --budget-s 90
    else
        echo "== identity: skipped (no prompts: set SPECD_SHARED or carry .gpu_carry/shared)"
    fi
fi
if want speed; then
    if [ -f "$PROMPTS" ]; then
        run_stage speed "${GPU_CHECK_SPEED_S:-75}" "$PYBIN" -m eval.gpu_step speed "${MODEL_ARGS[@]}" \
            --prompts "$PROMPTS" --speed-tokens 96
    else
        echo "== speed: skipped (no prompts)"
    fi
fi
if want shape8b; then
    run_stage shape8b "${GPU_CHECK_SHAPE8B_S:-60}" "$PYBIN" -m eval.gpu_step shape8b --context 512
fi

# --- older stages (run when named in GPU_CHECK_STAGES) ------------------------------------------
if want engine; then
    run_stage engine "${GPU_CHECK_ENGINE_S:-120}" env OMP_NUM_THREADS=4 "$PYBIN" -m eval.bench_real --device cuda \
        --target models/demo/target --draft models/demo/draft --prompts "$PROMPTS" --per-category 1 \
        --max-tokens 64 --batch 1,4 --threads 4 --dtype float32 --no-progress --profile-tokens 16 \
        --systems specd:off,specd:chain:4,specd:tree:16,specd:ngram:8,specd:auto,hf:generate --out "$OUT/gpu_engine"
fi
if want aot; then  # compile-time figures (sm_80 + sm_90a) with this machine's triton + bundled ptxas
    run_stage aot 300 "$PYBIN" -m specd_kernels.aot --check --json "$OUT/gpu_aot.json"
fi
if want timing; then
    budget=${GPU_CHECK_TIMING_S:-240}
    run_stage timing $((budget + 90)) "$PYBIN" -m eval.gpu_check --budget-s "$budget" "$@"
fi
if want server && [ "${GPU_CHECK_SERVER:-1}" = 1 ]; then
    run_stage server 240 env OMP_NUM_THREADS=2 "$PYBIN" -m eval.bench_server --device cuda --rounds 2 --repeats 5 \
        --max-tokens 192
fi
if want real; then
    test -f "${SPECD_GGUF:-$GGUF}" || { echo "real: the built-in GGUF was not found"; exit 1; }
    run_stage real "${GPU_CHECK_REAL_S:-330}" env OMP_NUM_THREADS=4 "$PYBIN" -m eval.bench_real --device cuda \
        --target "${SPECD_GGUF:-$GGUF}" --draft models/smollm2-draft --prompts "$PROMPTS" \
        --per-category "${GPU_CHECK_PER_CATEGORY:-2}" --max-tokens 256 --batch 1,4 --threads 4 \
        --dtype bfloat16 --quantization none --no-progress --profile-tokens 48 \
        --systems "${GPU_CHECK_REAL_SYSTEMS:-specd:off,specd:tree:16,specd:ngram:8,specd+head:chain:4,specd+head:tree:32,specd+head:auto,hf:generate,hf:pld:10}" \
        --out "$OUT/gpu_real"
fi
exit $status
