#!/usr/bin/env bash
# GPU check of specd on a real GPU, in stages (GPU_CHECK_STAGES, comma list; default all but `real`):
#
#   engine   the engine on the GPU end to end: eval.bench_real on the demo pair (models/demo), fp32,
#            specd plain / chain / tree / prompt lookup / auto and transformers generate, greedy
#            agreement of every speculative mode with specd plain (the report's "agree" column)
#   kernels  tests/test_kernels*.py compiled for the GPU (no interpreter), against the torch references
#   aot      the ahead-of-time register/spill report (python -m specd_kernels.aot --check)
#   timing   the paged tree-attention timing table of eval/gpu_check.py
#   server   websocket delivery vs in-process (eval/bench_server.py; needs starlette/uvicorn/websockets)
#   real     eval.bench_real on the built-in model (the SmolLM2-135M-Instruct GGUF at $SPECD_GGUF,
#            bf16 on the GPU) with the draft model and the feature head, Spec-Bench prompts
#            ($GPU_CHECK_PROMPTS), batch 1 and 4: tokens/s, accepted length, agreement with plain
#
#   GPU_CHECK_STAGES=engine,kernels,timing eval/gpu_check.sh [extra args for gpu_check.py]
#
# Wheels under .whl/ (packages the GPU machine lacks, e.g. gguf) are installed to /tmp/site first.
# Python: $PY if set, else the first of .venv/bin/python, python3 whose torch sees a CUDA device
# and which has triton. If none does, a .venv is created / installed from pyproject.toml (needs
# network). specd and specd_kernels are imported from this checkout (the repository root goes on
# PYTHONPATH), so no install is needed when torch+triton+pytest are present.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${GPU_CHECK_OUT:-eval/out}
mkdir -p "$OUT"
unset TRITON_INTERPRET
STAGES=",${GPU_CHECK_STAGES:-engine,kernels,aot,timing,server},"
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

export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>&1 | tee "$OUT/gpu_smi.txt"
PROMPTS=${GPU_CHECK_PROMPTS:-../shared/data/spec_bench/question.jsonl}

status=0
if want engine; then
    echo "== the engine on the GPU: eval.bench_real on the demo pair (fp32)"
    OMP_NUM_THREADS=4 timeout "${GPU_CHECK_ENGINE_S:-120}" "$PYBIN" -m eval.bench_real --device cuda \
        --target models/demo/target --draft models/demo/draft --prompts "$PROMPTS" --per-category 1 \
        --max-tokens 64 --batch 1,4 --threads 4 --dtype float32 --no-progress --profile-tokens 16 \
        --systems specd:off,specd:chain:4,specd:tree:16,specd:ngram:8,specd:auto,hf:generate \
        --out "$OUT/gpu_engine" 2>&1 | tee "$OUT/gpu_engine.log"
    rc=${PIPESTATUS[0]}
    [ "$rc" -eq 0 ] || { echo "engine check failed (rc=$rc)"; status=1; }
fi

if want kernels; then
    echo "== pytest tests/test_kernels*.py (compiled Triton on the GPU)"
    timeout "${GPU_CHECK_PYTEST_S:-240}" "$PYBIN" -m pytest -q -p no:cacheprovider tests/test_kernels*.py 2>&1 \
        | tee "$OUT/gpu_pytest.log"
    rc=${PIPESTATUS[0]}
    [ "$rc" -eq 0 ] || { echo "pytest failed (rc=$rc)"; status=1; }
fi

# issue 21 item 7: the ahead-of-time report (sm_80 + sm_90a registers / spills / shared memory of every
# launcher configuration) with this machine's triton + bundled ptxas; compile-time figures, ~1 min here
if want aot; then
    echo "== AOT compile report (python -m specd_kernels.aot --check)"
    timeout 300 "$PYBIN" -m specd_kernels.aot --check --json "$OUT/gpu_aot.json" 2>&1 | tee "$OUT/gpu_aot.md"
    rc=${PIPESTATUS[0]}
    [ "$rc" -eq 0 ] || { echo "specd_kernels.aot failed or found spills (rc=$rc)"; status=1; }
fi

if want timing; then
    echo "== timing"
    budget=${GPU_CHECK_TIMING_S:-240}
    timeout $((budget + 90)) "$PYBIN" -m eval.gpu_check --budget-s "$budget" "$@" 2>&1 | tee "$OUT/gpu_timing.md"
    rc=${PIPESTATUS[0]}
    [ "$rc" -eq 0 ] || { echo "gpu_check.py failed (rc=$rc)"; status=1; }
fi

# issue 5's delivery target on real hardware: websocket vs in-process tokens/s (demo pair, on the GPU)
if want server && [ "${GPU_CHECK_SERVER:-1}" = 1 ]; then
    echo "== websocket delivery vs in-process (eval/bench_server.py, device cuda)"
    OMP_NUM_THREADS=2 timeout 240 "$PYBIN" -m eval.bench_server --device cuda --rounds 2 --repeats 5 \
        --max-tokens 192 2>&1 | tee "$OUT/gpu_bench_server.md"
    rc=${PIPESTATUS[0]}
    [ "$rc" -eq 0 ] || { echo "bench_server.py failed (rc=$rc)"; status=1; }
fi
# issue 16/18 on a GPU: the built-in model (bf16) with the draft model and the feature head
if want real; then
    echo "== the built-in model on the GPU: eval.bench_real (bf16), Spec-Bench"
    test -f "${SPECD_GGUF:-}" || { echo "real: SPECD_GGUF (the SmolLM2-135M-Instruct GGUF) is not a file"; exit 1; }
    OMP_NUM_THREADS=4 timeout "${GPU_CHECK_REAL_S:-330}" "$PYBIN" -m eval.bench_real --device cuda \
        --target "$SPECD_GGUF" --draft models/smollm2-draft --prompts "$PROMPTS" \
        --per-category "${GPU_CHECK_PER_CATEGORY:-2}" --max-tokens 256 --batch 1,4 --threads 4 \
        --dtype bfloat16 --quantization none --no-progress --profile-tokens 48 \
        --systems "${GPU_CHECK_REAL_SYSTEMS:-specd:off,specd:tree:16,specd:ngram:8,specd+head:chain:4,specd+head:tree:32,specd+head:auto,hf:generate,hf:pld:10}" \
        --out "$OUT/gpu_real" 2>&1 | tee "$OUT/gpu_real.log"
    rc=${PIPESTATUS[0]}
    [ "$rc" -eq 0 ] || { echo "real-model bench failed (rc=$rc)"; status=1; }
fi
exit $status
