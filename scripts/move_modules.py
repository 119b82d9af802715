#!/usr/bin/env python3
"""Move modules of ``credit_parallel`` and rewrite every import of them over the syntax tree.

    python scripts/move_modules.py [--no-move] [--dry-run] [PATH ...]

``MOVES`` maps an old dotted module name (below ``credit_parallel``) to its new one.  Without
``--no-move`` the files are moved with ``git mv`` (new packages get an ``__init__.py`` only if
missing: write their docstrings yourself).  Then every ``.py`` file under src/, tests/,
benchmarks/ and scripts/ (or the PATHs given) is parsed with ``ast``; each ``import`` /
``from ... import`` node and each string constant naming an old module (``mock.patch`` targets,
``python -m`` module names, lazy-export tables' absolute names) is rewritten in place:

- a relative import stays relative, computed from the file's NEW location (a moved file's own
  relative imports were written for its old location and are resolved from there);
- an absolute import stays absolute;
- only exact module names are mapped (``credit_parallel.layout`` the module, not
  ``credit_parallel.layout.ranks``), so running the script twice changes nothing the second time
  and it can be run over a branch written before the move (``--no-move``).

Markdown files (README.md, docs/) get the same mapping for backticked dotted names.
"""

from __future__ import annotations

import argparse
import ast
import re
import subprocess
import sys
from pathlib import Path

PKG = "credit_parallel"
ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "src" / PKG

#: old module (below credit_parallel) -> new module: the package's own table, which also keeps
#: the old paths importable for one release
sys.path.insert(0, str(ROOT / "src"))
from credit_parallel import MOVED_MODULES as MOVES  # noqa: E402

#: a file that says this keeps its old paths on purpose (the test of the old paths)
KEEP_MARK = "move_modules: keep old paths"
ABS_MOVES = {f"{PKG}.{old}": f"{PKG}.{new}" for old, new in MOVES.items()}


def module_name(path: Path, src: Path = SRC) -> str:
    parts = list(path.relative_to(src).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join([PKG, *parts])


def package_of(module: str, is_package: bool) -> list[str]:
    parts = module.split(".")
    return parts if is_package else parts[:-1]


def resolve(node: ast.ImportFrom, package: list[str]) -> str:
    """The absolute module a ``from`` import names."""
    if node.level == 0:
        return node.module or ""
    base = package[: len(package) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def relative(target: str, package: list[str]) -> str:
    """``target`` written relative to ``package`` (dots then the remaining path)."""
    parts = target.split(".")
    common = 0
    while common < min(len(parts), len(package)) and parts[common] == package[common]:
        common += 1
    level = len(package) - common + 1
    return "." * level + ".".join(parts[common:])


def mapped(name: str) -> str | None:
    """New absolute name of an old module (or of a name inside one), else None."""
    if name in ABS_MOVES:
        return ABS_MOVES[name]
    return None


def _offsets(source: str) -> list[int]:
    offsets, total = [0], 0
    for line in source.splitlines(keepends=True):
        total += len(line)
        offsets.append(total)
    return offsets


def rewrite(source: str, old_module: str, new_module: str, is_package: bool) -> str:
    """``source`` of a file that was ``old_module`` and is now ``new_module``, imports mapped."""
    tree = ast.parse(source)
    offsets = _offsets(source)
    old_pkg = package_of(old_module, is_package)
    new_pkg = package_of(new_module, is_package)
    edits: list[tuple[int, int, str]] = []

    def span(node) -> tuple[int, int]:
        start = offsets[node.lineno - 1] + node.col_offset
        end = offsets[node.end_lineno - 1] + node.end_col_offset
        return start, end

    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            target = resolve(node, old_pkg)
            start, end = span(node)
            moved_names = [a for a in node.names if f"{target}.{a.name}" in ABS_MOVES]
            if moved_names:  # `from credit_parallel import config`: one statement per module
                edits.append((start, end, _split_module_imports(node, target, new_pkg)))
                continue
            new_target = mapped(target)
            if new_target is not None and all(
                _exists([*target.split("."), a.name]) for a in node.names
            ):
                continue  # `from credit_parallel.layout import mesh`: the new package's modules
            if new_target is None:
                # an unmoved target seen from a moved file: its relative path changes
                if node.level == 0 or not target.startswith(PKG):
                    continue
                new_target = target
            written = new_target if node.level == 0 else relative(new_target, new_pkg)
            old_written = "." * node.level + (node.module or "")
            if written == old_written:
                continue
            segment = source[start:end]
            new_segment = re.sub(
                r"^from\s+" + re.escape(old_written) + r"(\s+import)",
                lambda m, w=written: "from " + w + m.group(1),
                segment,
                count=1,
            )
            edits.append((start, end, new_segment))
        elif isinstance(node, ast.Import):
            start, end = span(node)
            segment = source[start:end]
            changed = segment
            for alias in node.names:
                new = mapped(alias.name)
                if new is not None:
                    changed = re.sub(
                        r"\b" + re.escape(alias.name) + r"\b(?!\.)", new, changed, count=1
                    )
            if changed != segment:
                edits.append((start, end, changed))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            start, end = span(node)
            segment = source[start:end]
            new_segment = _map_string(segment)
            if new_segment != segment:
                edits.append((start, end, new_segment))
    for start, end, text in sorted(set(edits), reverse=True):
        source = source[:start] + text + source[end:]
    return source


def _split_module_imports(node: ast.ImportFrom, target: str, new_pkg: list[str]) -> str:
    """``from pkg import a, moved_module as m`` as one statement per moved module (its new parent
    package may differ) plus one for the rest, at the node's indentation."""
    rest = [a for a in node.names if f"{target}.{a.name}" not in ABS_MOVES]
    lines = []

    def written(module: str) -> str:
        return module if node.level == 0 else relative(module, new_pkg)

    def alias(a: ast.alias, leaf: str) -> str:
        local = a.asname or a.name
        return leaf if local == leaf else f"{leaf} as {local}"

    if rest:
        lines.append(f"from {written(target)} import " + ", ".join(alias(a, a.name) for a in rest))
    for a in node.names:
        new = ABS_MOVES.get(f"{target}.{a.name}")
        if new is not None:
            parent, _, leaf = new.rpartition(".")
            lines.append(f"from {written(parent)} import {alias(a, leaf)}")
    return ("\n" + " " * node.col_offset).join(lines)


_DOTTED = re.compile(r"\b" + PKG + r"(?:\.[A-Za-z_][A-Za-z0-9_]*)+")


def _exists(parts: list[str]) -> bool:
    """Whether ``credit_parallel.<parts[1:]>`` is a module or package of the tree as it is now
    (``credit_parallel.layout.mesh`` is new-style although ``credit_parallel.layout`` moved)."""
    path = SRC.joinpath(*parts[1:])
    return len(parts) > 1 and (path.with_suffix(".py").exists() or path.is_dir())


def _map_string(value: str) -> str:
    """Old module names inside a string (``"credit_parallel.fsdp.fully_shard"``), mapped: the
    longest dotted prefix that is an old module wins."""

    def sub(match: re.Match) -> str:
        dotted = match.group(0)
        parts = dotted.split(".")
        for n in range(len(parts), 1, -1):
            head = ".".join(parts[:n])
            if head in ABS_MOVES and not _exists(parts[: n + 1]):
                return ".".join([ABS_MOVES[head], *parts[n:]])
        return dotted

    return _DOTTED.sub(sub, value)


def git_mv(dry_run: bool) -> dict[Path, str]:
    """Move the files; returns {new path: old module name} of the moved files."""
    moved: dict[Path, str] = {}
    for old, new in MOVES.items():
        src = SRC / (old.replace(".", "/") + ".py")
        dst = SRC / (new.replace(".", "/") + ".py")
        if not src.exists():
            continue
        if dst.parent != SRC and not dst.parent.exists() and not dry_run:
            dst.parent.mkdir(parents=True)
        # a module that becomes a package of the same name moves aside first
        moved[dst] = f"{PKG}.{old}"
        if dry_run:
            print(f"git mv {src} {dst}")
            continue
        init = dst.parent / "__init__.py"
        if dst == init:
            raise SystemExit(f"refusing to move {src} onto a package face")
        subprocess.run(["git", "mv", str(src), str(dst)], check=True, cwd=ROOT)
        if not init.exists():
            init.write_text(f'"""{PKG}.{new.rpartition(".")[0]}"""\n')
            subprocess.run(["git", "add", str(init)], check=True, cwd=ROOT)
    return moved


def rewrite_markdown(path: Path, dry_run: bool) -> bool:
    text = path.read_text()
    new = _map_string(text)
    # relative mentions in prose: `credit_parallel.mesh` in backticks are covered above
    if new != text and not dry_run:
        path.write_text(new)
    return new != text


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("paths", nargs="*", type=Path)
    ap.add_argument("--no-move", action="store_true", help="only rewrite imports")
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument(
        "--also",
        action="append",
        default=[],
        metavar="OLD=NEW",
        help="a further move for this run only (a module a branch added beside the moved ones)",
    )
    args = ap.parse_args(argv)
    for item in args.also:
        old, _, new = item.partition("=")
        MOVES[old] = new
        ABS_MOVES[f"{PKG}.{old}"] = f"{PKG}.{new}"
    # `layout.py` becomes the package `layout/`: move it aside first
    layout_py = SRC / "layout.py"
    move_layout = not args.no_move and layout_py.exists()
    if move_layout and not args.dry_run:
        subprocess.run(["git", "mv", str(layout_py), str(SRC / "_layout_ranks.py")], check=True)
        (SRC / "layout").mkdir(exist_ok=True)
        subprocess.run(
            ["git", "mv", str(SRC / "_layout_ranks.py"), str(SRC / "layout" / "ranks.py")],
            check=True,
        )
    moved = {} if args.no_move else git_mv(args.dry_run)
    if move_layout:
        moved[SRC / "layout" / "ranks.py"] = f"{PKG}.layout"
    roots = args.paths or [ROOT / "src", ROOT / "tests", ROOT / "benchmarks", ROOT / "scripts"]
    files = sorted(p for r in roots for p in ([r] if r.is_file() else r.rglob("*.py")))
    changed = 0
    for path in files:
        if path.resolve() == Path(__file__).resolve():
            continue
        in_pkg = SRC in path.resolve().parents
        is_package = path.name == "__init__.py"
        new_module = module_name(path.resolve()) if in_pkg else "__main__"
        old_module = moved.get(path.resolve(), new_module)
        source = path.read_text()
        if KEEP_MARK in source:
            continue
        out = rewrite(source, old_module, new_module, is_package)
        if out != source:
            changed += 1
            print(f"rewrote {path.relative_to(ROOT)}")
            if not args.dry_run:
                path.write_text(out)
    if not args.paths:
        for md in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
            if rewrite_markdown(md, args.dry_run):
                changed += 1
                print(f"rewrote {md.relative_to(ROOT)}")
    print(f"{changed} files rewritten", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
