"""lmforge.core.confighelp reads a config's options from source as describe() gives them from the class, and
refuses (Unreadable) what it does not evaluate rather than guessing."""

import dataclasses
import importlib.util
import sys

import pytest

from lmforge.core import confighelp
from lmforge.core.config import describe

CONFIG = """
import dataclasses
from typing import ClassVar, Literal

from .core.config import opt, section
from .consts import NAMES, WIDTH


@dataclasses.dataclass
class Base:
    lr: float = opt(1e-3, "peak rate")
    mode: Literal["a", "b"] = opt("a", f"one of {', '.join(NAMES)} (width {WIDTH * 2:>4})")


@dataclasses.dataclass
class Inner(Base):
    kind: ClassVar[str] = "not a field"
    steps: int = opt(-3, "steps " + "joined")
    lr: float = opt(2e-3, "peak rate, redefined: keeps its place")
    layers: list[int] = opt([1, 2], 'a list')
    plain: str = "no help"


@dataclasses.dataclass
class Top:
    inner: Inner = section(Inner, "the inner section")
    name: str | None = opt(None, help="keyword help")
"""
CONSTS = 'NAMES = {"x": len, "y": abs}\nWIDTH = 3\n'
OPT = """import dataclasses


def opt(default, help, keys=()):  # as lmforge.core.config's
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata={"help": help})
    return dataclasses.field(default=default, metadata={"help": help})


def section(cls, help=""):
    return dataclasses.field(default_factory=cls, metadata={"help": help})
"""


@pytest.fixture
def package(tmp_path, monkeypatch):
    """A package ``fakepkg`` with a config module, read by confighelp as if it were lmforge."""
    root = tmp_path / "fakepkg"
    root.mkdir()
    (root / "__init__.py").write_text("")
    (root / "consts.py").write_text(CONSTS)
    (root / "core").mkdir()
    (root / "core" / "__init__.py").write_text("")
    (root / "core" / "config.py").write_text(OPT)  # where lmforge's opt lives: lmforge/core/config.py
    monkeypatch.setattr(confighelp, "PACKAGE_DIR", root)
    confighelp._module.cache_clear()
    monkeypatch.syspath_prepend(str(tmp_path))
    yield root
    confighelp._module.cache_clear()
    for name in [m for m in sys.modules if m == "fakepkg" or m.startswith("fakepkg.")]:
        del sys.modules[name]


def imported(name: str, cls: str):
    spec = importlib.util.find_spec(f"fakepkg.{name}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return getattr(module, cls)


def test_rows_equal_describe_of_the_imported_class(package):
    (package / "conf.py").write_text(CONFIG)
    rows = confighelp.option_rows("conf", "Top")
    assert rows == describe(imported("conf", "Top"))
    assert rows[0] == ("inner.lr", "0.002", "peak rate, redefined: keeps its place")
    assert rows[1] == ("inner.mode", "'a'", "one of x, y (width    6)")
    assert [key for key, _, _ in rows] == [
        "inner.lr",
        "inner.mode",
        "inner.steps",
        "inner.layers",
        "inner.plain",
        "name",
    ]


@pytest.mark.parametrize("default", ["len(WIDTH)", "dataclasses.field(default=1)", "WIDTH + 'x'", "UNKNOWN"])
def test_what_it_cannot_evaluate_is_unreadable(package, default):
    (package / "conf.py").write_text(CONFIG.replace('opt(-3, "steps "', f'opt({default}, "steps "'))
    with pytest.raises(confighelp.Unreadable, match="conf.py:"):
        confighelp.option_rows("conf", "Top")


def test_constant_and_mapping_heads(package):
    (package / "conf.py").write_text(
        CONFIG + '\nSTAGES = {"one": ("first", len), "two": ("second " + "stage", abs)}\n'
        'TABLE = {"a": (1, -2.5), "b": NAMES.__class__}\n'
    )
    assert confighelp.mapping_heads("conf", "STAGES") == {"one": "first", "two": "second stage"}
    assert confighelp.constant("consts", "WIDTH") == 3
    with pytest.raises(confighelp.Unreadable):
        confighelp.constant("conf", "TABLE")
    assert dataclasses.is_dataclass(imported("conf", "Top"))
