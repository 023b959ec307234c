#!/usr/bin/env bash
# GPU CI: the cuda-marked tests (tests/test_cuda.py) and a short rank-local benchmark, on this
# machine's GPUs, with the CUDA build of torch already installed here (nothing is downloaded).
# Everything runs within 10 minutes; the log, junit.xml and the benchmark's tables go to $1.
#
#     scripts/gpu_ci.sh [out dir, default runs/gpu_ci]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-runs/gpu_ci}
mkdir -p "$OUT"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec > >(tee "$OUT/log.txt") 2>&1
START=$SECONDS
BUDGET=590  # seconds for everything, under the 10 minutes

echo "== gpu_ci $(date -u +%Y-%m-%dT%H:%M:%SZ) commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
nvidia-smi || echo "nvidia-smi: not found"
python - <<'EOF'
import torch
print("torch", torch.__version__, "| cuda", torch.version.cuda, "| available", torch.cuda.is_available(),
      "| gpus", torch.cuda.device_count())
for i in range(torch.cuda.device_count()):
    print(f"  cuda:{i}", torch.cuda.get_device_name(i))
if torch.cuda.is_available():
    print("nccl", ".".join(map(str, torch.cuda.nccl.version())))
EOF
if ! python -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then
    echo "gpu_ci: torch.cuda.is_available() is False: install a CUDA build of torch first"; exit 2
fi
if ! python -c "import autosp" 2>/dev/null; then
    pip install -e . --no-deps || exit 2
fi
python -c "import autosp, pytest" || { echo "gpu_ci: autosp or pytest does not import (see above)"; exit 2; }

echo "== tests/test_cuda.py"
timeout -k 10 400 python -m pytest -m cuda tests/test_cuda.py -v -rfEs --durations=10 --junitxml "$OUT/junit.xml"
tests_rc=$?

left=$((BUDGET - (SECONDS - START)))
echo "== benchmark: one rank of sp=4 on one GPU (fake process group), Inductor; ${left} s left"
if [ "$left" -gt 30 ]; then
    timeout -k 10 "$left" python -m benchmarks.run --device cuda --rank-local --quick --sp 4 \
        --systems single,autosp --steps 3 --out "$OUT/bench"
    bench_rc=$?
else
    echo "gpu_ci: no time left for the benchmark"; bench_rc=124
fi

echo "== gpu_ci done in $((SECONDS - START)) s: tests rc=$tests_rc (124: timed out), benchmark rc=$bench_rc; output in $OUT"
[ "$tests_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
