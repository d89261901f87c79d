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
source "$(dirname "$0")/gpu_setup.sh"
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
