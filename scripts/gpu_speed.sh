#!/usr/bin/env bash
# GPU speed, round 2 (docs/PERFORMANCE.md "GPU speed, round 2: prepared"): every measurement
# of the issue in ONE command, within BUDGET_S seconds of wall time (default 240), on a machine
# whose python3 has a CUDA torch, offline. Run from the repository root:
#
#   bash scripts/gpu_speed.sh "$OUT"
#
# Steps (cap in seconds; a step never runs past what is left of the budget, less RESERVE_S):
#   build   110  (180 when build/speed is missing) metamat._C with its CUDA backend AND the init kernel's variants
#                (METAMAT_FILL_VARIANTS=1, csrc/fill/fill_cuda_var_*.cu) for this GPU's architecture,
#                in build/speed: seconds after scripts/gpu_check.sh on the same machine (its
#                `variants` step built them there)
#   check    25  every variant, GPU == CPU bit for bit (fp32/fp16/bf16 x the distributions,
#                aligned, narrow, unaligned and many-table launches, 1 and 4 tiles per block)
#   init     45  bench/bench_init_variants.py: fp32/bf16 x Uniform/Normal/TruncatedNormal (and
#                fp16 Uniform) per variant against the same dtype's fill_; Constant (the store
#                path) and philoxbits (Philox + stores) as diagnostics; 10,240 tables of 1 MiB vs
#                one table, per variant x tiles per block (INIT_GIB 4, ROUNDS 7)
#   stage    50  bench/bench_stage.py --sweep: the read ceiling (same bytes, same reader threads,
#                into pinned memory, best of several), pinned H2D, staged rows with their ratios,
#                fp32 -> bf16 converted on the host vs the device, a bf16 checkpoint, and the
#                ring size x reader threads sweep (STAGE_GIB 1, STAGE_REPS 3)
#   gds      30  bench/bench_gds.py (log appended to stage.log): cold loads, metamat's staged
#                pipeline vs GPUDirect Storage (cuFile through torch.cuda.gds, compatibility mode
#                without nvidia-fs) vs the O_DIRECT read ceiling (GDS_GIB 0.5, GDS_REPS 2)
#   ncu      15  if ncu is on PATH: pipe utilisation of fp32 Uniform/Normal, base vs split
# A failing step never stops the later ones; a step that would start with under 8 s left is
# SKIPPED. OUT gets at most 8 files: summary.json (steps, statuses, seconds, the GPU, and the
# bench rows), summary.csv (the bench rows), env.txt, build.log, check.log, init.log,
# stage.log (also the gds step's), ncu.log (when ncu ran).
#
# On a fresh machine (not right after gpu_check.sh) the build takes ~2 min from nothing: give
# the call BUDGET_S=330 and a 350 s limit, or the build's cap leaves the benches no time.
# env: PYTHON (python3), BUDGET_S (240), RESERVE_S (5), STEPS (space-separated subset),
#      INIT_GIB, ROUNDS, TABLES, STAGE_GIB, STAGE_REPS, GDS_GIB, GDS_REPS, METAMAT_CUDA_ARCHS
#      (from the GPU).
#      GPU_SPEED_DRY=1 (tests, any machine): each step only prints its command.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
out=${1:-gpu_speed_out}
mkdir -p "$out" && out=$(cd "$out" && pwd)
py=${PYTHON:-python3}
budget=${BUDGET_S:-240}
reserve=${RESERVE_S:-5}
dry=${GPU_SPEED_DRY:-0}
start=$SECONDS
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
work=$(mktemp -d /tmp/gpu_speed.XXXXXX)  # the benches' JSON (read by the summary)
trap 'rm -rf "$work"' EXIT
steps_tsv=$work/steps.tsv
: >"$steps_tsv"

wanted() { [ -z "${STEPS:-}" ] || [[ " $STEPS " == *" $1 "* ]]; }
# step NAME CAP LOG CMD...: runs CMD under `timeout` within the budget, logs to OUT/LOG
# (+LOG: appends to it; OUT may hold 8 files)
step() {
  local name=$1 cap=$2 log=$3 append=0; shift 3
  if [[ $log == +* ]]; then log=${log#+}; append=1; fi
  wanted "$name" || return 0
  ((append)) || : >"$out/$log"
  local left=$((budget - reserve - (SECONDS - start)))
  local t=$((cap < left ? cap : left)) status rc t0=$SECONDS
  if [ "$t" -lt 8 ]; then
    printf '%s\tSKIPPED\t-1\t0\t%s\n' "$name" "$log" >>"$steps_tsv"
    echo "== $name SKIPPED (${left}s left)"
    return 0
  fi
  echo "== $name (cap ${t}s): $*"
  if [ "$dry" = 1 ]; then
    echo "dry run: $*" >>"$out/$log"
    rc=0
  else
    timeout -k 5 "$t" "$@" >>"$out/$log" 2>&1
    rc=$?
  fi
  case $rc in 0) status=PASS ;; 124|137) status=TIMEOUT ;; *) status=FAIL ;; esac
  printf '%s\t%s\t%d\t%d\t%s\n' "$name" "$status" "$rc" "$((SECONDS - t0))" "$log" >>"$steps_tsv"
  echo "   $status in $((SECONDS - t0))s ($log)"
  tail -n 40 "$out/$log"
}

# env: the GPU, driver, torch, nvcc, ncu; the architecture to build for
{
  date -u
  nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.mem,driver_version \
    --format=csv 2>&1 | head -3
  "$py" -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, \
'cuda', torch.version.cuda, torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no GPU')" 2>&1
  command -v nvcc >/dev/null && nvcc --version | tail -1
  command -v ncu >/dev/null && echo "ncu: $(ncu --version | tail -1)" || echo "ncu: none"
  nproc; free -g | head -2
} >"$out/env.txt" 2>&1
cat "$out/env.txt"
arch=${METAMAT_CUDA_ARCHS:-$("$py" -c "import torch; c = torch.cuda.get_device_capability(0); print(f'{c[0]}{c[1]}')" 2>/dev/null || echo 90)}

step build "$([ -d "${METAMAT_BUILD_DIR:-build/speed}" ] && echo 110 || echo 180)" build.log env METAMAT_CUDA=ON METAMAT_CUDA_ARCHS="$arch" METAMAT_FILL_VARIANTS=1 \
  METAMAT_BUILD_DIR="${METAMAT_BUILD_DIR:-build/speed}" "$py" scripts/build_ext.py
step check 25 check.log "$py" scripts/gpu_speed_check.py
step init 45 init.log "$py" bench/bench_init_variants.py --size-gib "${INIT_GIB:-4}" \
  --rounds "${ROUNDS:-7}" --tables "${TABLES:-10240}" --json "$work/init.json"
step stage 50 stage.log "$py" bench/bench_stage.py --device cuda --size-gib "${STAGE_GIB:-1}" \
  --reps "${STAGE_REPS:-3}" --sweep --json "$work/stage.json"
step gds 30 +stage.log "$py" bench/bench_gds.py --device cuda --size-gib "${GDS_GIB:-0.5}" \
  --reps "${GDS_REPS:-2}" --json "$work/gds.json"
if command -v ncu >/dev/null || [ "$dry" = 1 ]; then
  step ncu 15 ncu.log ncu --kernel-name regex:fill_kernel --launch-count 4 \
    --metrics sm__inst_executed_pipe_fma.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_fmaheavy.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_alu.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_lsu.avg.pct_of_peak_sustained_active,sm__inst_issued.avg.pct_of_peak_sustained_active,dram__throughput.avg.pct_of_peak_sustained_elapsed,sm__warps_active.avg.pct_of_peak_sustained_active \
    "$py" bench/bench_init_variants.py --size-gib 1 --rounds 1 --tables 64 --tiles 1 \
    --variants base,split --profile
fi
"$py" scripts/gpu_speed_summary.py "$work" "$out" "$((SECONDS - start))" "$budget"
echo "gpu_speed: $((SECONDS - start)) s of $budget; $(ls "$out" | wc -l) files in $out"
