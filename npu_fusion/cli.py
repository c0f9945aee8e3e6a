"""``npu-fusion`` command line: ``npu-fusion report`` (also ``python -m npu_fusion report``)."""
from __future__ import annotations

import argparse
import sys
from typing import List, Optional, Sequence


def main(argv: Optional[List[str]] = None, sources: Sequence = ()) -> int:
    """Run the ``npu-fusion`` command line; the exit status of its command.

    ``sources``: :class:`~npu_fusion.report.subjects.SubjectSource` s adding models to the
    report (the repository's harness adds ``--framework``: ``python -m npu_fusion_testing report``)."""
    parser = argparse.ArgumentParser(prog="npu-fusion", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    report = sub.add_parser("report", help="compile a model, train one step, report what was fused")
    from .report import command, fullsize, html

    command.add_arguments(report, sources)
    fullsize.add_arguments(report)
    args = parser.parse_args(argv)
    if args.command != "report":
        return 2
    sinks = [html.writer(args.html)] if args.html else []
    if args.hf_config:
        return fullsize.run(args, sinks)
    if args.overrides:
        parser.error(f"key=value overrides {args.overrides} are for --hf-config")
    return command.run(args, sinks, sources)


if __name__ == "__main__":
    sys.exit(main())
