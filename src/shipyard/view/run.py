"""One run as ``shipyard view`` reads it: its directory and its store, never a copy of either.

Contract: :class:`RunReader` opens a run directory (``<run.output_dir>/<run.name>``) and answers
what the dashboard and the rollout viewer ask, re-reading what changed on every call so a live run
shows its new steps:

- :meth:`status`: identity, progress (steps done of planned), finished or not, and ``problems``:
  plain sentences for what is missing or unreadable (no ``config.json`` yet, a store that cannot
  be reached or belongs to another run, torn metric lines, unreadable rollout batches);
- :meth:`metrics`: the trainer's ``train`` records from ``metrics.jsonl`` after the first
  ``after`` (read incrementally; a half-written last line waits for its newline);
- :meth:`evals`: held-out pass@1 before/after with 95% intervals (``eval_before.json``,
  ``summary.json``); :meth:`rewards`: the per-step reward distribution of trained rollouts;
- :meth:`servers`: per inference server, every version it adopted and how long after its
  publication (``adoptions/`` of the run's store) and its lease;
- :meth:`rollouts` / :meth:`rollout`: the paged rollout list (:mod:`shipyard.view.index`) and one
  whole session: turns, tool calls and outputs, the diff of the files it changed, the grader's
  report, summaries at segment boundaries, and per sampled token its text, the sampler's logprob
  and the trainer's (``run_dir/logprobs/``, :mod:`shipyard.trainer.records`).

User mistakes (a directory that does not exist or is not a run, a rollout id the run does not
hold) raise ``ValueError`` / ``LookupError`` with a message that says what to do.
Limits: a store given by a relative ``store.root`` is resolved against the directory the run was
started from (derived from ``run.output_dir``); a run whose store moved cannot show rollouts.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

from shipyard.agent.types import Trajectory
from shipyard.eval.stats import paired_diff_ci, wilson_ci
from shipyard.trainer.records import read_step_logprobs, token_key
from shipyard.view.index import RolloutIndex
from shipyard.view.types import RolloutQuery
from shipyard.weights.types import ADOPTIONS_PREFIX, SUBSCRIBERS_PREFIX

RUN_FILES = ("config.json", "run.json", "metrics.jsonl")
LIVE_S = 120.0
"""A run whose metrics changed this recently (and that has no summary yet) counts as running."""


class RunReader:
    def __init__(self, run_dir: str | Path, label: str | None = None) -> None:
        path = Path(run_dir).expanduser()
        if not path.exists():
            raise ValueError(
                f"run directory {str(path)!r} does not exist (a run directory is <run.output_dir>/<run.name>, e.g. runs/demo)"
            )
        if not path.is_dir() or not any((path / f).exists() for f in RUN_FILES):
            raise ValueError(
                f"{str(path)!r} is not a Shipyard run directory: it has none of {', '.join(RUN_FILES)} "
                "(a run directory is <run.output_dir>/<run.name>, e.g. runs/demo)"
            )
        self.dir = path.resolve()
        self.label = label or self.dir.name
        self._lock = threading.RLock()
        self._offset = 0
        self._train: list[dict[str, Any]] = []
        self._consumed: dict[str, int] = {}
        self._bad_lines = 0
        self._adoptions: dict[str, dict[str, Any]] = {}
        self._index: RolloutIndex | None = None
        self._store_problem: str | None = None
        self._store_tried = 0.0
        self._tokenizer: Any = None
        self._tokenizer_lock = threading.Lock()

    # -- files of the run directory ------------------------------------------------------------
    def _json(self, name: str) -> dict[str, Any] | None:
        try:
            return json.loads((self.dir / name).read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return None

    def config(self) -> dict[str, Any] | None:
        return self._json("config.json")

    def _read_metrics(self) -> None:
        """Parse the lines appended since the last call (complete lines only)."""
        try:
            with open(self.dir / "metrics.jsonl", "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return
        end = data.rfind(b"\n") + 1
        self._offset += end
        seen = {r["step"] for r in self._train}
        for line in data[:end].splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                self._bad_lines += 1
                continue
            if rec.get("kind") == "train" and rec.get("step") not in seen:  # a resume re-logs a step
                seen.add(rec["step"])
                self._train.append({k: v for k, v in rec.items() if "/bucket_" not in k})
            elif rec.get("kind") == "consumed":
                for group in rec.get("groups", []):
                    self._consumed[group] = int(rec["step"])

    def metrics(self, after: int = 0) -> dict[str, Any]:
        """``train`` records after the first ``after``; ``next`` is the count to pass next time."""
        with self._lock:
            self._read_metrics()
            return {"records": self._train[after:], "next": len(self._train)}

    def status(self) -> dict[str, Any]:
        with self._lock:
            self._read_metrics()
            cfg, identity, summary = self.config(), self._json("run.json"), self._json("summary.json")
            problems = []
            if cfg is None:
                problems.append(
                    f"no config.json in {self.dir}: the run has not started writing (or was started by an older Shipyard)"
                )
            if not (self.dir / "metrics.jsonl").exists():
                problems.append("no metrics.jsonl yet: the trainer has not finished its first step")
            if self._bad_lines:
                problems.append(
                    f"{self._bad_lines} line(s) of metrics.jsonl could not be parsed and were skipped"
                )
            index = self.index()
            if self._store_problem:
                problems.append(self._store_problem)
            if index is not None and index.unreadable:
                first = next(iter(index.unreadable.items()))
                problems.append(
                    f"{len(index.unreadable)} rollout batch(es) unreadable, e.g. {first[0]}: {first[1]}"
                )
            done = self._train[-1]["step"] if self._train else 0
            planned = (cfg or {}).get("trainer", {}).get("steps")
            return {
                "label": self.label,
                "dir": str(self.dir),
                "name": (identity or {}).get("name", self.dir.name),
                "run_id": (identity or {}).get("run_id"),
                "created_at": (identity or {}).get("created_at"),
                "steps_done": done,
                "steps_planned": planned,
                "state": self._state(summary),
                "model": (cfg or {}).get("model", {}),
                "precision": ((summary or {}).get("trainer") or {}).get("precision"),
                "problems": problems,
                "rollouts_indexed": index.indexed if index is not None else 0,
                "rollout_batches": index.batches if index is not None else 0,
            }

    def _state(self, summary: dict[str, Any] | None) -> str:
        if summary is not None:
            return "finished"
        try:
            age = time.time() - (self.dir / "metrics.jsonl").stat().st_mtime
        except FileNotFoundError:
            return "starting"
        return "running" if age < LIVE_S else "stopped"

    def health(self) -> list[dict[str, Any]]:
        """Every watched component's last progress (``health.jsonl``, :mod:`shipyard.metrics.health`):
        its phase, ticks, seconds since its last progress (as of now), deadline, and ``state``:
        ``stalled`` when a stall was recorded and no progress came after it, else ``ok``; and what
        the watchers recorded of it: ``stalls`` and ``crashes`` (a Ray worker's run that failed, its
        actor that died) and the ``last_event`` (``kind``, ``at``, ``what``: the stall's reason or the
        crash's error, ``action``), None when there was none."""
        path = self.dir / "health.jsonl"
        if not path.is_file():
            return []
        snapshot: list[dict[str, Any]] = []
        stalled: dict[str, float] = {}  # component -> the last progress its stall was named at
        events: dict[str, list[dict[str, Any]]] = {}  # component -> its stalls and crashes, in order
        for line in path.read_text().splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line being written
            if rec.get("kind") == "snapshot":
                snapshot = rec.get("components", [])
            elif rec.get("kind") == "stall":
                stalled[rec["component"]] = rec["last_progress_at"]
                snapshot = [c for c in snapshot if c["component"] != rec["component"]] + [rec]
            if rec.get("kind") in ("stall", "crash"):
                events.setdefault(rec["component"], []).append(rec)
        now = time.time()
        return [
            {
                **{k: c[k] for k in ("component", "phase", "ticks", "deadline_s")},
                "age_s": round(now - c["last_progress_at"], 1),
                "state": "stalled" if stalled.get(c["component"]) == c["last_progress_at"] else "ok",
                **_events(events.get(c["component"], [])),
            }
            for c in sorted(snapshot, key=lambda c: c["component"])
        ]

    def evals(self) -> list[dict[str, Any]]:
        """Held-out evaluations with their 95% intervals (Wilson for a rate, paired for a difference):
        ``eval_before.json`` and ``eval_after.json`` per task, else the after figures of ``summary.json``;
        each named with the split it scored (``eval.split`` of the run's ``config.json``)."""
        out = []
        held = f"held-out ({((self.config() or {}).get('eval') or {}).get('split', 'validation')})"
        before, after = self._json("eval_before.json"), self._json("eval_after.json")
        for label, res in (("before", before), ("after", after)):
            if res is not None and res.get("passed"):
                k, n = sum(res["passed"]), len(res["passed"])
                lo, hi = wilson_ci(k, n)
                out.append({"name": f"{held} pass@1 {label}", "n": n, "value": k / n, "low": lo, "high": hi})
        if before and after and before.get("task_ids") == after.get("task_ids"):
            diff, lo, hi = paired_diff_ci(
                [float(p) for p in before["passed"]], [float(p) for p in after["passed"]]
            )
            n = len(before["passed"])
            out.append({"name": f"{held} difference (paired)", "n": n, "value": diff, "low": lo, "high": hi})
            return out
        demo = (self._json("summary.json") or {}).get("demo")
        if demo is not None:
            n, rate = demo["heldout_n"], demo["heldout_after"]
            lo, hi = wilson_ci(round(rate * n), n)
            out.append({"name": f"{held} pass@1 after", "n": n, "value": rate, "low": lo, "high": hi})
            out.append(
                {
                    "name": f"{held} difference (paired)",
                    "n": n,
                    "value": demo["heldout_diff"],
                    "low": demo["heldout_diff_ci95_low"],
                    "high": demo["heldout_diff_ci95_high"],
                }
            )
        return out

    # -- the run's store -----------------------------------------------------------------------
    def index(self) -> RolloutIndex | None:
        """The rollout index over the run's store (None while the store cannot be opened)."""
        if self._index is not None or time.monotonic() - self._store_tried < 5.0:
            return self._index
        self._store_tried = time.monotonic()
        try:
            store = self._open_store()
        except (ValueError, OSError, ConnectionError) as e:
            self._store_problem = f"rollouts and servers unavailable: {e}"
            return None
        self._store_problem = None
        self._index = RolloutIndex(store)
        self._index.set_consumed(self._consumed)
        return self._index

    def _open_store(self) -> Any:
        from shipyard.config.schema import StoreConfig
        from shipyard.store.run import open_run

        cfg, identity = self.config(), self._json("run.json")
        if cfg is None or identity is None:
            raise ValueError("the run directory has no config.json/run.json yet, so its store is unknown")
        store_cfg = dict(cfg["store"])
        root = Path(store_cfg["root"]).expanduser()
        if store_cfg.get("type", "local") == "local" and not root.is_absolute():
            base = self.dir.parent  # the directory the run was started from: output_dir's parent chain
            for _ in Path(cfg["run"]["output_dir"]).parts:
                base = base.parent
            store_cfg["root"] = str(base / root)
        store = open_run(StoreConfig(**store_cfg), identity["name"])
        if store.identity.run_id != identity["run_id"]:
            raise ValueError(
                f"the store prefix {store_cfg['root']}/{identity['name']} belongs to run id {store.identity.run_id}, "
                f"not this directory's {identity['run_id']} (the run was re-made under the same name)"
            )
        return store

    def refresh_index(self, budget_s: float) -> RolloutIndex | None:
        with self._lock:
            self._read_metrics()
            index = self.index()
            if index is None:
                return None
            index.set_consumed(dict(self._consumed))
        index.refresh(budget_s)
        return index

    def rollouts(self, q: RolloutQuery, budget_s: float = 0.5) -> dict[str, Any]:
        index = self.refresh_index(budget_s)
        if index is None:
            return {
                "total": 0,
                "offset": q.offset,
                "rows": [],
                "indexed": 0,
                "batches": 0,
                "families": [],
                "problem": self._store_problem,
            }
        return {
            **index.page(q),
            "indexed": index.indexed,
            "batches": index.batches,
            "families": index.families(),
        }

    def rewards(self) -> dict[str, Any]:
        """Per trained step: reward quantiles (p10, p25, p50, p75, p90), mean and count of its rollouts."""
        index = self.refresh_index(0.5)
        by_step: dict[int, list[float]] = {}
        for row in list(index.rows) if index is not None else []:
            if row.step is not None:
                by_step.setdefault(row.step, []).append(row.reward)
        steps = sorted(by_step)
        out: dict[str, Any] = {"steps": steps, "n": [len(by_step[s]) for s in steps]}
        out["mean"] = [sum(by_step[s]) / len(by_step[s]) for s in steps]
        for q in (10, 25, 50, 75, 90):
            out[f"p{q}"] = [_quantile(sorted(by_step[s]), q / 100) for s in steps]
        return out

    def servers(self) -> list[dict[str, Any]]:
        """Per server (subscriber): its adoptions in version order, with the time from publication."""
        with self._lock:
            index = self.index()
            if index is None:
                return []
            return self._servers(index.store)

    def _servers(self, store: Any) -> list[dict[str, Any]]:
        for key in store.list(ADOPTIONS_PREFIX):
            if key not in self._adoptions and key.endswith(".json"):
                try:
                    self._adoptions[key] = json.loads(store.get(key))
                except (FileNotFoundError, json.JSONDecodeError):
                    continue
        leases = {}
        for key in store.list(SUBSCRIBERS_PREFIX):
            try:
                rec = json.loads(store.get(key))
            except (FileNotFoundError, json.JSONDecodeError):
                continue
            leases[key[len(SUBSCRIBERS_PREFIX) : -len(".json")]] = rec
        servers: dict[str, list[dict[str, Any]]] = {}
        for key, ev in sorted(self._adoptions.items()):
            name = key[len(ADOPTIONS_PREFIX) :].rsplit("/", 1)[0]
            published = ev.get("published_at")
            servers.setdefault(name, []).append({**ev, "sync_s": ev["at"] - published if published else None})
        return [
            {"name": name, "version": evs[-1]["version"], "adoptions": evs, "lease": leases.get(name)}
            for name, evs in sorted(servers.items())
        ]

    def rollout(self, rollout_id: str) -> dict[str, Any]:
        """One whole session (module doc); LookupError when the run holds no such rollout."""
        index = self.refresh_index(0.2)
        if index is None:
            raise LookupError(f"run {self.label!r} cannot show rollouts: {self._store_problem}")
        row = index.by_id.get(rollout_id)
        if row is None:
            index.refresh(5.0)
            row = index.by_id.get(rollout_id)
        if row is None:
            raise LookupError(
                f"run {self.label!r} has no rollout {rollout_id!r} ({len(index.rows)} rollouts indexed); "
                "open the rollout list to find one"
            )
        segs = [index.batch(row.key).trajectories[i] for i in row.positions]
        trainer = read_step_logprobs(self.dir, row.step) if row.step is not None else {}
        last = segs[-1]
        return {
            **row.to_json(),
            "reward_info": last.reward_info,
            "reward_components": last.reward_components,
            "error_text": last.error,
            "metrics": last.metrics,
            "changes": last.changes,
            "grade": last.grade,
            "trainer_logprobs": any(token_key(t) in trainer for t in segs),
            "segments": [self._segment(t, trainer.get(token_key(t))) for t in segs],
        }

    def _segment(self, t: Trajectory, trainer_lps: list[float] | None) -> dict[str, Any]:
        pieces = self._pieces(t.token_ids)
        trainer_at: dict[int, float] = {}
        if trainer_lps is not None:
            sampled = [i for i, m in enumerate(t.loss_mask) if m]
            trainer_at = dict(zip(sampled, trainer_lps, strict=False))
        turns = t.turns or [{"role": "record", "start": 0, "end": len(t.token_ids), "text": "".join(pieces)}]
        out = []
        for turn in turns:
            turn = dict(turn)
            if turn["role"] in ("assistant", "summary"):
                turn["tokens"] = [
                    [pieces[i], t.logprobs[i], trainer_at.get(i), t.versions[i]]
                    for i in range(turn["start"], turn["end"])
                ]
            out.append(turn)
        return {
            "index": t.segment_idx,
            "finish": t.finish,
            "prompt_len": t.prompt_len,
            "length": len(t.token_ids),
            "summary_tokens": t.summary_tokens,
            "turns": out,
        }

    def warm(self) -> threading.Thread:
        """Load the tokenizer in the background, so the first rollout opened does not wait for it."""
        thread = threading.Thread(
            target=self._pieces, args=([],), daemon=True, name=f"tokenizer-{self.label}"
        )
        thread.start()
        return thread

    def _pieces(self, ids: list[int]) -> list[str]:
        """Each token's text (the run's tokenizer), or ``<id>`` when the tokenizer cannot be loaded."""
        with self._tokenizer_lock:
            if self._tokenizer is None:
                self._tokenizer = _load_tokenizer(self.config())
        if self._tokenizer is False:
            return [f"<{i}>" for i in ids]
        return self._tokenizer.batch_decode([[i] for i in ids])


def _load_tokenizer(cfg: dict[str, Any] | None) -> Any:
    """The run's tokenizer (``model`` of its config), or False when it cannot be loaded here."""
    if cfg is None:
        return False
    try:
        from shipyard.config.schema import ModelConfig
        from shipyard.models.loading import load_tokenizer

        return load_tokenizer(ModelConfig(**cfg["model"]))
    except Exception as e:  # a model that is not on this machine: show token ids instead
        print(f"shipyard view: tokenizer unavailable ({type(e).__name__}: {e}); showing token ids")
        return False


def _quantile(values: list[float], q: float) -> float:
    """Linear-interpolated quantile of sorted ``values``."""
    pos = q * (len(values) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (pos - lo)


def _events(recs: list[dict[str, Any]]) -> dict[str, Any]:
    """A component's stall and crash records, counted, and the last one (:meth:`RunReader.health`)."""
    last = recs[-1] if recs else None
    return {
        "stalls": sum(r["kind"] == "stall" for r in recs),
        "crashes": sum(r["kind"] == "crash" for r in recs),
        "last_event": None
        if last is None
        else {
            "kind": last["kind"],
            "at": last.get("at"),
            "what": last.get("reason") if last["kind"] == "stall" else last.get("error"),
            "action": last.get("action"),
        },
    }
