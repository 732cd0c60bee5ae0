#!/usr/bin/env bash
# One prepared run on a lent GPU host (no registry, the image's python3): install the carried wheels,
# put the carried bubblewrap first on PATH, grade the demo class of every lab sandboxed on the GPU's
# profile (make gpu-class), then, with the time left, lab 10's step benchmark and make bench-gpu's GPU tests. Every log and
# the rows land in $OUT (or build/gpu-session where $OUT is unset) for the session to commit.
#
# Prepare here first (a CPU machine, after make venv):
#   ../shared/gpu/carry-bwrap.sh            # .dev/bwrap: bubblewrap and its libraries
#   python benchmarks/gpu_carry.py          # .dev/wheels: nbgrader, jupytext, SQLAlchemy, ... (~30 MiB)
# then one device call carrying .dev:  bash benchmarks/gpu_session.sh [gpu-class arguments]
# Budget: gpu-class is asked to take 8 minutes; SESSION_S (default 540) bounds the whole script.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-build/gpu-session}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
started=$(date +%s)
left() { echo $(( ${SESSION_S:-540} - ($(date +%s) - started) )); }

if [ -d .dev/bwrap/bin ]; then export PATH="$PWD/.dev/bwrap/bin:$PATH"; fi
if compgen -G ".dev/wheels/*.whl" >/dev/null; then
  echo "installing $(ls .dev/wheels/*.whl | wc -l) carried wheels into $(python3 -c 'import sys; print(sys.prefix)')"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir .dev/wheels/*.whl \
    >"$out/pip.log" 2>&1 || { echo "pip could not install the carried wheels:"; tail -20 "$out/pip.log"; exit 1; }
fi
{ nvidia-smi -L; python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'; } \
  2>&1 | tee "$out/host.txt"

echo "== make gpu-class (the demo class of every lab, sandboxed, on this GPU's profile)"
timeout "$(left)" make --no-print-directory gpu-class PYTHON=python3 CLASS_ARGS="$*" 2>&1 | tee "$out/gpu_class.log"
class_rc=${PIPESTATUS[0]}
cp benchmarks/results/gpu_class.csv "$out/" 2>/dev/null

if [ "$(left)" -gt 240 ]; then
  # Lab 10's step on GPT-2 medium's shape, torch's parts against the course's Triton kernels.
  echo "== benchmarks/capstone.py, with the $(left) s left"
  (cd benchmarks && timeout "$(( $(left) / 2 ))" python3 capstone.py) 2>&1 | tee "$out/capstone.log"
  cp benchmarks/results/capstone.csv "$out/" 2>/dev/null
fi
if [ "$(left)" -gt 120 ]; then
  echo "== make bench-gpu: the GPU tests, with the $(left) s left"
  timeout "$(( $(left) - 20 ))" make --no-print-directory bench-gpu PYTHON=python3 \
    BENCH_ARGS="--skip calibration,benchmarks --budget $(( $(left) - 30 ))" 2>&1 | tee "$out/bench_gpu.log"
  cp build/bench-gpu/tests.log "$out/" 2>/dev/null
fi
echo "gpu-class exit status: $class_rc; files in $out"
exit "$class_rc"
