"""The online trainer, the gate and the serving line with the tiny model, a real PostgreSQL and
local stores.

Checked: generations sampled by the real engine and rewarded by feedback train the policy in the
order their rewards matured (the weights move; the cursor advances; a restarted trainer resumes at
its cursor and never takes a generation twice); too-stale generations and ones sampled at another
temperature are dropped, not trained on; per-prompt leave-one-out baselines; the gate's rule
(a significant regression rejects, a target that falls rejects, otherwise promote) and a real gate
run (the same weights with the same seeds give a difference of exactly 0); promotion and rollback
publish new serving versions whose weights are the candidate's and the old version's, with every
decision recorded.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from shipyard.config.load import load_config
from shipyard.config.schema import OnlineTrainerConfig, ShipyardConfig
from shipyard.envs.services.postgres import postgres_available
from shipyard.inference.engine.engine import EmbeddedEngine
from shipyard.inference.types import GenerateRequest, SamplingParams
from shipyard.models.loading import load_model
from shipyard.online.database import OnlineDB
from shipyard.online.gate import SuiteResult, decide, run_gate
from shipyard.online.postgres import LocalPostgres
from shipyard.online.serving import ServingLine
from shipyard.online.trainer import Baselines, OnlineTrainer
from shipyard.online.types import FeedbackEvent, GenerationRecord
from shipyard.store.local import LocalStore
from shipyard.weights.publisher import named_params

pytestmark = pytest.mark.skipif(postgres_available() is not None, reason=str(postgres_available()))
ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ["Write add(a, b).", "Write a function that reverses a string."]


def _cfg(tmp_path: Path, *extra: str) -> ShipyardConfig:
    return load_config(
        ROOT / "configs" / "tiny.toml",
        [
            f'run.output_dir="{tmp_path}"',
            "sampling.temperature=1.0",
            "online.reward.mature_after_s=0",
            "online.trainer.batch_size=8",
            "online.trainer.min_batch=4",
            "online.trainer.candidate_every=1",
            "trainer.lr=1e-3",
            *extra,
        ],
    )


def _serve_and_log(
    db: OnlineDB, engine: EmbeddedEngine, version: int, n: int, t0: float, temp: float = 1.0, tag: str = "a"
) -> list[str]:
    """Sample ``n`` generations with the real engine, log them as the gateway would, thumb them."""
    tok = engine.tokenizer
    ids, events, records = [], [], []
    for i in range(n):
        msgs = [{"role": "user", "content": PROMPTS[i % 2]}]
        prompt = list(
            tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=True)[
                "input_ids"
            ]
        )
        [res] = engine.generate(
            [GenerateRequest(prompt, SamplingParams(temperature=temp, max_tokens=8, seed=i))]
        )
        gid = f"req{tag}{version}-{i}/0"
        records.append(
            GenerationRecord(
                gid,
                gid[:-2],
                "s",
                "",
                t0 + i,
                "tiny",
                version,
                prompt,
                res.token_ids,
                res.logprobs,
                [version] * len(res.token_ids),
                res.finish_reason,
                1.0,
                msgs,
                "def f():\n    return 1",
                temp,
            )
        )
        events.append(
            FeedbackEvent(
                f"e-{gid}", "thumb", 1.0 if i % 4 < 2 else -1.0, gid, occurred_at=t0 + i, received_at=t0 + i
            )
        )
        ids.append(gid)
    db.write_generations(records)
    db.write_feedback(events)
    return ids


def _weights(trainer: OnlineTrainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in named_params(trainer.policy.model).items()}


def test_online_steps_train_in_maturity_order_and_resume(db: OnlineDB, tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    serving = {"v": 0}
    cands = LocalStore(tmp_path / "candidates")
    trainer = OnlineTrainer(cfg, db, cands, tmp_path / "run", lambda: serving["v"])
    engine = EmbeddedEngine(*load_model(cfg.model), max_batch=4)
    assert trainer.step() is None  # nothing matured yet
    now = time.time() - 100
    _serve_and_log(db, engine, 0, 8, now)
    before = _weights(trainer)
    m = trainer.step()
    assert m is not None and m["online/items"] == 8 and m["step"] == 1 and m["online/candidate"] == 1
    assert m["online/baseline_loo"] == 8 and m["train/num_seqs"] == 8  # two prompts, four each: leave-one-out
    after = _weights(trainer)
    assert any(not torch.equal(before[k], after[k]) for k in before)  # the policy moved
    assert trainer.publisher.has(1) and not trainer.publisher.has(2)
    assert trainer.step() is None  # the cursor is past all eight
    # a restarted trainer resumes at its cursor: the same weights, no second pass over the eight
    again = OnlineTrainer(cfg, db, cands, tmp_path / "run", lambda: serving["v"])
    assert again.steps == 1 and again.state["cursor"] == trainer.state["cursor"] and again.step() is None
    assert all(torch.equal(after[k], v) for k, v in _weights(again).items())
    # stale (served 5 versions ago, lag bound 4) and other-temperature generations are dropped
    serving["v"] = 5
    _serve_and_log(db, engine, 0, 4, now + 10, tag="b")
    _serve_and_log(db, engine, 5, 4, now + 20, temp=0.5, tag="b")
    m = again.step()
    assert m is not None and m["online/dropped_stale"] == 4 and m["online/dropped_temperature"] == 4
    assert m["online/items"] == 0 and "train/loss" not in m


def test_baselines_leave_one_out_then_history_then_global() -> None:
    b = Baselines(OnlineTrainerConfig(baseline="prompt"))
    adv, src = b.advantages(["p", "p", "q"], [1.0, 0.0, 0.5])
    assert adv == [1.0, -1.0, pytest.approx(0.0)] and src == {
        "online/baseline_loo": 2.0,
        "online/baseline_step": 1.0,
    }
    adv, src = b.advantages(["p", "r"], [1.0, 1.0])
    assert adv[0] == pytest.approx(0.5)  # p's history: 1, 0
    assert adv[1] == pytest.approx(1.0 - 0.5)  # r is new: the running mean of 1, 0, 0.5
    assert src == {"online/baseline_history": 1.0, "online/baseline_global": 1.0}
    restored = Baselines(OnlineTrainerConfig(), b.state())
    assert restored.state() == b.state()


def _suite(name: str, diff: float, low: float, high: float, target: bool = False) -> SuiteResult:
    return SuiteResult(name, 50, 0.5, 0.5 + diff, diff, low, high, high < 0, target)


def test_gate_rule() -> None:
    ok = decide(
        2, 1, [_suite("heldout", 0.04, -0.02, 0.10, target=True), _suite("humaneval", -0.01, -0.05, 0.03)]
    )
    assert ok.promote and "no significant regression" in ok.reason
    bad = decide(
        2, 1, [_suite("heldout", 0.10, 0.02, 0.18, target=True), _suite("regression0", -0.2, -0.3, -0.1)]
    )
    assert not bad.promote and "regression0" in bad.reason
    fell = decide(2, 1, [_suite("heldout", -0.02, -0.08, 0.04, target=True)])
    assert not fell.promote and "must not fall" in fell.reason
    # target_fall_z: the same fall is within one standard error (se = 0.12 / 3.92 = 0.031); a fall of
    # 0.09 that is not significant (se = 0.05) is beyond 1.28 standard errors, not beyond 2
    assert decide(2, 1, [_suite("heldout", -0.02, -0.08, 0.04, target=True)], fall_z=1.0).promote
    wide = _suite("heldout", -0.09, -0.09 - 1.96 * 0.05, -0.09 + 1.96 * 0.05, target=True)
    beyond = decide(2, 1, [wide], fall_z=1.28)
    assert not wide.regressed and not beyond.promote and "beyond 1.28 standard errors" in beyond.reason
    assert decide(2, 1, [wide], fall_z=2.0).promote


def test_gate_run_promotion_and_rollback(db: OnlineDB, tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, "online.gate.suites=[{kind='heldout', n=3, samples_per_task=2, target=true}]")
    model, tok = load_model(cfg.model)
    base = {k: v.detach().clone() for k, v in named_params(model).items()}
    line = ServingLine(LocalStore(tmp_path / "serving"), db)
    assert line.current() == -1 and line.publish(base, {"online": {"action": "base"}}) == 0
    engine = EmbeddedEngine(model, tok, max_batch=4)
    same = run_gate(cfg, engine, (1, base), (0, base))
    [suite] = same.suites
    assert suite.n == 3 and suite.diff == 0.0 and suite.low == suite.high == 0.0 and same.promote
    bumped = {k: v + 0.01 for k, v in base.items()}
    assert line.decide(same, bumped) == 1
    served = line.weights(1)
    assert all(torch.allclose(served[k].float(), bumped[k].float()) for k in base)
    rejected = decide(2, 1, [_suite("heldout", -0.3, -0.4, -0.2, target=True)])
    assert line.decide(rejected, None) is None and line.current() == 1
    assert line.rollback(0, reason="test") == 2
    back = line.weights(2)
    assert all(torch.equal(back[k], line.weights(0)[k]) for k in base)
    actions = [(d["action"], d["serving_before"], d["serving_after"]) for d in line.decisions()]
    assert actions == [("rollback", 1, 2), ("reject", 1, None), ("promote", 0, 1)]
    assert line.status()["recorded_but_missing"] == []
    with pytest.raises(ValueError, match="serving versions are 0..2"):
        line.rollback(7)


def test_cli_status_and_rollback(
    db: OnlineDB, pg: LocalPostgres, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    from shipyard.cli import main
    from shipyard.store.run import stamp_new_run

    model, _ = load_model(_cfg(tmp_path).model)
    base = {k: v.detach().clone() for k, v in named_params(model).items()}
    line = ServingLine(stamp_new_run(LocalStore(tmp_path / "store"), "prod"), db)
    line.publish(base, {})
    line.publish({k: v * 2 for k, v in base.items()}, {})
    args = [
        str(ROOT / "configs" / "tiny.toml"),
        "run.name=prod",
        f'store.root="{tmp_path / "store"}"',
        f'online.db.dsn="{pg.dsn}"',
    ]
    assert main(["online", "rollback", "0", *args]) == 0
    assert '"serving_version": 2' in capsys.readouterr().out
    assert all(torch.equal(line.weights(2)[k], base[k]) for k in base)
    assert main(["online", "status", *args]) == 0
    out = capsys.readouterr().out
    assert '"serving_version": 2' in out and '"action": "rollback"' in out
    assert main(["online", "rollback", *args]) == 2  # no version
    assert "needs a VERSION" in capsys.readouterr().err


def test_a_candidate_is_due_by_time_as_well_as_by_steps(db: OnlineDB, tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, "online.trainer.candidate_every=1000", "online.trainer.candidate_every_s=0.001")
    trainer = OnlineTrainer(cfg, db, LocalStore(tmp_path / "candidates"), tmp_path / "run", lambda: 0)
    _serve_and_log(db, EmbeddedEngine(*load_model(cfg.model), max_batch=4), 0, 4, time.time() - 100)
    trainer.last_candidate_at -= 1.0  # the last candidate was a second ago
    m = trainer.step()
    assert m is not None and m["online/candidate"] == 1 and trainer.publisher.has(1)
