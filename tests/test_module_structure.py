"""jax_ep's modules import in one direction, at module level only.

Layers, bottom to top: base (no jax_ep imports but each other's) -> config ->
region sizing -> runtime state -> backends -> api. A module imports only from
its own layer or below, never inside a function (except optional
dependencies), and the graph has no cycle. ``jax_ep/gmm/`` is not walked
(it is a client of ``_ffi``, like ``api``).
"""
from __future__ import annotations

import ast
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PKG = os.path.join(ROOT, "jax_ep")

LAYERS = [
    ("base", ["jax_ep.abi", "jax_ep.extension", "jax_ep.first_order", "jax_ep.hosts",
              "jax_ep.shared_gpu", "jax_ep.nvshmem_env", "jax_ep.device_errors",
              "jax_ep.mesh_axes", "jax_ep.region",
              "jax_ep.intranode", "jax_ep.internode", "jax_ep.low_latency",
              "jax_ep.low_latency.types", "jax_ep.ragged"]),
    ("config", ["jax_ep.config", "jax_ep.types", "jax_ep.fp8", "jax_ep.low_latency.config",
                "jax_ep.ragged.config"]),
    ("sizing", ["jax_ep.intranode.region", "jax_ep.internode.region",
                "jax_ep.low_latency.region", "jax_ep.ragged.region"]),
    ("runtime", ["jax_ep.runtime"]),
    ("backends", ["jax_ep._ffi", "jax_ep.ffi_attrs", "jax_ep.routing", "jax_ep.validate",
                  "jax_ep.intranode.layout", "jax_ep.intranode.reference",
                  "jax_ep.intranode.native", "jax_ep.internode.native",
                  "jax_ep.low_latency.reference", "jax_ep.low_latency.native",
                  "jax_ep.ragged.reference", "jax_ep.ragged.native", "jax_ep.backend"]),
    ("api", ["jax_ep.api", "jax_ep.low_latency.api", "jax_ep.ragged.api", "jax_ep.launch", "jax_ep.gmm",
             "jax_ep"]),
]
LAYER_OF = {m: i for i, (_, mods) in enumerate(LAYERS) for m in mods}

# (module, imported name): function-local imports of optional dependencies
OPTIONAL_LOCAL = {("jax_ep.extension", "nvidia.nvshmem")}


def _modules() -> dict:
    """{module name: path} of jax_ep/**/*.py, gmm/ left out."""
    out = {}
    for d, dirs, files in os.walk(PKG):
        rel = os.path.relpath(d, ROOT)
        if rel.split(os.sep)[:2] == ["jax_ep", "gmm"] or "__pycache__" in rel:
            continue
        for f in files:
            if f.endswith(".py"):
                parts = rel.split(os.sep) + ([] if f == "__init__.py" else [f[:-3]])
                out[".".join(parts)] = os.path.join(d, f)
    return out


MODULES = _modules()


def _resolve(mod: str, is_pkg: bool, node) -> list:
    """jax_ep modules an import node names (``from . import x``: x when it is a module)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name.split(".")[0] == "jax_ep"]
    if node.level:
        base = mod.split(".")
        base = base if is_pkg else base[:-1]
        base = base[:len(base) - (node.level - 1)]
        target = ".".join(base + ([node.module] if node.module else []))
    else:
        target = node.module or ""
    if target.split(".")[0] != "jax_ep":
        return []
    out = []
    for a in node.names:
        sub = f"{target}.{a.name}"
        out.append(sub if sub in MODULES or sub == "jax_ep.gmm" else target)
    return out


def _imports(mod: str):
    """(module-level jax_ep imports, function-local imports [(name, line)])."""
    path = MODULES[mod]
    tree = ast.parse(open(path).read(), path)
    is_pkg = path.endswith("__init__.py")
    top, local = set(), []

    def visit(node, in_function):
        for child in ast.iter_child_nodes(node):
            fn = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                   ast.Lambda))
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                if fn:
                    names = ([a.name for a in child.names] if isinstance(child, ast.Import)
                             else [("." * child.level) + (child.module or "")])
                    local.extend((n, child.lineno) for n in names)
                else:
                    top.update(_resolve(mod, is_pkg, child))
            visit(child, fn)

    visit(tree, False)
    top.discard(mod)
    return top, local


GRAPH = {m: _imports(m)[0] for m in MODULES}


def test_every_module_has_a_layer():
    missing = sorted(set(MODULES) - set(LAYER_OF))
    assert not missing, f"place these modules in a layer of {__name__}.LAYERS: {missing}"


def test_no_function_local_imports():
    bad = []
    for m in sorted(MODULES):
        for name, line in _imports(m)[1]:
            if (m, name) not in OPTIONAL_LOCAL:
                bad.append(f"{MODULES[m]}:{line}: {name}")
    assert not bad, "imports inside functions (move them to the top):\n" + "\n".join(bad)


def test_imports_point_down():
    bad = [f"{m} ({LAYERS[LAYER_OF[m]][0]}) imports {d} ({LAYERS[LAYER_OF[d]][0]})"
           for m in sorted(GRAPH) for d in sorted(GRAPH[m])
           if d in LAYER_OF and m in LAYER_OF and LAYER_OF[d] > LAYER_OF[m]]
    assert not bad, "\n".join(bad)


def _topological() -> list:
    """Modules in dependency order; raises naming a cycle."""
    order, state = [], {}

    def visit(m, path):
        if state.get(m) == "done":
            return
        if state.get(m) == "open":
            raise AssertionError("import cycle: " + " -> ".join(path[path.index(m):] + [m]))
        state[m] = "open"
        for d in sorted(GRAPH.get(m, ())):
            if d in GRAPH:
                visit(d, path + [m])
        state[m] = "done"
        order.append(m)

    for m in sorted(GRAPH):
        visit(m, [])
    return order


def test_no_import_cycle():
    _topological()


_IMPORT_IN_ORDER = r"""
import importlib, json, sys, types
order, deps = json.loads(sys.argv[1])
# the package without its __init__: each module then loads only what it imports
pkg = types.ModuleType("jax_ep"); pkg.__path__ = [sys.argv[2]]
sys.modules["jax_ep"] = pkg
bad = []
for m in order:
    if m == "jax_ep":
        continue
    before = {k for k in sys.modules if k.startswith("jax_ep")}
    importlib.import_module(m)
    new = {k for k in sys.modules if k.startswith("jax_ep")} - before - {m}
    extra = sorted(n for n in new if n not in deps[m])
    if extra:
        bad.append(f"{m} loaded {extra}, which it does not import (directly or not)")
print(json.dumps(bad))
"""


def test_modules_import_alone_in_dependency_order():
    """In a fresh interpreter, with the package's __init__ left out, each module
    imports after its dependencies only and loads nothing else of jax_ep."""
    order = [m for m in _topological() if m != "jax_ep"]

    def closure(m, seen):
        for d in GRAPH.get(m, ()):
            if d not in seen:
                seen.add(d)
                closure(d, seen)
        return seen

    deps = {}
    for m in order:
        mods = closure(m, set()) | {m}
        deps[m] = sorted(mods | {p for d in mods for p in _parents(d)})
        if "jax_ep.extension" in mods:   # loads the compiled jax_ep._C by name, when built
            deps[m].append("jax_ep._C")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, "-c", _IMPORT_IN_ORDER, json.dumps([order, deps]), PKG],
                       capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    bad = json.loads(r.stdout.strip().splitlines()[-1])
    assert not bad, "\n".join(bad)


def _parents(m: str):
    parts = m.split(".")
    return {".".join(parts[:i]) for i in range(2, len(parts))}
