#!/usr/bin/env bash
# Everything that needs a GPU, in one go, within BUDGET_S seconds (default 570: one 10-minute
# command), on a machine whose python3 has a CUDA torch (offline is fine: nothing is installed):
#   (env)      what is there (GPU, torch, nvcc, compute-sanitizer, optional test packages)
#   build      metamat._C with the CUDA backend for this GPU's architecture, in place
#   backend    the build has its CUDA backend and sees the GPU
#   pytest     every `cuda` test (init and load): pytest -m cuda
#   bench_init bench/materialize.py --mode init --device cuda (GPU goals table at the end)
#   torchrec_cuda tests/test_torchrec_cuda_layout.py (CUDA TorchRec layout), when torchrec and
#              fbgemm_gpu are importable (its cuda tests also run in the pytest step)
#   bench_stage bench/bench_stage.py --device cuda: checkpoint -> CUDA tensors through the C++
#              staging pipeline (pinned ring, copy stream) vs the pinned-copy ceiling and
#              safetensors' loader; fp32, fp32->bf16 (host conversion), strided, small ring
#   bench_tp   bench/materialize.py --mode tp --device cuda --ranks 1: a DTensor model loaded
#              into the GPU by metamat vs to_empty + dcp.load vs the pinned H2D copy
#   memcheck   compute-sanitizer memcheck on the one-process cuda tests but the CUPTI one, with
#              torch's caching allocator off (PYTORCH_NO_CUDA_MEMORY_CACHING=1): bad accesses seen
#   racecheck  compute-sanitizer racecheck, same tests
#   bench_load bench/materialize.py --mode load --device cuda, when torchrec and fbgemm_gpu are
#              importable (TorchRec tables still load on CPU: the bench says so and measures CPU)
# Each step logs to OUTDIR/<step>.log and reports; a failing step does not stop the others;
# the exit status is non-zero if any step failed.
# Usage: bash scripts/gpu_check.sh [OUTDIR]   (default gpu_out/; PYTHON, SIZE_GIB, TP_GIB,
#        BUDGET_S)
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
out=${1:-gpu_out}
mkdir -p "$out"
py=${PYTHON:-python3}
budget=${BUDGET_S:-570}
size_gib=${SIZE_GIB:-10}  # 10 GiB: the goal's 10,000 (10,240) tables of 1 MiB
start=$SECONDS
failed=()

# step NAME MAX_SECONDS CMD...: run CMD with a timeout (its own cap and what is left of the
# budget), log to OUTDIR/NAME.log, report ok / FAILED and the log's tail.
step() {
  local name=$1 cap=$2 left rc t0=$SECONDS
  shift 2
  left=$((budget - (SECONDS - start)))
  if ((left < 10)); then
    echo "== $name: SKIPPED (time budget of ${budget}s spent)"
    failed+=("$name(no time)")
    return
  fi
  ((cap > left)) && cap=$left
  echo "== $name (at most ${cap}s)"
  timeout --kill-after=10 "$cap" "$@" >"$out/$name.log" 2>&1
  rc=$?
  if ((rc == 0)); then
    echo "   ok in $((SECONDS - t0))s"
  else
    ((rc == 124 || rc == 137)) && echo "   timed out after ${cap}s"
    echo "   FAILED (exit $rc) in $((SECONDS - t0))s; last lines of $out/$name.log:"
    tail -n 15 "$out/$name.log" | sed 's/^/   | /'
    failed+=("$name")
  fi
}

env_report() {
  nvidia-smi -L || true
  "$py" -c "import sys, torch; print('python', sys.version.split()[0], sys.executable); print('torch', torch.__version__, 'CUDA', torch.version.cuda, 'GPU visible', torch.cuda.is_available())"
  for m in pybind11 numpy pytest hypothesis scipy safetensors xxhash torchrec fbgemm_gpu matplotlib; do
    "$py" -c "import $m" 2>/dev/null && echo "module $m: ok" || echo "module $m: MISSING"
  done
  command -v nvcc || ls /usr/local/cuda/bin/nvcc || echo "nvcc: MISSING"
  command -v cmake || echo "cmake: not on PATH (build_ext.py also looks beside $py)"
  command -v compute-sanitizer || echo "compute-sanitizer: MISSING"
}

arch=$("$py" -c "import torch; c = torch.cuda.get_device_capability(0); print(f'{c[0]}{c[1]}')" 2>/dev/null)
echo "GPU sm_${arch:-?}; logs in $out/"
env_report >"$out/env.log" 2>&1
sed 's/^/   /' "$out/env.log"
step build 300 env METAMAT_CUDA=ON METAMAT_CUDA_ARCHS="${arch:-80;90}" "$py" scripts/build_ext.py
step backend 60 "$py" -c "import metamat._C as C; assert C.cuda_compiled(), 'no CUDA backend'; assert C.cuda_device_count() > 0, 'no GPU'; print('CUDA backend ok')"

# --continue-on-collection-errors: a test module whose optional package is missing here fails
# the step but does not keep the cuda tests of the other modules from running.
pytest_cuda=("$py" -m pytest -q -p no:cacheprovider --continue-on-collection-errors -rs tests/)
step pytest 180 "${pytest_cuda[@]}" -m cuda
step bench_init 150 env PYTHONPATH="$PWD" "$py" bench/materialize.py --mode init --device cuda \
  --size-gib "$size_gib" --reps 5 --sweep 1 --out "$out/bench_init"
grep -A8 "GPU goals" "$out/bench_init.log"
step bench_stage 90 env PYTHONPATH="$PWD" "$py" bench/bench_stage.py --device cuda --size-gib 1 \
  --reps 3
cat "$out/bench_stage.log" 2>/dev/null || true
# DTensor (tensor parallel) into GPU memory: metamat against to_empty + dcp.load, one rank on
# the one GPU, against the pinned host-to-device copy of the same bytes
step bench_tp 120 env PYTHONPATH="$PWD" "$py" bench/materialize.py --mode tp --device cuda \
  --ranks 1 --size-gib "${TP_GIB:-4}" --reps 2 --out "$out/bench_tp"
grep -A9 "^== tp" "$out/bench_tp.log"
# Sanitizers last: they are the slowest steps, so the benches' numbers come first. One
# process each (the two-process DTensor tests are left out: sanitizing spawned ranks is slow).
if command -v compute-sanitizer >/dev/null; then
  for tool in memcheck racecheck; do
    step "$tool" 150 env PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool "$tool" \
      --error-exitcode 9 --target-processes all "${pytest_cuda[@]}" \
      -m "cuda and not cupti and not multiprocess"
  done
else
  echo "== memcheck, racecheck: compute-sanitizer not found"
  failed+=("sanitizers(missing)")
fi
if "$py" -c "import torchrec, fbgemm_gpu" 2>/dev/null; then
  # TorchRec tables laid out for CUDA (docs/TORCHREC_GPU.md): the CPU layout checks against
  # this machine's fbgemm build plus the cuda-marked UVM allocation / one-launch fill tests
  step torchrec_cuda 150 "$py" -m pytest -q -p no:cacheprovider -rs tests/test_torchrec_cuda_layout.py
else
  echo "== torchrec_cuda: skipped (torchrec / fbgemm_gpu not importable)"
fi
if "$py" -c "import torchrec, fbgemm_gpu" 2>/dev/null; then
  step bench_load 120 env PYTHONPATH="$PWD" "$py" bench/materialize.py --mode load --device cuda \
    --quick --out "$out/bench_load"
else
  echo "== bench_load: skipped (torchrec / fbgemm_gpu not importable)"
fi

echo "== done in $((SECONDS - start))s"
if ((${#failed[@]})); then
  echo "FAILED: ${failed[*]}"
  exit 1
fi
echo "all steps passed"
