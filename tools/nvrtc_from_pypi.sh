#!/bin/sh
# NVRTC and the CUDA headers from PyPI, for compiling CUDA kernels on a machine
# with no GPU and no toolkit: NVRTC is only a compiler. Writes .nvrtc/ (include/ and
# lib64/, the layout of a toolkit; about 100 MB) and prints the environment that
# points rcoa at it. Used by the CUDA build's NVRTC tests:
#
#   sh tools/nvrtc_from_pypi.sh
#   CUDA_PATH=$PWD/.nvrtc LD_LIBRARY_PATH=$PWD/.nvrtc/lib64 \
#     cargo test -p rcoa-backend --features cuda --lib prebuild::nvrtc_tests
#
# The GPU machine has CUDA 13; the wheels are CUDA 12's, which compile the same kernels
# for an H100 (sm_90a). Without them those tests print SKIPPED and pass.
set -eu
dir=${1:-.nvrtc}
tmp=$(mktemp -d)
# nvcc's wheel only for its `include/crt` (the tensor-core `mma.h` includes it);
# CCCL's for `cuda/barrier` and `nv/target` (CubeCL's barriers and asynchronous
# copies include them; a toolkit has them).
python3 -m pip download --quiet --no-deps -d "$tmp" \
  nvidia-cuda-nvrtc-cu12 nvidia-cuda-runtime-cu12 nvidia-cuda-nvcc-cu12 nvidia-cuda-cccl-cu12
for w in "$tmp"/*.whl; do python3 -m zipfile -e "$w" "$tmp/x"; done
rm -rf "$dir" && mkdir -p "$dir"
cp -r "$tmp/x/nvidia/cuda_runtime/include" "$dir/include"
cp -r "$tmp/x/nvidia/cuda_nvcc/include/crt" "$dir/include/crt"
cp -r "$tmp/x/nvidia/cuda_cccl/include/cuda" "$tmp/x/nvidia/cuda_cccl/include/nv" "$dir/include/"
cp -r "$tmp/x/nvidia/cuda_nvrtc/lib" "$dir/lib64"
# cudarc and rcoa's preflight open libnvrtc.so by its unversioned name first.
ln -sf "$(cd "$dir/lib64" && ls libnvrtc.so.* | head -1)" "$dir/lib64/libnvrtc.so"
rm -rf "$tmp"
abs=$(cd "$dir" && pwd)
echo "export CUDA_PATH=$abs LD_LIBRARY_PATH=$abs/lib64\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
