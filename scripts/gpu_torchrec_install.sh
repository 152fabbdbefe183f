#!/usr/bin/env bash
# On the GPU machine (see scripts/gpu_torchrec_stack.sh): keeps the fbgemm half that came with
# this call in /tmp/gpustack (it lives while the machine stays warm); once both halves and
# .gpu/base are there, installs fbgemm-gpu + torchrec into /tmp/site. Prints one status line;
# exits 0 when installed, 3 while a half is still missing.
set -euo pipefail
S=/tmp/gpustack
mkdir -p $S
if PYTHONPATH=/tmp/site python3 -c "import fbgemm_gpu, torchrec" 2>/dev/null; then
  echo "torchrec stack: installed in /tmp/site"; exit 0; fi
cp -n .gpu/a/part.* .gpu/b/part.* $S/ 2>/dev/null || true
if [ ! -f $S/part.0 ] || [ ! -f $S/part.1 ] || [ ! -f .gpu/base/SHA256 ]; then
  echo "torchrec stack: have $(ls $S | tr '\n' ' '); send the other half with .gpu/base"; exit 3; fi
cat $S/part.0 $S/part.1 > $S/fbgemm.tar.xz
(cd $S && sha256sum -c --quiet "$OLDPWD/.gpu/base/SHA256")
mkdir -p /tmp/site
python3 -m pip install -q --no-index --no-deps --no-compile --no-build-isolation --target /tmp/site \
  .gpu/base/*.whl .gpu/base/*.tar.gz
xz -T0 -dc $S/fbgemm.tar.xz | tar -C /tmp/site -x
PYTHONPATH=/tmp/site python3 -c "import torch, fbgemm_gpu, torchrec; print('torchrec stack: torch', torch.__version__, 'fbgemm_gpu', fbgemm_gpu.__version__, 'torchrec', torchrec.__version__, 'cuda', torch.cuda.is_available())" 2>&1 | tail -1
