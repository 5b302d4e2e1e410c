"""Orbax checkpoints under <base_output_directory>/<run_name>/checkpoints/<step>/items (MaxText's layout),
with the input pipeline's position beside the state in <step>/input (JSON).

Start-up order, as in MaxText: an existing checkpoint of this run (auto-resume) first; else
load_parameters_path (params only, step 0) or load_full_state_path (everything); else a fresh init.

The directory is local or a gs:// URL (MaxText.config.storage: epath paths throughout, never a local "gs:" folder).

Kill safety: Orbax writes a step into a temporary directory and renames it when complete (in a bucket, where
there is no rename, it writes commit_success.txt last instead), so a process killed mid-save (SIGKILL, node
failure) leaves only a step that is never listed (and is removed at the next start). A complete step that
cannot be read (a corrupted file) is skipped with a warning for the newest readable one, and renamed
<step>.unreadable-<time> so that training can save that step again; if none can be read the run stops with an
error instead of starting afresh.

Verified, not trusted: every step also saves <step>/checksums (JSON), one 32-bit checksum per array of the
train state, computed on the devices from the arrays' bits (state_checksums). A restore recomputes them and
treats any mismatch like an unreadable step, naming the array: bytes changed inside an array file used to
restore silently as garbage (the data files are not compressed, so nothing else notices). A step without its
checksums is treated the same way, unless Orbax's own metadata of the step (the items it saved) shows it was
written before checksums existed: then it restores unverified, with a warning.

Every wait is bounded: Orbax always saves in its background thread here (async_checkpointing=false then
waits for the save before training goes on) with checkpoint_timeout_s as its deadline, and this module polls
for a save's end with the same deadline (plus a grace period) instead of joining Orbax's threads. A save that
misses it is a SaveTimeout: the run stops with one line, and main() exits without waiting for the stuck
writer threads.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import math
import os
import re
import sys
import time
import traceback

import orbax.checkpoint as ocp
from etils import epath

from MaxText.config import storage
from MaxText.config.errors import ConfigError
from MaxText.config.storage import describe as _describe

ITEM = "items"
INPUT = "input"
CHECKSUMS = "checksums"


class ChecksumMismatch(ValueError):
    """A restored array's bits differ from the checksum saved with it."""


def _array_checksum(x):
    """sum over elements of (bits of the element) x (an odd weight from its flat index), mod 2**32, computed
    where the array lives (a sharded sum: no copy to the host). Any change of one element changes it."""
    import jax.numpy as jnp
    from jax import lax

    if x.dtype.itemsize in (4, 8):
        bits = lax.bitcast_convert_type(x, jnp.uint32)  # 8-byte elements: [..., 2]
    elif x.dtype.itemsize == 2:
        bits = lax.bitcast_convert_type(x, jnp.uint16).astype(jnp.uint32)
    else:
        bits = lax.bitcast_convert_type(x, jnp.uint8).astype(jnp.uint32) if x.dtype != jnp.bool_ \
            else x.astype(jnp.uint32)
    index = jnp.zeros(bits.shape, jnp.uint32)
    for dim in range(bits.ndim):  # the flat index, wrapping at 2**32 like everything here
        stride = math.prod(bits.shape[dim + 1:]) % 2 ** 32
        index = index + lax.broadcasted_iota(jnp.uint32, bits.shape, dim) * jnp.uint32(stride)
    weight = index * jnp.uint32(2654435761 * 2 % 2 ** 32) + jnp.uint32(1)  # odd for every index
    return jnp.sum(bits * weight, dtype=jnp.uint32)


def state_manifest(state) -> dict:
    """What <step>/checksums holds: {"arrays": {path: {"checksum", "shape"}}} of a train state."""
    import jax

    shapes = {jax.tree_util.keystr(p): list(leaf.shape) for p, leaf in jax.tree_util.tree_flatten_with_path(state)[0]}
    return {"arrays": {path: {"checksum": value, "shape": shapes[path]}
                       for path, value in state_checksums(state).items()}}


def check_shapes(abstract_state, saved: dict, cfg, where: str,
                 fix: str = "use the config it was written with, or another run_name") -> None:
    """ConfigError naming the first array whose saved shape differs from what this config builds, and the
    config keys whose value is the differing size."""
    import jax

    arrays = saved.get("arrays", {})
    leaves = [(jax.tree_util.keystr(path), leaf)
              for path, leaf in jax.tree_util.tree_flatten_with_path(abstract_state)[0]]
    for name, leaf in sorted(leaves, key=lambda item: not item[0].startswith("['params']")):  # parameters first
        if name in arrays and list(leaf.shape) != arrays[name]["shape"]:
            old, new = arrays[name]["shape"], list(leaf.shape)
            sizes = {n for o, n in zip(old, new) if o != n} if len(old) == len(new) else set(new)
            keys = [f"{k}={v}" for k, v in cfg.items() if type(v) is int and v in sizes]
            raise ConfigError(f"checkpoint {where} was written by another model: {name} is {tuple(old)} there and "
                              f"{tuple(new)} under this config" + (f" ({', '.join(keys[:4])} here)" if keys else "")
                              + f"; {fix}")


def state_checksums(state) -> dict[str, int]:
    """{array path: checksum} of a train state (global arrays, any sharding)."""
    import jax

    leaves = jax.tree_util.tree_flatten_with_path(state)[0]
    paths = [jax.tree_util.keystr(path) for path, _ in leaves]
    sums = _checksums_jit()([leaf for _, leaf in leaves])
    return {path: int(value) for path, value in zip(paths, jax.device_get(sums))}


@functools.cache
def _checksums_jit():
    """One jitted function for all saves and restores (compiled once per state structure)."""
    import jax

    return jax.jit(lambda arrays: [_array_checksum(a) for a in arrays])


def verify(state, saved: dict) -> None:
    """Raises ChecksumMismatch naming the first array of `state` whose checksum differs from `saved`."""
    arrays = saved.get("arrays", {})
    for path, value in state_checksums(state).items():
        if path in arrays and arrays[path]["checksum"] != value:
            raise ChecksumMismatch(f"array {path} does not match its saved checksum (its file was changed or "
                                   "damaged after the save)")


class CheckpointError(RuntimeError):
    """A save failed (one line: the path and the OS's reason); the run stops, losing only the steps since the
    newest durable checkpoint."""


class SaveTimeout(CheckpointError):
    """A save was not durable within checkpoint_timeout_s; Orbax's writer threads may still be stuck in it."""


# Beyond checkpoint_timeout_s, how long this module's own poll waits for Orbax's (bounded) threads to return
# (at most checkpoint_timeout_s again).
GRACE_S = 60.0


class Checkpointer:
    """A CheckpointManager for this run's checkpoint directory, saving the whole train state as `items`."""

    def __init__(self, cfg, checkpoint_dir: str, log=print, on_durable=None):
        self.cfg = cfg
        self.log = log
        self.on_durable = on_durable  # called with each step once it is durable
        _quiet_orbax_failures()
        self.enabled = cfg.enable_checkpointing
        self.period = cfg.checkpoint_period
        self.directory = checkpoint_dir
        self.asynchronous = cfg.async_checkpointing
        self.timeout = cfg.checkpoint_timeout_s
        self.pending = None  # (step, when it began) of a save not yet known to be durable
        self.closed = False
        self.path = storage.path(checkpoint_dir)
        if self.enabled:  # a directory that cannot take a checkpoint is a start-up error, not a late surprise
            _probe_writable(self.path)
        options = ocp.CheckpointManagerOptions(
            max_to_keep=cfg.max_num_checkpoints_to_keep,
            enable_async_checkpointing=True,  # always: only a background save can be waited for with a deadline
            async_options=ocp.AsyncOptions(timeout_secs=cfg.checkpoint_timeout_s),
            create=True,
            cleanup_tmp_directories=True,  # what a killed save left behind
        )
        # Opened even when saving is off, so that a run can still resume from what is there.
        self.manager = ocp.CheckpointManager(self.path, options=options, item_names=(ITEM, INPUT, CHECKSUMS)) \
            if self.enabled or self.path.is_dir() else None

    def latest_step(self):
        return self.manager.latest_step() if self.manager else None

    def due(self, step: int, *, last: bool) -> bool:
        """Whether step is saved: multiples of checkpoint_period and (save_checkpoint_on_completion) the last
        step, once."""
        return (self.enabled and ((last and self.cfg.save_checkpoint_on_completion) or step % self.period == 0)
                and step != self.latest_step())

    def save(self, step: int, state, input_state: dict | None = None) -> None:
        """Saves the train state and, when given, this process's input position (every process's, gathered,
        is written once: {"process_count": P, "positions": [one per process]})."""
        import jax

        items = {ITEM: ocp.args.StandardSave(state), CHECKSUMS: ocp.args.JsonSave(state_manifest(state))}
        if input_state is not None:
            items[INPUT] = ocp.args.JsonSave({"process_count": jax.process_count(),
                                              "positions": _gather_json(input_state)})
        self.wait()  # the previous save first, with its deadline (Orbax's save() would join it unbounded)
        try:
            self.manager.save(step, args=ocp.args.Composite(**items), force=True)
        except Exception as e:  # noqa: BLE001 - a failed save is one line, never hundreds of traceback lines
            raise CheckpointError(self._failure(step, e)) from None
        self.pending = (step, time.monotonic())
        if self.asynchronous:
            self.log(f"saving checkpoint {self.directory}/{step} in the background")
        else:
            self.wait()

    def _durable(self, step: int) -> int:
        self.log(f"saved checkpoint {self.directory}/{step}" + (" (durable)" if self.asynchronous else ""))
        if self.on_durable is not None:
            self.on_durable(step)
        return step

    def poll(self) -> int | None:
        """The step of a save that has become durable since the last call (logged, then forgotten), else None;
        raises CheckpointError as soon as that save is known to have failed, SaveTimeout once it is past its
        deadline."""
        if self.pending is None:
            return None
        step, began = self.pending
        if self.manager.is_saving_in_progress():
            limit = self.timeout + min(GRACE_S, self.timeout)
            if time.monotonic() - began > limit:
                raise SaveTimeout(self._failure(step, TimeoutError(
                    f"not durable after {limit:.0f} s; checkpoint_timeout_s={self.timeout}")))
            return None
        self.pending = None
        try:
            self.manager.wait_until_finished()  # the finalize thread has ended: returns at once, or re-raises
            self.manager.check_for_errors()
        except Exception as e:  # noqa: BLE001
            if isinstance(e, TimeoutError):  # Orbax's own deadline (checkpoint_timeout_s) passed
                raise SaveTimeout(self._failure(step, TimeoutError(
                    f"not durable after {self.timeout} s; checkpoint_timeout_s={self.timeout}"))) from None
            raise CheckpointError(self._failure(step, e)) from None
        return self._durable(step)

    def wait(self) -> int | None:
        """poll() until the pending save, if any, is durable (its step) or has failed or missed its deadline
        (raises). Never much longer than checkpoint_timeout_s + GRACE_S after the save began."""
        while self.pending is not None:
            durable = self.poll()
            if durable is not None:
                return durable
            time.sleep(0.05)
        return None

    def _failure(self, step: int, error: Exception) -> str:
        durable = [s for s in (self.manager.all_steps() if self.manager else []) if s != step]
        return (f"saving checkpoint {self.directory}/{step} failed ({os_reason(error, self.path)}); the newest "
                f"durable checkpoint is " + (f"{self.directory}/{max(durable)}" if durable else "none"))

    def restore(self, step: int, abstract_state):
        """(train state, saved input positions {"process_count", "positions"} or None) of a step, its arrays
        verified against the step's checksums (steps saved before checksums existed, as their Orbax metadata
        shows, restore unverified with a warning; a step saved with checksums that are gone is not trusted)."""
        step_dir = self.path / str(step)
        if (step_dir / ITEM / "_METADATA").exists():
            refuse_upstream_state(step_dir / ITEM, f"the run's checkpoint {step_dir}")
        manifest = None
        if (step_dir / CHECKSUMS).is_dir():  # read first: another model's checkpoint is a config
            manifest = self.manager.restore(  # mistake, not a damaged step
                step, args=ocp.args.Composite(**{CHECKSUMS: ocp.args.JsonRestore()}))[CHECKSUMS]
            check_shapes(abstract_state, manifest, self.cfg, f"{self.directory}/{step}")
        else:  # trusted unverified only when the step's own metadata shows it predates checksums
            saved = _saved_items(step_dir)
            if saved is None or CHECKSUMS in saved:
                raise ValueError(f"its {CHECKSUMS}/ folder is missing, " + (
                    "though Orbax's metadata of the step lists it" if saved else "and the step has no Orbax "
                    "metadata (_CHECKPOINT_METADATA) to show it predates checksums") + ": its arrays cannot be "
                    "verified")
            self.log(f"warning: checkpoint {self.directory}/{step} was saved before checksums existed: its arrays "
                     "are restored unverified")
        has_input = (step_dir / INPUT).is_dir()
        items = {ITEM: ocp.args.StandardRestore(abstract_state)}
        if has_input:
            items[INPUT] = ocp.args.JsonRestore()
        restored = self.manager.restore(step, args=ocp.args.Composite(**items))
        if manifest is not None:
            verify(restored[ITEM], manifest)
        if has_input and not _well_formed_input(restored[INPUT]):
            raise ValueError(f"its input position file ({INPUT}/) is malformed")
        return restored[ITEM], restored[INPUT] if has_input else None

    def restore_latest(self, abstract_state, log, resume=None, fatal: tuple = ()):
        """(step, restore()) of the newest readable step, or None when there is no step. Unreadable newer steps are
        reported and renamed aside (kept for inspection); none readable is an error, never a fresh start.
        resume(step, restore()), when given, is part of reading a step (the input pipeline resumed at its saved
        position): what it returns stands for restore(), and its failure sets the step aside the same way, but
        for the exception types in fatal (a bad document, which an older step would meet again)."""
        steps = sorted(self.manager.all_steps(), reverse=True) if self.manager else []
        failures = []
        for step in steps:
            try:
                restored = self.restore(step, abstract_state)
                if resume is not None:
                    restored = resume(step, restored)
            except (ConfigError, *fatal):
                raise  # the config does not match the run's checkpoints: no older step will either
            except Exception as e:  # noqa: BLE001 -- any failure to read a step is reported, then the next tried
                failures.append((step, _describe(e)))
                log(f"warning: checkpoint {self.directory}/{step} cannot be restored ({failures[-1][1]}); "
                    "trying the previous one")
                continue
            for bad, _ in failures:
                self._set_aside(bad, log)
            return step, restored
        if failures:
            raise ConfigError(f"none of the checkpoints in {self.directory} can be restored (newest, step "
                              f"{failures[0][0]}: {failures[0][1]}); fix the config to match them, or move the "
                              "directory away to start afresh")
        return None

    def _set_aside(self, step: int, log) -> None:
        import jax

        path = self.path / str(step)
        aside = path.parent / f"{path.name}.unreadable-{time.strftime('%Y%m%d_%H%M%S')}"
        if jax.process_index() == 0:
            path.rename(aside)
        log(f"warning: moved the unreadable checkpoint {path} to {aside}")
        self.manager.reload()

    def close(self):
        """Waits (bounded) for a pending save (CheckpointError if it failed), then closes Orbax's manager; after
        a SaveTimeout the manager is left open, as closing it would join its stuck threads. Idempotent."""
        if self.manager and not self.closed:
            self.closed, timed_out = True, False
            try:
                self.wait()
            except SaveTimeout:
                timed_out = True
                raise
            finally:
                if not timed_out:
                    self.manager.close()


# The operating system's reasons, longest text first ("No space left on device" before "No space"...): what a
# storage library's message (TensorStore's, gcsfs') carries of the OSError underneath it, in words.
_STRERRORS = sorted(((os.strerror(code), name) for code, name in errno.errorcode.items()), key=lambda r: -len(r[0]))
_QUOTED_PATH = re.compile(r'"((?:/|[a-z][a-z0-9+.-]*://)[^"]+)"')


def os_reason(error: Exception, root) -> str:
    """Why a save failed, in one short clause: the OS's reason in words and its errno name, and the path it was
    writing, relative to root (the checkpoint directory) and shortened ("No space left on device (ENOSPC)
    writing 6.orbax-checkpoint-tmp/items.orbax-checkpoint-tmp/ocdbt.process_0/d/1f...0a"). The reason is
    found in an OSError or in the text of the storage library's error wrapping one (TensorStore names it at
    the end of a message hundreds of characters long). Anything else: its type, and the head and tail of its
    message."""
    text = " ".join(str(error).split())
    path = None
    if isinstance(error, OSError) and error.errno in errno.errorcode:
        reason = f"{os.strerror(error.errno)} ({errno.errorcode[error.errno]})"
        path = error.filename or _path_in_hand(error, root)
    else:  # the reason is looked for outside the quoted paths (a directory may be named anything)
        bare = _QUOTED_PATH.sub(lambda m: " " * len(m.group(0)), text)
        found = [(bare.find(words), words, name) for words, name in _STRERRORS if words in bare]
        if not found:
            return f"{type(error).__name__}: {_middle(text, 300)}" if text else type(error).__name__
        at, words, name = min(found, key=lambda f: (f[0], -len(f[1])))
        reason = f"{words} ({name})"
        paths = [m.group(1) for m in _QUOTED_PATH.finditer(text, 0, at)]
        path = paths[-1] if paths else None
    if not path:
        return reason
    path, root = str(path), str(root).rstrip("/") + "/"
    return f"{reason} writing {_middle(path[len(root):] if path.startswith(root) else path, 120)}"


def _path_in_hand(error: BaseException, root) -> str | None:
    """The file a Python write was on when it raised an OSError that names none (a write or close that runs out of
    space: Orbax's JSON metadata through etils' Path.write_text): the path under root held by the innermost frame
    of the traceback that holds one, else None."""
    root = str(root).rstrip("/") + "/"
    for frame, _ in reversed(list(traceback.walk_tb(error.__traceback__))):
        for value in frame.f_locals.values():
            if isinstance(value, os.PathLike) and os.fspath(value).startswith(root):
                return os.fspath(value)
    return None


def _middle(text: str, limit: int) -> str:
    """text, or its head and tail around "..." when longer than limit: a path's or a message's end says most."""
    return text if len(text) <= limit else f"{text[:limit // 2 - 2]}...{text[-(limit - limit // 2 - 1):]}"


class _DropOrbaxTracebacks:
    """A logging filter: the logged tracebacks of a failed save or restore, Orbax's own and asyncio's "Task
    exception was never retrieved" for the writes still running in Orbax's event loop when one failed (this
    module reports each failure in one line instead)."""

    def filter(self, record) -> bool:
        if not record.exc_info:
            return True
        files = [record.pathname, *(frame.f_code.co_filename for frame, _ in traceback.walk_tb(record.exc_info[2]))]
        return not any(f"{os.sep}orbax{os.sep}" in f for f in files)


@functools.cache
def _quiet_orbax_failures() -> None:
    import logging

    for name in ("absl", "asyncio"):
        logging.getLogger(name).addFilter(_DropOrbaxTracebacks())
    previous = sys.unraisablehook

    def unraisable(info):
        """Drops what TensorStore's callbacks raise for the writes still running when one failed and Orbax
        closed its event loop (one traceback each, dozens of them, around the one-line error)."""
        late = info.exc_type is RuntimeError and str(info.exc_value) == "Event loop is closed"
        frames = list(traceback.walk_tb(info.exc_traceback))
        if not (late and frames and frames[-1][0].f_code.co_name == "_check_closed"):
            previous(info)

    sys.unraisablehook = unraisable


def _gather_json(obj) -> list:
    """[obj of process 0, obj of process 1, ...] on every process."""
    import jax
    import numpy as np

    if jax.process_count() == 1:
        return [obj]
    from jax.experimental import multihost_utils

    data = json.dumps(obj).encode()
    sizes = multihost_utils.process_allgather(np.array([len(data)], np.int32))
    padded = np.frombuffer(data.ljust(int(np.max(sizes))), np.uint8)
    rows = multihost_utils.process_allgather(padded)
    return [json.loads(bytes(row[:int(size)]).decode()) for row, size in zip(rows, np.ravel(sizes))]


def _saved_items(step_dir: epath.Path) -> list[str] | None:
    """The item names Orbax recorded for a step when it saved it (its _CHECKPOINT_METADATA, written in the same
    commit), or None when that is missing or unreadable."""
    try:
        handlers = json.loads((step_dir / "_CHECKPOINT_METADATA").read_text()).get("item_handlers")
    except (OSError, ValueError, AttributeError):
        return None
    return sorted(handlers) if isinstance(handlers, dict) else None


def _well_formed_input(saved) -> bool:
    """{"process_count": P, "positions": [P dicts]}, as save() writes it."""
    return (isinstance(saved, dict) and type(saved.get("process_count")) is int
            and isinstance(saved.get("positions"), list) and len(saved["positions"]) == saved["process_count"]
            and all(isinstance(p, dict) for p in saved["positions"]))


def _probe_writable(where: epath.Path) -> None:
    """ConfigError (one line) unless a new file can be made in the checkpoint directory `where` (a local one is
    created when missing)."""
    try:
        probe = where / f".write-test-{os.getpid()}-{time.time_ns()}"
        if storage.is_remote(where):  # no mkdir: a bucket has no directories, and gcsfs would create a
            probe.write_bytes(b"")             # missing bucket
        else:  # a new file, never through a symlink
            where.mkdir(parents=True, exist_ok=True)
            os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644))
        probe.unlink()
    except Exception as e:  # noqa: BLE001 - an OSError here, or the bucket's client's own error
        reason = e.strerror if isinstance(e, OSError) and e.strerror else _describe(e)
        raise ConfigError(f"cannot write checkpoints to {where}: {reason}; fix its permissions (or your "
                          "credentials for a bucket), or set base_output_directory (or enable_checkpointing=false)"
                          ) from None


def _item_dir(path: str, key: str) -> epath.Path:
    path = storage.path(path)  # absolute when local: Orbax's OCDBT store needs it
    if not path.is_dir():
        raise ConfigError(f"{key}={path} does not exist; point it at a checkpoint's item directory, "
                          "e.g. <run>/checkpoints/<step>/items")
    if (path / ITEM).is_dir():  # accept .../checkpoints/<step> too
        path = path / ITEM
    if not (path / "_METADATA").exists():
        raise ConfigError(f"{key}={path} is not an Orbax checkpoint (no _METADATA there); point it at a "
                          "checkpoint's item directory, e.g. <run>/checkpoints/<step>/items")
    return path


def _check_manifest(path: epath.Path, abstract_tree, key: str, cfg) -> None:
    """check_shapes against the manifest beside a step's items, when the step has one (this trainer's)."""
    manifest = path.parent / CHECKSUMS
    if not manifest.is_dir():
        return
    with ocp.Checkpointer(ocp.JsonCheckpointHandler()) as ckptr:
        saved = ckptr.restore(manifest)
    check_shapes(abstract_tree, saved, cfg or {}, f"{path} ({key})", f"use this model's config, or set {key} to "
                 "one of its checkpoints")


def _restoring(key: str, path: str):
    """One ConfigError line for a checkpoint given by a key that cannot be restored into this model."""
    @contextlib.contextmanager
    def guard():
        try:
            yield
        except ConfigError:
            raise
        except Exception as e:  # noqa: BLE001 - Orbax's errors are many and long: one line of the first
            raise ConfigError(f"{key}={path} cannot be restored into this model ({_describe(e)})") from None
    return guard()


def load_full_state(path: str, abstract_state, cfg=None):
    """(train state, saved input positions or None) from an item directory: the whole state (step, params,
    optimizer) and, when the step beside it holds one, the input position, so the loaded run reads on
    where its source stopped."""
    path = _item_dir(path, "load_full_state_path")
    refuse_upstream_state(path, f"load_full_state_path={path}")
    _check_manifest(path, abstract_state, "load_full_state_path", cfg)
    with _restoring("load_full_state_path", path), ocp.StandardCheckpointer() as ckptr:
        state = ckptr.restore(path, abstract_state)
    input_dir = path.parent / INPUT
    if not input_dir.is_dir():
        return state, None
    with ocp.Checkpointer(ocp.JsonCheckpointHandler()) as ckptr:
        return state, ckptr.restore(input_dir)


def load_params(path: str, abstract_params, cfg=None, abstract_aux=None):
    """(params, MoE routing biases or None) of a saved train state (the optimizer state on disk is not read). The
    biases (`nnx_aux`) are read when this model has them and the checkpoint holds them: a DeepSeek-style model
    whose bias restarted at zero would route every token differently at step 0."""
    path = _item_dir(path, "load_parameters_path")
    saved = _saved_names(path)
    if _upstream_tree(saved):
        raise ConfigError(f"load_parameters_path={path} is upstream MaxText's parameter tree (params/params/decoder/"
                          f"...), not this trainer's: {UPSTREAM_CONVERSION}")
    item = {"params": abstract_params}
    if abstract_aux is not None and "nnx_aux" in {name.split(".")[0] for name in saved}:
        item["nnx_aux"] = abstract_aux
    _check_manifest(path, item, "load_parameters_path", cfg)
    restore_args = ocp.checkpoint_utils.construct_restore_args(item)
    with _restoring("load_parameters_path", path), ocp.PyTreeCheckpointer() as ckptr:
        restored = ckptr.restore(path, args=ocp.args.PyTreeRestore(
            item=item, restore_args=restore_args, partial_restore=True))
    import jax

    absent = [jax.tree_util.keystr(p) for p, leaf in jax.tree_util.tree_flatten_with_path(restored)[0]
              if isinstance(leaf, jax.ShapeDtypeStruct)]  # what partial_restore hands back for a missing array
    absent.sort(key=lambda name: not name.startswith("['params']"))
    if absent:
        raise ConfigError(f"load_parameters_path={path} holds no {absent[0]} ({len(absent)} parameters this config "
                          f"needs are not in it); {_absent_reason(saved, absent)}")
    return restored["params"], restored.get("nnx_aux")


def _saved_names(path) -> list[str]:
    """Every array's key path in an item directory (a path or an epath.Path), dot-joined (from Orbax's _METADATA)."""
    tree = json.loads((storage.path(path) / "_METADATA").read_text()).get("tree_metadata", {})
    return [".".join(str(k["key"]) for k in entry.get("key_metadata", ())) for entry in tree.values()]


# Upstream MaxText's parameter tree (its Orbax items hold params/params/decoder/..., token_embedder beside it; a
# params-only item params/decoder/...), and the way to bring one here.
UPSTREAM_TREE = ("params.params.decoder.", "params.decoder.")
UPSTREAM_CONVERSION = ("convert it with python -m MaxText.utils.ckpt_conversion.from_upstream <this config and model "
                       "keys> load_parameters_path=<it> base_output_directory=<out>, then load <out>/0/items")


def _upstream_tree(saved: list[str]) -> bool:
    """Whether a checkpoint's names (_saved_names) are upstream MaxText's parameter tree."""
    return any(name.startswith(UPSTREAM_TREE) for name in saved)


def refuse_upstream_state(path, what: str) -> None:
    """A train state that upstream MaxText wrote does not resume here: one line (about `what`, the key or the run's
    step it was given as) saying how to start from its params instead (its optimizer state is laid out for
    upstream's optimizer tree, which is not converted)."""
    if _upstream_tree(_saved_names(path)):
        raise ConfigError(f"{what} is upstream MaxText's train state "
                          "(params/params/decoder/...), which does not resume here (its optimizer state is not "
                          f"converted); start from its params instead: {UPSTREAM_CONVERSION} as load_parameters_path")


def _absent_reason(saved: list[str], absent: list[str]) -> str:
    """Why a checkpoint lacks parameters this config needs, as far as its own names tell: the other scan_layers
    layout, or no MTP depths; else which config to use. `saved`: the checkpoint's names (_saved_names)."""
    unrolled = any(".layers_0." in name for name in saved)
    stacked = any(re.search(r"_layers\.layers\.", name) for name in saved)
    wants_stacked = any("['layers']" in name for name in absent)
    wants_unrolled = any(re.search(r"\['layers_\d+'\]", name) for name in absent)
    if wants_stacked and unrolled and not stacked:
        return "it was written with scan_layers=false (one entry per layer): set scan_layers=false"
    if wants_unrolled and stacked and not unrolled:
        return "it was written with scan_layers=true (layers stacked on one axis): set scan_layers=true"
    if all("['mtp']" in name for name in absent) and not any(name.startswith("params.mtp.") for name in saved):
        return "it has no Multi-Token Prediction depths: set mtp_num_layers=0"
    return "use the config it was written for (model_name and the model keys)"


