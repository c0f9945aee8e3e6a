"""``npu-fusion report --framework LIBRARY:MODEL``: the report on a tiny random model of a training
framework's own code (:mod:`.frameworks`), with where each independently counted site ended.

The framework models and the CPU workarounds their libraries need are the harness's, outside the
wheel, so the installed ``npu-fusion`` command does not know them: this module adds them to the
report as a :class:`~npu_fusion.report.subjects.SubjectSource`. From the repository root::

    python -m npu_fusion_testing report --framework torchtune:gemma2 [any other report option]
"""
from __future__ import annotations

import argparse
from typing import List, Optional

from npu_fusion import cli
from npu_fusion.report.subjects import DTYPES, Subject, SubjectSource, UsageError

from . import frameworks


class FrameworkSubjects(SubjectSource):
    """``--framework``: the tiny random models of :data:`.frameworks.FRAMEWORKS`."""

    def add_arguments(self, models) -> None:
        names = tuple(frameworks.FRAMEWORKS)
        models.add_argument("--framework", metavar="LIBRARY:MODEL", choices=names,
                            help="a tiny random model of a training framework's own code: "
                                 + ", ".join(names) + "; needs that library")

    def chosen(self, args: argparse.Namespace) -> bool:
        return bool(getattr(args, "framework", None))

    def workarounds(self, args: argparse.Namespace):
        return frameworks.FRAMEWORKS[args.framework].workarounds()

    def subject(self, args: argparse.Namespace) -> Subject:
        framework = frameworks.FRAMEWORKS[args.framework]
        if args.checkpointing != "none":
            raise UsageError("--checkpointing is for the bundled and transformers models")
        try:
            model = frameworks.build(framework, DTYPES[args.dtype], args.layers, args.seed)
        except ImportError as exc:
            raise UsageError(f"--framework {args.framework} needs {framework.library}: {exc}") from None
        return Subject(name=f"{args.framework} (tiny random model of the library's own code)", model=model,
                       loss=lambda m, ids: frameworks.loss(framework, m, ids), vocab_size=frameworks.VOCAB,
                       counter=framework.sites, counts_outside=True,
                       reference=lambda: frameworks.widened(framework, model, args.layers))


def main(argv: Optional[List[str]] = None) -> int:
    """``npu-fusion``'s command line with ``--framework`` among the report's models."""
    return cli.main(argv, sources=(FrameworkSubjects(),))
