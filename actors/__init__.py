"""Actor side: step envs, run the NumPy policy, stream unrolls to the learner. No TensorFlow."""
