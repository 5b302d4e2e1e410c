"""Test set-up: CPU only, 8 simulated devices, set before anything imports jax."""

import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Tests compile many tiny programs and run each a few times: XLA:CPU's backend optimisations cost
# ~4x in compile time (measured: 12 s -> 3 s for the tiny model's sharded init) and buy nothing here.
_flags = os.environ.get("XLA_FLAGS", "")
for _flag in ("--xla_force_host_platform_device_count=8", "--xla_backend_optimization_level=0"):
    if _flag.split("=")[0] not in _flags:
        _flags += " " + _flag
os.environ["XLA_FLAGS"] = _flags.strip()
# Many tests build the same programs again (each train() call jits afresh, subprocess trainers start cold):
# a compilation cache for the session turns those recompiles into reads. Subprocesses inherit it.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    import tempfile

    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="jax_cache_")
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0.2"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    """`gpu`-marked tests skip cleanly on machines without an NVIDIA GPU."""
    has_gpu = any(d.platform == "gpu" for d in jax.devices()) if os.environ["JAX_PLATFORMS"] != "cpu" else False
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU")
    for item in items:
        if "gpu" in item.keywords and not has_gpu:
            item.add_marker(skip)
