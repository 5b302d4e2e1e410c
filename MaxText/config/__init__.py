"""Configuration, no JAX: the YAML chain and key=value overrides into one checked config (load), the
rules of a value (parse) and across keys (checks), upstream MaxText's keys (upstream), the errors a user meets
(errors), GPU profiles (hardware), XLA flags (xla_flags) and the run's files and URLs (storage).
"""
