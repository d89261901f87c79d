#!/usr/bin/env bash
# Prepares, on this (CPU) machine, what gpu_check.sh needs on a lent NVIDIA machine that has
# no TensorFlow, only CUDA 13 and no network: TensorFlow 2.21's cp312 wheel (headers left out)
# and CUDA 12's cudart, cuBLAS and cuBLASLt, xz-compressed and cut into 58 MiB pieces in .gpu/
# (each device call carries at most 64 MiB with the working tree); empty stand-ins for cuFFT,
# cuSOLVER and cuSPARSE in .gpu/stubs; TensorFlow's and the project's small dependencies as
# cp312 wheels in .whl. Run from the repository root; .gpu/ and .whl/ must be git-ignored
# (.git/info/exclude). Then, on the device, one call per piece, back to back (the machine is
# given back after 30 s idle):  mkdir -p /tmp/gp && cp .gpu/tf.00 /tmp/gp/   (carry .gpu/tf.00)
# and so on, and last gpu_check.sh, carrying .gpu/cu12.04, .gpu/stubs and .whl.
set -euo pipefail
W=$(mktemp -d)
P=(--no-deps --only-binary=:all: --python-version 3.12 --implementation cp
   --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
   --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
python3 -m pip download "${P[@]}" -d "$W/whl" tensorflow==2.21.0 nvidia-cuda-runtime-cu12==12.5.82 nvidia-cublas-cu12==12.5.3.2
mkdir -p "$W/tf" "$W/cu12" .gpu/stubs
(cd "$W/tf" && unzip -q "$W"/whl/tensorflow-*.whl && rm -rf tensorflow/include)
(cd "$W/cu12" && for w in "$W"/whl/nvidia_*.whl; do unzip -q -o "$w" 'nvidia/*/lib/*'; done)
rm -f .gpu/tf.* .gpu/cu12.*
(cd "$W/tf" && tar -cf - .) | xz -T2 -3 | split -b 58m -d -a 2 - .gpu/tf.
(cd "$W/cu12" && tar -cf - nvidia/cublas/lib/libcublas.so.12 nvidia/cublas/lib/libcublasLt.so.12 \
    nvidia/cuda_runtime/lib/libcudart.so.12) | xz -T2 -3 | split -b 58m -d -a 2 - .gpu/cu12.
echo 'int impala_rep_unused_stub(void) { return 0; }' > "$W/s.c"
for n in libcufft.so.11 libcusolver.so.11 libcusparse.so.12; do gcc -shared -fPIC -o ".gpu/stubs/$n" -Wl,-soname,$n "$W/s.c"; done
rm -rf .whl && python3 -m pip download "${P[@]}" -d .whl astunparse==1.6.3 gast==0.7.0 google-pasta==0.2.0 \
    termcolor==3.3.0 keras==3.15.1 namex==0.1.0 optree==0.20.0 tf_keras==2.21.0 dm-env==1.6 dm-tree==0.1.10 \
    h5py==3.14.0 grpcio==1.85.3 protobuf==7.36.2 numpy==2.4.6 ml_dtypes==0.6.0 flatbuffers==25.12.19 \
    wrapt==2.5.2 absl-py==2.5.1
rm -rf "$W"
ls -l .gpu .whl
