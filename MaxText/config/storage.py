"""Where a run's outputs live: a local directory or a gs:// bucket, reached through etils.epath (Orbax's own path
layer; TensorStore writes the checkpoint arrays). A URL stays a URL: nothing here turns gs://b/x into a local
path, so no local folder named "gs:" ever appears.

    run_dir = resolve(join(cfg.base_output_directory, cfg.run_name))   # absolute when local, the URL when not
    outputs = RunOutputs(run_dir, process_index, primary, log)
    with run_lock(outputs.local, ..., name=run_dir):
        outputs.open()        # a remote run's staging directory: emptied, the bucket's metrics.jsonl taken back
        ...                   # MetricsWriter and Profiler write under outputs.local
        outputs.sync()        # copies what changed up to the bucket (at most every SYNC_S seconds)
        outputs.close()       # the last copy

Checkpoints go straight to the bucket: Orbax marks a finished step there with commit_success.txt, so a step cut
short is never listed. The run's small files (metrics/metrics.jsonl and config.yml, tensorboard/ events and
profiles) are written to a local staging directory instead (an object cannot be appended to) and copied up as
whole objects, which a reader sees either old or new, never half written: at most every SYNC_S seconds while
training, whenever a checkpoint becomes durable, and at the end. A run that resumes first takes the bucket's
metrics.jsonl back, so the file reads on as it does on a local disk. The staging directory,
<tmp>/maxtext-remote-runs/<hash of the URL>-<process index>, also holds the run lock: it keeps a second trainer
on the same host out of the run; trainers on two hosts are not kept apart (a bucket has no lock that a killed
process gives back).

epath reaches gs:// through fsspec (gcsfs) here, not through TensorFlow's gfile, which it would pick wherever
TensorFlow is installed (this project's venv and image have it, for TFDS): one client whatever is installed,
pinned in requirements.txt, and one that honours STORAGE_EMULATOR_HOST (the tests' local GCS). The choice is
EPATH_USE_TF=false, set by MaxText/__init__.py: epath caches it at its first use in a process (jax's compilation
cache is one), so it must be made before that, and a program that uses epath before importing MaxText keeps
whichever client epath chose then.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import time

from etils import epath

from MaxText.config.errors import ConfigError

# The run lock's file in a run directory (trainer/run_lock.py holds it); copies and listings leave it out.
LOCK_NAME = ".lock"
REMOTE = "gs://"
SYNC_S = 30.0  # the longest a remote run's metrics and events wait in staging while training
METRICS = os.path.join("metrics", "metrics.jsonl")


def is_remote(path) -> bool:
    return str(path).startswith(REMOTE)


def resolve(path: str) -> str:
    """An absolute local path (Orbax's OCDBT store needs one), or the URL as given, less a trailing '/'."""
    return path.rstrip("/") if is_remote(path) else os.path.abspath(path)


def join(base: str, *parts: str) -> str:
    return "/".join([base.rstrip("/"), *parts]) if is_remote(base) else os.path.join(base, *parts)


def path(where: str) -> epath.Path:
    """epath.Path of a local path (made absolute) or a URL."""
    return epath.Path(resolve(str(where)))


def staging_dir(run_dir: str, process_index: int) -> str:
    """The local directory where a remote run's small files are written before they are copied up."""
    digest = hashlib.sha256(run_dir.encode()).hexdigest()[:16]
    return os.path.join(tempfile.gettempdir(), "maxtext-remote-runs", f"{digest}-{process_index}")


class RunOutputs:
    """The directory the metrics, TensorBoard and profiler writers use (`local`) and, for a remote run, its copy to
    the bucket (see the module's docstring). For a local run `local` is the run directory and sync does nothing."""

    def __init__(self, run_dir: str, process_index: int = 0, primary: bool = True, log=print):
        self.run_dir, self.primary, self.log = run_dir, primary, log
        self.remote = is_remote(run_dir)
        self.local = staging_dir(run_dir, process_index) if self.remote else run_dir
        self.copied: dict[str, tuple] = {}  # relative path -> (size, mtime) when it was last copied up
        self.last_sync = 0.0

    def open(self) -> None:
        """Empties the staging directory and takes the bucket's metrics.jsonl back, so that a resumed run appends to
        it. Called with the lock held. What an earlier run left unsent is dropped: its lines are for steps after the
        newest checkpoint (each durable checkpoint forces a copy), which this run trains and logs again."""
        if not self.remote:
            return
        os.makedirs(self.local, exist_ok=True)
        self._clear()
        source = path(self.run_dir) / METRICS
        try:
            found = self.primary and source.exists()
            if found:
                os.makedirs(os.path.dirname(os.path.join(self.local, METRICS)), exist_ok=True)
                with open(os.path.join(self.local, METRICS), "wb") as f:
                    f.write(source.read_bytes())
        except Exception as e:  # noqa: BLE001 - the client's errors are many: one line of the first
            raise ConfigError(f"cannot read {source}: {describe(e)}; check base_output_directory, the bucket's "
                              "permissions and your credentials") from None
        if found:
            self.copied[METRICS] = self._stamp(METRICS)
        self.log(f"outputs: checkpoints go to {self.run_dir}/checkpoints; metrics, TensorBoard events and profiles "
                 f"are written to {self.local} and copied there every {SYNC_S:.0f} s, at each checkpoint and at the "
                 "end")

    def _stamp(self, relative: str) -> tuple:
        st = os.stat(os.path.join(self.local, relative))
        return st.st_size, st.st_mtime_ns

    def _copy_up(self) -> None:
        """Every staged file that changed since its last copy, each as one object."""
        for root, _, names in os.walk(self.local):
            for name in names:
                relative = os.path.relpath(os.path.join(root, name), self.local)
                if relative == LOCK_NAME or name.endswith(".tmp"):
                    continue
                stamp = self._stamp(relative)
                if self.copied.get(relative) != stamp:
                    with open(os.path.join(self.local, relative), "rb") as f:
                        (path(self.run_dir) / relative).write_bytes(f.read())
                    self.copied[relative] = stamp

    def sync(self, force: bool = False) -> bool:
        """_copy_up at most every SYNC_S seconds unless `force`; whether everything staged is in the bucket now. A
        failure is a warning: the files stay staged for the next try."""
        if not self.remote or (not force and time.monotonic() - self.last_sync < SYNC_S):
            return not self.remote
        self.last_sync = time.monotonic()
        try:
            self._copy_up()
            return True
        except Exception as e:  # noqa: BLE001 - the run goes on; its checkpoints do not depend on this copy
            self.log(f"warning: copying {self.local} to {self.run_dir} failed ({describe(e)}); the files stay there "
                     "for the next try")
            return False

    def close(self) -> None:
        """The last copy; the staging directory is emptied once everything is in the bucket (else it is kept, and its
        path was logged with the warning)."""
        if self.remote and self.sync(force=True):
            self._clear()

    def _clear(self) -> None:
        for name in os.listdir(self.local):
            if name != LOCK_NAME:  # run_lock's file, held right now
                entry = os.path.join(self.local, name)
                if os.path.isdir(entry) and not os.path.islink(entry):
                    shutil.rmtree(entry)
                else:
                    os.remove(entry)
        self.copied = {}


def describe(error: Exception) -> str:
    """'Type: first line of the message' (at most 300 characters of it), or 'Type' when there is none."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0][:300]}" if lines else type(error).__name__


SHOWN_PATH_LIMIT = 200  # the most characters of a user's path an error line shows


def shown_path(path) -> str:
    """A user's path (or any text) in an error line: whole up to SHOWN_PATH_LIMIT characters, else its start and
    end with its size, so that a line stays short whatever was given."""
    text = str(path)
    if len(text) <= SHOWN_PATH_LIMIT:
        return text
    return f"{text[:120]}...{text[-40:]} ({len(text)} characters)"


def read_json_file(path: str, hint: str = "", limit: int = 120):
    """The JSON value of a local file; ConfigError (one line naming the file, `hint` after the reason) when it
    cannot be read or is not JSON (bad UTF-8, bad syntax, nested deeper than the parser goes)."""
    import json

    try:
        with open(path, "rb") as f:
            return json.loads(f.read())
    except OSError as e:
        raise ConfigError(f"{shown_path(path)} cannot be read ({e.strerror or e})") from None
    except (ValueError, RecursionError) as e:
        reason = (str(e).splitlines() or [type(e).__name__])[0][:limit]
        raise ConfigError(f"{shown_path(path)} is not valid JSON ({reason}){hint}") from None


def check_output(key: str, where: str, file: bool = False) -> str:
    """The absolute path of an output a command is about to write, checked before any work so that a mistake is one
    line (ConfigError naming `key`) and nothing is written. A directory (file=False) exists or can be made: it is
    not a file, nor beneath one; a file (file=True) is not a directory and its directory exists. The nearest
    directory that exists must take a new file: a probe is created there and removed again (os.access would not
    do: root passes every permission check, but not a read-only filesystem). A gs:// URL is returned as given."""
    if is_remote(where):
        return where
    shown = f"{key}={shown_path(where)}"
    full = os.path.abspath(where)
    if file and os.path.isdir(full):
        raise ConfigError(f"{shown} is a directory; give the path of a file to write")
    if not file and os.path.lexists(full) and not os.path.isdir(full):
        raise ConfigError(f"{shown} is a file, not a directory; give a directory to write into (new or empty)")
    ancestor, missing = (os.path.dirname(full), [os.path.basename(full)]) if file else (full, [])
    while not os.path.lexists(ancestor):  # also false beneath a file, and for a name too long
        ancestor, name = os.path.split(ancestor)
        missing.append(name)
    if not os.path.isdir(ancestor):
        raise ConfigError(f"{shown} lies beneath {shown_path(ancestor)}, which is a file, not a directory; choose "
                          "another path")
    if file and len(missing) > 1:
        raise ConfigError(f"{shown}: its directory {shown_path(os.path.dirname(full))} does not exist; create it "
                          "or choose another path")
    name_max, path_max = _limit(ancestor, "PC_NAME_MAX", 255), _limit(ancestor, "PC_PATH_MAX", 4096)
    longest = max((len(os.fsencode(name)) for name in missing), default=0)
    if longest > name_max:
        raise ConfigError(f"{shown}: a name in it is {longest} bytes long, over this filesystem's limit of "
                          f"{name_max}; choose a shorter path")
    if len(os.fsencode(full)) >= path_max:
        raise ConfigError(f"{shown} is {len(os.fsencode(full))} bytes long, over this system's limit of "
                          f"{path_max - 1}; choose a shorter path")
    probe = os.path.join(ancestor, f".maxtext-write-probe-{os.getpid()}-{time.time_ns()}")
    try:  # a new file, never through a symlink
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600))
        os.unlink(probe)
    except OSError as e:
        raise ConfigError(f"{shown}: cannot write in {shown_path(ancestor)} ({e.strerror or describe(e)}); choose "
                          "a writable location (not a read-only filesystem, nor one this user may not write)"
                          ) from None
    return full


def _limit(directory: str, name: str, default: int) -> int:
    try:
        return int(os.pathconf(directory, name))
    except (OSError, ValueError):
        return default
