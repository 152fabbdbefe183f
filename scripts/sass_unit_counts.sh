#!/usr/bin/env bash
# Instructions one thread executes per work unit of the CUDA init kernel, and per 16 bytes
# written, from the SASS of probe kernels (scripts/sass_probe.cu): static count up to the
# first EXIT, which includes the unit's index arithmetic and both branches of the (block-
# uniform) 32/64-bit division test, so it slightly over-counts. The interior path is straight
# line (the count is what runs per unit); the edge path loops over its two 4-lane halves, so
# its count is one half plus the shared code. Needs nvcc and cuobjdump. The kernel's staged
# store path, the variants and the pieces of the transforms: scripts/sass_kernel_mix.py.
# Usage: bash scripts/sass_unit_counts.sh [ARCH]   (default 90)
set -euo pipefail
cd "$(dirname "$0")/.."
arch=${1:-90}
nvcc=${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$nvcc" -std=c++17 -O3 --fmad=false -arch="sm_$arch" -cubin -Icsrc/include -Icsrc -o "$tmp/p.cubin" scripts/sass_probe.cu
printf "%-10s %-12s %-6s %7s %7s %9s %5s\n" path dist dtype instr bytes "instr/16B" regs
cuobjdump -res-usage "$tmp/p.cubin" | awk '/Function/ {f=$2} /REG:/ {sub(":", "", f); split($1, r, ":"); print f, r[2]}' > "$tmp/regs"
for f in $(cuobjdump -sass "$tmp/p.cubin" | awk '/Function :/ {print $3}' | grep -E "interior_probe|edge_probe"); do
  n=$(cuobjdump -sass -fun "$f" "$tmp/p.cubin" | awk '
    /^        \/\*[0-9a-f]+\*\// { n++; op = $2; if (op ~ /^@/) next; if (op ~ /^EXIT/) { print n; exit } }')
  path=${f#_ZN7metamat}; path=${path#[0-9][0-9]}; path=${path%%_probe*}; path=${path#[0-9]}
  kind=$(echo "$f" | sed -E 's/.*DistKindE([0-9]).*/\1/')
  dtype=$(echo "$f" | sed -E 's/.*ENS_[0-9]+([A-Z0-9]+)EEEv.*/\1/')
  dist=(Uniform Normal TruncNormal Constant)
  case $dtype in F32) size=4 ;; F64) size=8 ;; *) size=2 ;; esac
  bytes=$((32 * size))
  regs=$(awk -v f="$f" '$1 == f {print $2}' "$tmp/regs")
  printf "%-10s %-12s %-6s %7d %7d %9.1f %5s\n" "$path" "${dist[$kind]}" "$dtype" "$n" "$bytes" \
    "$(awk -v n="$n" -v b="$bytes" 'BEGIN {print n * 16 / b}')" "$regs"
done | sort
