"""Each kernel's parameters, read from its ``@triton.jit`` source without importing Triton.

The kernel's ``def`` is the one statement of its argument list: the planner names every launch
argument by it, the ahead-of-time build types it, and nothing restates it. The source files ship
with the package (they are what Triton compiles), so the list is read from them on first use,
once per kernel, whether or not Triton is installed.
``tests/aot/test_aot_without_triton.py`` keeps the answer equal to ``JITFunction.arg_names``.

Pure Python (no torch, no triton).
"""

from __future__ import annotations

import ast
import functools
import io
import re
import tokenize
from pathlib import Path
from typing import NamedTuple

__all__ = ["Parameters", "parameters"]

_ROOT = Path(__file__).resolve().parents[2]  # the folder holding the flash_attn package


class Parameters(NamedTuple):
    names: tuple  # every parameter in order (JITFunction.arg_names)
    constexprs: frozenset  # those annotated tl.constexpr


@functools.lru_cache(maxsize=None)
def parameters(module: str, kernel: str) -> Parameters:
    """The parameters of function ``kernel`` defined at the top level of module ``module``
    (``"flash_attn.kernels.forward"``)."""
    node = ast.parse(_header(module, kernel) + ": pass").body[0]
    args = node.args
    every = (*args.posonlyargs, *args.args, *args.kwonlyargs)
    return Parameters(tuple(a.arg for a in every), frozenset(a.arg for a in every if _constexpr(a.annotation)))


def _header(module: str, kernel: str) -> str:
    """``def kernel(...)`` as written in the module's source: only the header is parsed (a whole
    kernel module takes ~100 ms to parse in a process that has imported torch)."""
    source = _source(module)
    start = re.search(rf"^def {kernel}\(", source, re.M)
    if start is None:
        raise LookupError(f"{module} defines no function {kernel!r}")
    lines = io.StringIO(source[start.start():]).readline
    depth = 0
    for token in tokenize.generate_tokens(lines):
        if token.type == tokenize.OP and token.string in "([{":
            depth += 1
        elif token.type == tokenize.OP and token.string in ")]}":
            depth -= 1
            if depth == 0:
                row, col = token.end
                header = source[start.start():].splitlines(keepends=True)[:row]
                return "".join(header[:-1]) + header[-1][:col]
    raise LookupError(f"{module}: the parameter list of {kernel} does not end")


@functools.lru_cache(maxsize=None)
def _source(module: str) -> str:
    path = _ROOT.joinpath(*module.split(".")).with_suffix(".py")
    try:
        return path.read_text(encoding="utf-8")
    except OSError as exc:
        raise LookupError(f"cannot read the kernel source {path} ({exc}): the package ships it; reinstall "
                          f"flash_attn") from None


def _constexpr(annotation) -> bool:
    """``tl.constexpr`` (or ``constexpr`` imported by name)."""
    if isinstance(annotation, ast.Attribute):
        return annotation.attr == "constexpr"
    return isinstance(annotation, ast.Name) and annotation.id == "constexpr"
