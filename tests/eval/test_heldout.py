"""Held-out splits per task kind and `shipyard eval` on db and repo tasks.

Checked: the db and repo held-out tasks are never among the tasks the rollout worker trains on
(db: other generator instances; repo: defects no trained task has), the function split is the one
`tasks.set` gives (long included), asking for more than the generator can hold out is a
ValueError naming the fields, and `run_eval` with the tiny model plays the db and repo suites
through the environment (a db task graded without its database would be an error, not a score).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from shipyard.config.load import load_config
from shipyard.envs.services.postgres import postgres_available
from shipyard.envs.tasks.files import extra_training_tasks
from shipyard.envs.tasks.splits import heldout_tasks, task_splits

ROOT = Path(__file__).resolve().parents[2]


def _cfg(*overrides: str):
    return load_config(ROOT / "configs" / "tiny.toml", list(overrides))


def test_db_heldout_is_never_trained_on() -> None:
    cfg = _cfg("tasks.num_db=9")
    trained = {t.id for t in extra_training_tasks(cfg.tasks)}
    held = heldout_tasks(cfg, "db", 5)
    assert [t.id for t in held] == [t.id for t in heldout_tasks(cfg, "db", 5)]  # deterministic
    assert len(held) == 5 and all(t.kind == "db" and t.hidden_checks for t in held)
    assert not trained & {t.id for t in held} and len(trained) == 9
    assert [int(t.id.rsplit("-", 1)[1]) for t in held] == [9, 10, 11, 12, 13]
    trained_setups = {t.setup["postgres"] for t in extra_training_tasks(cfg.tasks)}
    assert not trained_setups & {t.setup["postgres"] for t in held}  # own rows and names


def test_repo_heldout_has_only_untrained_defects() -> None:
    cfg = _cfg("tasks.num_repo=4")
    trained = extra_training_tasks(cfg.tasks)
    pairs = {t.id.rsplit("-", 1)[0] for t in trained}
    held = heldout_tasks(cfg, "repo", 12)
    assert len(trained) == 4 and len(pairs) == 4 and len(held) == 12
    assert all(t.kind == "repo" and t.id.rsplit("-", 1)[0] not in pairs for t in held)
    assert len({t.id.rsplit("-", 1)[0] for t in held}) == 4  # the 4 other defects, 3 package names each
    with pytest.raises(ValueError, match=r"eval.repo_n=13 .* tasks.num_repo=4 trains on 4 of the 8 defects"):
        heldout_tasks(cfg, "repo", 13)
    with pytest.raises(ValueError, match="leaving 0 untrained tasks; lower tasks.num_repo or eval.repo_n"):
        heldout_tasks(_cfg("tasks.num_repo=8"), "repo", 1)
    assert len(heldout_tasks(_cfg(), "repo", 10)) == 10  # nothing trained: any 10


def test_function_heldout_follows_tasks_set_and_unknown_kind_is_refused() -> None:
    cfg = _cfg()
    assert [t.id for t in heldout_tasks(cfg, "function", 3)] == [t.id for t in task_splits(cfg)[1][:3]]
    long = _cfg('tasks.set="long"', "tasks.long_modules=3")
    held = heldout_tasks(long, "function", 2)
    assert len(held) == 2 and all(t.source == "long" for t in held)
    with pytest.raises(ValueError, match="held-out kind 'sql' is unknown"):
        heldout_tasks(cfg, "sql", 1)


def test_eval_suites_accept_db_and_repo() -> None:
    cfg = _cfg('eval.suites=["db", "repo"]', "eval.db_n=2", "eval.repo_n=3")
    assert cfg.eval.suites == ["db", "repo"] and (cfg.eval.db_n, cfg.eval.repo_n) == (2, 3)
    with pytest.raises(ValueError, match="eval.suites"):
        _cfg('eval.suites=["sql"]')


@pytest.mark.skipif(postgres_available() is not None, reason=str(postgres_available()))
def test_run_eval_plays_db_and_repo_suites_through_the_environment(tmp_path: Path) -> None:
    from shipyard.eval.command import run_eval

    cfg = _cfg(
        'eval.suites=["db", "repo"]',
        "eval.db_n=2",
        "eval.repo_n=2",
        "tasks.num_repo=2",
        f'run.results_dir="{tmp_path}"',
        "rollout.concurrency=4",
    )
    out = run_eval(cfg)
    assert set(out) == {"db", "repo"}
    for name in ("db", "repo"):
        res = out[name]
        # an error would mean the session ran outside its environment (no database, no repository)
        assert res["n"] == 2 and res["errors"] == 0 and len(res["rewards"]) == 2
        assert res["pass1"] == sum(res["passed"]) / 2 and "flagged" in res
        lo, hi = res["ci95"]
        assert 0.0 <= lo <= res["pass1"] <= hi <= 1.0
    assert not (tmp_path / "humaneval.json").exists()  # only the humaneval suite writes there


def test_function_heldout_never_silently_shrinks() -> None:
    cfg = _cfg()  # 40 generated tasks: a held-out split of 10
    assert len(heldout_tasks(cfg, "function", 10)) == 10
    with pytest.raises(
        ValueError,
        match=r"eval.heldout_n=11 but the validation split has 10 tasks .* raise tasks.num_generated",
    ):
        heldout_tasks(cfg, "function", 11)


def test_eval_scores_a_task_file_of_ones_own(tmp_path: Path) -> None:
    """Issue 41: the `files` suite reads task files in the tasks.files format and scores them like
    any suite (pass@1, its interval, per-task results); a file the run trains on is refused."""
    from shipyard.eval.command import run_eval

    mine = tmp_path / "mine.jsonl"
    lines = [
        '{"id": "mine-one", "prompt": "Write `one()` returning 1.", "entry_point": "one", '
        '"hidden_tests": "from solution import one\\n\\ndef test_one():\\n    assert one() == 1\\n"}',
        '{"id": "mine-two", "prompt": "Write `two()` returning 2.", "entry_point": "two", '
        '"hidden_tests": "from solution import two\\n\\ndef test_two():\\n    assert two() == 2\\n"}',
    ]
    mine.write_text("\n".join(lines) + "\n")
    cfg = _cfg('eval.suites=["files"]', f'eval.files=["{mine}"]', f'run.results_dir="{tmp_path}"')
    out = run_eval(cfg)
    res = out["files"]
    assert set(out) == {"files"} and res["task_ids"] == ["mine-one", "mine-two"] and res["errors"] == 0
    assert res["n"] == 2 and res["pass1"] == sum(res["passed"]) / 2
    lo, hi = res["ci95"]
    assert 0.0 <= lo <= res["pass1"] <= hi <= 1.0
    with pytest.raises(ValueError, match="also in tasks.files: the run trains on them"):
        run_eval(_cfg('eval.suites=["files"]', f'eval.files=["{mine}"]', f'tasks.files=["{mine}"]'))
    with pytest.raises(ValueError, match='eval.suites has "files" but eval.files is empty'):
        _cfg('eval.suites=["files"]')
    with pytest.raises(ValueError, match="does not exist"):
        run_eval(_cfg('eval.suites=["files"]', f'eval.files=["{tmp_path / "nope.jsonl"}"]'))
