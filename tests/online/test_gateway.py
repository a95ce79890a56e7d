"""The online gateway with a real PostgreSQL server, the tiny model's real inference server and the
`openai` client.

Checked: the schema migrates once (a second migrate applies nothing); a served chat completion,
streamed or not, is logged token-exact (prompt ids are the chat template's, sampled ids, logprobs
and versions are the upstream's) while the client gets the upstream's answer; `store: false`
keeps nothing, and its feedback is dropped; feedback is idempotent (a retried event counts once);
with the database stopped, requests and feedback still succeed and everything lands once it is
back; matured rewards come back in maturity order; retention and the JSONL export.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch

from shipyard.config.schema import GatewayConfig, ModelConfig, OnlineRewardConfig
from shipyard.envs.services.postgres import postgres_available
from shipyard.inference.engine.engine import EmbeddedEngine
from shipyard.inference.serving.server import InferenceServer
from shipyard.models.loading import load_model
from shipyard.online.database import MIGRATIONS, OnlineDB
from shipyard.online.feedback import FeedbackClient
from shipyard.online.gateway import Gateway
from shipyard.online.postgres import LocalPostgres
from shipyard.online.reward import RewardModel
from shipyard.online.types import FeedbackEvent

pytestmark = pytest.mark.skipif(postgres_available() is not None, reason=str(postgres_available()))
MSG = [{"role": "user", "content": "Write a function add(a, b)."}]


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[Any, InferenceServer]]:
    torch.set_num_threads(1)
    model, tok = load_model(ModelConfig(source="tiny", tiny="dense"))
    with InferenceServer(EmbeddedEngine(model, tok, max_batch=4), model_name="tiny") as server:
        yield tok, server


@pytest.fixture()
def gateway(pg: LocalPostgres, served: tuple[Any, InferenceServer], db: OnlineDB) -> Iterator[Gateway]:
    cfg = GatewayConfig(upstream=served[1].url, port=0, retry_s=0.1, retry_max_s=0.5)
    with Gateway(cfg, lambda: OnlineDB(pg.dsn, connect_timeout_s=1)) as gw:
        yield gw


def _oai(gw: Gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0, timeout=120)


def _rows(db: OnlineDB, sql: str) -> list[tuple[Any, ...]]:
    with db.conn.cursor() as cur:
        cur.execute(sql)
        return cur.fetchall()


def test_migrations_apply_once(db: OnlineDB) -> None:
    assert db.schema_version() == MIGRATIONS[-1][0]
    assert db.migrate() == []  # already there
    assert _rows(db, "SELECT version FROM schema_migrations ORDER BY version") == [
        (v,) for v, _, _ in MIGRATIONS
    ]
    indexes = {r[0] for r in _rows(db, "SELECT indexname FROM pg_indexes WHERE schemaname = 'public'")}
    assert {"feedback_generation", "feedback_session", "generations_prompt", "generations_created"} <= indexes


def test_a_served_completion_is_logged_token_exact(gateway: Gateway, db: OnlineDB, served: Any) -> None:
    tok, _ = served
    with _oai(gateway) as client:
        raw = client.chat.completions.with_raw_response.create(
            model="tiny",
            messages=MSG,
            max_tokens=12,
            seed=3,
            n=2,
            user="alice",
            metadata={"session_id": "s1"},
        )
        resp = raw.parse()
        streamed = list(
            client.chat.completions.create(model="tiny", messages=MSG, max_tokens=8, seed=5, stream=True)
        )
    rid = raw.headers["x-shipyard-request-id"]
    assert rid == resp.id and raw.headers["x-shipyard-stored"] == "true"
    assert gateway.buffer.flush(30)
    rows = _rows(
        db,
        "SELECT generation_id, session_id, user_hash, prompt_ids, token_ids, logprobs, versions, "
        "weight_version, completion, latency_ms FROM generations ORDER BY generation_id",
    )
    assert len(rows) == 3
    prompt = list(
        tok.apply_chat_template(MSG, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    )
    by_id = {r[0]: r for r in rows}
    for i, choice in enumerate(resp.choices):
        row = by_id[f"{rid}/{i}"]
        ext = choice.model_extra["shipyard"]
        assert row[1] == "s1" and len(row[2]) == 64 and "alice" not in row[2]
        assert row[3] == prompt and row[4] == ext["token_ids"] and row[6] == ext["versions"]
        assert row[5] == pytest.approx(ext["logprobs"], abs=1e-6)  # real (float32) column
        assert row[7] == 0 and row[8] == choice.message.content and row[9] > 0
    stream_id = streamed[0].id
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    srow = by_id[f"{stream_id}/0"]
    assert srow[8] == text and len(srow[4]) == len(srow[5]) >= 1 and srow[3] == prompt


def test_store_false_keeps_nothing_and_drops_its_feedback(gateway: Gateway, db: OnlineDB) -> None:
    with _oai(gateway) as client:
        raw = client.chat.completions.with_raw_response.create(
            model="tiny", messages=MSG, max_tokens=4, extra_body={"store": False}
        )
    rid = raw.headers["x-shipyard-request-id"]
    assert raw.headers["x-shipyard-stored"] == "false" and raw.parse().choices[0].message is not None
    resp = httpx.post(
        f"{gateway.url}/v1/feedback",
        json={"event_id": "e-opt", "kind": "thumb", "value": 1, "request_id": rid},
    )
    assert resp.status_code == 202 and resp.json() == {"accepted": 0, "dropped_opted_out": 1}
    assert gateway.buffer.flush(30)
    assert _rows(db, "SELECT count(*) FROM generations") == [(0,)]
    assert _rows(db, "SELECT count(*) FROM feedback") == [(0,)]
    assert gateway.stats()["opted_out"] == 1


def test_feedback_is_idempotent_and_validated(gateway: Gateway, db: OnlineDB) -> None:
    fb = FeedbackClient(gateway.url)
    ev = FeedbackEvent.make("tests", -1, generation_id="r1/0", detail={"command": "pytest"})
    assert fb.send([ev]) == 1 and fb.send([ev]) == 1  # the retry is accepted by the gateway ...
    fb.abandoned("s9")
    assert gateway.buffer.flush(30)
    assert _rows(db, "SELECT count(*) FROM feedback") == [(2,)]  # ... and stored once
    assert gateway.stats()["duplicate_feedback"] == 1
    bad = httpx.post(
        f"{gateway.url}/v1/feedback", json={"event_id": "x", "kind": "stars", "value": 1, "session_id": "s"}
    )
    assert bad.status_code == 400 and "stars" in bad.json()["error"]["message"]
    with pytest.raises(ValueError, match=r"outside \[-1.0, 1.0\]"):
        FeedbackEvent("y", "thumb", 3.0, generation_id="r/0")
    fb.close()


def test_database_down_loses_nothing(gateway: Gateway, db: OnlineDB, pg: LocalPostgres) -> None:
    db.close()
    pg.stop("immediate")  # a crash, as far as PostgreSQL knows
    fb = FeedbackClient(gateway.url)
    ids = []
    with _oai(gateway) as client:
        for i in range(4):
            resp = client.chat.completions.create(model="tiny", messages=MSG, max_tokens=4, seed=i)
            ids.append(resp.id)
            fb.thumb(f"{resp.id}/0", up=i % 2 == 0)
    assert gateway.buffer.wait(lambda s: s.get("write_errors", 0) >= 1, 30)  # the writer tried and failed
    stats = gateway.stats()
    assert stats["buffered"] == 8 and stats["write_errors"] >= 1 and stats.get("dropped_overflow", 0) == 0
    pg.start()
    assert gateway.buffer.flush(60)
    back = OnlineDB(pg.dsn)
    assert {r[0] for r in _rows(back, "SELECT request_id FROM generations")} == set(ids)
    assert _rows(back, "SELECT count(*) FROM feedback") == [(4,)]
    back.close()


def test_matured_rewards_in_order_retention_and_export(db: OnlineDB, tmp_path: Path) -> None:
    from shipyard.online.types import GenerationRecord

    now = time.time()

    def rec(i: int, text: str, age_s: float) -> GenerationRecord:
        return GenerationRecord(
            f"q{i}/0",
            f"q{i}",
            "s",
            "",
            now - age_s,
            "tiny",
            1,
            [1, 2],
            [3, 4],
            [-0.5, -0.25],
            [1, 1],
            "stop",
            5.0,
            MSG,
            text,
        )

    code = "```python\ndef add(a, b):\n    return a + b\n```"
    db.write_generations([rec(0, code, 7200), rec(1, code, 7100), rec(2, "", 7000), rec(3, code, 10)])
    db.write_feedback(
        [
            FeedbackEvent("a", "thumb", -1, "q0/0", occurred_at=now - 7000, received_at=now),
            FeedbackEvent(
                "b", "thumb", 1, "q0/0", occurred_at=now - 6000, received_at=now
            ),  # changed its mind
            FeedbackEvent("c", "tests", -1, "q0/0", occurred_at=now - 6000, received_at=now),
            FeedbackEvent("d", "thumb", 1, "q2/0", occurred_at=now - 6000, received_at=now),  # a dodge, liked
        ]
    )
    model = RewardModel(OnlineRewardConfig(mature_after_s=3600))
    assert db.mature(model, now) == 3  # q3 is too young
    got = db.rewarded(0)
    assert [(item.record.generation_id, round(item.reward, 3)) for _, item in got] == [
        ("q0/0", -0.2),
        ("q2/0", -1.0),
    ]
    assert got[0][1].breakdown["rule"] == "weighted_mean" and got[1][1].breakdown["dodge"] == "empty"
    assert db.rewarded(got[0][0]) == got[1:]  # a cursor
    assert db.counts() == {
        "generations": 4,
        "feedback": 4,
        "matured": 3,
        "rewarded": 2,
    }  # q1: no signal, skipped
    out = tmp_path / "export.jsonl"
    assert db.export_jsonl(out) == 4
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert (
        lines[0]["generation_id"] == "q0/0" and len(lines[0]["feedback"]) == 3 and lines[3]["reward"] is None
    )
    assert db.retain(days=7050 / 86400, now=now) == {"generations": 2, "feedback": 0}
    assert db.counts()["generations"] == 2 and db.counts()["matured"] == 1  # rewards go with their generation


def test_a_full_buffer_drops_the_oldest_generation_counted_never_feedback(
    served: tuple[Any, InferenceServer], db: OnlineDB, pg: LocalPostgres
) -> None:
    db.close()
    pg.stop("immediate")
    cfg = GatewayConfig(upstream=served[1].url, port=0, buffer_max=3, retry_s=0.1, retry_max_s=0.2)
    with Gateway(cfg, lambda: OnlineDB(pg.dsn, connect_timeout_s=1)) as gw, _oai(gw) as client:
        ids = [client.chat.completions.create(model="tiny", messages=MSG, max_tokens=2).id for _ in range(5)]
        assert gw.stats()["dropped_overflow"] == 2 and gw.stats()["buffered"] == 3  # counted, never silent
        events = [{"event_id": f"f{i}", "kind": "thumb", "value": 1, "request_id": ids[i]} for i in range(3)]
        ok = httpx.post(f"{gw.url}/v1/feedback", json={"events": events})
        assert ok.status_code == 202  # feedback pushes generation records out, not the other way round
        assert gw.stats()["dropped_overflow"] == 5 and gw.stats()["buffered"] == 3
        more = httpx.post(
            f"{gw.url}/v1/feedback",
            json={"event_id": "f9", "kind": "thumb", "value": -1, "request_id": ids[4]},
        )
        assert more.status_code == 503 and more.headers["retry-after"] == "1"  # full of feedback: retry later
        pg.start()
        assert gw.buffer.flush(60)
    back = OnlineDB(pg.dsn)
    assert _rows(back, "SELECT event_id FROM feedback ORDER BY event_id") == [("f0",), ("f1",), ("f2",)]
    back.close()
