#!/usr/bin/env bash
# The device checks of a session that is lent a GPU, in one command: the CUDA tests (the
# captured step as a real CUDA graph, held to the pure path), then the benchmark suite on
# CUDA (the GPU table of docs/performance.md, with the GPU's measured streaming bandwidth and
# the share of it each step reaches: its bandwidth case). The machine has its own PyTorch and no
# network; prepare its one missing package here first, then run this there with `.whl`
# carried:
#
#   make gpu-wheels                # optree for that machine's Python 3.12, into .whl/
#   bash benchmarks/gpu_check.sh   # on the GPU machine; logs and JSON under $OUT (or build/gpu)
#
# Each part has its own time limit, so that one slow part still leaves the other's output.
set -uo pipefail
out="${OUT:-build/gpu}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
if ! python3 -c "import optree" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
    || { echo "gpu_check: no optree wheel in .whl/ (run make gpu-wheels here first)"; exit 2; }
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
python3 -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; \
print('torch', torch.__version__, torch.cuda.get_device_name())" || exit 2
# the CUDA cases (and the compiled one, marked slow); the CPU cases of these files too
timeout 240 python3 -m pytest -q -m "slow or not slow" -o addopts="--strict-markers" \
  tests/test_capture.py 2>&1 | tee "$out/tests.log"
# the compiled mixed step reading the bf16 gradients itself (its path off the CPU)
timeout 180 python3 -m pytest -q -o addopts="--strict-markers" tests/test_compiled.py \
  -k on_cuda 2>&1 | tee -a "$out/tests.log"
timeout 420 python3 benchmarks/run.py --device cuda --json "$out/bench.json" 2>&1 \
  | tee "$out/bench.log"
