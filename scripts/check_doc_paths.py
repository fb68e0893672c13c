#!/usr/bin/env python3
"""Checks that every repository path a document names exists (docs/ARCHITECTURE.md by default).

A path is a token that starts with one of the repository's top-level directories (dkfac/, tools/, tests/, python/,
bench/, scripts/, cmake/, docs/, examples/, fuzz/, .ci/); `file.cpp:123` and `file.{h,cpp}` are read as the files
they name, and the directory trees drawn in fenced blocks are read entry by entry. Prints each missing path with its line and exits 1 if any is missing.
Usage: scripts/check_doc_paths.py [DOCUMENT ...]
"""

from __future__ import annotations

import itertools
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
TOP = ('dkfac', 'tools', 'tests', 'python', 'bench', 'scripts', 'cmake', 'docs', 'examples', 'fuzz', '.ci')
PATH = re.compile(r'(?<![\w./-])((?:' + '|'.join(re.escape(t) for t in TOP) + r')/[\w./{},*-]*[\w}*])')


def expand(token: str) -> list[str]:
    """`a/b.{h,cpp}` -> a/b.h, a/b.cpp; a trailing `:123` or `/` dropped."""
    token = re.sub(r':\d+(-\d+)?$', '', token).rstrip('/.')
    parts = re.split(r'\{([^}]*)\}', token)
    choices = [[p] if i % 2 == 0 else p.split(',') for i, p in enumerate(parts)]
    return [''.join(c) for c in itertools.product(*choices)]


def exists(path: str) -> bool:
    return any(ROOT.glob(path)) if '*' in path else (ROOT / path).exists()


def tree_entries(line: str, directory: str) -> list[str]:
    """The paths an entry line of a directory tree names: "  linear.h, conv2d.h   text" under dkfac/nn/."""
    if not directory or not line.startswith('  ') or line.startswith('   '):
        return []
    words = line.split()
    count = 1
    while count < len(words) and words[count - 1].endswith(','):  # "linear.h, conv2d.h"
        count += 1
    return [directory + word.rstrip(',') for word in words[:count]]


def missing_paths(document: pathlib.Path) -> list[tuple[int, str]]:
    """Paths named in prose and in fenced blocks, and the entries of the directory trees drawn in fenced blocks
    (a path at the line's start opens a directory; lines indented by two spaces name its entries). A line that
    says "generated" names files the build writes."""
    missing = []
    fenced, directory = False, ''
    for number, line in enumerate(document.read_text().splitlines(), 1):
        if line.startswith('```'):
            fenced, directory = not fenced, ''
            continue
        if not fenced:
            named = [path for token in PATH.findall(line) for path in expand(token)]
        elif line.startswith(' '):  # an entry of the tree, or its description's next line
            named = [path for entry in tree_entries(line, directory) for path in expand(entry)]
        else:
            start = PATH.match(line)
            opens = start is not None and line[start.end():start.end() + 1] == '/'  # "dkfac/math/   text"
            directory = start.group(1) + '/' if opens else ''
            named = expand(start.group(1)) if start else []
        if 'generated' in line:
            continue
        missing += [(number, path) for path in named if not exists(path)]
    return missing


def main(argv: list[str]) -> int:
    documents = [pathlib.Path(a) for a in argv] or [ROOT / 'docs' / 'ARCHITECTURE.md']
    bad = 0
    for document in documents:
        for number, path in missing_paths(document):
            print(f'{document}:{number}: {path} does not exist')
            bad += 1
    return 1 if bad else 0


if __name__ == '__main__':
    sys.exit(main(sys.argv[1:]))
