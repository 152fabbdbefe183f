#!/usr/bin/env bash
# Prepares, on a development machine with network, TorchRec's CUDA stack for the GPU machine
# (Python 3.12, torch 2.11+cu130, no torchrec, no network, 64 MiB per transfer) in ONE
# transfer: .gpu/stack/ (47.4 MiB; the repo's own files add ~2.5 MB; the limit is 64 MiB).
#
#   fbgemm-gpu 1.6.0 (cp312, CUDA 13 build: the one for torch 2.11), every file and all host
#   code kept (every library loads, every operator registers), device code cut by
#   scripts/fatbin_keep_arch.py to the sm_90a cubins an H100/H200 loads, less the kernel
#   families metamat never uses (DROP below: the SSD (key-value) TBE, which metamat refuses,
#   and variable batch sizes (VBE), which TorchRec uses only for variable-stride KJTs; kept:
#   every fused optimizer, the dense TBE, the IntN/FP8/FP16/FP32 inference TBE, every
#   cache/UVM/sparse/jagged op): 2.4 GB -> xz -9e 45.5 MiB (every sm_90a cubin: 60.8 MiB, too
#   much for one transfer with the rest; xz -6: 79 MiB); torchrec 1.6.1, tensordict, pyvers,
#   iopath (~2 MB, whole).
#
# A dropped kernel, if ever launched, fails with "no kernel image is available for execution
# on the device"; .gpu/stack/DROPPED.tsv names every dropped cubin's kernels. DROP='' keeps
# every sm_90a cubin (~61 MiB: then split in two, .gpu/stack + .gpu/stack2, two `run` calls;
# scripts/gpu_torchrec_install.sh keeps the first half in /tmp/gpustack while the machine is
# warm, ~30 s).
#
# Usage, in the project root:  bash scripts/gpu_torchrec_stack.sh   (12-16 min on 2 cores: xz)
#   env: SM (90), DROP (regex, see below), XZ_LEVEL (9e; 6 takes half the time, +27%),
#        MAX_MIB (56: larger is split),
#        FBGEMM, TORCHREC (pip requirement strings)
# Result (git-ignored through .git/info/exclude): .gpu/stack/ = fbgemm.tar.xz (or part.0),
#   the small wheels, SHA256, DROPPED.tsv, MANIFEST. On the GPU machine:
#   carry [".gpu/stack"]:  bash scripts/gpu_check.sh "$OUT"   (installs it into /tmp/site)
set -euo pipefail
cd "$(dirname "$0")/.."
D=.gpu
SM=${SM:-90}
XZ_LEVEL=${XZ_LEVEL:-9e}  # its 64 MiB window finds the cubins' likeness: 27% smaller than -6
MAX_MIB=${MAX_MIB:-56}
# A cubin is dropped when ALL its kernels' names match (see fatbin_keep_arch.py).
DEFAULT_DROP='^ssd_|_vbe'
DROP=${DROP-$DEFAULT_DROP}
PY=${PYTHON:-python3}
mkdir -p .git/info
grep -qxF "/$D/" .git/info/exclude 2>/dev/null || echo "/$D/" >> .git/info/exclude
rm -rf $D/stack $D/stack2 $D/work $D/a $D/b $D/base
mkdir -p $D/stack $D/work/tree
PLAT="--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64"
FBGEMM=${FBGEMM:-fbgemm-gpu==1.6.0}
TORCHREC=${TORCHREC:-torchrec==1.6.1}
$PY -m pip download -q --no-deps $PLAT -d $D/work "$FBGEMM"
$PY -m pip download -q --no-deps $PLAT -d $D/stack "$TORCHREC" tensordict "pyvers>=0.2,<0.3"
$PY -m pip download -q --no-deps --no-binary=:none: -d $D/stack iopath==0.1.10
(cd $D/stack && sha256sum ./*.whl ./*.tar.gz) > $D/work/SHA256.wheels
$PY -m zipfile -e $D/work/fbgemm_gpu-*.whl $D/work/tree
$PY scripts/fatbin_keep_arch.py ${DROP:+--drop "$DROP"} --empty-dir $D/work/empty \
  --report $D/stack/DROPPED.tsv "$SM" $D/work/tree/fbgemm_gpu/*.so
# every fatbin still reads whole (empty cubins where code was cut), where cuobjdump exists
if command -v cuobjdump >/dev/null; then
  for f in $D/work/tree/fbgemm_gpu/*.so; do
    if cuobjdump -lelf "$f" >/dev/null 2>&1; then
      (mkdir -p $D/work/x && cd $D/work/x && cuobjdump -xelf all "../tree/fbgemm_gpu/${f##*/}" >/dev/null && rm -f ./*) \
        || { echo "cuobjdump cannot read $f" >&2; exit 1; }
    fi
  done
  echo "cuobjdump read every cubin of every library"
fi
tar -C $D/work/tree -cf - . | xz -T0 "-$XZ_LEVEL" > $D/work/fbgemm.tar.xz
size=$(stat -c %s $D/work/fbgemm.tar.xz)
(cd $D/work && sha256sum fbgemm.tar.xz) > $D/stack/SHA256
mv $D/work/SHA256.wheels $D/stack/
if ((size > MAX_MIB * 1048576)); then  # two transfers: .gpu/stack (part.0), .gpu/stack2
  mkdir -p $D/stack2
  split -b $(((size + 1) / 2)) -d -a 1 $D/work/fbgemm.tar.xz $D/work/part.
  mv $D/work/part.0 $D/stack/ && mv $D/work/part.1 $D/stack2/
  echo "fbgemm.tar.xz is $((size >> 20)) MiB > ${MAX_MIB}: split in two (.gpu/stack, .gpu/stack2)"
else
  mv $D/work/fbgemm.tar.xz $D/stack/
fi
{
  echo "fbgemm: $FBGEMM  torchrec: $TORCHREC  sm_$SM  xz -$XZ_LEVEL"
  echo "drop: ${DROP:-<none>}"
  echo "fbgemm.tar.xz: $size bytes; dropped cubins: $(wc -l < $D/stack/DROPPED.tsv)"
  (cd $D/stack && ls -l)
} > $D/stack/MANIFEST
rm -rf $D/work
cat $D/stack/MANIFEST
du -sh $D/stack* | tr '\n' ' '; echo
tree_bytes=$( (git ls-files -co --exclude-standard -z | xargs -0 stat -c %s 2>/dev/null || true) \
  | awk '{s+=$1} END {print s+0}')
echo "one transfer: repo $((tree_bytes >> 20)) MiB + .gpu/stack $(du -sm $D/stack | cut -f1) MiB (limit 64 MiB)"
