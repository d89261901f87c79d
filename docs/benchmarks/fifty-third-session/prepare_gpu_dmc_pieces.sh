#!/usr/bin/env bash
# Prepares, on this (CPU) machine, what a pixel DM Control run needs on a lent NVIDIA machine beside
# the thirty-sixth session's TensorFlow pieces (../thirty-sixth-session/prepare_gpu_pieces.sh, cut at
# 52 MiB): dm_control 1.0.50 (its locomotion, blender and dog assets left out: the suite's other
# domains do not read them), mujoco 3.17 and their small dependencies (labmaze binary, the rest pure Python) unpacked as cp312
# site-packages, and libglvnd's libEGL, libOpenGL and libGLdispatch from this machine (the lent
# machine has NVIDIA's EGL vendor library and its glvnd JSON, but no libEGL.so.1 to dispatch to it),
# xz-compressed and cut into 52 MiB pieces in .dmc/ (git-ignored: .git/info/exclude). scipy and lxml
# are the lent machine's own. Run from the repository root.
set -euo pipefail
W=$(mktemp -d)
P=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
   --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
   --platform manylinux1_x86_64 --platform any --no-deps)
python3 -m pip download -q "${P[@]}" -d "$W/whl" dm-control==1.0.50 mujoco==3.17.0 pyopengl==3.1.10 \
    glfw==2.11.0 pyparsing==3.3.3 tqdm==4.70.1 requests==2.34.2 urllib3==2.8.0 idna==3.20 \
    certifi==2026.10.19.post1 charset_normalizer==3.5.3 labmaze==1.0.6 etils==1.15.0
mkdir -p "$W/site" "$W/gl"
for w in "$W"/whl/*.whl; do (cd "$W/site" && unzip -q -o "$w"); done
rm -rf "$W/site/dm_control/locomotion" "$W/site/dm_control/blender" "$W/site/dm_control/suite/dog_assets" \
    "$W/site/dm_control/suite/all_domains.png"
for l in libEGL.so.1 libOpenGL.so.0 libGLdispatch.so.0; do
  cp -L "/usr/lib/x86_64-linux-gnu/$l" "$W/gl/$l"; cp -L "/usr/lib/x86_64-linux-gnu/$l" "$W/gl/${l%.*}"
done
mkdir -p .dmc && rm -f .dmc/dmc.*
tar -cf - -C "$W" site gl | xz -T2 -6 | split -b 52m -d -a 2 - .dmc/dmc.
rm -rf "$W"
ls -l .dmc
