"""The package's arrows (docs/architecture.md): server -> conversation -> engine, and the engine imports nothing of
the media side, the server or the client; each engine subpackage is importable on its own."""
from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "rtc_agent"
ENGINE = PACKAGE / "engine"
OUTSIDE_THE_ENGINE = ("rtc_agent.media", "rtc_agent.server", "rtc_agent.client", "rtc_agent.conversation")


def _imports(path: Path) -> list[str]:
    """The absolute names of the modules `path` imports (relative imports resolved against its package)."""
    package = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts[:-1])
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[:len(package.split(".")) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            names += [module] + [f"{module}.{alias.name}" for alias in node.names]
    return names


def test_the_engine_imports_nothing_of_media_server_or_client() -> None:
    crossing = {f"{path.relative_to(PACKAGE)}: {name}" for path in ENGINE.rglob("*.py") for name in _imports(path)
                if name.startswith(OUTSIDE_THE_ENGINE)}
    assert not crossing


def test_imports_are_resolved_as_python_resolves_them() -> None:
    """(the check above reads the right names: a relative import two levels up from engine/step/ is rtc_agent's)"""
    names = _imports(ENGINE / "step" / "turn_scoring.py")
    assert "rtc_agent.smart_turn" in names and "rtc_agent.engine.step.graphs" in names


@pytest.mark.parametrize("subpackage", sorted(p.name for p in ENGINE.iterdir() if (p / "__init__.py").exists()))
def test_each_engine_subpackage_imports_on_its_own(subpackage: str) -> None:
    for path in sorted((ENGINE / subpackage).rglob("*.py")):
        importlib.import_module(".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__"))
