"""Learner side: gRPC service, validation, queue and batcher, training loop, checkpoints."""
