"""``python -m flash_attn <command>``: the package's command line.

Each command lives in its own module, listed in :data:`COMMANDS` as ``name: (module, help)``.
The module provides

* ``add_arguments(parser: argparse.ArgumentParser) -> None``: its options;
* ``run(args: argparse.Namespace) -> int``: does the work and returns the exit status.

Adding a command is one line in :data:`COMMANDS` plus its module. A command whose module cannot
be imported stays listed and, when run, says why (exit status 2), so one broken command never
takes the others down.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Optional, Sequence

COMMANDS: dict[str, tuple[str, str]] = {
    "doctor": ("flash_attn.doctor", "check this installation and explain what to fix"),
    "bench": ("flash_attn.bench", "benchmark attention: CPU, GPU or the kernel build"),
    "build-kernels": ("flash_attn.kernel_build.build", "compile the ahead-of-time GPU kernels (no GPU needed)"),
    "amd-kernels": ("flash_attn.kernel_build.amd", "compile every kernel for the AMD GPU families and report on them "
                                                   "(compile only, no GPU needed)"),
    "info": ("flash_attn.kernel_build.info", "what this installation ships: AOT kernels, archs, bytes, op library"),
}


def _version() -> str:
    try:
        from flash_attn._version import __version__  # noqa: PLC0415
    except Exception:  # noqa: BLE001  (a broken install still gets --help)
        return "unknown"
    return __version__


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m flash_attn",
        description="flash_attn command line (each command: python -m flash_attn COMMAND --help)",
    )
    parser.add_argument("--version", action="version", version=f"flash_attn {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module_name, help_text) in COMMANDS.items():
        command = sub.add_parser(name, help=help_text, description=help_text)
        try:
            module = importlib.import_module(module_name)
            module.add_arguments(command)
        except Exception as exc:  # noqa: BLE001
            command.set_defaults(_broken=f"{module_name} cannot be loaded: {type(exc).__name__}: {exc}")
            continue
        command.set_defaults(_run=module.run)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    broken = getattr(args, "_broken", None)
    if broken:
        print(f"python -m flash_attn {args.command}: {broken}", file=sys.stderr)
        return 2
    return int(args._run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
