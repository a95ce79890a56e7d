"""The layering of docs/design.md holds: a package imports only packages below it (or a same-layer
package's ``types`` module), and only those :data:`DEPENDS` lists, a table that is exactly what the
code imports (an edge no code uses fails too, so the table cannot drift looser than the code); data
flows up through the store; the trainer never loads the sandbox stack. Every import counts:
absolute, relative, ``from shipyard import pkg``, lazy ones inside functions, and module names given
to ``importlib.import_module`` / ``__import__`` / ``importlib.util.find_spec``.

The size limits of the style guide hold too: no module of ``src/shipyard`` over
:data:`MAX_FILE_LINES` lines and no function over :data:`MAX_FUNCTION_LINES`, but those in
:data:`SIZE_EXCEPTIONS`, each with its reason (an entry no longer needed fails)."""

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

DEPENDS: dict[str, set[str]] = {
    "config": set(),
    "store": {"config"},
    "metrics": set(),
    "weights": {"store"},
    "models": {"config"},
    "inference": {"config", "metrics", "models", "store", "weights"},
    "envs": {"config"},
    "agent": {"config", "envs", "inference"},
    "rollout": {"agent", "config", "envs", "metrics", "store", "weights"},
    "trainer": {"agent", "config", "envs", "metrics", "models", "rollout", "store", "weights"},
    "eval": {"agent", "config", "envs", "inference", "metrics", "store", "weights"},
    "online": {"agent", "config", "envs", "eval", "inference", "store", "trainer", "weights"},
    "fleet": {
        "agent",
        "config",
        "envs",
        "inference",
        "metrics",
        "models",
        "rollout",
        "store",
        "trainer",
        "weights",
    },
    "orchestrate": {
        *("agent", "config", "envs", "eval", "fleet", "inference", "metrics", "models", "rollout"),
        *("store", "trainer", "weights"),
    },
    "view": {"agent", "config", "eval", "models", "rollout", "store", "trainer", "weights"},
    "cli": {"config", "eval", "fleet", "inference", "metrics", "online", "orchestrate", "view"},
}
"""The Shipyard packages each package imports: exactly those (a new dependency is a decision: add it
here, within :data:`LAYERS`' order; a dependency dropped from the code is dropped here)."""

MAX_FILE_LINES = 800
MAX_FUNCTION_LINES = 60
SIZE_EXCEPTIONS: dict[str, str] = {
    "config/schema.py": "every config section with a docstring per field, in one file users read top to "
    "bottom (the config package imports without torch; splitting it would scatter the reference)",
    "trainer/loop.py:run_trainer": "the training loop, kept whole so it reads top to bottom (the style "
    "guide's limit for it is 100 lines)",
}
"""``path`` (a module over the file limit) or ``path:function`` (a function over its limit) -> why."""

ENVS_INNER: dict[str, set[str]] = {
    "sandbox": {"sandbox", "types", "processes"},
    "services": {"services", "types", "processes"},
    "grading": {"grading", "sandbox", "types"},
    "tasks": {"tasks", "grading", "sandbox", "services", "types"},
}
"""Inside ``envs/``: what each package may import of ``envs`` (nothing above it; ``environment.py``
sits on top of all four)."""


IMPORTERS = {"import_module", "__import__", "find_spec"}
"""Calls whose first argument, a string constant, is a module name imported (importlib's and ``__import__``)."""


def _imports(path: Path) -> list[tuple[str, int]]:
    """(``shipyard.x.y`` module, line) of every import in ``path`` (module docstring)."""
    package = _dotted(path).rsplit(".", 1)[0] if path.name != "__init__.py" else _dotted(path)
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = _resolve(package, node.level, node.module)
            if base == "shipyard":  # from shipyard import pkg
                out += [(f"shipyard.{a.name}", node.lineno) for a in node.names]
            elif node.level and not node.module:  # from . import module
                out += [(f"{base}.{a.name}", node.lineno) for a in node.names]
            elif base.startswith("shipyard."):
                out.append((base, node.lineno))
        elif isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names if a.name.startswith("shipyard.")]
        elif isinstance(node, ast.Call) and node.args and _called(node.func) in IMPORTERS:
            arg = node.args[0]
            if (
                isinstance(arg, ast.Constant)
                and isinstance(arg.value, str)
                and arg.value.startswith("shipyard.")
            ):
                out.append((arg.value, node.lineno))
    return out


def _dotted(path: Path) -> str:
    """The module name of a file under ``src/`` (a test's own file: its stem under ``shipyard``)."""
    try:
        rel = path.relative_to(SRC.parent)
    except ValueError:
        return f"shipyard.{path.stem}"
    return ".".join(rel.with_suffix("").parts).removesuffix(".__init__")


def _resolve(package: str, level: int, module: str | None) -> str:
    """The absolute module of ``from <level dots><module> import ...`` in ``package``."""
    if not level:
        return module or ""
    base = package.rsplit(".", level - 1)[0] if level > 1 else package
    return f"{base}.{module}" if module else base


def _called(func: ast.expr) -> str:
    return func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""


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
    bad.write_text(
        "import importlib\n"
        "from shipyard import orchestrate\n"
        "def f():\n"
        "    from shipyard.orchestrate.train import train\n"
        "    return importlib.import_module('shipyard.view.server'), __import__('shipyard.cli')\n"
    )
    assert _imports(bad) == [
        ("shipyard.orchestrate", 2),
        ("shipyard.orchestrate.train", 4),
        ("shipyard.view.server", 5),
        ("shipyard.cli", 5),
    ]
    kinds = SRC / "envs" / "tasks" / "kinds.py"  # relative imports resolve against the file's package
    assert _resolve("shipyard.envs.tasks", 1, "files") == "shipyard.envs.tasks.files"
    assert _resolve("shipyard.envs.tasks", 2, "grading.grader") == "shipyard.envs.grading.grader"
    assert _resolve("shipyard.envs.tasks", 3, None) == "shipyard"
    assert _dotted(kinds) == "shipyard.envs.tasks.kinds"


def test_the_dependency_table_is_exactly_what_the_code_imports() -> None:
    used: dict[str, set[str]] = {pkg: set() for pkg in LAYERS}
    where: dict[tuple[str, str], str] = {}
    for path in SRC.rglob("*.py"):
        pkg = _package(path)
        for module, line in _imports(path):
            target = module.split(".")[1]
            if pkg in LAYERS and target in LAYERS and target != pkg:
                used[pkg].add(target)
                where.setdefault((pkg, target), f"{path.relative_to(SRC)}:{line}")
    new = [f"{p} -> {t} ({where[p, t]})" for p in sorted(used) for t in sorted(used[p] - DEPENDS[p])]
    unused = [f"{p} -> {t}" for p in sorted(DEPENDS) for t in sorted(DEPENDS[p] - used[p])]
    assert not new, "imports DEPENDS does not list (add them if intended):\n" + "\n".join(new)
    assert not unused, "DEPENDS lists imports no code makes (tighten it):\n" + "\n".join(unused)
    assert set(DEPENDS) == set(LAYERS)
    upward = [f"{p} -> {t}" for p, ts in DEPENDS.items() for t in ts if LAYERS[t] > LAYERS[p]]
    assert not upward, upward


def test_files_and_functions_stay_within_the_size_limits() -> None:
    over: dict[str, int] = {}
    for path in SRC.rglob("*.py"):
        rel = str(path.relative_to(SRC))
        text = path.read_text()
        if (n := len(text.splitlines())) > MAX_FILE_LINES:
            over[rel] = n
        for node in ast.walk(ast.parse(text)):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            if (n := (node.end_lineno or node.lineno) - node.lineno + 1) > MAX_FUNCTION_LINES:
                over[f"{rel}:{node.name}"] = n
    unexcused = {k: v for k, v in over.items() if k not in SIZE_EXCEPTIONS}
    assert not unexcused, (
        f"over {MAX_FILE_LINES} lines (file) or {MAX_FUNCTION_LINES} (function): {unexcused}; split them, "
        "or add them to SIZE_EXCEPTIONS with the reason"
    )
    stale = sorted(set(SIZE_EXCEPTIONS) - set(over))
    assert not stale, f"SIZE_EXCEPTIONS entries within the limits now (drop them): {stale}"


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
