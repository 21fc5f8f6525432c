"""The ``python -m ringzero.X`` commands that the README and docs/*.md show, read from their code blocks.

What it is
    ``commands()`` reads every fenced code block of README.md and docs/*.md,
    joins ``\\`` continuations, and returns one ``Command`` per line that runs
    ``python -m ringzero.X`` (or ``python -m mpi4py -m ringzero.X`` under
    mpirun): the module, its arguments as written, the rank count if it runs
    under mpirun, and where it was found. A command documented tomorrow is
    picked up without a change here.
What it is not
    The runner: tests/smoke/test_documented_commands.py makes each command
    tiny (small model, few sizes, files from fixtures) and runs it.
"""
from __future__ import annotations

import glob
import os
import re
import shlex
from typing import NamedTuple

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOCS = ["README.md"] + sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))
RUN = re.compile(r"python -m (mpi4py -m )?(ringzero(?:\.\w+)+)(.*)$")


class Command(NamedTuple):
    module: str             # "ringzero.bench"
    args: tuple             # as written, shell words ("[--verify]" groups removed)
    ranks: int | None    # the mpirun -n, None when it runs as one process
    where: str              # "README.md:212"
    text: str               # the line as written (continuations joined)


def code_lines(doc):
    """(line number, text) of every line inside the fenced code blocks of one file, continuations joined."""
    with open(os.path.join(ROOT, doc), encoding="utf-8") as f:
        lines = f.read().split("\n")
    out, inside, buf, start = [], False, "", 0
    for i, line in enumerate(lines, 1):
        if line.lstrip().startswith("```"):
            inside = not inside
            continue
        if not inside:
            continue
        if not buf:
            start = i
        if line.rstrip().endswith("\\"):
            buf += line.rstrip()[:-1] + " "
            continue
        out.append((start, buf + line))
        buf = ""
    return out


def parse(text, where):
    """A Command for one shell line, or None if it runs no ringzero module."""
    m = RUN.search(text)
    if not m:
        return None
    before, rest = text[:m.start()], m.group(3)
    if re.search(r"(^|\s)#", before):                      # inside a comment: prose, not a command
        return None
    rest = re.split(r"\s#|\s\|\s|;|&&|\s>", rest)[0]        # a comment, a pipe, the next command
    rest = re.sub(r"\[[^\]]*\]", " ", rest)                 # optional parts: [--verify], [--grad-accum 4]
    try:
        args = tuple(shlex.split(rest))
    except ValueError:
        args = tuple(rest.split())
    ranks = None
    if "mpirun" in before or m.group(1):
        n = re.search(r"-n\s+(\S+)", before)
        ranks = int(n.group(1)) if n and n.group(1).isdigit() else 2
    return Command(m.group(2), args, ranks, where, text.strip())


def commands():
    out = []
    for doc in DOCS:
        for line_no, text in code_lines(doc):
            c = parse(text, f"{doc}:{line_no}")
            if c:
                out.append(c)
    return out


if __name__ == "__main__":
    for c in commands():
        print(f"{c.where:28s} n={c.ranks} {c.module} {' '.join(c.args)}")
