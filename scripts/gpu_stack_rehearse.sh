#!/usr/bin/env bash
# Rehearses, on a machine WITHOUT a GPU, what scripts/gpu_check.sh does with the carried
# TorchRec stack on the lent GPU machine, so that a broken stack costs no device time:
#
#   * a Python 3.12 venv with that machine's torch (2.11.0+cu130, PyPI's CUDA build) and the
#     packages its image has that torchrec's wheels need (cloudpickle, portalocker,
#     pyre-extensions, typing-inspect, torchmetrics 1.9.0: see the device notes' KINDS.md);
#   * the stack that scripts/gpu_torchrec_stack.sh packed (.gpu/stack: fbgemm-gpu 1.6.0's CUDA
#     wheel with its device code cut to sm_90a, torchrec 1.6.1) installed by
#     scripts/gpu_torchrec_install.sh, exactly as the GPU machine installs it, and imported
#     (every library loads, every operator registers);
#   * gpu_check.sh's env, stack, build (metamat._C with its CUDA backend) and
#     torchrec_emulated steps, then every TorchRec test (pytest -m torchrec) on the CPU with
#     that CUDA build of fbgemm.
#
# fbgemm's CUDA libraries link the driver's NVML (libnvidia-ml.so.1), which only a machine
# with an NVIDIA driver has: a stand-in that answers "no driver" to the six calls they import
# is built here with gcc, for loading only (nothing here runs on a GPU).
#
# Usage, in the project root, after scripts/gpu_torchrec_stack.sh:
#   bash scripts/gpu_stack_rehearse.sh            (~20 min on 2 cores; ~5 GiB venv in /tmp)
# env: PY312 (a Python 3.12), R (/tmp/metamat-rehearse: venv, site, build, logs), XDIST_N (2)
# Exit status: that of the TorchRec tests (gpu_check's own steps are in $R/check/summary.json;
# its backend step fails here by design: no GPU).
set -euo pipefail
cd "$(dirname "$0")/.."
R=${R:-/tmp/metamat-rehearse}
[ -f .gpu/stack/SHA256 ] || { echo "no .gpu/stack: run scripts/gpu_torchrec_stack.sh first" >&2; exit 2; }
PY312=${PY312:-}
for c in "$PY312" python3.12 /root/.pyenv/versions/3.12*/bin/python3.12 /usr/bin/python3.12; do
  if [ -n "$c" ] && "$c" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
    PY312=$c; break
  fi
done
"$PY312" --version || { echo "no Python 3.12 found (set PY312)" >&2; exit 2; }
mkdir -p "$R"
if [ ! -x "$R/venv/bin/python" ]; then
  "$PY312" -m venv "$R/venv"
  "$R/venv/bin/pip" install -q --no-compile torch==2.11.0
  "$R/venv/bin/pip" install -q --no-compile pybind11 numpy scipy pytest pytest-timeout \
    "pytest-xdist>=3.6,<4" pytest-benchmark hypothesis safetensors psutil tqdm xxhash matplotlib \
    cmake ninja setuptools wheel cloudpickle portalocker pyre-extensions typing-inspect \
    torchmetrics==1.9.0 transformers==5.24.0
fi
"$R/venv/bin/python" -c "import torch; assert torch.version.cuda, 'not a CUDA build'; print('torch', torch.__version__)"
mkdir -p "$R/nvml"
cat > "$R/nvml/stub.c" <<'EOF'
/* The driver's NVML on a machine without one: every call answers NVML_ERROR_DRIVER_NOT_LOADED. */
int nvmlInit_v2(void) { return 9; }
int nvmlDeviceGetCount_v2(unsigned *n) { if (n) *n = 0; return 9; }
int nvmlDeviceGetHandleByIndex_v2(unsigned i, void **h) { return 9; }
int nvmlDeviceGetNvLinkRemotePciInfo_v2(void *d, unsigned l, void *p) { return 9; }
int nvmlDeviceGetNvLinkState(void *d, unsigned l, int *s) { return 9; }
int nvmlDeviceGetPciInfo_v3(void *d, void *p) { return 9; }
EOF
gcc -shared -fPIC -Wl,-soname,libnvidia-ml.so.1 -o "$R/nvml/libnvidia-ml.so.1" "$R/nvml/stub.c"
# the repository as the GPU machine gets it (tracked and untracked files, the stack), so the
# build here never touches this checkout's build/ or metamat/_C
rm -rf "$R/repo" && mkdir -p "$R/repo"
git ls-files -co --exclude-standard -z | xargs -0 cp --parents -t "$R/repo"
cp -r .gpu "$R/repo/"
export LD_LIBRARY_PATH="$R/nvml${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export PATH="$R/venv/bin:$PATH"
cd "$R/repo"
rm -rf "$R/site" "$R/check" "$R/work"
PYTHON="$R/venv/bin/python" SITE="$R/site" XDIST_N="${XDIST_N:-2}" BUDGET_S=3000 \
  GPU_CHECK_WORK="$R/work" STEPS="env stack build backend torchrec_emulated" \
  bash scripts/gpu_check.sh "$R/check" || true
PYTHONPATH="$R/site:$PWD" "$R/venv/bin/python" -m pytest -q -p no:cacheprovider -p no:benchmark \
  -n "${XDIST_N:-2}" -m torchrec tests/ 2>&1 | tee "$R/torchrec_tests.log"
