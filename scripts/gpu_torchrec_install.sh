#!/usr/bin/env bash
# On the GPU machine: installs the TorchRec CUDA stack that scripts/gpu_torchrec_stack.sh
# packed (carried as .gpu/stack) into $SITE (default /tmp/site; use it with
# PYTHONPATH=/tmp/site). Offline, ~15-30 s (xz unpacks 2.4 GB, mostly zeros).
# When the stack was split in two (DROP='' in gpu_torchrec_stack.sh), the half that came with
# this call is kept in /tmp/gpustack (it lives while the machine stays warm) until the other
# one comes with the next call (.gpu/stack2).
# Exit status: 0 installed (or already there), 2 no stack carried, 3 a half still missing,
# 1 anything else (a checksum, pip, or the import failed). Prints one status line last.
# env: PYTHON (python3), SITE (/tmp/site), STACK (.gpu/stack), STACK2 (.gpu/stack2)
set -euo pipefail
PY=${PYTHON:-python3}
SITE=${SITE:-/tmp/site}
STACK=${STACK:-.gpu/stack}
STACK2=${STACK2:-.gpu/stack2}
S=/tmp/gpustack
check() {
  PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" "$PY" -c "import torch, fbgemm_gpu, torchrec; print('torchrec stack: torch', torch.__version__, 'fbgemm_gpu', fbgemm_gpu.__version__, 'torchrec', torchrec.__version__, 'cuda', torch.cuda.is_available())"
}
if [ -f "$SITE/.stack_installed" ] && check 2>/dev/null; then
  echo "torchrec stack: already installed in $SITE"; exit 0
fi
if [ ! -f "$STACK/SHA256" ] && [ ! -f "$STACK2/part.1" ]; then
  echo "torchrec stack: not carried ($STACK missing; run scripts/gpu_torchrec_stack.sh here and carry it)"
  exit 2
fi
mkdir -p $S
archive=$STACK/fbgemm.tar.xz
if [ ! -f "$archive" ]; then  # two halves
  cp -n "$STACK"/part.0 "$STACK"/SHA256* "$STACK"/*.whl "$STACK"/*.tar.gz $S/ 2>/dev/null || true
  cp -n "$STACK2"/part.1 $S/ 2>/dev/null || true
  if [ ! -f $S/part.0 ] || [ ! -f $S/part.1 ] || [ ! -f $S/SHA256 ]; then
    echo "torchrec stack: have $(ls $S | tr '\n' ' '); send the other half (.gpu/stack / .gpu/stack2)"
    exit 3
  fi
  cat $S/part.0 $S/part.1 > $S/fbgemm.tar.xz
  archive=$S/fbgemm.tar.xz
  STACK=$S
fi
sums=$(cd "$STACK" && pwd)/SHA256
(cd "$(dirname "$archive")" && sha256sum -c --quiet "$sums") \
  || { echo "torchrec stack: fbgemm.tar.xz checksum FAILED"; exit 1; }
if [ -f "$STACK/SHA256.wheels" ]; then
  (cd "$STACK" && sha256sum -c --quiet SHA256.wheels) || { echo "torchrec stack: wheel checksum FAILED"; exit 1; }
fi
mkdir -p "$SITE"
t0=$SECONDS
"$PY" -m pip install -q --no-index --no-deps --no-compile --no-build-isolation --target "$SITE" \
  "$STACK"/*.whl "$STACK"/*.tar.gz
if command -v xz >/dev/null; then
  xz -T0 -dc "$archive" | tar -C "$SITE" -x
else
  "$PY" -c "import sys, tarfile; tarfile.open(sys.argv[1], 'r:xz').extractall(sys.argv[2])" "$archive" "$SITE"
fi
rm -f $S/fbgemm.tar.xz
touch "$SITE/.stack_installed"
echo "unpacked in $((SECONDS - t0))s into $SITE ($(du -sh "$SITE" | cut -f1))"
check 2>&1 | tail -1
check >/dev/null 2>&1
