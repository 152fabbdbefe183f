#!/usr/bin/env bash
# Prepares, on a development machine with network, TorchRec's CUDA stack for the GPU machine
# (Python 3.12, torch 2.11+cu130, no torchrec, no network, 64 MiB per transfer) in TWO
# transfers: fbgemm-gpu 1.6.0 with only sm_90a device code kept (scripts/fatbin_keep_arch.py),
# packed with xz (~79 MiB) and split in two; torchrec 1.6.1, tensordict, pyvers, iopath whole.
# (../shared/gpu/stack-wheels.sh sends the whole wheel: nine 52 MiB transfers.)
# Usage, in the project root:  bash scripts/gpu_torchrec_stack.sh   (~4 min on 2 cores)
# Result (git-ignored): .gpu/a, .gpu/b (one half each), .gpu/base (small wheels, SHA256).
# On the GPU machine, two `run` calls back to back (it stays warm ~30 s between them):
#   carry [".gpu/a"]:               bash scripts/gpu_torchrec_install.sh; (anything else)
#   carry [".gpu/b", ".gpu/base"]:  bash scripts/gpu_torchrec_install.sh && export PYTHONPATH=/tmp/site; ...
# With pytest-xdist there, pass `-p no:benchmark` (pytest-benchmark breaks with -n there).
set -euo pipefail
cd "$(dirname "$0")/.."
D=.gpu
SM=${SM:-90}
mkdir -p .git/info
grep -qxF "/$D/" .git/info/exclude 2>/dev/null || echo "/$D/" >> .git/info/exclude
rm -rf $D && mkdir -p $D/a $D/b $D/base $D/work/tree
PLAT="--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64"
python3 -m pip download -q --no-deps $PLAT -d $D/work "${FBGEMM:-fbgemm-gpu==1.6.0}"
python3 -m pip download -q --no-deps $PLAT -d $D/base "${TORCHREC:-torchrec==1.6.1}" tensordict "pyvers>=0.2,<0.3"
python3 -m pip download -q --no-deps --no-binary=:none: -d $D/base iopath==0.1.10
python3 -m zipfile -e $D/work/fbgemm_gpu-*.whl $D/work/tree
python3 scripts/fatbin_keep_arch.py "$SM" $D/work/tree/fbgemm_gpu/*.so
tar -C $D/work/tree -cf - . | xz -T0 -6 > $D/work/fbgemm.tar.xz
(cd $D/work && sha256sum fbgemm.tar.xz) > $D/base/SHA256
half=$(( ($(stat -c %s $D/work/fbgemm.tar.xz) + 1) / 2 ))
split -b "$half" -d -a 1 $D/work/fbgemm.tar.xz $D/work/part.
mv $D/work/part.0 $D/a/ && mv $D/work/part.1 $D/b/
rm -rf $D/work
du -sh $D/a $D/b $D/base | tr '\n' ' '; echo
