#!/usr/bin/env bash
# The GPU learner check on a lent NVIDIA machine (thirty-sixth session; see BENCHMARKS.md).
# Run there from the repository root after prepare_gpu_pieces.sh here and the pieces' calls:
#   cp .gpu/cu12.04 /tmp/gp/ && bash docs/benchmarks/thirty-sixth-session/gpu_check.sh 2>&1 | tee $OUT/log
#
# The lent machine has no TensorFlow and only CUDA 13, and nothing there can be fetched, so
# TensorFlow 2.21's cp312 wheel (xz-compressed, its C++ headers left out) and CUDA 12's
# cudart, cuBLAS and cuBLASLt (what TensorFlow 2.21 was built against) travel beforehand as
# 58 MB pieces into /tmp/gp; the pure-Python and small compiled dependencies travel as wheels
# in .whl. cuFFT, cuSOLVER and cuSPARSE are empty stand-ins named as TensorFlow dlopens them:
# the learner computes no FFT, dense solve or sparse product, and TensorFlow only dlopens them
# at start-up to decide whether the GPU is usable. cuDNN is the machine's own (9.x).
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
B="timeout 150 python3 scripts/bench_learner.py --kind gpu --replicas 1 --warmup-seconds 5 --seconds 10 --max-steps 2000 --json"
$B --torso shallow deep | tee "$OUTD/learner_gpu_f32.json"
$B --torso shallow --precision bfloat16 | tee "$OUTD/learner_gpu_bf16.json"
$B --torso shallow deep --batch-size 128 | tee "$OUTD/learner_gpu_b128.json"
$B --torso shallow --xla | tee "$OUTD/learner_gpu_xla.json"
# End to end: the synthetic workload's env through real actor processes and gRPC into the GPU learner.
# (The session's first try named the env id "synthetic", which the launcher refused; the runs
# below were made in two further calls on the same warm machine, with the same environment.)
# Each bench_launch run takes about 70 s (start-up, 20 s warm-up, 30 s window, stop); the
# limits are those the runs were made under.
L="python3 scripts/bench_launch.py --env benchmark:synthetic_env --warmup 20 --seconds 30 --learner gpu --json"
timeout 280 $L --actors 64 128 | tee "$OUTD/launch_synthetic_gpu_64_128.json"
timeout 120 $L --actors 128 --learner-threads 4 | tee "$OUTD/launch_gpu_threads4.json"
timeout 120 $L --actors 128 --learner-threads 4 --batch-size 128 | tee "$OUTD/launch_gpu_threads4_b128.json"
echo "all took $(( $(date +%s) - t0 )) s"
