"""One trainer per run directory: an exclusive lock on <base_output_directory>/<run_name>, held for the life
of the run and released by the OS when the process ends, however it ends.

    with run_lock(run_dir, primary, process_count):   # ConfigError (one line naming the holder) when taken
        ...

A multi-process run takes it once, in process 0; every other process waits for process 0's decision and
stops with it.

The lock is `fcntl.flock` on `<run_dir>/.lock` (advisory, per open file; works on local disks and on
NFS/Lustre mounts that support flock; a gs:// run's lock is in its local staging directory, so it keeps out
a second trainer on the same host only). The file records the holder (host, pid, start time) for the message a
second trainer prints; it is never deleted, so a stale file is harmless: only a live process holds the lock.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import secrets
import socket
import time

from MaxText.config.errors import ConfigError
from MaxText.config.storage import LOCK_NAME


def automatic_run_name() -> str:
    """run_<date>_<time>_<random>: unique even for two launches in the same second."""
    return time.strftime("run_%Y%m%d_%H%M%S_") + secrets.token_hex(3)


class RunLock:
    """The run directory's lock (created with the directory when missing)."""

    def __init__(self, run_dir: str, name: str | None = None):
        self.run_dir, self.name = run_dir, name or run_dir
        self.path = os.path.join(run_dir, LOCK_NAME)
        self.fd = None

    def __enter__(self):
        try:
            os.makedirs(self.run_dir, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        except OSError as e:
            raise ConfigError(f"cannot use run directory {self.name}: {e.strerror}; check base_output_directory "
                              "and run_name") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = _read_holder(fd)
            os.close(fd)
            raise ConfigError(f"run directory {self.name} is in use by another trainer ({holder}); wait for it "
                              "to finish, or choose another run_name") from None
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                                 "started": time.strftime("%Y-%m-%d %H:%M:%S %Z")}).encode())
        os.fsync(fd)
        self.fd = fd
        return self

    def __exit__(self, *exc):
        if self.fd is not None:
            os.close(self.fd)  # closing the file releases the lock
            self.fd = None
        return False


@contextlib.contextmanager
def run_lock(run_dir: str, primary: bool = True, process_count: int = 1, name: str | None = None):
    """RunLock taken by process 0 (`primary`) for the run; the others learn its outcome by a broadcast. `name`: the
    run directory as messages call it (a remote run's lock is in its local staging directory, MaxText.config.storage)."""
    lock, error = RunLock(run_dir, name), None
    if primary:
        try:
            lock.__enter__()
        except ConfigError as e:
            error = e
    if process_count > 1:
        import numpy as np
        from jax.experimental import multihost_utils

        taken = bool(multihost_utils.broadcast_one_to_all(np.int32(error is None)))
        if not taken and error is None:
            error = ConfigError(f"process 0 could not lock run directory {name or run_dir} (its log says why)")
    if error is not None:
        raise error
    try:
        yield lock
    finally:
        lock.__exit__(None, None, None)


def _read_holder(fd: int) -> str:
    """'host h, pid p, since t' from the lock file, or what can be said without it."""
    try:
        holder = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
        return f"host {holder['host']}, pid {holder['pid']}, since {holder['started']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "holder unknown"
