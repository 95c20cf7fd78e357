#!/usr/bin/env bash
# GPU check of the specd Triton kernels: kernel tests on the real GPU (compiled, no interpreter),
# then the ahead-of-time register/spill report (python -m specd_kernels.aot), then the timing
# table of eval/gpu_check.py, then websocket delivery vs in-process on the GPU
# (eval/bench_server.py; GPU_CHECK_SERVER=0 skips it). Meant to finish within ~13 minutes on an H200.
#
#   eval/gpu_check.sh [extra args for gpu_check.py]
#
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

status=0
echo "== pytest tests/test_kernels*.py (compiled Triton on the GPU)"
timeout 240 "$PYBIN" -m pytest -q -p no:cacheprovider tests/test_kernels*.py 2>&1 | tee "$OUT/gpu_pytest.log"
rc=${PIPESTATUS[0]}
[ "$rc" -eq 0 ] || { echo "pytest failed (rc=$rc)"; status=1; }

# issue 21 item 7: the ahead-of-time report (sm_80 + sm_90a registers / spills / shared memory of every
# launcher configuration) with this machine's triton + bundled ptxas; compile-time figures, ~1 min here
echo "== AOT compile report (python -m specd_kernels.aot --check)"
timeout 300 "$PYBIN" -m specd_kernels.aot --check --json "$OUT/gpu_aot.json" 2>&1 | tee "$OUT/gpu_aot.md"
rc=${PIPESTATUS[0]}
[ "$rc" -eq 0 ] || { echo "specd_kernels.aot failed or found spills (rc=$rc)"; status=1; }

echo "== timing"
timeout 330 "$PYBIN" -m eval.gpu_check --budget-s 240 "$@" 2>&1 | tee "$OUT/gpu_timing.md"
rc=${PIPESTATUS[0]}
[ "$rc" -eq 0 ] || { echo "gpu_check.py failed (rc=$rc)"; status=1; }

# issue 5's delivery target on real hardware: websocket vs in-process tokens/s (demo pair, on the GPU)
if [ "${GPU_CHECK_SERVER:-1}" = 1 ]; then
    echo "== websocket delivery vs in-process (eval/bench_server.py, device cuda)"
    OMP_NUM_THREADS=2 timeout 240 "$PYBIN" -m eval.bench_server --device cuda --rounds 2 --repeats 5 \
        --max-tokens 192 2>&1 | tee "$OUT/gpu_bench_server.md"
    rc=${PIPESTATUS[0]}
    [ "$rc" -eq 0 ] || { echo "bench_server.py failed (rc=$rc)"; status=1; }
fi
exit $status
