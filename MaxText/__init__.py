"""A MaxText-compatible JAX trainer for Mixture-of-Experts language models."""

import os

# etils.epath (Orbax's path layer, also jax's compilation cache) picks TensorFlow's gfile for gs:// wherever TensorFlow
# is installed, and caches that choice at its first use in the process: gcsfs instead (MaxText/config/storage.py says
# why), chosen here, before anything imported through this package can touch epath.
os.environ.setdefault("EPATH_USE_TF", "false")
