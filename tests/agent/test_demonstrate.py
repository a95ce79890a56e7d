"""Warm start: the scripted expert plays long tasks through the real harness (sandboxes, summaries,
grader), supervised fine-tuning learns its tokens, and `shipyard warmstart` writes a loadable policy."""

from __future__ import annotations

import json
import os
import re
import types
from pathlib import Path

import pytest
import torch

from shipyard.agent.demonstrate import (
    SUBMIT,
    SUMMARY_LEAD,
    FunctionToolExpert,
    LongTaskExpert,
    demonstrations,
)
from shipyard.agent.spec import session_spec
from shipyard.agent.types import Trajectory
from shipyard.cli import main
from shipyard.config import load_config
from shipyard.config.schema import ModelConfig
from shipyard.envs.sandbox import sandbox_available
from shipyard.envs.tasks.functions import generated_tasks
from shipyard.envs.tasks.long import RULES, long_tasks, read_rule, solution_from_rules
from shipyard.models.loading import load_model
from shipyard.orchestrate.warmstart import _save
from shipyard.trainer.sft import sft

ROOT = Path(__file__).resolve().parents[2]
needs_sandbox = pytest.mark.skipif(sandbox_available() is not None, reason=str(sandbox_available()))


def _run(task_files: dict[str, str], solution: str, entry: str, x: int) -> int:
    """``solution`` run in-process with the task's modules importable (no sandbox needed)."""
    import sys

    for name, src in task_files.items():
        mod = types.ModuleType(name.removesuffix(".py"))
        exec(src, mod.__dict__)
        sys.modules[mod.__name__] = mod
    scope: dict[str, object] = {}
    exec(solution, scope)
    return scope[entry](x)  # type: ignore[operator]


def test_rules_are_read_back_and_the_solution_matches_the_reference() -> None:
    tasks = long_tasks(12, seed=5, modules=6) + long_tasks(4, seed=5, modules=3, local_constants=True)
    seen = set()
    for t in tasks:
        rules = [read_rule(t.files[f"part_{j:02d}.py"]) for j in range(len(t.files))]
        assert all(r is not None for r in rules)
        seen |= {r.rule.key for r in rules if r is not None}
        sol = solution_from_rules(t.entry_point, [r for r in rules if r is not None])
        ref: dict[str, object] = {}
        exec(t.reference, ref)
        for x in (0, -7, 13, 250, 12345):
            assert _run(t.files, sol, t.entry_point, x) == ref[t.entry_point](x), (t.id, x)  # type: ignore[operator]
    assert seen == {r.key for r in RULES}, "every kind of rule was parsed"
    assert read_rule('"""part_00: stage 1 of 4.\n\nRule: add the con') is None  # a cut module


@pytest.fixture(scope="module")
def demo() -> tuple[object, list[list[Trajectory]]]:
    # a generous command limit: the claim is what the expert does, not how fast a loaded machine
    # runs the grader's pytest (at 10 s a demonstration once failed under a parallel benchmark)
    cfg = load_config(ROOT / "configs/long_horizon.toml", ["model.source=tiny", "sandbox.timeout_s=60"])
    _, tok = load_model(cfg.model)
    tasks = long_tasks(3, seed=2, modules=4, filler_lines=2)
    spec = session_spec(cfg, LongTaskExpert(tasks[0], tok, cfg.agent.summary.instruction), tok)
    return spec, demonstrations(spec, tasks)


def test_the_function_expert_answers_each_harness_protocol_from_its_context() -> None:
    """Tools in the prompt: a Hermes call (bash heredoc, or write_file), then the finish; mini-swe-agent's
    text mode (its submission line in the prompt, no tools): one bash block that writes and submits;
    anything else: the solution in a python block."""
    task = next(t for t in generated_tasks(20, seed=1234) if t.reference)
    expert, ref = FunctionToolExpert(task, tokenizer=None), task.reference

    def tools(*names: str) -> str:
        return "<tools>\n" + "\n".join(json.dumps({"name": n}) for n in names) + "\n</tools>"

    call = json.loads(expert.reply(tools("bash")).split("\n")[1])
    assert call == {"name": "bash", "arguments": {"command": f"cat > solution.py <<'EOF'\n{ref}EOF"}}
    done = json.loads(expert.reply(tools("bash") + "<tool_response>ok").split("\n")[1])
    assert done["arguments"]["command"] == f"echo {SUBMIT}"
    assert json.loads(expert.reply(tools("write_file")).split("\n")[1])["arguments"]["content"] == ref
    text = expert.reply(f"Write solution.py, then echo {SUBMIT}")
    assert text == f"```bash\ncat > solution.py <<'EOF'\n{ref}EOF\necho {SUBMIT}\n```"
    assert re.fullmatch(r"```bash\s*\n(.*?)\n```", text, re.S), "mini-swe-agent's action_regex reads it"
    assert expert.reply("Write the function.") == f"```python\n{ref}```"


@needs_sandbox
def test_expert_sessions_read_each_module_once_summarize_and_pass(demo) -> None:
    spec, sessions = demo
    assert len(sessions) == 3, "every demonstration passed the hidden tests"
    tok = spec.frame.tok
    for segments in sessions:
        assert len(segments) >= 2 and all(s.reward == 1.0 and s.error is None for s in segments)
        assert [s.finish for s in segments] == ["summary"] * (len(segments) - 1) + ["passed"]
        reads = []
        for s in segments:
            sampled = tok.decode([t for t, m in zip(s.token_ids, s.loss_mask, strict=True) if m])
            reads += re.findall(r"cat (part_\d+)\.py", sampled)
            assert len(s.token_ids) <= spec.agent.max_session_tokens
            if s.finish == "summary":
                assert SUMMARY_LEAD in sampled and s.summary_tokens > 0
                n_read = int(re.search(r"\((\d+) of 4 modules\)", sampled)[1])
                assert n_read == len(reads), "the summary counts the modules read so far"
                notes = re.findall(r"^part_\d+: from (part_\d+) import ([A-Z_0-9]+); ", sampled, re.M)
                assert len(notes) == n_read and all(c.endswith(home[-2:]) for home, c in notes)
                assert sampled.removesuffix("<|im_end|>").endswith(
                    f"Next: read part_{n_read:02d}.py" if n_read < 4 else "Next: write solution.py"
                )
        assert reads == [f"part_{j:02d}" for j in range(4)], "each module read once, in order"
        last = tok.decode(
            [t for t, m in zip(segments[-1].token_ids, segments[-1].loss_mask, strict=True) if m]
        )
        assert "```python\nfrom part_" in last and "return x" in last


@needs_sandbox
def test_sft_learns_the_demonstrations_and_trains_only_the_top_layers(demo) -> None:
    _, sessions = demo
    segments = [s for session in sessions for s in session]
    model, _ = load_model(ModelConfig(source="tiny"))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    losses = sft(model, segments, epochs=4, lr=3e-3, micro_batch=4, train_layers=1)
    # a random tiny model with one trainable block and a frozen (tied) head: ~10.7 -> ~10.2 nats
    assert len(losses) == 4 and losses == sorted(losses, reverse=True) and losses[0] - losses[-1] > 0.3
    after = model.state_dict()
    top = f"model.layers.{model.config.num_hidden_layers - 1}."
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all(k.startswith(top) or k == "model.norm.weight" for k in changed), sorted(changed)[
        :3
    ]
    empty = Trajectory("t", "g", 0, [1, 2], [0, 0], [0.0, 0.0], [-1, -1], prompt_len=2)
    with pytest.raises(ValueError, match="no segment"):
        sft(model, [empty])


@needs_sandbox
def test_warmstart_command_writes_a_loadable_policy(tmp_path: Path) -> None:
    out = tmp_path / "sft"
    args = [
        "model.source=tiny",
        "tasks.num_generated=40",
        "trainer.train_layers=1",
        "trainer.bf16_decoder=false",
    ]
    args += ["warmstart.demos=2", "warmstart.epochs=1", f'warmstart.output_dir="{out}"']
    assert main(["warmstart", str(ROOT / "configs/long_horizon.toml"), *args]) == 0
    report = json.loads((out / "warmstart.json").read_text())
    assert report["demos_played"] == report["demos_kept"] == 2 and report["segments"] >= 4
    loaded, _ = load_model(ModelConfig(source="hf", path=str(out)))
    tiny, _ = load_model(ModelConfig(source="tiny"))
    diff = [k for k, v in tiny.state_dict().items() if not torch.equal(v, loaded.state_dict()[k])]
    assert diff and not list(tmp_path.glob(".sft-*")), "trained weights written, no temporary left"
    umask = os.umask(0)
    os.umask(umask)
    assert out.stat().st_mode & 0o777 == 0o777 & ~umask, "the directory gets the umask's mode"


def test_sft_and_save_reject_what_would_corrupt_the_policy(tmp_path: Path) -> None:
    """A segment whose only learned token is its first (no prefix, never scored) is no data: a
    micro-batch of such segments has no scored token (0/0 loss, an autograd error mid-training),
    so it is refused up front, weights untouched. A failed save leaves nothing behind."""
    model, tok = load_model(ModelConfig(source="tiny"))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    first_only = Trajectory("t", "g", 0, [1, 2, 3], [1, 0, 0], [0.0] * 3, [-1] * 3, prompt_len=0)
    with pytest.raises(ValueError, match="no segment"):
        sft(model, [first_only])
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    with pytest.raises(TypeError):
        _save(model, tok, tmp_path / "sft", {"not json": object()})
    assert list(tmp_path.iterdir()) == [], "no temporary directory and no output"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_sft_trains_a_model_on_the_gpu() -> None:
    """The batches follow the model to its device (they were built on the CPU)."""
    model, _ = load_model(ModelConfig(source="tiny"))
    model = model.cuda()
    seg = Trajectory("t", "g", 0, [1, 2, 3, 4], [0, 1, 1, 1], [0.0] * 4, [-1] * 4, prompt_len=1)
    losses = sft(model, [seg, seg], epochs=2, lr=1e-3, micro_batch=2)
    assert len(losses) == 2 and all(0.0 < v < 20.0 for v in losses) and losses[1] < losses[0]
