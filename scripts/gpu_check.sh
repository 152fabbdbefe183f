#!/usr/bin/env bash
# Everything that needs a GPU, in one go (for a machine with CUDA torch, nvcc and a GPU):
#   1. build metamat._C with the CUDA backend for this GPU's architecture
#   2. run the CUDA tests (pytest -m cuda)
#   3. run them again under compute-sanitizer memcheck and racecheck
#   4. take the GPU init numbers (fill bandwidth, 10,000 x 1 MiB tables vs one table)
# Usage: bash scripts/gpu_check.sh [OUTDIR]    (logs and CSV go to OUTDIR, default gpu_out/)
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-gpu_out}
mkdir -p "$out"
py=${PYTHON:-python3}
arch=$($py -c "import torch; p = torch.cuda.get_device_properties(0); print(f'{p.major}{p.minor}')")
echo "GPU sm_$arch; building the CUDA backend"
METAMAT_CUDA=1 METAMAT_CUDA_ARCHS="$arch" $py -m pip install -q --no-build-isolation --no-deps -e . \
  2>&1 | tee "$out/build.log" | tail -3
$py -c "import metamat._C as C; assert C.cuda_compiled() and C.cuda_device_count() > 0, 'no CUDA backend'"
$py -m pytest -q -m cuda tests/test_fill_cuda.py 2>&1 | tee "$out/pytest_cuda.log" | tail -5
if command -v compute-sanitizer >/dev/null; then
  for tool in memcheck racecheck; do
    compute-sanitizer --tool "$tool" --error-exitcode 9 \
      $py -m pytest -q -m cuda tests/test_fill_cuda.py -p no:cacheprovider \
      2>&1 | tee "$out/sanitizer_$tool.log" | tail -3
  done
else
  echo "compute-sanitizer not found: skipped" | tee "$out/sanitizer.log"
fi
$py bench/materialize.py --mode init --device cuda --size-gib "${SIZE_GIB:-10}" --reps 5 \
  --out "$out" 2>&1 | tee "$out/bench_init_cuda.log" | tail -20
