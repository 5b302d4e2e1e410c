"""Test set-up: CPU only, 8 simulated devices, set before anything imports jax."""

import os
import socket
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Tests compile many tiny programs and run each a few times: XLA:CPU's backend optimisations cost
# ~4x in compile time (measured: 12 s -> 3 s for the tiny model's sharded init) and buy nothing here.
_flags = os.environ.get("XLA_FLAGS", "")
# (Only on CPU: a GPU run of the `gpu` tests keeps XLA's optimisations.)
for _flag in ("--xla_force_host_platform_device_count=8",
              *(("--xla_backend_optimization_level=0",) if os.environ["JAX_PLATFORMS"] == "cpu" else ())):
    if _flag.split("=")[0] not in _flags:
        _flags += " " + _flag
os.environ["XLA_FLAGS"] = _flags.strip()
# Many tests build the same programs again (each train() call jits afresh, subprocess trainers start cold):
# a compilation cache for the session turns those recompiles into reads. Subprocesses inherit it.
# The process that makes it (pytest's main one; xdist's workers end first) removes it at exit: a GiB or more a run.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    import atexit
    import shutil
    import tempfile

    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="jax_cache_")
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0.2"
    atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import MaxText  # noqa: E402,F401 - its EPATH_USE_TF choice precedes jax's compilation cache's first use of epath
import jax  # noqa: E402
import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    """`gpu`-marked tests skip cleanly on machines without an NVIDIA GPU; `te_trace` tests skip on machines with
    one (their stand-in for TE's extension would take the real one's place for the whole session)."""
    has_gpu = any(d.platform == "gpu" for d in jax.devices()) if os.environ["JAX_PLATFORMS"] != "cpu" else False
    skip_gpu = pytest.mark.skip(reason="needs an NVIDIA GPU")
    skip_trace = pytest.mark.skip(reason="traces TE through a stand-in: CPU only (the GPU runs TE itself)")
    for item in items:
        if "gpu" in item.keywords and not has_gpu:
            item.add_marker(skip_gpu)
        if "te_trace" in item.keywords and has_gpu:
            item.add_marker(skip_trace)


@pytest.fixture(scope="session")
def te_standin():
    """Transformer Engine's real Python over the trace-only stand-in for its compiled extension (SM 90 unless a
    test switches it with te_trace.set_sm and switches back). Process-wide once installed."""
    from MaxText.planning import te_trace

    return te_trace.install(90)


@pytest.fixture
def no_network(monkeypatch):
    """Any attempt to open a connection fails the test."""
    def refuse(*args, **kwargs):
        raise AssertionError(f"network access attempted: {args}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
