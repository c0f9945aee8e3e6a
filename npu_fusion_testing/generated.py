"""Write a benchmark's output into its block of a docs/ page, with the command, date, versions and cores.

A page holds each generated block between ``<!-- generated:NAME -->`` and ``<!-- /generated -->``;
:func:`write_block` replaces what is between them and nothing else, so the prose around a table
stays as written while the table is always the last run's. The benchmarks take ``--write-docs
NAME`` and run their printing under :func:`publishing`, which copies what they print to the
terminal into the block.
"""
from __future__ import annotations

import contextlib
import datetime
import io
import os
import pathlib
import re
import shlex
import sys
from typing import Iterator, Optional, Sequence

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
END = "<!-- /generated -->"


def start_marker(name: str) -> str:
    return f"<!-- generated:{name} -->"


def find_page(name: str, docs: pathlib.Path = DOCS) -> pathlib.Path:
    """The one docs/ page holding block ``name``; an error naming the marker when none or several do."""
    pages = [p for p in sorted(docs.glob("*.md")) if start_marker(name) in p.read_text()]
    if len(pages) != 1:
        raise LookupError(f"{start_marker(name)} must be in exactly one page of {docs}, found {len(pages)}")
    return pages[0]


def provenance(command: Sequence[str], when: Optional[datetime.datetime] = None) -> str:
    """One line saying how the block was made: command, UTC date, torch (and transformers), cores."""
    import torch

    when = when or datetime.datetime.now(datetime.timezone.utc)
    versions = [f"torch {torch.__version__}"]
    transformers = sys.modules.get("transformers")
    if transformers is not None:
        versions.append(f"transformers {transformers.__version__}")
    shown = " ".join(shlex.quote(part) for part in command)
    return (f"Last run: `{shown}` on {when:%Y-%m-%d} (UTC), {', '.join(versions)}, "
            f"{os.cpu_count()} CPU cores.")


def render(text: str, command: Sequence[str], fenced: bool) -> str:
    body = text.strip("\n")
    if fenced:
        body = f"```\n{body}\n```"
    return f"{provenance(command)}\n\n{body}\n"


def write_block(name: str, content: str, docs: pathlib.Path = DOCS) -> pathlib.Path:
    """Replace the text of block ``name`` with ``content``; the page it is in."""
    page = find_page(name, docs)
    text = page.read_text()
    pattern = re.compile(re.escape(start_marker(name)) + r"\n.*?" + re.escape(END), re.S)
    if not pattern.search(text):
        raise LookupError(f"{start_marker(name)} in {page} has no {END} after it")
    page.write_text(pattern.sub(lambda _: f"{start_marker(name)}\n{content}{END}", text, count=1))
    return page


class _Tee(io.TextIOBase):
    """A stream that writes to ``out`` and keeps a copy."""

    def __init__(self, out):
        self.out, self.copy = out, io.StringIO()

    def write(self, text):
        self.copy.write(text)
        return self.out.write(text)

    def flush(self):
        self.out.flush()


@contextlib.contextmanager
def publishing(name: Optional[str], command: Sequence[str], fenced: bool = True) -> Iterator[None]:
    """Print as usual and, when ``name`` is given, write what was printed into block ``name``.

    ``command`` is the command line to show (the script's module from the repository root and its
    arguments); ``fenced`` puts the text in a code block (plain text tables), else it is markdown.
    Nothing is written when the body raises."""
    if name is None:
        yield
        return
    find_page(name)  # fail before a long run, not after it
    tee = _Tee(sys.stdout)
    with contextlib.redirect_stdout(tee):
        yield
    page = write_block(name, render(tee.copy.getvalue(), command, fenced))
    print(f"wrote block {name!r} of {page.relative_to(ROOT)}", file=sys.stderr)


def pop_write_docs(argv: Sequence[str]):
    """``(NAME or None, the other arguments)`` for a script that reads its arguments by hand."""
    args, name = list(argv), None
    for i, arg in enumerate(args):
        if arg == "--write-docs" and i + 1 < len(args):
            return args[i + 1], args[:i] + args[i + 2:]
        if arg.startswith("--write-docs="):
            return arg.split("=", 1)[1], args[:i] + args[i + 1:]
    return name, args


def script_command(script: str, argv: Optional[Sequence[str]]) -> list:
    """``python -m <the script's module> <argv>`` without ``--write-docs NAME``."""
    args = list(sys.argv[1:] if argv is None else argv)
    kept, skip = [], False
    for arg in args:
        if skip:
            skip = False
        elif arg == "--write-docs":
            skip = True
        elif not arg.startswith("--write-docs="):
            kept.append(arg)
    relative = pathlib.Path(os.path.relpath(os.path.abspath(script), ROOT)).with_suffix("")
    return ["python", "-m", ".".join(relative.parts), *kept]
