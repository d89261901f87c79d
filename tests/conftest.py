"""Shared pytest configuration for the TensorFlow-free suites.

Tests directly under ``tests/`` never import TensorFlow in the pytest process: they render
MuJoCo scenes, and TensorFlow plus MuJoCo's software renderer crash in one process (see
DESIGN.md). TensorFlow tests live in ``tests/learner/`` and run in a separate pytest process
(``scripts/test.sh`` runs both).
"""
