"""Prints the requirements.txt lines of what the GPU kit imports and this Python lacks, one per line (nothing
when all is there). Run by scripts/gpu_check.sh before the kit, with the kit's Python, from the project root.

It imports the kit's modules as the kit will; each missing module is noted and replaced by a permissive
stand-in so the imports go on and every missing package is named in one pass (not one per run). It reads
only the standard library, since anything else may be what is missing.
"""

import importlib
import importlib.abc
import importlib.machinery
import os
import re
import sys
import types

KIT_MODULES = ("pytest", "MaxText.benchmarks.gpu_check", "MaxText.benchmarks.ep_check", "MaxText.trainer.loop",
               "tests.test_te_dropless", "tests.test_attention_cudnn")
# Import names whose distribution is spelt otherwise in requirements.txt.
DISTRIBUTION = {"yaml": "PyYAML", "absl": "absl-py", "orbax": "orbax-checkpoint", "google": "protobuf"}
PROJECT = ("MaxText", "tests")


class _Anything:
    """Whatever a missing module's attribute is asked to be at import time: callable, subscriptable, a base."""

    def __init__(self, *args, **kwargs):
        pass

    def __call__(self, *args, **kwargs):
        return _Anything()

    def __getattr__(self, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return _Anything()

    def __getitem__(self, key):
        return _Anything()

    def __mro_entries__(self, bases):
        return (object,)

    def _any(self, *args):
        return _Anything()

    __lt__ = __le__ = __gt__ = __ge__ = __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = _any
    __truediv__ = __rtruediv__ = __floordiv__ = __mod__ = __pow__ = __neg__ = __and__ = __or__ = _any


class _Absent(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves a stand-in for every module under a top-level name found missing."""

    def __init__(self):
        self.tops = []

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in self.tops:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__getattr__ = lambda attr: _Anything()
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


def requirement_lines(path="requirements.txt") -> dict:
    lines = {}
    for line in open(path):
        line = line.split("#")[0].strip()
        if line:
            lines[re.split(r"[=<>!~\[; ]", line)[0].lower().replace("_", "-")] = line
    return lines


def missing_tops() -> list:
    sys.path.insert(0, os.getcwd())  # the project root (sys.path[0] is scripts/)
    absent = _Absent()
    sys.meta_path.insert(0, absent)
    for _ in range(50):
        try:
            for name in KIT_MODULES:
                importlib.import_module(name)
            break
        except ModuleNotFoundError as e:
            top = (e.name or "").split(".")[0]
            if not top or top in PROJECT or top in absent.tops:
                break  # the project's own layout, or a stand-in that was not enough: the kit will say
            absent.tops.append(top)
            for name in [n for n in sys.modules if n.split(".")[0] in PROJECT]:
                del sys.modules[name]  # import the project again, past the new stand-in
        except Exception:  # noqa: BLE001 - a stand-in used beyond import: report what was found so far
            break
    return absent.tops


def main() -> None:
    lines = requirement_lines()
    for top in missing_tops():
        name = DISTRIBUTION.get(top, top).lower().replace("_", "-")
        print(lines.get(name, name))


if __name__ == "__main__":
    main()
