"""The options ``lmforge <command> --help`` lists, read from the source of the config classes.

A recipe module imports torch (its run needs it), and importing torch and transformers takes seconds
(6-7 s on a busy laptop) that help should not wait for. A config's options are dataclass fields declared
with :func:`lmforge.core.config.opt` and :func:`lmforge.core.config.section`, so their keys, defaults and help texts
can be read from the modules' syntax trees without running them: :func:`option_rows` gives the rows
:func:`lmforge.core.config.describe` gives for the imported class.

The reader follows what the config modules write: dataclasses (and their dataclass bases) across the
package's modules, ``from`` imports (relative or ``lmforge.``), module aliases (``rl_config.RolloutConfig``),
literal defaults and help texts (implicit concatenation, ``+``, f-strings) and module-level constants.
Anything else (a default computed by a call, a ``dataclasses.field``) raises :class:`Unreadable`; the CLI
then imports the module and describes the class itself: slower, the same text. tests/recipes/test_cli.py
checks that every command is read here and that the rows equal ``describe``'s.
"""

from __future__ import annotations

import ast
import functools
import operator
from pathlib import Path
from typing import Any

PACKAGE_DIR = Path(__file__).resolve().parent.parent  # the lmforge package (this file is in lmforge/core)
REQUIRED = "(required)"  # describe()'s default of a field without one


class Unreadable(Exception):
    """The source says something this reader does not evaluate; the message says what and where."""


class _Module:
    """One module of the package: its top-level classes, functions, constants and imports."""

    def __init__(self, name: str):
        self.name = name  # dotted, relative to lmforge ("" = the package itself)
        parts = name.split(".") if name else []
        path = PACKAGE_DIR.joinpath(*parts).with_suffix(".py") if parts else PACKAGE_DIR / "__init__.py"
        self.is_package = not path.is_file()
        if self.is_package:
            path = PACKAGE_DIR.joinpath(*parts, "__init__.py")
        self.path = path
        self.scope: dict[str, tuple] = {}  # name -> ("node", ast node) | ("import", module, attr or None)
        for stmt in ast.parse(path.read_text(encoding="utf-8"), str(path)).body:
            self._declare(stmt)

    def _declare(self, stmt: ast.stmt) -> None:
        if isinstance(stmt, (ast.ClassDef, ast.FunctionDef)):
            self.scope[stmt.name] = ("node", stmt)
        elif isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name):
            self.scope[stmt.targets[0].id] = ("node", stmt.value)
        elif isinstance(stmt, ast.AnnAssign) and stmt.value is not None and isinstance(stmt.target, ast.Name):
            self.scope[stmt.target.id] = ("node", stmt.value)
        elif isinstance(stmt, ast.ImportFrom):
            source = self._absolute(stmt.module, stmt.level)
            for alias in stmt.names:
                self.scope[alias.asname or alias.name] = ("import", source, alias.name)

    def _absolute(self, module: str | None, level: int) -> str | None:
        """The imported module's name relative to lmforge, or None for a module outside the package."""
        if level == 0:
            if module == "lmforge" or (module or "").startswith("lmforge."):
                return module[len("lmforge.") :] if "." in module else ""
            return None
        parts = self.name.split(".") if self.name else []
        base = parts if self.is_package else parts[:-1]
        base = base[: len(base) - (level - 1)]
        return ".".join(base + (module.split(".") if module else []))

    def where(self, node: ast.AST) -> str:
        return f"{self.path.relative_to(PACKAGE_DIR.parent)}:{getattr(node, 'lineno', '?')}"


@functools.lru_cache(maxsize=None)
def _module(name: str) -> _Module:
    return _Module(name)


def _lookup(module: _Module, name: str, at: ast.AST) -> tuple[_Module, Any]:
    """(defining module, ast node or ("module", name)) of ``name`` as seen in ``module``."""
    entry = module.scope.get(name)
    if entry is None:
        raise Unreadable(f"{module.where(at)}: '{name}' is not a top-level name of {module.name or 'lmforge'}")
    if entry[0] == "node":
        return module, entry[1]
    _, source, attr = entry
    if source is None:
        return module, ("external", attr)
    target = _module(source)
    if attr in target.scope:
        return _lookup(target, attr, at)
    submodule = f"{source}.{attr}" if source else attr
    return module, ("module", submodule)


def _resolve(module: _Module, node: ast.expr) -> tuple[_Module, Any]:
    """What a Name or a dotted Attribute refers to (a class, a function, a value's node, a module)."""
    if isinstance(node, ast.Name):
        return _lookup(module, node.id, node)
    if isinstance(node, ast.Attribute):
        owner, target = _resolve(module, node.value)
        if isinstance(target, tuple) and target[0] == "module":
            inner = _module(target[1])
            return _lookup(inner, node.attr, node)
        if isinstance(target, tuple) and target[0] == "external":
            return owner, ("external", node.attr)
    raise Unreadable(f"{module.where(node)}: cannot follow {ast.unparse(node)!r}")


def _value(module: _Module, node: ast.expr) -> Any:
    """The value of a constant expression: literals, containers, + - *, f-strings, module constants."""
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
        items = [_value(module, item) for item in node.elts]
        return {ast.List: list, ast.Tuple: tuple, ast.Set: set}[type(node)](items)
    if isinstance(node, ast.Dict) and None not in node.keys:
        return {_value(module, k): _value(module, v) for k, v in zip(node.keys, node.values)}
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        operand = _value(module, node.operand)
        return -operand if isinstance(node.op, ast.USub) else +operand
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub, ast.Mult)):
        operation = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}[type(node.op)]
        try:
            return operation(_value(module, node.left), _value(module, node.right))
        except TypeError as exc:
            raise Unreadable(f"{module.where(node)}: {ast.unparse(node)!r}: {exc}") from None
    if isinstance(node, ast.JoinedStr):
        return "".join(_value(module, part) for part in node.values)
    if isinstance(node, ast.FormattedValue):
        shown = _value(module, node.value)
        if node.conversion != -1:  # !s, !r, !a
            shown = {ord("s"): str, ord("r"): repr, ord("a"): ascii}[node.conversion](shown)
        return format(shown, _value(module, node.format_spec) if node.format_spec else "")
    if isinstance(node, (ast.Name, ast.Attribute)):
        owner, target = _resolve(module, node)
        if isinstance(target, ast.expr):
            return _value(owner, target)
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "join"
        and isinstance(node.func.value, ast.Constant)
        and len(node.args) == 1
        and not node.keywords
    ):
        return node.func.value.value.join(_names(module, node.args[0]))  # "', '.join(REGISTRY)"
    raise Unreadable(f"{module.where(node)}: {ast.unparse(node)!r} is not a constant this reader evaluates")


def _names(module: _Module, node: ast.expr) -> list:
    """The items of a constant sequence, or the keys of a dict literal (a registry of functions)."""
    if isinstance(node, (ast.Name, ast.Attribute)):
        owner, target = _resolve(module, node)
        if isinstance(target, ast.expr):
            return _names(owner, target)
    if isinstance(node, ast.Dict) and None not in node.keys:
        return [_value(module, key) for key in node.keys]
    return list(_value(module, node))


def _dataclass(module: _Module, node: ast.expr) -> tuple[_Module, ast.ClassDef] | None:
    """The dataclass an annotation names, or None for any other type."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):  # a quoted annotation
        node = ast.parse(node.value, mode="eval").body
    if not isinstance(node, (ast.Name, ast.Attribute)):
        return None  # Literal[...], list[str], X | None, ...: describe() lists these as one key
    try:
        owner, target = _resolve(module, node)
    except Unreadable:
        if isinstance(node, ast.Name):  # int, str, float, bool: builtins
            return None
        raise
    if isinstance(target, ast.ClassDef) and _is_dataclass(target):
        return owner, target
    return None


def _is_dataclass(cls: ast.ClassDef) -> bool:
    return any(ast.unparse(d).split("(")[0] in ("dataclass", "dataclasses.dataclass") for d in cls.decorator_list)


def _fields(module: _Module, cls: ast.ClassDef) -> dict[str, tuple[_Module, ast.AnnAssign]]:
    """A dataclass's fields in dataclasses' order: the bases' first, a redefined field keeps its place."""
    if not _is_dataclass(cls):
        raise Unreadable(f"{module.where(cls)}: class {cls.name} is not a dataclass")
    fields: dict[str, tuple[_Module, ast.AnnAssign]] = {}
    for base in cls.bases:
        owner, target = _resolve(module, base)
        if not isinstance(target, ast.ClassDef):
            raise Unreadable(f"{module.where(base)}: base {ast.unparse(base)!r} of {cls.name} is not a class here")
        fields.update(_fields(owner, target))
    for stmt in cls.body:
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            if "ClassVar" in ast.unparse(stmt.annotation):
                continue
            fields[stmt.target.id] = (module, stmt)
    return fields


def _default_and_help(module: _Module, stmt: ast.AnnAssign) -> tuple[Any, str]:
    """A leaf field's default and help text from ``opt(default, help)`` (or a plain default)."""
    value = stmt.value
    if value is None:
        return REQUIRED, ""
    if isinstance(value, ast.Call):
        owner, target = _resolve(module, value.func)
        if not (isinstance(target, ast.FunctionDef) and target.name == "opt" and owner.name == "core.config"):
            raise Unreadable(f"{module.where(value)}: {ast.unparse(value.func)}(...) is not config.opt")
        arguments = dict(zip(("default", "help"), value.args)) | {k.arg: k.value for k in value.keywords if k.arg}
        return _value(module, arguments["default"]), _value(module, arguments["help"])
    return _value(module, value), ""


def _rows(module: _Module, cls: ast.ClassDef, prefix: str) -> list[tuple[str, str, str]]:
    rows = []
    for name, (owner, stmt) in _fields(module, cls).items():
        section = _dataclass(owner, stmt.annotation)
        if section is not None:
            rows.extend(_rows(*section, prefix + name + "."))
            continue
        default, text = _default_and_help(owner, stmt)
        rows.append((prefix + name, repr(default), text))
    return rows


def option_rows(module: str, cls: str) -> list[tuple[str, str, str]]:
    """(dotted key, repr of the default, help) of every leaf option of the dataclass ``cls`` defined in
    ``module`` (dotted, relative to lmforge, e.g. ``"recipes.sft"``), as :func:`lmforge.core.config.describe`
    gives them, read without importing either. :class:`Unreadable` when the source goes beyond what the
    reader follows; a SyntaxError or OSError as reading the file raises them."""
    owner, target = _lookup(_module(module), cls, ast.Name(id=cls))
    if not isinstance(target, ast.ClassDef):
        raise Unreadable(f"{owner.path}: {cls} is not a class")
    return _rows(owner, target, "")


def constant(module: str, name: str) -> Any:
    """The value of the top-level constant ``name`` of ``module`` (e.g. ``quantize.catalog``'s table)."""
    owner, target = _lookup(_module(module), name, ast.Name(id=name))
    if not isinstance(target, ast.expr):
        raise Unreadable(f"{owner.path}: {name} is not a constant")
    return _value(owner, target)


def mapping_heads(module: str, name: str) -> dict[str, Any]:
    """The keys of the top-level dict literal ``name`` in ``module``, each with the first item of its value
    (a tuple), e.g. ``{stage: help text}`` of ``STAGES = {stage: (help text, runner)}``."""
    owner, target = _lookup(_module(module), name, ast.Name(id=name))
    if not isinstance(target, ast.Dict) or None in target.keys:
        raise Unreadable(f"{owner.path}: {name} is not a dict literal")
    heads = {}
    for key, value in zip(target.keys, target.values):
        if not isinstance(value, ast.Tuple) or not value.elts:
            raise Unreadable(f"{owner.where(value)}: {name}'s values are not tuples")
        heads[_value(owner, key)] = _value(owner, value.elts[0])
    return heads
