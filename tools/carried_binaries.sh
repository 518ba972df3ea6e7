#!/bin/sh
# The binaries a GPU session carries to the device machine, which has no Rust toolchain:
# the CUDA build of rcoa and the test and bench binaries the call scripts run
# (backend/bench/gpu_flash_call.sh, gpu_one_call.sh, gpu_jobs.sh), each stripped and
# gzipped into .rcoa-bin/, with BUILT_FROM naming the commit. The device tool's carry
# takes 64 MiB in all; this stops if the directory grows past that.
#
#   sh tools/carried_binaries.sh                  # rcoa, flash tests, four benches
#   sh tools/carried_binaries.sh --with-transport # and the CUDA transport bench (gpu_jobs.sh)
#   sh tools/carried_binaries.sh --speed-only     # rcoa and the tests only (gpu_speed_call.sh)
#
# About 25 minutes on two cores from a cold target directory. No GPU, toolkit or NVRTC
# is needed to build: cudarc loads CUDA at run time.
set -eu
out=.rcoa-bin
transport=0
benches="flash gemm embedding compile_phase"
for a in "$@"; do
  case "$a" in
    --with-transport) transport=1 ;;
    --speed-only) benches="" ;;
    *) echo "usage: sh tools/carried_binaries.sh [--with-transport | --speed-only]" >&2; exit 2 ;;
  esac
done
mkdir -p "$out"

# The executable cargo built for target NAME of kind KIND, from its JSON messages on stdin.
executable() {
  python3 -c '
import json, sys
name, kind = sys.argv[1], sys.argv[2]
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    t = m.get("target", {})
    if m.get("reason") == "compiler-artifact" and m.get("executable") \
            and t.get("name") == name and kind in t.get("kind", []):
        print(m["executable"])
        break
else:
    sys.exit("cargo built no %s %s" % (kind, name))
' "$1" "$2"
}

# pack FILE NAME: FILE stripped and gzipped to $out/NAME.gz.
pack() {
  strip -o "/tmp/carried-$2" "$1"
  gzip -9 -c "/tmp/carried-$2" > "$out/$2.gz"
  rm -f "/tmp/carried-$2"
  echo "$out/$2.gz $(du -k "$out/$2.gz" | cut -f1) KiB"
}

cargo build --release --features cuda --bin rcoa --message-format=json-render-diagnostics \
  | executable rcoa bin > /tmp/carried-path
pack "$(cat /tmp/carried-path)" rcoa
# The backend's unit tests: the flash, cuBLAS and embedding kernels' CUDA tests and trials.
cargo test --release -p rcoa-backend --features cuda --lib --no-run \
  --message-format=json-render-diagnostics | executable rcoa_backend lib > /tmp/carried-path
pack "$(cat /tmp/carried-path)" flash-tests
rm -f "$out"/*-bench.gz
for bench in $benches; do
  cargo bench -p rcoa-backend --features cuda --bench "$bench" --no-run \
    --message-format=json-render-diagnostics | executable "$bench" bench > /tmp/carried-path
  pack "$(cat /tmp/carried-path)" "$(echo "$bench" | tr _ -)-bench"
done
if [ "$transport" = 1 ]; then
  cargo bench -p rcoa-backend --features cuda --bench transport --no-run \
    --message-format=json-render-diagnostics | executable transport bench > /tmp/carried-path
  pack "$(cat /tmp/carried-path)" transport-cuda
fi
rm -f /tmp/carried-path

dirty=$(git status --porcelain --untracked-files=no | grep -q . && echo " (with uncommitted changes)" || true)
echo "$(git rev-parse --short HEAD)$dirty" > "$out/BUILT_FROM"
total=$(du -sk "$out" | cut -f1)
echo "$out: $total KiB, built from $(cat "$out/BUILT_FROM")"
if [ "$total" -gt $((64 * 1024)) ]; then
  echo "$out is over the carry's 64 MiB: leave a bench out" >&2
  exit 1
fi
