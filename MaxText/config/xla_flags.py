"""Check a recipe's `xla_flags` against the installed jaxlib before launch, on any machine (no GPU needed).

XLA aborts the process at start on a flag it does not know ("Unknown flags in XLA_FLAGS: ..."), and flags
get renamed between jaxlib releases, so a recipe that worked last month can die on the cluster in its
first second. The preflight (`python -m MaxText.preflight`) calls `check_flags` and prints one row per
problem. The verdict comes from XLA itself: one CPU-only Python subprocess starts JAX with exactly these
flags (xla_gpu_* flags are registered in every jaxlib build, the CPU one included). `known_flag_names`
only feeds the "did you mean".

    from MaxText.config.xla_flags import check_flags
    for problem in check_flags(cfg.xla_flags):
        print(problem.message)
"""

from __future__ import annotations

import difflib
import functools
import importlib.util
import mmap
import os
import pathlib
import re
import subprocess
import sys
from typing import NamedTuple

# Prints where jaxlib lives before JAX parses XLA_FLAGS (that happens on the first backend use), so the
# messages name the jaxlib that actually judged the flags, even when `python` is another interpreter.
_PROBE = (
    "import os, jaxlib; print('jaxlib', jaxlib.__version__, os.path.dirname(jaxlib.__file__), flush=True); "
    "import jax; jax.devices()"
)
_UNKNOWN = re.compile(r"Unknown flags? in XLA_FLAGS: (.*)")
_PARSE_FAILED = "Flag parsing failed"
_FLAG_NAME = re.compile(rb"xla_[a-z0-9_]+")


class FlagProblem(NamedTuple):
    """One entry of `xla_flags` that XLA would reject (or could not be checked)."""

    flag: str  # the entry as given, e.g. "--xla_gpu_enable_nccl_symmetric_buffers=true"
    message: str  # one line naming the flag and the fix
    suggestion: str | None  # nearest known flag, written "--name" (no value), or None


def check_flags(flags: str | list[str], python: str = sys.executable, timeout: float = 60) -> list[FlagProblem]:
    """Returns the problems of `flags` (a whitespace-separated string or a list of `--name=value` entries),
    in the order given; empty when XLA starts with all of them.

    Runs `python` (which must have jax installed) once on CPU with XLA_FLAGS set to exactly these flags,
    nothing inherited from the caller's XLA_FLAGS. A second run happens only when XLA rejects a value:
    it stops before its unknown-flag check then, so the run is repeated without those entries. Malformed
    entries (not `--name...`) are reported without running. Never raises for the user's flags: a start
    that fails for another reason is one problem quoting XLA's (or Python's) last words.
    """
    entries = flags.split() if isinstance(flags, str) else list(flags)
    problems: dict[int, FlagProblem] = {}
    for i, entry in enumerate(entries):
        name = _name(entry)
        if not entry.startswith("--") or not name or any(c.isspace() for c in entry):
            problems[i] = FlagProblem(
                entry, f"malformed XLA flag {entry!r} in xla_flags: write each entry as --name=value", None)
    to_run = [i for i in range(len(entries)) if i not in problems]
    for _ in range(2):
        if not to_run:
            break
        found, rejected_values = _run_once([entries[i] for i in to_run], python, timeout)
        problems.update({to_run[j]: p for j, p in found.items()})
        if not rejected_values:
            break
        to_run = [i for j, i in enumerate(to_run) if j not in found]
    return [problems[i] for i in sorted(problems)]


def known_flag_names(jaxlib_dir: str | None = None) -> list[str]:
    """Names (without dashes) of the XLA options the jaxlib in `jaxlib_dir` (default: this interpreter's)
    knows, sorted. Used for suggestions, never for the verdict.

    Read from the protobuf descriptors compiled into jaxlib: the `xla_...` fields, nearly all of them
    DebugOptions fields set by the flag of the same name. Checked one by one under jaxlib 0.12.0.1: 336
    of the 351 are flags; the other 15 are options set only through the API (e.g. xla_detailed_logging),
    and a few flags have no field (e.g. xla_fuel). Removed flags become `reserved` names, which are
    never listed. Falls back to every printable `xla_...` string (minus those reserved names) when no
    descriptor is found. ~0.3 s (one regex pass over the ~330 MB libjax_common.so); cached per directory.
    """
    return list(_known_names(jaxlib_dir or _own_jaxlib_dir()))


def suggest(name: str, known: list[str]) -> str | None:
    """Nearest name in `known` to the unknown flag `name` (no dashes), or None.

    A renamed flag usually keeps its tail (`xla_gpu_enable_nccl_symmetric_buffers` ->
    `xla_gpu_experimental_enable_nccl_symmetric_buffers`), so a unique known name ending in the tail wins
    over plain string similarity (which prefers the unrelated `xla_gpu_enable_nccl_user_buffers` there).
    """
    others = [k for k in known if k != name]
    for tail in _tails(name):
        same_tail = [k for k in others if k.endswith("_" + tail)]
        if len(same_tail) == 1:
            return same_tail[0]
    close = difflib.get_close_matches(name, others, n=1, cutoff=0.75)
    return close[0] if close else None


def _run_once(entries: list[str], python: str, timeout: float) -> tuple[dict[int, FlagProblem], bool]:
    """Starts JAX once with `entries`; returns {index in entries: problem} and whether XLA rejected a value."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    # TF_CPP_MIN_LOG_LEVEL=0: XLA names a rejected value in an ERROR line, which a caller's setting could hide.
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=" ".join(entries), TF_CPP_MIN_LOG_LEVEL="0")
    everything = " ".join(entries)
    try:
        proc = subprocess.run([python, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {0: FlagProblem(everything, f"could not check xla_flags: {python} did not start JAX within "
                                           f"{timeout:g} s; retry with a longer timeout", None)}, False
    except OSError as e:
        return {0: FlagProblem(everything, f"could not check xla_flags: cannot run {python} ({e}); "
                                           "pass a Python that has jax installed", None)}, False
    if proc.returncode == 0:
        return {}, False
    version, jaxlib_dir = _probe_header(proc.stdout)
    lines = proc.stderr.splitlines()
    unknown = next((m.group(1).split() for m in map(_UNKNOWN.search, lines) if m), None)
    if unknown is not None:
        known = _known_names(jaxlib_dir) if jaxlib_dir else ()
        found = {}
        for j, entry in enumerate(entries):
            if entry in unknown:
                guess = suggest(_name(entry), list(known))
                fix = f"did you mean --{guess}?" if guess else "remove it from xla_flags"
                found[j] = FlagProblem(entry, f"unknown XLA flag --{_name(entry)}{_under(version)}; {fix}",
                                       f"--{guess}" if guess else None)
        if found:
            return found, False
    if any(_PARSE_FAILED in line for line in lines):
        found = _rejected_values(entries, lines, version)
        if found:
            return found, True
    return {0: FlagProblem(everything, f"JAX did not start with these xla_flags (exit {proc.returncode})"
                                       f"{_under(version)}: {_last_words(lines)}", None)}, False


def _rejected_values(entries: list[str], lines: list[str], version: str | None) -> dict[int, FlagProblem]:
    """Maps XLA's ERROR lines about bad values (they name the flag) to the entries that set it."""
    found = {}
    for line in lines:
        if not line.startswith("E") or "]" not in line:
            continue
        said = line.split("]", 1)[1].strip().rstrip(".")
        for j, entry in enumerate(entries):
            name = _name(entry)
            if j not in found and re.search(rf"\b{re.escape(name)}\b", said):
                found[j] = FlagProblem(entry, f"bad value for XLA flag --{name}{_under(version)}: {said}; "
                                              "fix the value in xla_flags", None)
                break
    return found


def _last_words(lines: list[str]) -> str:
    """The line that says why the start failed: XLA's last ERROR before a flag-parsing failure (the FATAL
    line after it is generic), else its last ERROR/FATAL line, else the last line (a Python exception)."""
    logged = [line.split("]", 1)[1].strip() for line in lines if line[:1] in "EF" and "]" in line]
    if any(_PARSE_FAILED in line for line in logged):
        errors = [line for line in lines if line.startswith("E") and "]" in line]
        if errors:
            return errors[-1].split("]", 1)[1].strip()
        # Some enum-valued flags (e.g. xla_gpu_pipeline_all_gather=true) fail without an ERROR line.
        return "XLA rejected a value without naming the flag; check the enum-valued flags' values"
    if logged:
        return logged[-1]
    return next((line.strip() for line in reversed(lines) if line.strip()), "(no output)")


def _under(version: str | None) -> str:
    """The ` under jaxlib X` of a message; empty when the probe died before printing the version."""
    return f" under jaxlib {version}" if version else ""


def _probe_header(stdout: str) -> tuple[str | None, str | None]:
    """(jaxlib version, jaxlib directory) from _PROBE's first line; (None, None) if it never printed."""
    for line in stdout.splitlines():
        parts = line.split(" ", 2)
        if len(parts) == 3 and parts[0] == "jaxlib":
            return parts[1], parts[2]
    return None, None


def _name(entry: str) -> str:
    """`--xla_foo=1` -> `xla_foo`."""
    return entry[2:].split("=", 1)[0] if entry.startswith("--") else entry.split("=", 1)[0]


def _tails(name: str) -> list[str]:
    """The parts of `name` a rename tends to keep: after the `xla_gpu_`/`xla_` prefix, and without a leading
    `experimental_` (flags move into and out of it). Single words are too common to mean anything."""
    prefix = next(p for p in ("xla_gpu_", "xla_cpu_", "xla_", "") if name.startswith(p))
    tail = name[len(prefix):]
    tails = [tail, tail.removeprefix("experimental_")]
    return [t for t in dict.fromkeys(tails) if "_" in t]


def _own_jaxlib_dir() -> str:
    """The jaxlib package directory of this interpreter, found without importing (and so initialising) it."""
    spec = importlib.util.find_spec("jaxlib")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("known_flag_names needs jaxlib: pip install jax, or pass jaxlib_dir")
    return list(spec.submodule_search_locations)[0]


def retired_flags(flags: str | list[str], jaxlib_dir: str | None = None) -> list[str]:
    """One line per entry of `flags` whose option the installed jaxlib has retired (a `reserved` name in its
    DebugOptions descriptor) but still parses as an alias, e.g. `--xla_gpu_enable_pipelined_all_gather` in
    jaxlib 0.12 (now `--xla_gpu_pipeline_all_gather=on|off|default|explicit`): it works today, and the
    next release may refuse it. Empty when none are, or when no descriptor is found."""
    directory = jaxlib_dir or _own_jaxlib_dir()
    reserved = _descriptor(directory)[1]
    lines = []
    for entry in (flags.split() if isinstance(flags, str) else flags):
        name = _name(entry)
        if name in reserved:
            guess = suggest(name, list(_known_names(directory)))
            lines.append(f"--{name} is a retired alias" + (f" of --{guess}" if guess else "")
                         + "; use the current name before a jaxlib upgrade refuses it")
    return lines


@functools.cache
def _known_names(jaxlib_dir: str) -> tuple[str, ...]:
    """known_flag_names for one directory (see there)."""
    fields, reserved, printable = _descriptor(jaxlib_dir)
    if fields:
        return tuple(sorted(fields))
    return tuple(sorted(n for n in printable - reserved if not n.endswith("_") and not re.search(r"_2[ef]", n)))


@functools.cache
def _descriptor(jaxlib_dir: str) -> tuple[frozenset, frozenset, frozenset]:
    """(field names, reserved names, every printable xla_... string) in the jaxlib libraries of a directory."""
    fields, reserved, printable = set(), set(), set()
    for lib in sorted(pathlib.Path(jaxlib_dir).rglob("*.so")):
        if not lib.is_file() or lib.stat().st_size == 0:  # mmap refuses empty files
            continue
        with open(lib, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            for m in _FLAG_NAME.finditer(data):
                start, name = m.start(), m.group()
                # A descriptor stores a field as 0x0A <len> name 0x18 <number>, a reserved name as 0x52 <len> name.
                tagged = start >= 2 and data[start - 1] == len(name)
                if tagged and data[start - 2] == 0x0A and data[m.end():m.end() + 1] == b"\x18":
                    fields.add(name.decode())
                elif tagged and data[start - 2] == 0x52:
                    reserved.add(name.decode())
                else:
                    # Adjacent literals can run together ("..._passesxla_gpu_..."): split where a name restarts.
                    printable.update(re.split(r"(?<=[a-z0-9])(?=xla_)", name.decode()))
    return frozenset(fields), frozenset(reserved), frozenset(printable)
