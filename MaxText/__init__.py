"""A MaxText-compatible JAX trainer for Mixture-of-Experts language models."""
