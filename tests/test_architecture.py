"""The package layout is the design (README: Architecture): each package imports only from the layers below it,
no module imports itself back through others, and an import inside a function says why in a comment.

Layers, lowest first (a package may import its own modules and those of lower layers; packages of one layer
stay out of each other):
  config (no JAX)  ->  parallel, data  ->  layers  ->  step  ->  planning  ->  trainer  ->  utils.ckpt_conversion
  ->  the commands (MaxText/<command>.py), benchmarks, upstream_paths
"""

from __future__ import annotations

import ast
import os
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "MaxText"
COMMANDS = 7  # the layer of the entry points, benchmarks and upstream's command paths
LAYERS = {"config": 0, "parallel": 1, "data": 1, "layers": 2, "step": 3, "planning": 4, "trainer": 5, "utils": 6,
          "benchmarks": COMMANDS, "upstream_paths": COMMANDS}


def _modules() -> dict[str, pathlib.Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


MODULES = _modules()


def layer_of(module: str) -> tuple[str, int]:
    """The package a module belongs to (its first name under MaxText; a command module is its own) and its layer."""
    parts = module.split(".")
    if module == "MaxText":
        return "MaxText", 0  # the package's __init__: one environment variable, nothing imported
    if parts[1] in LAYERS:
        return parts[1], LAYERS[parts[1]]
    return module, COMMANDS


class Import:
    def __init__(self, source: str, target: str, line: int, local: bool, commented: bool):
        self.source, self.target, self.line, self.local, self.commented = source, target, line, local, commented

    def __repr__(self):
        return f"{MODULES[self.source].relative_to(ROOT)}:{self.line} imports {self.target}"


def _resolve(module: str, node: ast.ImportFrom | ast.Import) -> list[str]:
    """The project modules an import statement loads (a name imported from a package may be a submodule)."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        base = module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]
        if node.level:
            base = ".".join(base.split(".")[:len(base.split(".")) - node.level + 1])
            origin = f"{base}.{node.module}" if node.module else base
        else:
            origin = node.module
        names = [f"{origin}.{a.name}" if f"{origin}.{a.name}" in MODULES else origin for a in node.names]
    found = []
    for name in names:
        while name not in MODULES and "." in name:
            name = name.rpartition(".")[0]
        if name in MODULES and name != module:
            found.append(name)
    return found


def _commented(lines: list[str], import_lines: set[int], node) -> bool:
    """A comment on the statement, or on the line above the block of import statements it stands in."""
    if any("#" in text for text in lines[node.lineno - 1:node.end_lineno]):
        return True
    above = node.lineno - 2
    while above >= 0 and (above in import_lines or not lines[above].strip()):
        if "#" in lines[above]:
            return True
        above -= 1
    return above >= 0 and lines[above].strip().startswith("#")


def _imports(module: str) -> list[Import]:
    path = MODULES[module]
    lines = path.read_text().splitlines()
    tree = ast.parse(path.read_text(), str(path))
    top = set()
    for node in tree.body:  # module level, also inside `if`/`try` at module level
        top.update(id(n) for n in ast.walk(node) if not isinstance(node, (ast.FunctionDef, ast.ClassDef)))
    statements = [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]
    import_lines = {line for n in statements for line in range(n.lineno - 1, n.end_lineno)}
    out = []
    for node in statements:
        commented = _commented(lines, import_lines, node)
        for target in _resolve(module, node):
            if target.startswith("MaxText"):
                out.append(Import(module, target, node.lineno, id(node) not in top, commented))
    return out


IMPORTS = [i for m in sorted(MODULES) for i in _imports(m)]


def _defined(module: str) -> set[str]:
    """The names a module defines at its top level (functions, classes, assignments, imports)."""
    names = set()
    for node in ast.walk(ast.parse(MODULES[module].read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
    return names


def test_every_imported_name_exists():
    """`from MaxText.x import y`: y is a module of x or a name x defines (a module moved and an import left behind
    fails here, without running the code that imports it)."""
    missing = []
    for path in sorted([*MODULES.values(), *(ROOT / "tests").rglob("*.py"), *(ROOT / "scripts").rglob("*.py")]):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").startswith("MaxText"):
                if node.module not in MODULES:
                    missing.append(f"{path.relative_to(ROOT)}:{node.lineno}: no module {node.module}")
                    continue
                for alias in node.names:
                    if f"{node.module}.{alias.name}" not in MODULES and alias.name not in _defined(node.module):
                        missing.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.module} has no "
                                       f"{alias.name}")
    assert not missing, "imports of names that do not exist:\n" + "\n".join(missing)


def test_every_package_has_a_layer():
    unplaced = sorted({m.split(".")[1] for m in MODULES if m.count(".") >= 2 and m.split(".")[1] not in LAYERS})
    assert not unplaced, f"packages without a layer in LAYERS: {unplaced}"


def test_imports_point_down_the_layers():
    wrong = []
    for i in IMPORTS:
        (source, rank), (target, target_rank) = layer_of(i.source), layer_of(i.target)
        if source != target and (target_rank > rank or (target_rank == rank and rank < COMMANDS)):
            wrong.append(f"{i!r} ({source}, layer {rank} -> {target}, layer {target_rank})")
    assert not wrong, "imports against the layer order:\n" + "\n".join(wrong)


def test_no_import_circles():
    graph = {m: set() for m in MODULES}
    for i in IMPORTS:
        graph[i.source].add(i.target)
    state, stack, circles = {}, [], []

    def visit(m):
        state[m] = "open"
        stack.append(m)
        for t in sorted(graph[m]):
            if state.get(t) == "open":
                circles.append(" -> ".join(stack[stack.index(t):] + [t]))
            elif t not in state:
                visit(t)
        stack.pop()
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m)
    assert not circles, "import circles:\n" + "\n".join(circles)


def test_imports_inside_functions_say_why():
    """Only with a comment on the statement or the line above it: JAX loads after the XLA flags are applied (the
    commands), optional heavy dependencies load where they are used."""
    silent = [repr(i) for i in IMPORTS if i.local and not i.commented and not i.source.startswith("MaxText.benchmarks")]
    assert not silent, f"{len(silent)} imports of the project's own modules inside functions, no reason given:\n" + \
        "\n".join(silent)


@pytest.mark.parametrize("module", ["MaxText.config.load", "MaxText.config.checks", "MaxText.config.upstream",
                                    "MaxText.config.storage", "MaxText.config.xla_flags", "MaxText.data",
                                    "MaxText.planning.flops", "MaxText.train"])
def test_the_configuration_layer_loads_no_jax(module, tmp_path):
    """What the commands read before the XLA flags are applied never imports JAX (XLA reads its flags once)."""
    import subprocess
    import sys

    code = f"import sys, {module}; print('jax' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "False", f"importing {module} loads JAX"


# ------------------------------------------------------------------------------------------- the MoE layer's depth

MOE_MESHES = {"none": None, "fsdp8": ["ici_fsdp_parallelism=8"],
              "fsdp2_expert4": ["ici_fsdp_parallelism=2", "ici_expert_parallelism=4"],
              "expert8_token_chunks3": ["ici_fsdp_parallelism=1", "ici_expert_parallelism=8", "num_moe_token_chunks=3"]}


def calls_to_grouped_gemm(impl: str, mesh_keys) -> list[int]:
    """While moe_ffn of `impl` traces: for every call of the grouped GEMM (gmm.grouped_matmul under the
    reference kernels; dense's batched einsums), the calls from moe_ffn to it, counted as the frames of
    MaxText/ code on the stack from the GEMM's caller up to moe_ffn (JAX's own frames, shard_map's included,
    are not counted)."""
    import sys  # noqa: PLC0415 - these three load JAX; the rest of this file must not need it
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415

    from MaxText.layers.moe.block import MOE_FFNS  # noqa: PLC0415
    from MaxText.layers.moe.experts import ExpertWeights  # noqa: PLC0415
    from MaxText.layers.moe.gmm import grouped_matmul  # noqa: PLC0415
    from MaxText.layers.moe.router import Routing  # noqa: PLC0415
    from MaxText.parallel import sharding  # noqa: PLC0415
    from tests.tiny import tiny_config  # noqa: PLC0415

    t, d, f, e, k = 128, 16, 32, 8, 2
    cfg = tiny_config(f"moe_impl={impl}", "te_kernels=reference", f"num_experts={e}", "max_target_length=16",
                      f"base_emb_dim={d}", f"base_moe_mlp_dim={f}", f"num_experts_per_tok={k}", *(mesh_keys or []))
    rules = sharding.axis_rules(cfg) if mesh_keys else None
    depths = []

    def is_gemm(code) -> bool:
        dense_gemm = code.co_filename.endswith("moe/dense.py") and code.co_name == "matmul"
        return code is grouped_matmul.__code__ or dense_gemm

    def profile(frame, event, arg):
        if event != "call" or not is_gemm(frame.f_code):
            return
        calls, caller = 0, frame.f_back
        while caller is not None:
            if str(PACKAGE) in caller.f_code.co_filename:
                calls += 1
                if caller.f_code.co_name == "moe_ffn":
                    depths.append(calls)
                    return
            caller = caller.f_back
        depths.append(-1)  # not reached from a moe_ffn

    w = ExpertWeights(jnp.zeros((e, d, f)), jnp.zeros((e, d, f)), jnp.zeros((e, f, d)))
    routing = Routing(jnp.ones((t, k)), jnp.zeros((t, k), jnp.int32), jnp.zeros(()), jnp.zeros(()), jnp.zeros((e,)),
                      jnp.zeros(()))

    def trace():
        jax.make_jaxpr(lambda x, w: MOE_FFNS[impl](x, routing, w, cfg, rules)[0])(jnp.zeros((t, d)), w)

    sys.setprofile(profile)
    try:
        if mesh_keys:
            with jax.set_mesh(sharding.create_mesh(cfg)):
                trace()
        else:
            trace()
    finally:
        sys.setprofile(None)
    return depths


@pytest.mark.parametrize("mesh_name", list(MOE_MESHES))
@pytest.mark.parametrize("impl", ["dense", "ragged", "te_dropless"])
def test_moe_ffn_reaches_the_grouped_gemm_in_at_most_4_calls(impl, mesh_name):
    """moe_ffn -> layout.run -> the per-device stages -> expert_ffn -> the GEMM: the MoE layer is four stages
    in one function, not a chain of callbacks (three GEMMs per chunk of tokens, each reached that way)."""
    depths = calls_to_grouped_gemm(impl, MOE_MESHES[mesh_name])
    assert len(depths) >= 3, f"{impl} on {mesh_name}: the grouped GEMM was called {len(depths)} times"
    assert -1 not in depths and max(depths) <= 4, f"{impl} on {mesh_name}: calls from moe_ffn {depths}"


# ------------------------------------------------------------------------------------------- config keys read

CONFIG_METHODS = {"get", "items", "keys", "as_configdict", "to_dict"}  # ConfigDict's own, not keys


def config_keys_read(source: str) -> dict[str, int]:
    """Every config key `source` reads by name, with a line: cfg.key, self.cfg.key, cfg["key"], cfg.get("key"),
    getattr(cfg, "key"). Keys built at run time (cfg[f"{axis}_parallelism"]) are not seen."""
    def is_cfg(node) -> bool:
        return (isinstance(node, ast.Name) and node.id == "cfg") or (isinstance(node, ast.Attribute)
                                                                       and node.attr == "cfg")

    def text(node):
        return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None

    found = {}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and is_cfg(node.value) and node.attr not in CONFIG_METHODS:
            found.setdefault(node.attr, node.lineno)
        elif isinstance(node, ast.Subscript) and is_cfg(node.value) and text(node.slice):
            found.setdefault(text(node.slice), node.lineno)
        elif isinstance(node, ast.Call) and node.args:
            func, args = node.func, node.args
            if isinstance(func, ast.Attribute) and func.attr == "get" and is_cfg(func.value) and text(args[0]):
                found.setdefault(text(args[0]), node.lineno)
            elif isinstance(func, ast.Name) and func.id == "getattr" and is_cfg(args[0]) and text(args[1]):
                found.setdefault(text(args[1]), node.lineno)
    return found


def test_the_key_scanner_sees_every_way_of_reading_a_key():
    source = 'cfg.a\nself.cfg.b\ncfg["c"]\ncfg.get("d", 1)\ngetattr(cfg, "e")\ncfg.to_dict()\ncfg[f"{x}_y"]\n'
    assert set(config_keys_read(source)) == {"a", "b", "c", "d", "e"}


def test_code_reads_only_keys_that_the_schema_declares():
    """MaxText/config/schema.py declares every key (its type, rules and doc; test_schema holds configs/base.yml to
    it): a key read anywhere in MaxText/ that it lacks is a typo or an undeclared key, which load_config would
    never fill."""
    from MaxText.config.schema import SCHEMA  # noqa: PLC0415 - the configuration layer, read as data here

    undeclared = [f"{path.relative_to(ROOT)}:{line} reads {key}" for path in sorted(MODULES.values())
                  for key, line in config_keys_read(path.read_text()).items() if key not in SCHEMA]
    assert not undeclared, "keys that MaxText/config/schema.py does not declare:\n" + "\n".join(undeclared)
