"""Where the run config travels: the functions a recipe's whole config is passed to, transitively, from
the RL setup (``rl/loop.py:prepare``), and the files they sit in (issue 39, item 2: at most 10).

Static and conservative. A call is resolved by name to every function, method or class of that name in
the package (so a name shared by two functions counts both). An expression holds the config when it is
a traced parameter, an alias of one, a copy (``dataclasses.replace(cfg, ...)``, ``copy.deepcopy``) or
any attribute named ``cfg``; a class that receives the config makes every ``.cfg`` read anywhere count.
A section (``cfg.rollout``) is not the config: passing one is what the rule asks for.

    python tools/config_trace.py [--start=rl/loop.py:prepare:cfg] [-v]
"""

from __future__ import annotations

import ast
import sys
from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "lmforge"


def _index(package: Path):
    defs, trees = defaultdict(list), {}  # name -> [(file, node, is_method)]
    for path in sorted(package.rglob("*.py")):
        tree = trees[path] = ast.parse(path.read_text())
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                defs[node.name].append((path, node, False))
            if isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        defs[item.name].append((path, item, True))
    return defs, trees


def _params(fn, is_method: bool) -> list[str]:
    args = [a.arg for a in fn.args.posonlyargs + fn.args.args]
    return args[1:] if is_method and args and args[0] in ("self", "cls") else args


def _holds(expr, names: set[str]) -> bool:
    if isinstance(expr, ast.Name):
        return expr.id in names
    if isinstance(expr, ast.Attribute):
        return expr.attr == "cfg"
    if isinstance(expr, ast.Call) and expr.args:
        name = expr.func.id if isinstance(expr.func, ast.Name) else getattr(expr.func, "attr", "")
        return name in ("replace", "copy", "deepcopy") and _holds(expr.args[0], names)
    return False


def _targets(call: ast.Call, names: set[str], defs) -> list:
    """(file, def, is_method, parameter) for each argument of ``call`` that holds the config."""
    func = call.func
    callee = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
    out = []
    for position, arg in enumerate(call.args):
        if _holds(arg, names):
            for path, node, is_method in defs.get(callee, []):
                if isinstance(node, ast.ClassDef):
                    out.append((path, node, is_method, f"#{position}"))
                elif position < len(params := _params(node, is_method)):
                    out.append((path, node, is_method, params[position]))
    for keyword in call.keywords:
        if keyword.arg and _holds(keyword.value, names):
            for path, node, is_method in defs.get(callee, []):
                if isinstance(node, ast.ClassDef) or keyword.arg in _params(node, is_method) or node.args.kwarg:
                    out.append((path, node, is_method, keyword.arg))
    return out


def trace(start: str = "rl/loop.py:prepare:cfg", package: Path = PACKAGE) -> dict[Path, str]:
    """{file entered: why} for the config passed to ``FILE:FUNCTION:PARAM``."""
    defs, trees = _index(package)
    file, function, param = start.split(":")
    work = [(path, node, m, param, "start") for path, node, m in defs[function] if path == package / file]
    entered, seen, holders = {}, set(), set()
    while work:
        path, fn, is_method, param, why = work.pop()
        if (path, fn.lineno, param) in seen:
            continue
        seen.add((path, fn.lineno, param))
        entered.setdefault(path, why)
        if isinstance(fn, ast.ClassDef):  # an object holding the config: every .cfg read counts (below)
            holders.add(fn.name)
            continue
        names = {param}
        for _ in range(3):  # aliases and copies, to a fixed point
            for node in ast.walk(fn):
                if isinstance(node, ast.Assign) and _holds(node.value, names):
                    names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        for node in ast.walk(fn):
            if isinstance(node, ast.Call):
                where = f"{path.relative_to(package)}:{node.lineno}"
                work += [(p, d, m, name, where) for p, d, m, name in _targets(node, names, defs)]
    if holders:
        for path, tree in trees.items():
            for node in ast.walk(tree):
                if isinstance(node, ast.Attribute) and node.attr == "cfg" and isinstance(node.ctx, ast.Load):
                    entered.setdefault(path, f".cfg read at line {node.lineno}")
    return entered


if __name__ == "__main__":
    start = next((a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("--start=")), "rl/loop.py:prepare:cfg")
    entered = trace(start)
    print(f"{len(entered)} files entered by the run config from {start}")
    for path in sorted(entered):
        print(f"  {path.relative_to(PACKAGE)}" + (f"  <- {entered[path]}" if "-v" in sys.argv else ""))
