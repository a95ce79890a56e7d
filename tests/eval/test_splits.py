"""The evaluation protocol's splits: validation to tune on, test to report, families never trained.

Checked, on the demo's task set (2,000 generated tasks, difficulty <= 2, 8 unseen families, half
of the non-validation tasks in test): training, validation, test and the unseen-families suite
share no task; no unseen family's task is in training, validation or test; the unseen families
come from both difficulties; validation is exactly the held-out split runs had before the test
split existed (less unseen families' tasks), so the configurations tuned on it were tuned on
validation, not test; two configs built alike draw the same tasks; a test split asked of a config
without one, unseen families or a test split on the long set, or more tasks than a split holds, is
a ValueError naming the fields.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from shipyard.config.load import load_config
from shipyard.envs.tasks.function_families import FAMILIES
from shipyard.envs.tasks.splits import heldout_tasks, task_splits, unseen_families, unseen_family_tasks

ROOT = Path(__file__).resolve().parents[2]
DEMO_TASKS = (
    "tasks.num_generated=2000",
    "tasks.max_difficulty=2",
    "tasks.heldout_frac=0.25",
    "tasks.test_frac=0.5",
    "tasks.unseen_families=8",
)


def _cfg(*overrides: str):
    return load_config(ROOT / "configs" / "tiny.toml", list(overrides))


def _ids(tasks) -> set[str]:
    return {t.id for t in tasks}


def test_splits_are_disjoint_and_unseen_families_are_never_trained() -> None:
    val = _cfg(*DEMO_TASKS)
    test = _cfg(*DEMO_TASKS, 'eval.split="test"')
    unseen = unseen_families(val)
    assert len(unseen) == 8 and unseen == unseen_families(test)
    assert {f.difficulty for f in FAMILIES if f.key in unseen} == {1, 2}
    train, validation = task_splits(val)
    test_split = heldout_tasks(test, "function", 250)
    unseen_val = unseen_family_tasks(val, 80)
    unseen_test = unseen_family_tasks(test, 200)
    splits = [train, validation, test_split, unseen_val, unseen_test]
    assert sum(map(len, splits)) == len(set().union(*map(_ids, splits)))  # no task in two
    assert not {t.family for t in train + validation + test_split} & unseen
    assert {t.family for t in unseen_val + unseen_test} <= unseen
    assert len({t.family for t in train}) == 16 == len({t.family for t in test_split})
    assert len(train) > 250 and all(t.difficulty <= 2 for s in splits for t in s)


def test_validation_is_the_held_out_split_tuned_on_before() -> None:
    old = _cfg("tasks.num_generated=2000", "tasks.max_difficulty=2")
    new = _cfg("tasks.num_generated=2000", "tasks.max_difficulty=2", "tasks.test_frac=0.5")
    assert [t.id for t in task_splits(new)[1]] == [t.id for t in task_splits(old)[1]]
    assert _ids(task_splits(new)[0]) < _ids(task_splits(old)[0])  # test comes out of training
    held_out = _ids(task_splits(_cfg(*DEMO_TASKS))[1])
    assert held_out < _ids(task_splits(old)[1])  # unseen families' tasks leave validation
    assert [t.id for t in heldout_tasks(new, "function", 5)] == [t.id for t in task_splits(old)[1][:5]]


def test_two_configs_built_alike_draw_the_same_tasks() -> None:
    a = _cfg(*DEMO_TASKS, 'eval.split="test"')
    b = _cfg(*DEMO_TASKS, 'eval.split="test"')
    assert [t.id for t in heldout_tasks(a, "function", 100)] == [
        t.id for t in heldout_tasks(b, "function", 100)
    ]
    assert unseen_families(_cfg(*DEMO_TASKS, "tasks.seed=7")) != unseen_families(a)  # seeded


def test_bad_split_requests_name_the_fields() -> None:
    with pytest.raises(ValueError, match=r'eval.split="test" but tasks.test_frac = 0'):
        _cfg('eval.split="test"')
    with pytest.raises(ValueError, match=r"eval.heldout_n=400 but the test split has \d+ tasks"):
        heldout_tasks(_cfg(*DEMO_TASKS, 'eval.split="test"'), "function", 400)
    with pytest.raises(ValueError, match=r"tasks.unseen_families = 0: hold some families out"):
        _cfg('eval.suites=["unseen_families"]')
    with pytest.raises(ValueError, match=r"eval.unseen_n=200 but the validation split has \d+ tasks"):
        unseen_family_tasks(_cfg(*DEMO_TASKS), 200)
    with pytest.raises(ValueError, match=r"tasks.unseen_families=24 leaves no family to train on"):
        unseen_families(_cfg(*DEMO_TASKS[:4], "tasks.unseen_families=24"))
    with pytest.raises(ValueError, match=r'tasks.unseen_families=2 need tasks.set="functions"'):
        _cfg('tasks.set="long"', "tasks.unseen_families=2")
