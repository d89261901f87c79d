"""impala_rep: IMPALA-style actor-learner reinforcement learning.

This package is what actors and learner share. Importing it (and every module the actor
side uses) never imports TensorFlow: actors render with MuJoCo's software renderer, which
crashes in a process that has loaded TensorFlow.
"""

__version__ = "0.1.0"
