#!/usr/bin/env bash
# Everything that needs a GPU, in ONE command, within BUDGET_S seconds of wall time (default
# 540 s = 9 min, inside one 10-minute `run`), on a machine whose python3 has a CUDA torch,
# offline. Run from the repository root:
#
#   bash scripts/gpu_check.sh "$OUT"
#
# with carry [".gpu/stack"]: TorchRec's CUDA stack, made here first by
# `bash scripts/gpu_torchrec_stack.sh` (47.4 MiB, git-ignored; with the repo ~50 MiB of the
# 64 MiB a call carries; without it the TorchRec steps are SKIPPED). The exact `run` call and the expected times: docs/TORCHREC_GPU.md.
#
# Steps, in this order (cap in seconds; a step never runs past what is left of the budget,
# and one that would start with less than MIN_STEP_S left is SKIPPED):
#   env            30  what is there (GPU, torch, nvcc, compute-sanitizer, packages)
#   stack         120  installs the carried TorchRec stack into /tmp/site (on PYTHONPATH)
#   fbgemm_smoke   60  one launch of each fbgemm CUDA kernel family TorchRec uses, vs the host
#   build         300  metamat._C with its CUDA backend for this GPU (scripts/build_ext.py),
#                      started in the background right after env, waited for here
#   backend        30  the build has its CUDA backend and sees the GPU
#   variants      240  the init kernel's variants (METAMAT_FILL_VARIANTS=1) for
#                      scripts/gpu_speed.sh, built into build/speed (not installed) at nice 19
#                      in the background from here until the benches (without TorchRec: until
#                      the benches after the cuda tests), on the cores the tests
#                      leave idle: gpu_speed.sh run next on the warm machine builds nothing
#   torchrec_gpu  200  pytest -m cuda tests/test_torchrec_gpu.py (materialize + train vs eager
#                      DMP on CUDA, per location) tests/test_torchrec_managed_collision.py
#                      (managed collision, evicting) tests/test_torchrec_hash_zch.py (multi-probe
#                      ZCH, inserting) tests/test_torchrec_two_dim.py (2D parallel vs TorchRec's
#                      DMPCollection) tests/test_torchrec_train_pipeline.py (TorchRec's
#                      TrainPipelineSparseDist) tests/test_torchrec_composable.py
#                      (shard_modules beside FSDP2); pytest-xdist -n XDIST_N (4) when installed
#   torchrec_layout 90 pytest tests/test_torchrec_cuda_layout.py (-n XDIST_N too)
#   quant_gpu     120  pytest -m cuda tests/test_quant_cuda.py tests/test_quant_refresh.py
#                      tests/test_quant_feature_processed.py tests/test_quant_managed_collision*.py
#                      (quantized inference TBEs on the GPU; -n XDIST_N too)
#   bench_dmp     100  bench/materialize.py --mode dmp --device cuda (DMP_GIB 16 of DEVICE
#                      tables, UVM tables at most 4 GiB, DMP_REPS 3, SMALL_TABLES 2048)
#   bench_load    100  bench/materialize.py --mode load --device cuda (LOAD_GIB 4, LOAD_REPS 3)
#   bench_quant    75  bench/bench_quant.py --device cuda (QUANT_GIB 1, QUANT_REPS 1: four
#                      fresh processes): a float DCP checkpoint into CUDA INT8 inference TBEs
#                      vs TorchRec's path
#   cuda          150  every other `cuda` test: pytest -m cuda tests/ (less the files above:
#                      the engine's kernels and staged loads, which ran on GPUs before; after
#                      the benches of the TorchRec paths, whose numbers are the goals)
#   bench_init     90  bench/materialize.py --mode init --device cuda (INIT_GIB 10, 5 reps)
#   bench_stage    60  bench/bench_stage.py --device cuda --size-gib 1 --reps 3
#   bench_tp       90  bench/materialize.py --mode tp --device cuda --ranks 1 (TP_GIB 4)
#   torchrec_emulated 100 pytest tests/test_torchrec_gpu_emulated.py (-n XDIST_N; CPU-bound:
#                      this fbgemm-gpu 1.6.0 against metamat's emulated device; the same
#                      Python as fbgemm-gpu-cpu 1.6.0, which `make test-gpustack` runs on any CPU)
#   memcheck      120  compute-sanitizer memcheck on the one-process cuda tests (if time remains)
#   racecheck     120  compute-sanitizer racecheck, same tests (if time remains)
# A failing step never stops the later ones. pytest steps run with -v -rA, a per-test timeout
# (pytest-timeout, PER_TEST_S 120, when installed) and a JUnit XML. Expected on an H100
# (estimates, nothing measured yet): env 10 s, stack 30, smoke 15, build done by ~100 s,
# TorchRec and quant tests 3-4 min, benches 1-1.5 min each, other cuda tests 1-2 min: the
# steps after `cuda`, the emulated-device tests and the sanitizers run only if time remains.
#
# OUTDIR gets at most 4 files (the device tool returns 8): summary.json (every step: status
# PASS/FAIL/SKIPPED/TIMEOUT, seconds, tests passed/failed/skipped, every failing test's id and
# message, log file; overall PASS/FAIL/INCOMPLETE), logs.tar.gz (logs/<step>.log,
# logs/<step>.xml, bench folders), benches.csv (every bench's rows, a 'step' column first),
# gpu_check.log (this output). They are rewritten after every step: a stopped run still
# leaves a summary.
# overall: FAIL if a step FAILed, or TIMEd OUT and is not optional (variants, bench_tp,
# torchrec_emulated, memcheck, racecheck: they run if time remains, with at least 60 s for a
# sanitizer); else INCOMPLETE if
# a step that is not optional was SKIPPED (no time, nothing carried, all its tests skipped);
# else PASS. Exit status: 0 PASS, 1 FAIL, 2 INCOMPLETE.
#
# env: PYTHON (python3), BUDGET_S (540), STEPS / SKIP_STEPS (space-separated step names: run
#      only / leave out; a rerun of some steps on a warm machine), MIN_STEP_S (10), RESERVE_S
#      (15: kept for the summary), PER_TEST_S, DMP_GIB, DMP_REPS, SMALL_TABLES, LOAD_GIB,
#      LOAD_REPS, QUANT_GIB, QUANT_REPS, INIT_GIB, TP_GIB, XDIST_N (4; 0: no xdist), SITE (/tmp/site),
#      GPU_CHECK_WORK (a fresh /tmp folder).
#      GPU_CHECK_DRY=1 (tests/test_gpu_check_script.py, any machine): every step only says what
#      it would run, pytest steps run a tiny stand-in test file; GPU_CHECK_FAIL / GPU_CHECK_HANG
#      (step names) make those steps fail / hang there.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
out=${1:-gpu_out}
mkdir -p "$out" && out=$(cd "$out" && pwd)
work=${GPU_CHECK_WORK:-$(mktemp -d /tmp/gpu_check.XXXXXX)}
mkdir -p "$work"
py=${PYTHON:-python3}
spy=${SUMMARY_PYTHON:-python3}  # the summary needs only the standard library
budget=${BUDGET_S:-540}
reserve=${RESERVE_S:-15}
min_step=${MIN_STEP_S:-10}
site=${SITE:-/tmp/site}
dry=${GPU_CHECK_DRY:-0}
start=$SECONDS
: >"$work/steps.tsv"
exec > >(tee -a "$out/gpu_check.log") 2>&1
tee_pid=$!
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
order="env stack fbgemm_smoke build backend variants torchrec_gpu torchrec_layout quant_gpu bench_dmp
  bench_load bench_quant cuda bench_init bench_stage bench_tp torchrec_emulated memcheck racecheck"  # the summary lists the steps so
printf '{"budget_s": %d, "start_epoch": %d, "dry": %s, "order": ["%s"], "optional_steps": ["variants", "bench_tp", "torchrec_emulated", "memcheck", "racecheck"]}\n' \
  "$budget" "$(date +%s)" "$([ "$dry" = 1 ] && echo true || echo false)" \
  "$(echo $order | sed 's/ /", "/g')" >"$work/meta.json"

in_list() { [[ " $2 " == *" $1 "* ]]; }
wanted() {
  [ -n "${STEPS:-}" ] && ! in_list "$1" "$STEPS" && return 1
  [ -n "${SKIP_STEPS:-}" ] && in_list "$1" "$SKIP_STEPS" && return 1
  return 0
}
summarize() { "$spy" scripts/gpu_check_summary.py "$work" "$out" "$@" || echo "   (summary update failed)"; }
# record NAME STATUS RC SECONDS CAP KIND NOTE: a line of steps.tsv, then the summary anew
record() {
  printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$@" >>"$work/steps.tsv"
  [[ $7 == "not selected"* ]] || summarize >/dev/null
}
skip() {  # skip NAME CAP KIND WHY
  echo "== $1: SKIPPED ($4)"
  record "$1" SKIPPED "" 0 "$2" "$3" "$4"
}

# step NAME CAP KIND CMD...: run CMD (KIND cmd or pytest) with a timeout (its cap and what is
# left of the budget), log to WORK/NAME.log, record PASS / FAIL / TIMEOUT and show the tail.
# BG=1 step ...: start it in the background now; `finish NAME` waits for it and records it.
declare -A bg_pid=() bg_cap=() bg_kind=() bg_t0=()
step() {
  local name=$1 cap=$2 kind=$3 left
  shift 3
  wanted "$name" || { record "$name" SKIPPED "" 0 "$cap" "$kind" "not selected (STEPS/SKIP_STEPS)"; return; }
  left=$((budget - reserve - (SECONDS - start)))
  if ((left < ${MIN:-$min_step})); then  # MIN=N step ...: a step not worth starting with less
    skip "$name" "$cap" "$kind" "no time left of the ${budget}s budget (${left}s)"
    return
  fi
  ((cap > left)) && cap=$left
  if [ "$dry" = 1 ]; then
    if in_list "$name" "${GPU_CHECK_HANG:-}"; then
      set -- sleep 100000
    elif [ "$kind" = pytest ]; then
      local k="passes"
      in_list "$name" "${GPU_CHECK_FAIL:-}" && k="passes or fails"
      set -- env PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 "$py" -m pytest -v -rA -p no:cacheprovider \
        --rootdir "$work/dry" --junitxml="$work/$name.xml" "$work/dry/test_dry_stand_in.py" -k "$k"
    elif in_list "$name" "${GPU_CHECK_FAIL:-}"; then
      set -- sh -c "echo 'dry run: $name fails here'; exit 3"
    else
      local what="$*"
      set -- echo "dry run, would run: ${what:0:300}"
    fi
  fi
  if [ "${BG:-0}" = 1 ]; then
    echo "== $name (at most ${cap}s, in the background)"
    timeout --kill-after=5 "$cap" "$@" >"$work/$name.log" 2>&1 </dev/null &
    bg_pid[$name]=$! bg_cap[$name]=$cap bg_kind[$name]=$kind bg_t0[$name]=$SECONDS
    return
  fi
  echo "== $name (at most ${cap}s)"
  local t0=$SECONDS rc
  timeout --kill-after=5 "$cap" "$@" >"$work/$name.log" 2>&1 </dev/null
  rc=$?
  done_step "$name" "$cap" "$kind" "$rc" $((SECONDS - t0))
}

# finish NAME [stop]: wait for a background step (nothing if it was not started or is
# finished already); with `stop`,
# one still running is stopped instead (TERM to its timeout, which passes it to the whole
# process group) and recorded as TIMEOUT
finish() {
  local name=$1 rc
  [ -n "${bg_pid[$name]:-}" ] || return 0
  if [ "${2:-}" = stop ] && kill -0 "${bg_pid[$name]}" 2>/dev/null; then
    echo "== $name: still running after $((SECONDS - bg_t0[$name]))s: stopped"
    kill -TERM "${bg_pid[$name]}" 2>/dev/null
    wait "${bg_pid[$name]}"
    record "$name" TIMEOUT "$?" $((SECONDS - bg_t0[$name])) "${bg_cap[$name]}" "${bg_kind[$name]}" \
      "stopped before the benches"
    unset "bg_pid[$name]"  # finished: a later `finish` of it does nothing
    return
  fi
  echo "== $name: waiting for it (started $((SECONDS - bg_t0[$name]))s ago)"
  wait "${bg_pid[$name]}"
  rc=$?
  done_step "$name" "${bg_cap[$name]}" "${bg_kind[$name]}" "$rc" $((SECONDS - bg_t0[$name]))
  unset "bg_pid[$name]"
}

# done_step NAME CAP KIND RC SECONDS: the status, the log's tail if not PASS, the record
done_step() {
  local name=$1 cap=$2 kind=$3 rc=$4 secs=$5 status note=""
  if ((rc == 0)); then
    status=PASS
  elif ((rc == 124 || (rc == 137 && secs >= cap))); then
    status=TIMEOUT note="stopped at its ${cap}s cap"
  elif [ "$kind" = pytest ] && ((rc == 5)); then
    status=SKIPPED note="no tests collected"
  else
    status=FAIL
  fi
  echo "   $name: $status (exit $rc) in ${secs}s"
  if [ "$status" != PASS ]; then
    echo "   last lines of logs/$name.log:"
    tail -n 12 "$work/$name.log" | cut -c1-300 | sed 's/^/   | /'
  fi
  record "$name" "$status" "$rc" "$secs" "$cap" "$kind" "$note"
}

# pytest_step NAME CAP ARGS...: pytest with -v -rA, the 15 slowest tests, JUnit XML and the
# per-test timeout
pytest_step() {
  local name=$1 cap=$2
  shift 2
  step "$name" "$cap" pytest "$py" -m pytest -v -rA -p no:cacheprovider --durations=15 \
    --continue-on-collection-errors --junitxml="$work/$name.xml" "${timeout_args[@]}" "$@"
}
# xdist_args: pytest-xdist workers for the TorchRec steps (each test is its own NCCL/gloo world
# on a free port; pytest-benchmark breaks under -n there, hence -p no:benchmark)

if [ "$dry" = 1 ]; then  # the stand-in test file of the dry run's pytest steps
  mkdir -p "$work/dry"
  printf 'def test_passes():\n    pass\n\n\ndef test_fails():\n    assert 1 == 2, "dry run: this step fails here"\n' \
    >"$work/dry/test_dry_stand_in.py"
fi

env_report() {
  echo "repo $(git rev-parse --short HEAD 2>/dev/null) $(git status --porcelain 2>/dev/null | wc -l) changed files; budget ${budget}s; outdir $out; work $work"
  nvidia-smi -L || true
  nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv,noheader || true
  "$py" -c "import sys, torch; print('python', sys.version.split()[0], sys.executable); print('torch', torch.__version__, 'CUDA', torch.version.cuda, 'GPU visible', torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else '')"
  for m in pybind11 numpy pytest pytest_timeout xdist hypothesis scipy safetensors xxhash matplotlib torchrec fbgemm_gpu; do
    "$py" -c "import $m" 2>/dev/null && echo "module $m: ok" || echo "module $m: MISSING"
  done
  for t in nvcc cmake ninja compute-sanitizer cuobjdump xz zstd; do
    echo "$t: $(command -v $t || echo MISSING)"
  done
  ls /usr/local/cuda/bin/nvcc 2>/dev/null
  echo "cores $(nproc); memory $(free -g 2>/dev/null | awk '/Mem:/ {print $2 " GiB"}'); /tmp free $(df -h /tmp | awk 'NR==2 {print $4}')"
  [ -d .gpu/stack ] && cat .gpu/stack/MANIFEST 2>/dev/null | head -4
  true
}

timeout_args=() xdist_args=()
if [ "$dry" != 1 ]; then
  arch=$("$py" -c "import torch; c = torch.cuda.get_device_capability(0); print(f'{c[0]}{c[1]}')" 2>/dev/null)
  "$py" -c "import pytest_timeout" 2>/dev/null && timeout_args=(--timeout "${PER_TEST_S:-120}")
  "$py" -c "import xdist" 2>/dev/null && ((${XDIST_N:-4} > 1)) && xdist_args=(-n "${XDIST_N:-4}" -p no:benchmark)
fi
echo "GPU sm_${arch:-?}; budget ${budget}s; output in $out (logs: $work)"

export py budget out work
step env 30 cmd bash -c "$(declare -f env_report); env_report"
sed 's/^/   /' "$work/env.log" 2>/dev/null | head -40
# metamat._C builds in the background (all cores) while the stack installs and is smoke-tested
BG=1 step build 300 cmd env METAMAT_CUDA=ON METAMAT_CUDA_ARCHS="${arch:-90}" "$py" scripts/build_ext.py

# --- the TorchRec stack (carried as .gpu/stack), then a smoke test of its kernels -----------
if [ -d .gpu/stack ] || [ -d .gpu/stack2 ] || [ -f "$site/.stack_installed" ] || [ "$dry" = 1 ]; then
  step stack 120 cmd env SITE="$site" PYTHON="$py" bash scripts/gpu_torchrec_install.sh
  tail -n 1 "$work/stack.log" 2>/dev/null | sed 's/^/   /'
else
  skip stack 120 cmd "not carried: make .gpu/stack with scripts/gpu_torchrec_stack.sh and carry it"
fi
[ -d "$site" ] && export PYTHONPATH="$site:$PYTHONPATH"
has_torchrec=1
if [ "$dry" != 1 ] && ! "$py" -c "import torchrec, fbgemm_gpu" >/dev/null 2>&1; then
  has_torchrec=0
fi
no_trec="torchrec / fbgemm_gpu not importable (see the stack step)"
if ((has_torchrec)); then
  step fbgemm_smoke 60 cmd "$py" scripts/gpu_fbgemm_smoke.py
  grep -E "^(ok|FAIL|skip) |checks" "$work/fbgemm_smoke.log" 2>/dev/null | sed 's/^/   /' | head -30
else
  skip fbgemm_smoke 60 cmd "$no_trec"
fi

# --- metamat._C with its CUDA backend (started first, above) ---------------------------------
finish build
step backend 30 cmd "$py" -c "import metamat._C as C; assert C.cuda_compiled(), 'no CUDA backend'; assert C.cuda_device_count() > 0, 'no GPU'; print('CUDA backend ok')"
# the init kernel's variants for scripts/gpu_speed.sh, on the cores the tests leave idle; not
# installed into metamat/ (the tests keep the build above)
BG=1 step variants 240 cmd env METAMAT_CUDA=ON METAMAT_CUDA_ARCHS="${arch:-90}" METAMAT_FILL_VARIANTS=1 \
  METAMAT_BUILD_DIR=build/speed nice -n 19 "$py" scripts/build_ext.py --no-copy

# --- TorchRec on the GPU first (training, then quantized inference), then the benches of both
# (the goal numbers), then every other cuda test (the engine's, run on GPUs before) ------------
trec_files=(tests/test_torchrec_gpu.py tests/test_torchrec_cuda_layout.py tests/test_torchrec_gpu_emulated.py
            tests/test_torchrec_managed_collision.py tests/test_torchrec_hash_zch.py
            tests/test_torchrec_two_dim.py tests/test_torchrec_train_pipeline.py
            tests/test_torchrec_composable.py)
quant_files=(tests/test_quant_cuda.py tests/test_quant_refresh.py tests/test_quant_feature_processed.py
             tests/test_quant_managed_collision.py tests/test_quant_managed_collision_sharded.py)
if ((has_torchrec)); then
  pytest_step torchrec_gpu 200 "${xdist_args[@]}" -m cuda tests/test_torchrec_gpu.py \
    tests/test_torchrec_managed_collision.py tests/test_torchrec_hash_zch.py \
    tests/test_torchrec_two_dim.py tests/test_torchrec_train_pipeline.py \
    tests/test_torchrec_composable.py
  pytest_step torchrec_layout 90 "${xdist_args[@]}" tests/test_torchrec_cuda_layout.py
  pytest_step quant_gpu 120 "${xdist_args[@]}" -m cuda "${quant_files[@]}"
else
  skip torchrec_gpu 200 pytest "$no_trec"
  skip torchrec_layout 90 pytest "$no_trec"
  skip quant_gpu 120 pytest "$no_trec"
fi
ignore=()
for f in "${trec_files[@]}" "${quant_files[@]}"; do ignore+=(--ignore "$f"); done

# --- benches (GB/s tables in the logs, rows in benches.csv) ------------------------------------
# nothing compiles under the benches (build/speed keeps what it built); without TorchRec the
# variants go on building while the cuda tests run, and stop before the benches after them
((has_torchrec)) && finish variants stop
bench=("$py" bench/materialize.py --device cuda)
if ((has_torchrec)); then
  step bench_dmp 100 cmd "${bench[@]}" --mode dmp --size-gib "${DMP_GIB:-16}" --reps "${DMP_REPS:-3}" \
    --small-tables "${SMALL_TABLES:-2048}" --out "$work/bench_dmp"  # CSV after each table set
  step bench_load 100 cmd "${bench[@]}" --mode load --size-gib "${LOAD_GIB:-4}" \
    --reps "${LOAD_REPS:-3}" --out "$work/bench_load"
  step bench_quant 75 cmd "$py" bench/bench_quant.py --device cuda --size-gib "${QUANT_GIB:-1}" \
    --reps "${QUANT_REPS:-1}" --out "$work/bench_quant"
else
  skip bench_dmp 100 cmd "$no_trec"
  skip bench_load 100 cmd "$no_trec"
  skip bench_quant 75 cmd "$no_trec"
fi
pytest_step cuda 150 -m cuda "${ignore[@]}" tests/
finish variants stop
step bench_init 90 cmd "${bench[@]}" --mode init --size-gib "${INIT_GIB:-10}" --reps 5 --sweep 1 \
  --out "$work/bench_init"
grep -A8 "GPU goals" "$work/bench_init.log" 2>/dev/null | sed 's/^/   /'
step bench_stage 60 cmd "$py" bench/bench_stage.py --device cuda --size-gib 1 --reps 3
step bench_tp 90 cmd "${bench[@]}" --mode tp --ranks 1 --size-gib "${TP_GIB:-4}" --reps 2 \
  --out "$work/bench_tp"
if ((has_torchrec)); then
  pytest_step torchrec_emulated 100 "${xdist_args[@]}" tests/test_torchrec_gpu_emulated.py
else
  skip torchrec_emulated 100 pytest "$no_trec"
fi

# --- sanitizers last, if time remains: one process each (spawned ranks are slow to sanitize) ---
if command -v compute-sanitizer >/dev/null || [ "$dry" = 1 ]; then
  for tool in memcheck racecheck; do
    MIN=60 step "$tool" 120 cmd env PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool "$tool" \
      --error-exitcode 9 --target-processes all "$py" -m pytest -q -p no:cacheprovider \
      --continue-on-collection-errors -m "cuda and not cupti and not multiprocess" "${ignore[@]}" tests/
  done
else
  skip memcheck 120 cmd "compute-sanitizer not found"
  skip racecheck 120 cmd "compute-sanitizer not found"
fi

summarize --final --print
status=$("$spy" -c "import json, sys; print(json.load(open(sys.argv[1]))['overall'])" "$out/summary.json" 2>/dev/null)
echo "== done in $((SECONDS - start))s: ${status:-no summary}; $out: $(ls "$out" | tr '\n' ' ')"
exec >&- 2>&-
wait "$tee_pid" 2>/dev/null
case $status in PASS) exit 0 ;; INCOMPLETE) exit 2 ;; *) exit 1 ;; esac
