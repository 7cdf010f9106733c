"""The doctor's command line: ``python -m flash_attn doctor`` and the ``flash-attn-doctor`` script.
The one module of the doctor that prints."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Optional, Sequence

from flash_attn.doctor.checks import run_checks
from flash_attn.doctor.render import render_text


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON object (facts and findings)")
    parser.add_argument("--strict", action="store_true", help="exit 1 on warnings too")


def run(args: argparse.Namespace) -> int:
    """Print the report (text or JSON); return the exit status."""
    report = run_checks()
    if args.json:
        print(json.dumps(report.to_json(args.strict), indent=2, default=str))
    else:
        print(render_text(report, args.strict))
    return report.exit_status(args.strict)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """The ``flash-attn-doctor`` console script."""
    parser = argparse.ArgumentParser(prog="flash-attn-doctor", description="check the flash_attn installation")
    add_arguments(parser)
    status = run(parser.parse_args(argv))
    if argv is None:
        sys.exit(status)
    return status
