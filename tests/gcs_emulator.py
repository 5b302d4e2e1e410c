"""A local Google Cloud Storage for the tests: gcp-storage-emulator (requirements.txt), in memory.

    python -m tests.gcs_emulator PORT BUCKET      # serves http://localhost:PORT until killed

    with emulator() as env:                        # a subprocess on a free port, one bucket "bkt";
        ...                                        # env: what a process needs to use it (os.environ is set too)

One difference from GCS is mended here: the emulator's media downloads lack the x-goog-generation header that GCS
always sends, and TensorStore needs it to update an OCDBT manifest ("Malformed StorageGeneration" on the second
write of a checkpoint); each download gets its object's generation.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time

import pytest

BUCKET = "bkt"


def _serve(port: int, bucket: str) -> None:
    from gcp_storage_emulator import server
    from gcp_storage_emulator.handlers import objects

    plain = objects.download

    def download(request, response, storage, *args, **kwargs):
        plain(request, response, storage, *args, **kwargs)
        try:
            found = storage.get_file_obj(request.params["bucket_name"], request.params["object_id"])
        except Exception:  # noqa: BLE001 - not found: the 404 is already in the response
            return
        response["x-goog-generation"] = str(found["generation"])
        response["x-goog-metageneration"] = str(found.get("metageneration", "1"))

    objects.download = download  # objects.get calls it for alt=media
    for _, handlers in server.HANDLERS:
        for method, handler in list(handlers.items()):
            if handler is plain:
                handlers[method] = download
    server.create_server("localhost", port, in_memory=True, default_bucket=bucket).run()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def emulator(bucket: str = BUCKET):
    """Starts the emulator and points gcsfs and TensorStore at it (here and in child processes, through the
    environment); stops it and restores the environment on exit."""
    port = _free_port()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    process = subprocess.Popen([sys.executable, "-m", "tests.gcs_emulator", str(port), bucket], cwd=root,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://localhost:{port}"
    env = {"STORAGE_EMULATOR_HOST": url, "TENSORSTORE_GCS_HTTP_URL": url,
           # gcsfs asks GCS's storage-control API for a bucket's layout, which the emulator lacks (one warning a call)
           "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("localhost", port), timeout=1).close()
                break
            except OSError:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the GCS emulator did not start on port {port}") from None
                time.sleep(0.1)
        with pytest.MonkeyPatch.context() as patch:
            for key, value in env.items():
                patch.setenv(key, value)
            yield env
    finally:
        process.kill()
        process.wait()


if __name__ == "__main__":
    _serve(int(sys.argv[1]), sys.argv[2])
