"""Config: TOML + dotted overrides, errors that name the field, no torch at import."""

import subprocess
import sys
from pathlib import Path

import pytest

from shipyard.config import ConfigError, load_config, to_toml

ROOT = Path(__file__).resolve().parents[2]


def test_shipped_configs_load_and_overrides_apply() -> None:
    for path in sorted((ROOT / "configs").glob("*.toml")):
        load_config(path)
    cfg = load_config(
        ROOT / "configs/demo.toml", ["trainer.lr=3e-5", "run.name=x", "trainer.betas=[0.9, 0.95]"]
    )
    assert cfg.trainer.lr == 3e-5 and cfg.run.name == "x" and cfg.trainer.betas == (0.9, 0.95)


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ("trainer.lrr=1", "trainer.lrr: unknown field"),
        ("trainer.lr=-1", "trainer.lr"),
        ("rollout.group_size=1", "rollout.group_size"),
        ("trainer.mode=fast", "trainer.mode"),
        ("nosection.x=1", "nosection: unknown field"),
        ("trainer.groups_per_step=3", "must be a multiple of rollout.num_workers"),
    ],
)
def test_bad_values_name_the_field(override: str, needle: str) -> None:
    overrides = [override] + (["rollout.num_workers=2"] if "groups_per_step" in override else [])
    with pytest.raises(ConfigError) as e:
        load_config(ROOT / "configs/demo.toml", overrides)
    assert needle in str(e.value)


def test_missing_file_and_bad_override_syntax(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml")
    with pytest.raises(ConfigError, match="section.field=value"):
        load_config(None, ["trainer.lr"])


@pytest.mark.parametrize("name", ["demo.toml", "online.toml"])  # online: a list of sections (gate suites)
def test_dry_run_output_round_trips(tmp_path: Path, name: str) -> None:
    cfg = load_config(ROOT / "configs" / name, ["trainer.steps=7"])
    p = tmp_path / "resolved.toml"
    p.write_text(to_toml(cfg))
    assert load_config(p) == cfg


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ("online.reward.weights={stars=1.0}", "unknown signal kind(s) ['stars']"),
        (
            "online.gate.suites=[{kind='heldout', target=true}, {kind='humaneval', target=true}]",
            "at most one suite",
        ),
        ("online.gate.suites=[{kind='regression'}]", "needs path"),
        ("eval.samples_per_task=0", "eval.samples_per_task"),
        ('rollout.server_urls=["10.0.0.5:8100"]', "is not an http(s) URL"),
        ("inference={port=65535, num_servers=2}", "choose a port at most 65534"),
    ],
)
def test_online_and_eval_fields_are_validated(override: str, needle: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(ROOT / "configs/online.toml", [override])
    assert needle in str(e.value)


def test_config_and_cli_import_without_torch() -> None:
    code = "import sys, shipyard.config, shipyard.cli; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_cli_dry_run_and_error_exit_code() -> None:
    cli = [sys.executable, "-m", "shipyard.cli"]
    ok = subprocess.run(
        [*cli, "train", str(ROOT / "configs/demo.toml"), "trainer.steps=3", "--dry-run"],
        capture_output=True,
        text=True,
    )
    assert ok.returncode == 0 and "steps = 3" in ok.stdout
    bad = subprocess.run(
        [*cli, "train", str(ROOT / "configs/demo.toml"), "agent.max_turn=3"], capture_output=True, text=True
    )
    assert bad.returncode == 2 and "agent.max_turn: unknown field" in bad.stderr
