"""The layering of docs/design.md holds: a package imports only packages below it (or a same-layer
package's ``types`` module), data flows up through the store, and the trainer never loads the
sandbox stack."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "shipyard"

LAYERS: dict[str, int] = {
    "config": 1,
    "store": 2,
    "metrics": 2,
    "weights": 3,
    "models": 4,
    "inference": 5,
    "envs": 6,
    "agent": 7,
    "rollout": 8,
    "trainer": 8,
    "eval": 8,
    "online": 9,
    "fleet": 9,
    "orchestrate": 10,
    "view": 10,
    "cli": 11,
}
"""Layer of each top-level package (docs/design.md, "Layers"); a new package must be placed here."""

ENVS_INNER: dict[str, set[str]] = {
    "sandbox": {"sandbox", "types", "processes"},
    "services": {"services", "types", "processes"},
    "grading": {"grading", "sandbox", "types"},
    "tasks": {"tasks", "grading", "sandbox", "services", "types"},
}
"""Inside ``envs/``: what each package may import of ``envs`` (nothing above it; ``environment.py``
sits on top of all four)."""


def _imports(path: Path) -> list[tuple[str, int]]:
    """(``shipyard.x.y`` module, line) of every import in ``path``, lazy ones included."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("shipyard."):
            out.append((node.module, node.lineno))
        elif isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names if a.name.startswith("shipyard.")]
    return out


def _package(path: Path) -> str:
    rel = path.relative_to(SRC)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def test_every_package_has_a_layer() -> None:
    packages = {_package(p) for p in SRC.rglob("*.py")} - {"__init__", "__main__"}
    assert packages <= set(LAYERS), f"place {sorted(packages - set(LAYERS))} in LAYERS and docs/design.md"


def test_no_package_imports_against_the_flow() -> None:
    bad = []
    for path in SRC.rglob("*.py"):
        pkg = _package(path)
        if pkg not in LAYERS:
            continue
        for module, line in _imports(path):
            parts = module.split(".")
            target = parts[1]
            if target == pkg or target not in LAYERS:
                continue
            same_layer_types = LAYERS[target] == LAYERS[pkg] and parts[-1] == "types"
            if LAYERS[target] > LAYERS[pkg] or (LAYERS[target] == LAYERS[pkg] and not same_layer_types):
                bad.append(
                    f"{path.relative_to(SRC)}:{line} ({pkg}, layer {LAYERS[pkg]}) imports {module} (layer {LAYERS[target]})"
                )
    assert not bad, "imports against the layering:\n" + "\n".join(sorted(bad))


def test_envs_packages_are_layered_too() -> None:
    bad = []
    for inner, allowed in ENVS_INNER.items():
        for path in (SRC / "envs" / inner).rglob("*.py"):
            for module, line in _imports(path):
                parts = module.split(".")
                if (
                    parts[1] == "envs"
                    and len(parts) > 2
                    and parts[2] not in allowed
                    or parts[1] not in ("envs", "config")
                ):
                    bad.append(f"{path.relative_to(SRC)}:{line} imports {module}")
    assert not bad, "\n".join(bad)


def test_the_layering_test_catches_a_forbidden_import(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from shipyard.orchestrate.train import train\n")
    assert _imports(bad) == [("shipyard.orchestrate.train", 2)]


def test_the_trainer_does_not_load_the_sandbox_stack() -> None:
    code = (
        "import sys, shipyard.trainer.loop, shipyard.trainer.feed\n"
        "print(sorted(m for m in sys.modules if m.startswith(('shipyard.envs.sandbox', 'shipyard.envs.services',"
        " 'shipyard.agent.session', 'shipyard.rollout.worker'))))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.strip() == "[]", out.stdout
