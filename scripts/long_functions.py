#!/usr/bin/env python3
"""List functions longer than a line limit (issue 37: none over 80 lines).

Python files are measured with `ast` (end_lineno - lineno + 1, decorators
excluded); the cc/ FFI handler files (cc/**/ffi_*.cc) with a brace-matching
scan, since they have no parser here.

Usage: python3 scripts/long_functions.py [--limit 80] [PATH ...]
Exits 1 when any function is over the limit, so it can gate CI.
"""
from __future__ import annotations

import argparse
import ast
import re
import sys
from pathlib import Path
from typing import Iterable, NamedTuple

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_LIMIT = 80
PY_GLOBS = ("jax_ep/**/*.py", "bench/*.py", "tests/**/*.py")
CC_GLOBS = ("cc/**/ffi_*.cc",)


class LongFunction(NamedTuple):
    path: str
    line: int
    name: str
    length: int


def _python_functions(source: str) -> Iterable[tuple[str, int, int]]:
    """Yields (qualified name, first line, length) for every def, nested too."""
    tree = ast.parse(source)

    def walk(node: ast.AST, prefix: str):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = prefix + child.name
                yield name, child.lineno, child.end_lineno - child.lineno + 1
                yield from walk(child, name + ".")
            elif isinstance(child, ast.ClassDef):
                yield from walk(child, prefix + child.name + ".")
            else:
                yield from walk(child, prefix)

    yield from walk(tree, "")


# A C++ function definition: a signature line ending in ")" (plus optional
# qualifiers) followed by "{", not a control-flow statement.
_CC_SIGNATURE = re.compile(r"([A-Za-z_][\w:~]*)\s*\([^;{}]*\)\s*(?:const\s*)?(?:noexcept\s*)?(?:->\s*[\w:<>,\s*&]+)?\s*\{", re.S)
_CC_KEYWORDS = {"if", "for", "while", "switch", "catch", "return", "sizeof", "defined"}


def _strip_cc(source: str) -> str:
    """Blanks comments and string/char literals, keeping newlines."""
    def blank(m: re.Match) -> str:
        return re.sub(r"[^\n]", " ", m.group(0))
    pattern = r'//[^\n]*|/\*.*?\*/|"(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])*\''
    return re.sub(pattern, blank, source, flags=re.S)


def _cc_functions(source: str) -> Iterable[tuple[str, int, int]]:
    """Yields (name, first line, length) for top-level-ish function bodies.

    Lambdas and blocks inside a function count toward it; a function is
    reported from its signature's line to its closing brace.
    """
    text = _strip_cc(source)
    pos = 0
    while True:
        m = _CC_SIGNATURE.search(text, pos)
        if not m:
            return
        name = m.group(1).split("::")[-1]
        open_brace = m.end() - 1
        depth, i = 0, open_brace
        while i < len(text):
            if text[i] == "{":
                depth += 1
            elif text[i] == "}":
                depth -= 1
                if depth == 0:
                    break
            i += 1
        if name in _CC_KEYWORDS:
            pos = m.end()
            continue
        first = text.count("\n", 0, m.start()) + 1
        last = text.count("\n", 0, i) + 1
        yield m.group(1), first, last - first + 1
        pos = i + 1


def _files(paths: list[str] | None) -> Iterable[Path]:
    if paths:
        for p in paths:
            path = Path(p)
            if path.is_dir():
                yield from sorted(path.rglob("*.py"))
                yield from sorted(path.rglob("ffi_*.cc"))
            else:
                yield path
        return
    for pattern in PY_GLOBS + CC_GLOBS:
        yield from sorted(ROOT.glob(pattern))


def find_long_functions(paths: list[str] | None = None,
                        limit: int = DEFAULT_LIMIT) -> list[LongFunction]:
    found = []
    for path in _files(paths):
        path = path.resolve()
        try:
            rel = path.relative_to(ROOT).as_posix()
        except ValueError:
            rel = str(path)
        source = path.read_text()
        scan = _python_functions if path.suffix == ".py" else _cc_functions
        for name, line, length in scan(source):
            if length > limit:
                found.append(LongFunction(rel, line, name, length))
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="*",
                        help="files or folders (default: jax_ep/, bench/, tests/, cc/ FFI handlers)")
    parser.add_argument("--limit", type=int, default=DEFAULT_LIMIT)
    args = parser.parse_args(argv)
    found = find_long_functions(args.paths or None, args.limit)
    for f in sorted(found, key=lambda f: -f.length):
        print(f"{f.length:5d}  {f.path}:{f.line}  {f.name}")
    print(f"{len(found)} function(s) over {args.limit} lines")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
