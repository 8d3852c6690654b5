"""Imports only go down: the import-linter contracts of pyproject.toml hold, they can fail, and
docs/architecture.md lists the same layers.

import-linter (its graph library, grimp) reads every import statement of every module, at module
level and inside functions, so a lazy import that climbs a layer or closes a cycle is caught too.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("importlinter.cli")
grimp = pytest.importorskip("grimp")
tomllib = pytest.importorskip("tomllib" if sys.version_info >= (3, 11) else "tomli")

ROOT = Path(__file__).resolve().parents[2]
CONTRACTS = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]


def layered(container: str) -> list[str]:
    return next(c["layers"] for c in CONTRACTS if c["type"] == "layers" and c["containers"] == [container])


def grimp_layers(layers: list[str]) -> list:
    return [grimp.Layer(*(part.strip() for part in layer.split("|"))) for layer in layers]


def test_every_contract_is_kept():
    """``lint-imports`` itself, in a child process (it reconfigures logging, which would silence the
    loggers of the tests after it)."""
    code = (
        "import sys; from importlinter.cli import lint_imports; "
        f"sys.exit(lint_imports(config_filename={str(ROOT / 'pyproject.toml')!r}, no_cache=True, no_logo=True))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Contracts: 6 kept, 0 broken." in done.stdout


def test_the_contracts_cover_the_rl_package_and_forbid_cycles():
    kinds = {(c["type"], tuple(c.get("containers", c.get("ancestors", [])))) for c in CONTRACTS}
    for container in ("lmforge", "lmforge.rl", "lmforge.rl.sources", "lmforge.data"):
        assert ("layers", (container,)) in kinds
        assert next(c for c in CONTRACTS if c.get("containers") == [container])["exhaustive"] is True
    assert ("acyclic_siblings", ("lmforge",)) in kinds


@pytest.mark.parametrize(
    "importer, imported",
    [
        ("lmforge.core.ops", "lmforge.rl.loop"),  # a tensor helper reaching for the RL loop (inside a function counts)
        ("lmforge.rollout.engine", "lmforge.serve.app"),  # the sampler importing the server
        ("lmforge.model.load", "lmforge.data.tasks"),  # models above data, as lora <-> models once was
    ],
)
def test_an_upward_import_breaks_the_layers(importer, imported):
    graph = grimp.build_graph("lmforge")
    layers = grimp_layers(layered("lmforge"))
    assert not graph.find_illegal_dependencies_for_layers(layers, containers={"lmforge"})
    graph.add_import(importer=importer, imported=imported)
    assert graph.find_illegal_dependencies_for_layers(layers, containers={"lmforge"})


def test_a_cycle_inside_the_rl_package_is_caught():
    """The circle of the old rl.py / rl_update.py / rl_async.py cannot come back: an upward import
    (batch -> updates, whose Updates reads batches) is illegal and closes a cycle."""
    graph = grimp.build_graph("lmforge")
    layers = grimp_layers(layered("lmforge.rl"))
    assert not graph.find_illegal_dependencies_for_layers(layers, containers={"lmforge.rl"})
    assert not graph.nominate_cycle_breakers("lmforge.rl")
    graph.add_import(importer="lmforge.rl.batch", imported="lmforge.rl.updates")
    assert graph.find_illegal_dependencies_for_layers(layers, containers={"lmforge.rl"})
    assert graph.nominate_cycle_breakers("lmforge.rl")


def test_architecture_doc_lists_the_contract_layers():
    """docs/architecture.md's layer list is the contract's, in order (a line per layer, names as in
    pyproject.toml)."""
    doc = (ROOT / "docs" / "architecture.md").read_text()
    for container in ("lmforge", "lmforge.rl"):
        block = re.search(rf"```text\n# layers of {re.escape(container)}, top to bottom\n(.*?)```", doc, re.S)
        assert block, f"docs/architecture.md has no layer block for {container}"
        lines = [line.split("#")[0].strip() for line in block.group(1).splitlines() if line.split("#")[0].strip()]
        assert lines == layered(container)


def _config_trace():
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import config_trace
    finally:
        sys.path.remove(str(ROOT / "tools"))
    return config_trace


def test_the_run_config_from_the_rl_setup_enters_at_most_ten_files():
    """Sections, not the run: the recipe's whole config, traced from ``rl.prepare`` through every call it
    is passed to (tools/config_trace.py), stays in a few files (the setup, the run's start, its resume
    check and the config module that saves it)."""
    entered = _config_trace().trace()
    assert len(entered) <= 10, sorted(str(p) for p in entered)


def test_the_config_trace_follows_calls_copies_and_holders(tmp_path):
    """The tracer can fail: a config handed on through a call, a copy and an object that holds it is
    followed into each file that receives or reads it; a section handed on is not."""
    pkg = tmp_path / "lmforge"
    (pkg / "rl").mkdir(parents=True)
    (pkg / "rl" / "loop.py").write_text(
        "import dataclasses\n"
        "def prepare(cfg):\n"
        "    resolved = dataclasses.replace(cfg, seed=1)\n"
        "    check(resolved)\n"
        "    use_section(cfg.rollout)\n"
        "    return Run(cfg=cfg)\n"
    )
    (pkg / "checks.py").write_text("def check(config):\n    deeper(config)\n")
    (pkg / "deep.py").write_text("def deeper(c):\n    return c\n")
    (pkg / "sections.py").write_text("def use_section(rollout):\n    return rollout.temperature\n")
    (pkg / "run.py").write_text("class Run:\n    cfg: object\n")
    (pkg / "reader.py").write_text("def step(state):\n    return state.run.cfg.train\n")
    entered = {p.name for p in _config_trace().trace(package=pkg)}
    assert entered == {"loop.py", "checks.py", "deep.py", "run.py", "reader.py"}


def test_the_top_level_holds_fewer_than_twenty_rooms():
    """The top of src/lmforge is the packages of the layer contract and the two entry modules (plus the
    shipped assets): a new top-level module has to find its package."""
    top = ROOT / "src" / "lmforge"
    rooms = sorted(p.name for p in top.iterdir() if p.name != "__pycache__" and (p.suffix == ".py" or p.is_dir()))
    assert len(rooms) < 20, rooms
    layered_names = {name.strip() for layer in layered("lmforge") for name in layer.split("|")}
    code = {Path(name).stem for name in rooms if name not in ("__init__.py", "assets")}
    assert code == layered_names, code ^ layered_names


def test_a_recipe_importing_another_breaks_the_recipes_contract():
    """rm once imported dpo, and distill imported grpo and sft: the recipes are independent (the pipelines
    that run whole commands sit a layer above them), and an import between two of them is caught."""
    contract = next(c for c in CONTRACTS if c["type"] == "independence")
    assert contract["modules"] == ["lmforge.recipes.*"] and not contract.get("ignore_imports")
    graph = grimp.build_graph("lmforge")
    recipes = sorted(graph.find_children("lmforge.recipes"))

    def between() -> list:
        return [(a, b) for a in recipes for b in recipes if graph.direct_import_exists(importer=a, imported=b)]

    assert between() == []
    assert not graph.find_illegal_dependencies_for_layers(grimp_layers(layered("lmforge")), containers={"lmforge"})
    graph.add_import(importer="lmforge.recipes.rm", imported="lmforge.recipes.dpo")
    assert between() == [("lmforge.recipes.rm", "lmforge.recipes.dpo")]
    # the pipelines import recipes from above; a recipe importing a pipeline breaks the layers
    graph.add_import(importer="lmforge.recipes.sft", imported="lmforge.pipelines.quickstart")
    assert graph.find_illegal_dependencies_for_layers(grimp_layers(layered("lmforge")), containers={"lmforge"})
