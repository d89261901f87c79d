"""The actor side and evaluation never import TensorFlow (it crashes MuJoCo's software renderer)."""

import subprocess
import sys

ACTOR_SIDE = [
    "impala_rep",
    "impala_rep.specs",
    "impala_rep.framestack",
    "impala_rep.config",
    "impala_rep.flags",
    "impala_rep.plan",
    "impala_rep.probe",
    "impala_rep.export",
    "impala_rep.evaluate",
    "learner.evaluator",
    "learner.export",  # impala_rep.evaluate finds checkpoint exports by it
    "impala_rep.distributions",
    "impala_rep.networks",
    "impala_rep.networks.numpy_backend",
    "impala_rep.wire",
    "envs",
    "actors",
    "actors.actor",
    "actors.client",
    "actors.supervisor",
    "actors.run",
]


def test_actor_side_modules_do_not_import_tensorflow():
    code = (
        "import sys\n"
        + "".join(f"import {m}\n" for m in ACTOR_SIDE)
        + "bad = sorted(m for m in sys.modules if m == 'tensorflow' or m.startswith(('tensorflow.', 'tf_keras', 'keras')))\n"
        + "print(bad)\n"
        + "sys.exit(1 if bad else 0)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"TensorFlow imported by the actor side: {proc.stdout}{proc.stderr}"


def test_the_check_would_catch_tensorflow():
    # The same check, run on a module that does import TensorFlow, must fail.
    code = "import sys, impala_rep.networks.tf_backend\nsys.exit(0 if 'tensorflow' in sys.modules else 1)\n"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
