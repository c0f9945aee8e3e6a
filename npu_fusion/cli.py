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

    add_arguments(report)
    args = parser.parse_args(argv)
    if args.command == "report":
        return run(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
