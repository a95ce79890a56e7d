"""`tasks.files` paths are made absolute once, when the config is loaded.

Checked: an entry written in a config file is relative to that file's directory, an override to
the working directory at load time, absolute and `~` entries are kept (expanded); the loaded tasks
are the same whatever directory a process reads them from later (Ray actors run elsewhere).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from shipyard.config import load_config
from shipyard.envs.tasks.files import extra_training_tasks, load_task_file

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "docs" / "examples" / "tasks.toml"


def test_config_file_entries_resolve_against_the_file_and_overrides_against_cwd(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    conf_dir, elsewhere = tmp_path / "run" / "configs", tmp_path / "elsewhere"
    (conf_dir / "tasks").mkdir(parents=True)
    elsewhere.mkdir()
    shutil.copy(EXAMPLE, conf_dir / "tasks" / "mine.toml")
    shutil.copy(EXAMPLE, elsewhere / "cwd.toml")
    conf = conf_dir / "run.toml"
    conf.write_text(f'[tasks]\nfiles = ["tasks/mine.toml", "{EXAMPLE}"]\n')
    monkeypatch.chdir(elsewhere)
    cfg = load_config(os.path.relpath(conf, elsewhere))  # a relative config path works too
    assert cfg.tasks.files == [str(conf_dir / "tasks" / "mine.toml"), str(EXAMPLE)]
    over = load_config(conf, ['tasks.files=["cwd.toml", "~/x.toml"]'])
    assert over.tasks.files == [str(elsewhere / "cwd.toml"), os.path.expanduser("~/x.toml")]
    # another process in another directory reads the same tasks
    monkeypatch.chdir(tmp_path)
    tasks = extra_training_tasks(cfg.tasks.model_copy(update={"files": cfg.tasks.files[:1]}))
    assert [t.id for t in tasks] == [t.id for t in load_task_file(EXAMPLE)] and len(tasks) == 2


def test_missing_relative_entry_names_the_resolved_path(tmp_path: Path) -> None:
    conf = tmp_path / "run.toml"
    conf.write_text('[tasks]\nfiles = ["nope/tasks.toml"]\n')
    cfg = load_config(conf)
    with pytest.raises(ValueError, match=f"task file '{tmp_path}/nope/tasks.toml' does not exist"):
        extra_training_tasks(cfg.tasks)
