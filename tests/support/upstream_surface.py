"""Upstream flash-attn's module surface, read from its source with ``ast`` (never imported).

``tests/data/upstream-surface-0251105a.json`` is this module's output for upstream's main at commit
0251105a (``__version__`` 2.8.4), committed so that the surface test (tests/ports/test_upstream_surface.py)
needs no copy of upstream. To regenerate it from a git mirror of Dao-AILab/flash-attention::

    python tests/support/upstream_surface.py /path/to/flash-attention.git 0251105a > tests/data/upstream-surface-0251105a.json

The record holds, per module of ``flash_attn/`` (``flash_attn.cute``, FlashAttention-4, is a separate
distribution that co-installs through ``__path__``, and is left out), the names it defines at module
level: functions, classes and assignments, including those under a top-level ``if``/``try``/``with``
(imports are not definitions). It also holds the signatures of FlashAttention-3's public functions
(``hopper/flash_attn_interface.py``), the spec of ``fa3_interface/flash_attn_interface.py``.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys

FA3_FUNCTIONS = ("flash_attn_func", "flash_attn_qkvpacked_func", "flash_attn_varlen_func", "flash_attn_with_kvcache",
                 "flash_attn_combine", "get_scheduler_metadata")


def defined_names(source: str) -> list[str]:
    """Module-level functions, classes and assigned names, also inside top-level compound statements."""
    names: set[str] = set()

    def visit(statements):
        for node in statements:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
            elif isinstance(node, (ast.If, ast.Try, ast.With)) or type(node).__name__ == "TryStar":
                for field in ("body", "orelse", "finalbody"):
                    visit(getattr(node, field, []))
                for handler in getattr(node, "handlers", []):
                    visit(handler.body)

    visit(ast.parse(source).body)
    return sorted(names)


def signatures(source: str, functions) -> dict:
    """``{function: [[name, kind, default source or None], ...]}`` for the named module-level functions."""
    found = {}
    for node in ast.parse(source).body:
        if isinstance(node, ast.FunctionDef) and node.name in functions:
            a = node.args
            positional = a.posonlyargs + a.args
            defaults = [None] * (len(positional) - len(a.defaults)) + [ast.unparse(d) for d in a.defaults]
            params = [[p.arg, "positional", d] for p, d in zip(positional, defaults)]
            params += [[p.arg, "keyword_only", None if d is None else ast.unparse(d)]
                       for p, d in zip(a.kwonlyargs, a.kw_defaults)]
            found[node.name] = params
    return found


def _git(repo: str, *args: str) -> str:
    return subprocess.run(["git", "-C", repo, *args], check=True, capture_output=True, text=True).stdout


def record(repo: str, commit: str) -> dict:
    full = _git(repo, "rev-parse", commit).strip()
    files = [f for f in _git(repo, "ls-tree", "-r", "--name-only", full, "flash_attn").split()
             if f.endswith(".py") and not f.startswith("flash_attn/cute/")]
    modules = {}
    for path in files:
        module = path[:-3].replace("/", ".").removesuffix(".__init__")
        modules[module] = defined_names(_git(repo, "show", f"{full}:{path}"))
    version = ast.literal_eval(next(
        n.value for n in ast.parse(_git(repo, "show", f"{full}:flash_attn/__init__.py")).body
        if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == "__version__"))
    fa3 = signatures(_git(repo, "show", f"{full}:hopper/flash_attn_interface.py"), FA3_FUNCTIONS)
    return {"repository": "Dao-AILab/flash-attention", "commit": full, "version": version,
            "modules": modules, "fa3_signatures": fa3}


if __name__ == "__main__":
    json.dump(record(sys.argv[1], sys.argv[2]), sys.stdout, indent=1, sort_keys=True)
    sys.stdout.write("\n")
