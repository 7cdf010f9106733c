"""The package's layers, checked on its import graph.

Modules are nodes; every ``import`` statement between them is an edge, function-local ones
included (a local import that only hides a cycle is still a cycle). Importing a submodule runs its
parent packages' ``__init__`` first; that is Python's mechanics, not a dependency, so an edge to a
package counts only where something other than a submodule is taken from it
(``from flash_attn import flash_attn_func``) or the package itself is imported (``import flash_attn``).

Layers, top to bottom; a module may import its own layer or lower ones, never a higher one, and
the graph has no cycle.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from support import REPO

PACKAGE_DIR = REPO / "flash_attn"

LAYERS = (
    # command-line tools and integrations: use everything, used by nothing in the package
    ("tools", ("flash_attn.__main__", "flash_attn.doctor", "flash_attn.bench", "flash_attn.integrations",
               "flash_attn.kernel_build")),
    # upstream's model-building packages: layers, blocks, whole models, losses, generation helpers
    # (upstream's ops.fused_dense holds its tensor-parallel layers: it sits with modules.tensor_parallel)
    ("modules", ("flash_attn.modules", "flash_attn.models", "flash_attn.losses", "flash_attn.utils",
                 "flash_attn.ops.fused_dense", "flash_attn.layers.patch_embed")),
    # the public API
    ("api", ("flash_attn", "flash_attn.flash_attn_interface", "flash_attn.lowlevel", "flash_attn.entry_points",
             "flash_attn.kvcache", "flash_attn.bert_padding", "flash_attn.layers")),
    # upstream's flash_attn.ops: fused norms, loss, rotary, activations (flash_attn.layers.rotary uses them)
    ("fused_ops", ("flash_attn.ops",)),
    ("ops", ("flash_attn.custom_ops",)),  # the custom ops (autograd, torch.compile)
    ("dispatch", ("flash_attn.dispatch", "flash_attn.validation")),  # which backend runs a call
    ("backends", ("flash_attn.backends",)),  # cpu, reference, triton, interpret, aot: run plans
    ("aot", ("flash_attn.aot",)),  # shipped images: architectures, manifest, op library
    ("planning", ("flash_attn.planning",)),  # call -> launches, configs (no Triton, no device)
    ("kernels", ("flash_attn.kernels",)),  # Triton source only
    ("core", ("flash_attn.params", "flash_attn.limits", "flash_attn.dropout", "flash_attn.placeholders",
              "flash_attn.rotation", "flash_attn.environ", "flash_attn._version")),
)


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE_DIR.rglob("*.py"):
        parts = path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def _imports(name: str, path: Path, modules: dict) -> set[str]:
    """The package modules ``name`` imports (see the module docstring for what counts)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    edges = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            edges.update(alias.name for alias in node.names if alias.name in modules)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            if base not in modules:
                continue
            submodules = {f"{base}.{alias.name}" for alias in node.names} & modules.keys()
            edges |= submodules
            if len(submodules) < len(node.names):  # a name defined by the module itself
                edges.add(base)
    edges.discard(name)
    return edges


def _layer(module: str) -> int:
    best = None
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if module == prefix or module.startswith(prefix + "."):
                if best is None or len(prefix) > best[0]:
                    best = (len(prefix), index)
    if best is None:
        raise AssertionError(f"{module} is in no layer: add it to LAYERS")
    return best[1]


def upward_edges(graph: dict[str, set[str]]) -> list[str]:
    return [f"{a} ({LAYERS[_layer(a)][0]}) imports {b} ({LAYERS[_layer(b)][0]})"
            for a, targets in sorted(graph.items()) for b in sorted(targets) if _layer(b) < _layer(a)]


def cycles(graph: dict[str, set[str]]) -> list[str]:
    """One line per back edge of a depth-first search (each closes a cycle)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    found = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        path = path + [node]
        for target in sorted(graph.get(node, ())):
            if state.get(target) == 1:
                found.append(" -> ".join(path[path.index(target):] + [target]))
            elif target not in state:
                visit(target, path)
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [])
    return found


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def test_every_module_has_a_layer(graph):
    for module in graph:
        _layer(module)


def test_imports_run_down_the_layers(graph):
    assert not upward_edges(graph), "\n".join(upward_edges(graph))


def test_no_import_cycle(graph):
    assert not cycles(graph), "\n".join(cycles(graph))


def test_the_checks_see_violations(tmp_path):
    """What the checks report on a made-up package with a local import going up and a cycle."""
    (tmp_path / "flash_attn" / "kernels").mkdir(parents=True)
    sources = {
        "flash_attn/__init__.py": "from flash_attn.flash_attn_interface import flash_attn_func\n",
        "flash_attn/flash_attn_interface.py": "from flash_attn import custom_ops\n",
        "flash_attn/custom_ops.py": "from flash_attn import limits\n",
        "flash_attn/limits.py": "def f():\n    from flash_attn.kernels import forward\n",
        "flash_attn/kernels/__init__.py": "",
        "flash_attn/kernels/forward.py": "def g():\n    import flash_attn.custom_ops\n",
    }
    for name, text in sources.items():
        (tmp_path / name).write_text(text)
    modules = {name[:-3].replace("/", ".").removesuffix(".__init__"): tmp_path / name for name in sources}
    made_up = {name: _imports(name, path, modules) for name, path in modules.items()}
    assert made_up["flash_attn"] == {"flash_attn.flash_attn_interface"}
    assert made_up["flash_attn.flash_attn_interface"] == {"flash_attn.custom_ops"}  # a submodule: no edge to the package
    assert upward_edges(made_up) == ["flash_attn.kernels.forward (kernels) imports flash_attn.custom_ops (ops)",
                                     "flash_attn.limits (core) imports flash_attn.kernels.forward (kernels)"]
    assert cycles(made_up) == ["flash_attn.custom_ops -> flash_attn.limits -> flash_attn.kernels.forward -> flash_attn.custom_ops"]
