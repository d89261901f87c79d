"""Environments: the env registry, DeepMind Control pixel tasks, wrappers, built-in envs."""
