"""``npu-fusion`` command line: ``npu-fusion report`` (also ``python -m npu_fusion report``)."""
from __future__ import annotations

import argparse
import sys
from typing import List, Optional


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="npu-fusion", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    report = sub.add_parser("report", help="compile a model, train one step, report what was fused")
    from .plugin.report import add_arguments, run
    from .report import fullsize, html

    add_arguments(report)
    fullsize.add_arguments(report)
    args = parser.parse_args(argv)
    if args.command != "report":
        return 2
    sinks = [html.writer(args.html)] if args.html else []
    if args.hf_config:
        return fullsize.run(args, sinks)
    if args.overrides:
        parser.error(f"key=value overrides {args.overrides} are for --hf-config")
    return run(args, sinks)


if __name__ == "__main__":
    sys.exit(main())
