"""Build-time check that the base image's JAX and Transformer Engine meet pyproject.toml's `gpu` extra.

docker/Dockerfile runs this before it installs anything:

    python docker/check_versions.py --freeze /opt/image-stack-constraints.txt

It reads the installed versions from the packages' metadata (importing TE needs a GPU driver, which a
build has not), prints one `error:` line and exits 1 if any is missing or below its minimum, and
otherwise writes a pip constraints file that pins the image's own JAX stack at its installed versions,
so that no later `pip install` can replace NVIDIA's builds with PyPI's.

Standard library only: it runs on the bare base image. Versions compare by PEP 440's rules for what
these packages publish: release numbers, then pre-releases (`a`, `b`, `rc`, `.dev`) below the release
they lead to (a TE built from main before 2.20 reads `2.20.0.dev0+<sha>` and lacks 2.20's API), local
labels (`+<sha>`) ignored.
"""

from __future__ import annotations

import argparse
import fnmatch
import importlib.metadata
import re
import sys
import tomllib
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"

# Frozen at the image's versions: NVIDIA's JAX and TE builds (every distribution they ship as), and the
# two packages whose C API their compiled code uses at run time.
IMAGE_STACK = ("jax", "jaxlib", "jax-cuda*", "transformer-engine*", "numpy", "ml-dtypes")

_MINIMUM = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[[^\]]*\])?\s*>=\s*([0-9][0-9A-Za-z.+!-]*)\s*$")
_VERSION = re.compile(r"^\s*v?(?:\d+!)?(\d+(?:\.\d+)*)(.*)$")


class VersionError(RuntimeError):
    """The image cannot run the GPU path; the message is one line saying what and why."""


def canonical(name: str) -> str:
    """PEP 503 name: `transformer_engine` and `Transformer-Engine` are the same distribution."""
    return re.sub(r"[-_.]+", "-", name).lower()


def gpu_minimums(pyproject: Path = PYPROJECT) -> dict[str, str]:
    """{distribution: minimum version} from the `gpu` extra, whose entries must all read `name[extras]>=X`."""
    with open(pyproject, "rb") as f:
        extras = tomllib.load(f).get("project", {}).get("optional-dependencies", {})
    if "gpu" not in extras:
        raise VersionError(f"{pyproject} has no [project.optional-dependencies] gpu extra to check against")
    minimums = {}
    for entry in extras["gpu"]:
        match = _MINIMUM.match(entry)
        if match is None:
            raise VersionError(f"gpu extra entry {entry!r} in {pyproject} is not of the form 'name>=version'")
        minimums[canonical(match[1])] = match[2]
    return minimums


def version_key(version: str) -> tuple[tuple[int, ...], int]:
    """Sort key of a version: (release numbers without trailing zeros, 0 for a pre-release else 1)."""
    match = _VERSION.match(version)
    if match is None:
        raise VersionError(f"cannot read version {version!r}")
    release = tuple(int(p) for p in match[1].split("."))
    while len(release) > 1 and release[-1] == 0:
        release = release[:-1]
    rest = match[2].split("+", 1)[0].lower()
    pre = "post" not in rest and re.search(r"(dev|a|b|c|rc|alpha|beta|pre|preview)\d*", rest) is not None
    return release, 0 if pre else 1


def check(installed: dict[str, str | None], minimums: dict[str, str]) -> None:
    """Raise VersionError (one line naming every shortfall) unless each minimum is met.

    installed: {distribution: version or None when it is not installed}, names in any spelling.
    """
    installed = {canonical(name): version for name, version in installed.items()}
    problems = []
    for name, minimum in minimums.items():
        version = installed.get(name)
        if version is None:
            problems.append(f"{name} is not installed (needs >={minimum})")
        elif version_key(version) < version_key(minimum):
            problems.append(f"{name} {version} is below {minimum}")
    if problems:
        raise VersionError(f"the base image cannot run the GPU path: {'; '.join(problems)} (minimums from "
                           "pyproject.toml's gpu extra); build on a newer NVIDIA JAX image with "
                           "--build-arg BASE_IMAGE=...")


def installed_versions() -> dict[str, str]:
    """{canonical name: version} of this interpreter's distributions, the one Python imports when doubled."""
    versions: dict[str, str] = {}
    for dist in importlib.metadata.distributions():
        name = dist.metadata["Name"]
        if name:
            versions.setdefault(canonical(name), dist.version)
    return versions


def stack_constraints(installed: dict[str, str]) -> list[str]:
    """`name==version` lines for the installed distributions that IMAGE_STACK freezes."""
    return sorted(f"{name}=={version}" for name, version in installed.items()
                  if any(fnmatch.fnmatchcase(name, pattern) for pattern in IMAGE_STACK))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pyproject", type=Path, default=PYPROJECT)
    parser.add_argument("--freeze", type=Path, metavar="FILE",
                        help="write pip constraints pinning the image's JAX stack at its installed versions")
    args = parser.parse_args(argv)
    installed = installed_versions()
    try:
        minimums = gpu_minimums(args.pyproject)
        check({name: installed.get(name) for name in minimums}, minimums)
    except VersionError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print("image stack: " + ", ".join(f"{name} {installed[name]}" for name in minimums))
    if args.freeze:
        args.freeze.write_text("\n".join(stack_constraints(installed)) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
