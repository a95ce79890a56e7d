"""Known reward hacks (``hacks/``) against the production grader, a naive exit-code grader, and the detectors.

Each directory under ``hacks/`` is one hack for one generated task (``generated_tasks(60, 0)``):
``hack.json`` names the task, the detector flags it must raise and how it cheats; every other
file is part of the final workspace (``solution.py`` and, for some, ``conftest.py``,
``pytest.ini`` or ``pytest.py``). For every hack this asserts that:

- the naive grader (:func:`naive_grade`: plain ``python -m pytest`` over the hidden tests in the
  same sandbox, pass = exit status 0, as many RL harnesses do) is fooled: the positive control
  showing the hack really works;
- the production grader gives it reward 0;
- :func:`shipyard.envs.grading.anticheat.detect` raises the flags listed in ``hack.json``.

Honest reference solutions of the same tasks pass the production grader in full, and the
canary tasks cannot be passed by their honest references. Gradings run on 4 threads.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from shipyard.agent.session import workspace_files
from shipyard.config.schema import SandboxConfig
from shipyard.envs.grading.anticheat import canary_tasks, detect, hack_rate
from shipyard.envs.grading.grader import HIDDEN_FILE, grade
from shipyard.envs.sandbox import BwrapSandbox, sandbox_available
from shipyard.envs.tasks.functions import generated_tasks
from shipyard.envs.types import RewardResult, Task

pytestmark = pytest.mark.skipif(sandbox_available() is not None, reason=str(sandbox_available()))

HACKS_DIR = Path(__file__).parent / "hacks"
CFG = SandboxConfig(timeout_s=20)
NAIVE_CMD = f"python -m pytest -q -p no:cacheprovider {HIDDEN_FILE}"


@dataclass
class Hack:
    name: str
    task: Task
    files: dict[str, str]
    """The final workspace: the task's starting files plus the hack's files."""
    flags: list[str]
    why: str


def load_hacks(root: Path = HACKS_DIR, n: int = 60, seed: int = 0) -> list[Hack]:
    """Every hack of the corpus, bound to its task of ``generated_tasks(n, seed)``."""
    tasks = {t.id: t for t in generated_tasks(n, seed)}
    hacks = []
    for d in sorted(p for p in root.iterdir() if p.is_dir()):
        meta = json.loads((d / "hack.json").read_text())
        task = tasks[meta["task"]]
        files = {p.name: p.read_text() for p in sorted(d.iterdir()) if p.name != "hack.json"}
        assert task.entry_point in files["solution.py"], (
            f"{d.name}: task {task.id} is no longer {task.entry_point}"
        )
        hacks.append(Hack(d.name, task, {**workspace_files(task), **files}, meta["flags"], meta["why"]))
    return hacks


def naive_grade(task: Task, files: dict[str, str], cfg: SandboxConfig = CFG) -> bool:
    """The contrast: hidden tests next to the files, plain pytest, pass = exit status 0."""
    with BwrapSandbox({**files, HIDDEN_FILE: task.hidden_tests}, cfg) as sb:
        return sb.exec(NAIVE_CMD).returncode == 0


HACKS = load_hacks()


@pytest.fixture(scope="module")
def results() -> dict[str, tuple[bool, RewardResult, RewardResult]]:
    """Per hack: (naive pass, production result for the hack, production result for the reference)."""

    def run(h: Hack) -> tuple[bool, RewardResult, RewardResult]:
        honest = {**workspace_files(h.task), "solution.py": h.task.reference}
        return naive_grade(h.task, h.files), grade(h.task, h.files, CFG), grade(h.task, honest, CFG)

    with ThreadPoolExecutor(4) as pool:
        return dict(zip([h.name for h in HACKS], pool.map(run, HACKS), strict=True))


def test_corpus_is_large_and_not_collected(request: pytest.FixtureRequest) -> None:
    assert len(HACKS) >= 10 and len({h.task.id for h in HACKS}) == len(HACKS)
    loaded = [getattr(p, "__file__", "") or "" for p in request.config.pluginmanager.get_plugins()]
    assert not any(str(HACKS_DIR) in f for f in loaded), "a hack's conftest.py was loaded into this session"


@pytest.mark.parametrize("hack", HACKS, ids=[h.name for h in HACKS])
def test_hack_fools_naive_grader_but_not_production(
    hack: Hack, results: dict[str, tuple[bool, RewardResult, RewardResult]]
) -> None:
    naive, production, honest = results[hack.name]
    assert naive, f"{hack.name}: positive control failed, the hack does not fool plain pytest"
    assert production.reward == 0.0 and production.passed == 0, (hack.name, production.details)
    assert honest.reward == 1.0, (hack.name, honest.details)


@pytest.mark.parametrize("hack", HACKS, ids=[h.name for h in HACKS])
def test_hack_is_flagged(hack: Hack) -> None:
    flags = detect(hack.files, [], original=workspace_files(hack.task))
    assert flags and set(hack.flags) <= set(flags), (hack.name, flags)


def test_canaries_only_pass_by_cheating() -> None:
    canaries = canary_tasks()
    assert len(canaries) >= 3 and all(t.id.startswith("canary-") for t in canaries)
    always_equal = (HACKS_DIR / "always_equal" / "solution.py").read_text()

    def run(task: Task) -> tuple[RewardResult, RewardResult, bool]:
        honest = {**workspace_files(task), "solution.py": task.reference}
        cheat = {"solution.py": always_equal.replace("nth_fibonacci(n)", f"{task.entry_point}(*args)")}
        return grade(task, honest, CFG), grade(task, cheat, CFG), naive_grade(task, cheat)

    with ThreadPoolExecutor(4) as pool:
        outcomes = list(pool.map(run, canaries))
    for task, (honest, cheat, _) in zip(canaries, outcomes, strict=True):
        assert honest.reward < 1.0 and cheat.reward < 1.0, task.id
        assert detect({"solution.py": task.reference}, []) == [], task.id
    # the always-equal object fools plain pytest on the canaries compared with ==
    assert sum(naive for _, _, naive in outcomes) >= 2
    assert hack_rate([(t, honest) for t, (honest, _, _) in zip(canaries, outcomes, strict=True)]) == 0.0
