#!/usr/bin/env bash
# Sourced by gpu_check.sh (thirty-sixth session) and ../thirty-eighth-session/gpu_overlap.sh, on a
# lent NVIDIA machine, from the repository root, after the pieces' calls (see gpu_check.sh):
# installs the wheels of .whl and the pieces of /tmp/gp into /tmp/site and /tmp/cu12lib, sets
# PYTHONPATH and LD_LIBRARY_PATH, and checks that TensorFlow runs a convolution on the GPU
# (exit 7 if no library path makes it so). OUTD is $OUT (or /tmp/out).
set -u
OUTD=${OUT:-/tmp/out}
mkdir -p "$OUTD" /tmp/site /tmp/cu12lib /tmp/cu12x
t0=$(date +%s)
sha256sum /tmp/gp/* | cut -c1-16 > "$OUTD/parts.sha"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 3
cat /tmp/gp/tf.* | xz -d -T0 | tar -xf - -C /tmp/site || exit 4
cat /tmp/gp/cu12.* | xz -d -T0 | tar -xf - -C /tmp/cu12x || exit 5
cp /tmp/cu12x/nvidia/*/lib/*.so.12 /tmp/cu12lib/ && cp .gpu/stubs/* /tmp/cu12lib/ || exit 6
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TF_CPP_MIN_LOG_LEVEL=1
export XLA_FLAGS=--xla_gpu_cuda_data_dir=/usr/local/cuda-13.0
echo "setup took $(( $(date +%s) - t0 )) s"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
check() {
python3 - <<'PY'
import tensorflow as tf
info = tf.sysconfig.get_build_info()
print("tensorflow", tf.__version__, "built with CUDA", info.get("cuda_version"), "cuDNN", info.get("cudnn_version"))
gpus = tf.config.list_physical_devices("GPU")
print("GPUs:", gpus)
assert gpus, "TensorFlow sees no GPU"
with tf.device("/gpu:0"):
    y = tf.nn.conv2d(tf.random.uniform([8, 84, 84, 9]), tf.random.uniform([8, 8, 9, 16]), 4, "VALID")
    z = tf.matmul(tf.random.uniform([256, 256]), tf.random.uniform([256, 256]))
print("conv on", y.device, y.shape, "matmul on", z.device, float(tf.reduce_sum(y)) > 0)
PY
}
ok=0
for extra in "/usr/lib/x86_64-linux-gnu" "/opt/torch/.venv/lib/python3.12/site-packages/nvidia/cudnn/lib:/usr/local/cuda-13.0/targets/x86_64-linux/lib"; do
  export LD_LIBRARY_PATH=/tmp/cu12lib:$extra
  echo "== check with LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
  if check; then ok=1; break; fi
  TF_CPP_MIN_LOG_LEVEL=0 check 2>&1 | grep -i -E "dlopen|could not|cannot|error|cudnn|cuda" | head -40
done
[ $ok = 1 ] || { echo "no usable GPU configuration"; exit 7; }
