"""The harness on db and repo tasks: first message per kind, named writes into real sandboxes, refused
paths, the rolled-back trial of a migration on the session's own database, and token-exact records.

Writes go through :func:`shipyard.agent.session._act` (the dispatch every policy turn goes through)
into the sandboxes the rollout worker uses (:class:`shipyard.envs.environment.Environment`); the
grader then scores what was written. Database tests skip only without the server binaries.
"""

from __future__ import annotations

import pytest

from shipyard.agent.actions import parse_action
from shipyard.agent.session import (
    ChatFrame,
    SessionSpec,
    _act,
    first_message,
    run_session,
    workspace_files,
)
from shipyard.config.schema import AgentConfig, ModelConfig, SamplingConfig, SandboxConfig
from shipyard.envs.environment import Environment
from shipyard.envs.services.postgres import postgres_available
from shipyard.envs.tasks.db import db_tasks
from shipyard.envs.tasks.functions import generated_tasks
from shipyard.envs.tasks.kinds import FILES_REMINDER, FILES_SYSTEM_PROMPT
from shipyard.envs.tasks.long import long_tasks
from shipyard.envs.tasks.repo import apply_patch_locally, repo_tasks
from shipyard.envs.types import Sandbox, Task

CFG = SandboxConfig(timeout_s=30)
AGENT = AgentConfig()
REPO = repo_tasks(1, seed=0)[0]
DB = db_tasks(1, seed=0)[0]
OLD_SUFFIX = "\n\nReply with the complete solution.py in a ```python block."


def act(task: Task, sb: Sandbox, text: str) -> tuple[str, str]:
    return _act(AGENT, task, sb, parse_action(text, task.kind))


def _changed(task: Task) -> dict[str, str]:
    """The files the reference fix changes, with their fixed text."""
    fixed = apply_patch_locally(task.files, task.reference)
    return {p: t for p, t in fixed.items() if task.files.get(p) != t}


def test_first_message_per_kind() -> None:
    fn, lg = generated_tasks(10, seed=0)[0], long_tasks(2, seed=0, modules=3)[0]
    assert first_message(fn) == fn.prompt + OLD_SUFFIX  # unchanged for the trained runs
    long_msg = first_message(lg)
    assert long_msg.startswith(lg.prompt) and "`cat part_00.py`" in long_msg and "solution.py" in long_msg
    db = first_message(DB)
    assert db.startswith(DB.prompt) and "```sql block: it becomes migration.sql" in db
    assert "psql service=db -c '\\d'" in db and "rolled back" in db and "SUBMIT" in db
    repo = first_message(REPO)
    assert repo.startswith(REPO.prompt) and "```python path/to/module.py" in repo
    assert "python -m pytest -q tests" in repo and "SUBMIT" in repo
    listed = repo.split("Files:\n", 1)[1].split("\n\n", 1)[0].splitlines()
    assert listed == sorted(REPO.files) and REPO.reference not in repo
    many = Task(
        id="big", prompt="p", entry_point="", kind="repo", files={f"m{i:03d}.py": "" for i in range(45)}
    )
    assert "m039.py\n... and 5 more" in first_message(many) and "m040.py" not in first_message(many)


def test_repo_writes_named_files_and_refuses_protected_paths() -> None:
    [(path, fixed)] = _changed(REPO).items()
    test_path = next(p for p in REPO.files if p.startswith("tests/"))
    with Environment(CFG) as env, env.session(REPO) as hooks:
        sb = hooks.sandbox(workspace_files(REPO))
        feedback, done = act(REPO, sb, f"Fix:\n```python {path}\n{fixed}```")
        assert (feedback, done) == (f"{path} written.", "")  # repo sessions end on SUBMIT only
        assert sb.read(path) == fixed
        refused = {
            f"```python {test_path}\ndef test_x():\n    pass\n```": f"Cannot write {test_path}: it is a protected file",
            "```python /tmp/evil.py\nX = 1\n```": "Cannot write /tmp/evil.py: paths are relative to the workspace",
            "```python ../evil.py\nX = 1\n```": "Cannot write ../evil.py: paths may not leave the workspace",
            "```toml pyproject.toml\n[tool]\n```": "Cannot write pyproject.toml: it is a protected file",
            "```python\nX = 1\n```": "Name the file to write after the language",
            "```text .git/config\n[core]\n```": "Cannot write .git/config: the repository's .git directory",
        }
        for text, message in refused.items():
            feedback, done = act(REPO, sb, text)
            assert feedback.startswith(message) and done == "", (text, feedback)
        assert sb.read(test_path) == REPO.files[test_path] and "evil.py" not in sb.files()
        assert act(REPO, sb, "thinking...") == (FILES_REMINDER, "")
        assert act(REPO, sb, "SUBMIT") == ("", "submit")
        res = hooks.grade(REPO, sb.files())
        sb.close()
    assert res.reward == 1.0 and hooks.flags == []


def test_function_named_write_of_solution_is_the_old_write() -> None:
    task = generated_tasks(10, seed=0)[0]
    with Environment(CFG) as env, env.session(task) as hooks:
        sb = hooks.sandbox(workspace_files(task))
        unnamed = act(task, sb, f"```python\n{task.reference}```")
        named = act(task, sb, f"```python solution.py\n{task.reference}```")
        assert unnamed == named == ("solution.py written. Visible tests passed.", "passed")
        helper = act(task, sb, "```python helper.py\nK = 3\n```")
        assert helper == ("helper.py written. Visible tests passed.", "passed")
        assert (
            sb.read("helper.py") == "K = 3\n" and sb.read("solution.py") == task.reference.strip("\n") + "\n"
        )
        assert act(task, sb, "```python test_visible.py\n\n```")[0].startswith(
            "Cannot write test_visible.py: it is a protected file"
        )
        sb.close()
    no_visible = Task(id="nv", prompt="p", entry_point="f", hidden_tests="def test_a():\n    pass\n")
    with Environment(CFG) as env, env.session(no_visible) as hooks:
        sb = hooks.sandbox({})
        assert act(no_visible, sb, "```python helper.py\nK = 3\n```") == ("helper.py written.", "")
        assert act(no_visible, sb, "```python\nK = 3\n```") == ("solution.py written.", "written")
        sb.close()


@pytest.mark.skipif(postgres_available() is not None, reason=str(postgres_available()))
def test_db_migration_write_is_tried_and_rolled_back_then_graded() -> None:
    with Environment(CFG) as env, env.session(DB) as hooks:
        sb = hooks.sandbox(workspace_files(DB))
        feedback, done = act(DB, sb, "```sql\nALTER TABLE no_such_table ADD x int;\n```")
        assert feedback.startswith("migration.sql written. Trial run on your database (rolled back) failed:")
        assert 'relation "no_such_table" does not exist' in feedback and done == ""
        ok = ("migration.sql written. Trial run on your database (rolled back): OK.", "passed")
        assert act(DB, sb, f"```sql\n{DB.reference}```") == ok
        # rolled back: the same migration applies again (adding the constraint twice would fail)
        assert act(DB, sb, f"```sql migration.sql\n{DB.reference}```") == ok
        assert act(DB, sb, "```sql notes.sql\nSELECT 1;\n```") == ("notes.sql written.", "")
        assert "protected" in act(DB, sb, "```ini .pg_service.conf\n[db]\n```")[0]
        assert sb.read("migration.sql") == DB.reference.strip("\n") + "\n"
        res = hooks.grade(DB, sb.files())
        sb.close()
    assert res.reward == 1.0 and hooks.flags == []


@pytest.fixture(scope="module")
def engine_tok():
    from shipyard.inference.engine.engine import EmbeddedEngine
    from shipyard.models.loading import load_model

    model, tok = load_model(ModelConfig(source="tiny", tiny="dense"))
    return EmbeddedEngine(model, tok, max_batch=4), tok


def test_repo_session_record_is_token_exact_with_the_files_prompt(engine_tok) -> None:
    from shipyard.inference.client import LocalInferenceClient

    engine, tok = engine_tok
    frame = ChatFrame(tok)
    with Environment(CFG) as env, env.session(REPO) as hooks:
        spec = SessionSpec(
            client=LocalInferenceClient(engine),
            frame=frame,
            agent=AgentConfig(max_turns=2, max_session_tokens=2000),
            sampling=SamplingConfig(max_tokens=16),
            bench=hooks,
        )
        [traj] = run_session(spec, REPO, "g", 0)
    prompt = frame.prompt_ids(first_message(REPO), FILES_SYSTEM_PROMPT)
    assert traj.error is None and traj.token_ids[: traj.prompt_len] == prompt
    assert traj.prompt_len == len(prompt) and not any(traj.loss_mask[: traj.prompt_len])
    env_ids = [
        t
        for t, m in zip(traj.token_ids[traj.prompt_len :], traj.loss_mask[traj.prompt_len :], strict=True)
        if m == 0
    ]
    expected = frame.tool_turn_ids(
        FILES_REMINDER, closed_by_eos=False
    )  # random tiny model: no action, no EOS
    assert env_ids in (expected, expected[1:]) and traj.reward == 0.0  # nothing fixed
