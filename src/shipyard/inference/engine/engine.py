"""Embedded inference engine: batched KV-cache sampling with in-flight weight updates.

Contract:
- Continuous batching: :meth:`EmbeddedEngine.serve` keeps one running batch of at most ``max_batch`` rows
  and, at every decode-step boundary, admits waiting requests into the free slots: they get one left-padded
  prefill of their own (attention mask, position ids counted from each row's first real token), and their KV
  cache is left-padded to the running cache's length (or the running cache to theirs) and joined to it, so a
  straggler never holds back the requests behind it. Each step decodes one token for every running row on a
  transformers ``DynamicCache`` whose full-attention layers grow in place (``kv_slack`` spare positions,
  :mod:`shipyard.inference.engine.kv_cache`; 0: transformers' ``torch.cat`` of the whole cache a step).
  :meth:`generate` is ``serve`` over a fixed list of requests; the HTTP server's scheduler feeds ``serve``
  from its queue. Each row has its own temperature, top-p, max_tokens,
  stop strings and ``torch.Generator`` (seeded from ``seed`` when given, else from torch's global RNG), so a
  seeded request draws the same random numbers whatever else shares its batch.
- Temperature 0 is greedy (argmax). The logprob reported for a sampled token is
  ``log_softmax(logits / T)`` at that token for T > 0 and ``log_softmax(logits)`` for T = 0: the
  full tempered distribution, *before* top-p truncation (the distribution a trainer can
  recompute; top-p only restricts which tokens may be drawn).
- A row ends on an EOS id (``tokenizer.eos_token_id`` and ``generation_config.eos_token_id``) ->
  ``"eos"``; when a stop string appears in its decoded generated text -> ``"stop"`` (the token
  that completed it is kept, nothing after it); on ``max_tokens`` or the model's context limit ->
  ``"length"``. Finished rows leave the batch and the KV cache at once (a compaction copies the kept
  rows' cache once), and leading padding columns no remaining row needs are cut from the cache.
- Prefix cache (``prefix_cache_mb > 0``, in the model's device memory; off in deterministic mode,
  for MoE models that record routes and for sliding-window caches): a finished row's keys/values are kept (:mod:`shipyard.inference.engine.prefix_cache`),
  and a request whose prompt extends a kept sequence (an agent's next turn) forwards only its
  new tokens. Every prompt is kept as soon as it is prefilled, and rows of the same prompt
  (admitted with it, or while it still runs) are served from it: a GRPO group's sessions prefill
  their prompt once. The cache is cleared when new weights go live, and a row that ran across an
  update is not kept, so reused keys/values always come from the weights now serving.
- Weights: :meth:`stage_weights` may be called from any thread; the update is applied in place
  (``copy_`` into the live parameters, or only the elements a delta changed when the caller says
  where they are) at the next decode-step boundary of a running generate, or by
  :meth:`apply_pending` / the next generate when idle. Every token records the version live for
  the forward pass that produced its logits; each apply's duration is appended to ``pauses`` and
  the number of elements it wrote to ``written_elements``.
  The KV cache of running rows is kept across a swap (in-flight update: tokens after the swap
  attend to keys/values computed with the older weights).
- Packed linears (``packed=True``, CPU): the linear layers compute with oneDNN-packed copies of their
  weights (:mod:`shipyard.inference.engine.packed`); an apply repacks the layers whose weights it wrote,
  inside the pause.
- Lean decode (``lean=True``, Llama-architecture models on a CPU): a decode step runs the model's modules
  without transformers' per-module Python (:mod:`shipyard.inference.engine.lean_decode`), bit-identical
  to the model's forward; other models take their own forward.
- MoE routes (``record_routes``; on by default for a model with routers of
  :data:`~shipyard.models.router_replay.ROUTER_CLASSES`): every forward records, per MoE layer,
  the experts each token used (:class:`~shipyard.models.router_replay.RouterSeam`), and each result
  carries ``routes`` for all its forwarded positions, prompt and sampled tokens but the last (a
  :mod:`shipyard.models.routes` record, uint8/uint16 ids). A request's ``prompt_routes`` (an
  earlier turn's routes of a prefix of its prompt) are replayed in the prefill, so across turns a
  token keeps the experts of its first forward, as with a reused KV cache; its result's routes
  start with them.
- Deterministic mode (``deterministic=True``): every request runs as a batch of its own (admitted only when
  nothing else runs; no padding, fixed per-row shapes), so a sequence's logits, tokens and routes are
  bit-identical whatever else was submitted with it; it costs the batching speedup (measured in
  ``benchmarks/mismatch.py``).

Limits: one ``serve``/``generate`` runs at a time (calls from several threads are serialised; the server's
scheduler is the one caller that batches threads); requests are admitted in the order ``take`` gives them
(priorities and preemption are the scheduler's: a row whose ``cancelled`` hook turns true leaves at the next
step boundary, before admissions); a joined row pads the shorter cache to the longer one, so a long prompt
admitted next to short rows costs them attention over its padding until it finishes; a model with
sliding-window cache layers admits only into an empty batch (static batching); stop
strings are searched in the decoded text of the last ``2 * longest_stop + 8`` generated tokens each step;
one device (the CPU or one GPU: the model, its KV cache and the prefix cache live there; sampling and
the rows' masks stay on the CPU). The running batch's records (its rows, padded cache, mask and
positions) are in :mod:`shipyard.inference.engine.batch`.

Shape legend: B = rows in the running batch, T = key/value length (padded prompt + generated),
V = vocabulary size, P = parameters' own shapes.

Example::

    engine = EmbeddedEngine(model, tokenizer, max_batch=8)
    [res] = engine.generate([GenerateRequest(prompt_ids=ids, params=SamplingParams(temperature=0))])
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from contextlib import nullcontext
from functools import partial
from typing import Any

import numpy as np
import torch
from transformers import DynamicCache

from shipyard.inference.engine.attention import use_packed_decode
from shipyard.inference.engine.batch import Batch, Job, Row, left_pad
from shipyard.inference.engine.kv_cache import SLACK, cache_kwarg, full_attention, slack_cache
from shipyard.inference.engine.lean_decode import lean_decode
from shipyard.inference.engine.packed import can_pack, pack_linears
from shipyard.inference.engine.prefix_cache import PrefixCache, PrefixEntry
from shipyard.inference.engine.sampling import adjust_logits, sample_tokens, top_logprobs
from shipyard.inference.types import GenerateRequest, GenerateResult, SamplingParams
from shipyard.metrics.health import Beat
from shipyard.models.router_replay import RouterSeam, moe_routers, route_plan
from shipyard.models.routes import encode_routes

MAX_TOP_LOGPROBS = 20
"""Most candidates a request may ask per token (OpenAI's limit)."""


_WeightOp = tuple[torch.Tensor | None, torch.Tensor]
"""A staged write to one parameter: (None, whole tensor) or (flat indices, their values)."""


_BIT_VIEWS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits_np(t: torch.Tensor) -> np.ndarray | None:
    """The flat bits of a contiguous CPU tensor as a numpy view of the same memory, or None.
    numpy gathers and scatters by index about twice as fast as torch's advanced indexing on CPU,
    and a bit-view copy is exact for every dtype."""
    view = _BIT_VIEWS.get(t.element_size())
    if t.device.type != "cpu" or not t.is_contiguous() or view is None:
        return None
    return t.detach().reshape(-1).view(view).numpy()


def _take(target_P: torch.Tensor, tensor: torch.Tensor, idx_C: torch.Tensor | None, copy: bool) -> _WeightOp:
    """The staged write of ``tensor`` into ``target_P``: whole, or its elements at flat ``idx_C``."""
    if idx_C is None:
        return None, tensor.detach().to(device=target_P.device, dtype=target_P.dtype, copy=copy)
    src = _bits_np(tensor) if tensor.dtype == target_P.dtype and target_P.device.type == "cpu" else None
    if src is not None:
        return idx_C, torch.from_numpy(np.take(src, idx_C.numpy())).view(tensor.dtype)
    values_C = tensor.detach().reshape(-1)[idx_C.to(tensor.device)]
    return idx_C, values_C.to(device=target_P.device, dtype=target_P.dtype)


def _write(target_P: torch.Tensor, idx_C: torch.Tensor | None, values: torch.Tensor) -> None:
    """Apply one staged write in place (any strides: indices are flat, row-major)."""
    if idx_C is None:
        target_P.copy_(values)
        return
    dst = _bits_np(target_P) if values.dtype == target_P.dtype else None
    src = _bits_np(values) if dst is not None else None
    if dst is not None and src is not None:
        dst[idx_C.numpy()] = src
    elif target_P.is_contiguous():
        target_P.view(-1)[idx_C.to(target_P.device)] = values
    else:
        target_P[torch.unravel_index(idx_C.to(target_P.device), target_P.shape)] = values


def _new_stats() -> dict[str, float]:
    """The engine's counters, all zero. ``batches``: prefills (admissions); ``joins``: admissions
    into a running batch; ``prefix_hits`` / ``prefix_tokens``: requests (and prompt tokens) served
    from the prefix cache; ``shared_prompts``: of those, rows whose prompt a row admitted with them
    had just prefilled; ``prefilled_tokens``: positions the prefills forwarded (rows × padded width,
    what they computed; a prompt served from the cache counts only its new tokens); ``aborted``: rows
    ended early because their caller cancelled them;
    ``prefill_s``, ``prefix_prefill_s``, ``decode_s``: seconds in cold prefills, in prefills from the
    prefix cache (the cache's keys/values stacked into a batch, then the new tokens) and in decode
    steps (each forward and its logits' copy to the CPU; on a GPU, ending with that copy's
    synchronisation)."""
    counts = ("batches", "sequences", "generated_tokens", "decode_steps", "largest_batch", "compactions")
    counts += ("joins", "prefix_hits", "prefix_tokens", "shared_prompts", "prefilled_tokens", "aborted")
    return {**dict.fromkeys(counts, 0), "prefill_s": 0.0, "prefix_prefill_s": 0.0, "decode_s": 0.0}


def _bulk_dtype(model: Any) -> str:
    """The dtype of most of ``model``'s parameter tensors (an fp32 head on a bf16 decoder is "bfloat16")."""
    counts: dict[str, int] = {}
    for p in model.parameters():
        name = str(p.dtype).removeprefix("torch.")
        counts[name] = counts.get(name, 0) + 1
    return max(counts, key=lambda k: counts[k])


class EmbeddedEngine:
    """Batched sampler around an HF causal LM; see the module docstring for the contract."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        max_batch: int = 16,
        version: int = 0,
        *,
        record_routes: bool | None = None,
        deterministic: bool = False,
        prefix_cache_mb: int = 0,
        packed: bool = False,
        kv_slack: int = SLACK,
        lean: bool = True,
    ) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch={max_batch} must be >= 1")
        self.model = model.eval()
        self.cache_kw = cache_kwarg(model)
        self.beat: Beat | None = None
        """Where the serving loop reports progress (``decode`` steps, ``idle``; the run's watchdog)."""
        """The keyword the model's forward takes its KV cache under (:func:`cache_kwarg`)."""
        self.device = next(model.parameters()).device
        if self.device.type == "cpu":
            use_packed_decode(model)  # a batch without padding decodes 2.6x faster (inference.attention)
        self.packed = pack_linears(model) if packed and can_pack(model) else None
        """oneDNN-packed linear layers (CPU; :mod:`shipyard.inference.engine.packed`), repacked after each apply."""
        self.lean = lean_decode(model) if lean else None
        """The decode step without transformers' per-module Python (:mod:`~shipyard.inference.engine.lean_decode`;
        None: the model's own forward)."""
        self.tokenizer = tokenizer
        self.max_batch = max_batch
        self.kv_slack = kv_slack
        """Spare positions per KV-cache buffer (:mod:`shipyard.inference.engine.kv_cache`); 0: ``torch.cat`` a step."""
        self.deterministic = deterministic
        self.seam = self._route_seam(model, record_routes)
        self.prefix = (
            PrefixCache(prefix_cache_mb << 20)
            if prefix_cache_mb > 0
            and not deterministic
            and self.seam is None
            and full_attention(DynamicCache(config=model.config))
            else None
        )
        self._epoch = 0
        self.version = version
        self.pauses: list[float] = []
        self.written_elements: list[int] = []
        self.stats = _new_stats()
        self.vocab_size = int(model.get_input_embeddings().num_embeddings)
        self.max_positions = int(getattr(model.config, "max_position_embeddings", 0) or 1 << 30)
        self.eos_ids = self._eos_ids(model, tokenizer)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.pad_id = int(pad) if pad is not None else 0
        self.precision: dict[str, str] = {"dtype": _bulk_dtype(model), "reason": "as given"}
        """The model's dtype and why it was chosen (set by whoever cast the model; served on ``/stats``)."""
        self._targets: dict[str, torch.Tensor] = dict(model.state_dict(keep_vars=True))
        self._lock = threading.RLock()
        self._stage_lock = threading.Lock()
        self._pending: tuple[int, dict[str, _WeightOp]] | None = None

    @staticmethod
    def _route_seam(model: Any, record_routes: bool | None) -> RouterSeam | None:
        """A recording seam for an MoE model (None: dense, or ``record_routes=False``)."""
        if record_routes is False:
            return None
        if not moe_routers(model):
            if record_routes:
                raise ValueError(f"record_routes=True, but {type(model).__name__} has no MoE router")
            return None
        seam = RouterSeam(model)
        seam.record = True
        return seam

    @staticmethod
    def _eos_ids(model: Any, tokenizer: Any) -> frozenset[int]:
        ids: set[int] = set()
        gen_cfg = getattr(model, "generation_config", None)
        for value in (tokenizer.eos_token_id, getattr(gen_cfg, "eos_token_id", None)):
            if isinstance(value, int):
                ids.add(value)
            elif isinstance(value, Iterable):
                ids.update(int(v) for v in value)
        return frozenset(ids)

    # ----------------------------------------------------------------------------------- weights

    def stage_weights(
        self,
        version: int,
        state_dict: dict[str, torch.Tensor],
        copy: bool = True,
        positions: Mapping[str, Any] | None = None,
    ) -> None:
        """Queue ``state_dict`` (all or some parameters) as ``version``; applied at the next step boundary.

        Staged updates that have not been applied yet merge (later tensors win), so partial
        updates are never lost. ``copy=True`` snapshots the tensors now, so the caller may keep
        changing its own; ``copy=False`` only converts dtype/device and the caller must not mutate
        them. ``positions[name]`` (flat int64 indices, numpy or torch; None = all) says the live
        tensor differs from ``state_dict[name]`` only there: just those elements are taken now and
        written at the boundary, so the pause scales with what changed, not with the model. A
        queued update of the same tensor is live-relative too, so the new one also takes the
        elements it would write (all of them when it was a whole tensor).
        """
        if not isinstance(version, int):
            raise ValueError(f"version must be an int, got {type(version).__name__}")
        staged: dict[str, _WeightOp] = {}
        for name, tensor in state_dict.items():
            target = self._targets.get(name)
            if target is None:
                raise ValueError(f"stage_weights: {name!r} is not a parameter or buffer of the model")
            if tuple(tensor.shape) != tuple(target.shape):
                raise ValueError(
                    f"stage_weights: {name!r} has shape {tuple(tensor.shape)}, model has {tuple(target.shape)}"
                )
            where = None if positions is None else positions.get(name)
            idx_C = None if where is None else torch.as_tensor(where, dtype=torch.long).to(target.device)
            staged[name] = _take(target, tensor, idx_C, copy)
        with self._stage_lock:
            merged = {} if self._pending is None else self._pending[1]
            for name, op in staged.items():
                queued = merged.get(name)
                if queued is not None and op[0] is not None:  # also undo what the queued one writes
                    both_C = None if queued[0] is None else torch.unique(torch.cat([queued[0], op[0]]))
                    op = _take(self._targets[name], state_dict[name], both_C, copy)
                merged[name] = op
            self._pending = (version, merged)

    def apply_pending(self) -> bool:
        """Apply a staged update now; False when none is staged or a generate in another thread runs.

        A generate running in another thread applies the update itself at its next step boundary.
        """
        if not self._lock.acquire(blocking=False):
            return False
        try:
            with self._stage_lock:
                pending, self._pending = self._pending, None
            if pending is None:
                return False
            version, ops_P = pending
            t0 = time.perf_counter()
            written: set[int] = set()
            elements = 0
            with torch.no_grad():
                for name, (idx_C, values) in ops_P.items():
                    target_P = self._targets[name]
                    if target_P.data_ptr() not in written:  # tied parameters: once
                        _write(target_P.data, idx_C, values)
                        elements += values.numel()
                        written.add(target_P.data_ptr())
                if self.packed is not None:
                    self.packed.refresh(written)
            self.version = version
            if self.beat is not None:
                self.beat.note(version=version)  # the server's record says what it serves
            self._epoch += 1
            if self.prefix is not None:
                self.prefix.clear()
            self.pauses.append(time.perf_counter() - t0)
            self.written_elements.append(elements)
            return True
        finally:
            self._lock.release()

    # ---------------------------------------------------------------------------------- requests

    def prefill_cost(self, prompt_ids: list[int]) -> int:
        """Prompt tokens an admission of ``prompt_ids`` would forward now: those the prefix cache does
        not hold (a preempted row's continuation: one). Call from the thread running :meth:`serve`."""
        return len(prompt_ids) - (self.prefix.cached_len(prompt_ids) if self.prefix is not None else 0)

    def validate(self, requests: list[GenerateRequest]) -> None:
        """Raise ValueError naming the first malformed request (ids, sampling parameters, length)."""
        if not isinstance(requests, list):
            raise ValueError(f"requests must be a list of GenerateRequest, got {type(requests).__name__}")
        for i, req in enumerate(requests):
            if not isinstance(req, GenerateRequest):
                raise ValueError(f"request {i} is a {type(req).__name__}, not a GenerateRequest")
            p = req.params
            if not req.prompt_ids:
                raise ValueError(f"request {i}: prompt_ids is empty")
            if any(not isinstance(t, int) or not 0 <= t < self.vocab_size for t in req.prompt_ids):
                raise ValueError(f"request {i}: prompt_ids must be ints in [0, {self.vocab_size})")
            if len(req.prompt_ids) >= self.max_positions:
                raise ValueError(
                    f"request {i}: prompt of {len(req.prompt_ids)} tokens leaves no room (context {self.max_positions})"
                )
            if not (
                isinstance(p.temperature, int | float) and math.isfinite(p.temperature) and p.temperature >= 0
            ):
                raise ValueError(f"request {i}: temperature={p.temperature!r} must be a finite number >= 0")
            if not (isinstance(p.top_p, int | float) and 0 < p.top_p <= 1):
                raise ValueError(f"request {i}: top_p={p.top_p!r} must be in (0, 1]")
            if not isinstance(p.max_tokens, int) or p.max_tokens < 1:
                raise ValueError(f"request {i}: max_tokens={p.max_tokens!r} must be an int >= 1")
            if not isinstance(p.stop, list) or any(not isinstance(s, str) or not s for s in p.stop):
                raise ValueError(f"request {i}: stop must be a list of non-empty strings")
            if p.seed is not None and not (isinstance(p.seed, int) and -(2**63) <= p.seed < 2**64):
                raise ValueError(f"request {i}: seed={p.seed!r} must be a 64-bit int or None")
            self._check_logit_controls(i, p)
            if req.prompt_routes is not None:
                self._check_prompt_routes(i, req)

    def _check_logit_controls(self, i: int, p: SamplingParams) -> None:
        if not (isinstance(p.top_logprobs, int) and 0 <= p.top_logprobs <= MAX_TOP_LOGPROBS):
            raise ValueError(
                f"request {i}: top_logprobs={p.top_logprobs!r} must be an int in [0, {MAX_TOP_LOGPROBS}]"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(p, name)
            if not (isinstance(value, int | float) and -2 <= value <= 2):
                raise ValueError(f"request {i}: {name}={value!r} must be a number in [-2, 2]")
        for tok, bias in p.logit_bias.items():
            if not 0 <= tok < self.vocab_size or not -100 <= bias <= 100:
                raise ValueError(
                    f"request {i}: logit_bias {{{tok}: {bias}}} needs a token id in [0, {self.vocab_size}) "
                    "and a bias in [-100, 100]"
                )

    def _check_prompt_routes(self, i: int, req: GenerateRequest) -> None:
        if self.seam is None:
            raise ValueError(f"request {i}: prompt_routes given, but this engine records no MoE routes")
        routes = req.prompt_routes or {}
        self.seam.check_record(routes, f"request {i}: prompt_routes")
        if routes["n"] > len(req.prompt_ids):
            raise ValueError(
                f"request {i}: prompt_routes cover {routes['n']} positions, the prompt has {len(req.prompt_ids)}"
            )

    def generate(self, requests: list[GenerateRequest]) -> list[GenerateResult]:
        """Sample every request (continuous batching over ``max_batch`` slots); results in request order."""
        self.validate(requests)
        results: list[GenerateResult | None] = [None] * len(requests)
        waiting = deque(enumerate(requests))

        def take(free: int, idle: bool) -> list[Job] | None:
            if not waiting:
                return None
            jobs: list[Job] = []
            while waiting and len(jobs) < free:
                i, req = waiting.popleft()
                jobs.append(Job(req, partial(results.__setitem__, i)))
            return jobs

        self.serve(take)
        return [r for r in results if r is not None]

    def serve(self, take: Callable[[int, bool], list[Job] | None]) -> None:
        """Run the continuous-batching loop until ``take`` returns None and every running row is done.

        At every step boundary with a free slot, ``take(free, idle)`` is called with the number of
        free slots and whether no row is running; it returns up to ``free`` validated requests, each
        with the callback that receives its result, ``[]`` for none now, or None to stop admitting
        (rows already running still finish). A caller with nothing to give while ``idle`` should
        block inside ``take`` for a while rather than return ``[]`` at once.
        """
        with self._lock, torch.inference_mode():
            batch: Batch | None = None
            logits_BV = torch.empty(0)
            admitting = True
            while admitting or batch is not None:
                batch, logits_BV = self._evict(batch, logits_BV)
                free = self._free_slots(batch)
                jobs = take(free, batch is None) if admitting and free else []
                if jobs is None:
                    admitting = False
                elif jobs:
                    self._progress("decode")
                    batch, logits_BV = self._admit(batch, logits_BV, jobs)
                if batch is not None:
                    batch, logits_BV = self._step(batch, logits_BV)
                self._progress("decode" if batch is not None else "idle")

    def _progress(self, phase: str) -> None:
        """Report to :attr:`beat`: a step (or an admission) made in ``phase``; ``idle`` once."""
        if self.beat is None:
            return
        if self.beat.phase != phase:
            self.beat.enter(phase)
        elif phase != "idle":
            self.beat.tick()

    def _free_slots(self, batch: Batch | None) -> int:
        if batch is None:
            return 1 if self.deterministic else self.max_batch
        if self.deterministic or not batch.joinable():
            return 0
        return self.max_batch - len(batch.rows)

    def _admit(
        self, batch: Batch | None, logits_BV: torch.Tensor, jobs: list[Job]
    ) -> tuple[Batch, torch.Tensor]:
        """Prefill ``jobs`` as new rows and join them to the running batch (or start one)."""
        if not 0 < len(jobs) <= self._free_slots(batch):
            raise ValueError(
                f"serve: take returned {len(jobs)} requests for {self._free_slots(batch)} free slots"
            )
        if batch is None:
            self.apply_pending()
        rows = [self._new_row(job) for job in jobs]
        parts = self._prefill_rows(rows) if self.prefix is None else self._prefill_sharing(rows)
        joined, new_logits_BV = parts[0]
        for part, part_logits_BV in parts[1:]:
            joined.join(part)
            new_logits_BV = torch.cat([new_logits_BV, part_logits_BV])
        self.stats["batches"] += 1
        self.stats["sequences"] += len(rows)
        if batch is not None:
            batch.join(joined)
            joined, new_logits_BV = batch, torch.cat([logits_BV, new_logits_BV])
            self.stats["joins"] += 1
        self.stats["largest_batch"] = max(self.stats["largest_batch"], len(joined.rows))
        return joined, new_logits_BV

    def _step(self, batch: Batch, logits_BV: torch.Tensor) -> tuple[Batch | None, torch.Tensor]:
        """Sample a token per row, hand finished rows their results, decode the others one step."""
        gens = [r.generator for r in batch.rows]
        logits_BV = adjust_logits(
            logits_BV, [r.params for r in batch.rows], [r.token_ids for r in batch.rows]
        )
        tokens_B, logprobs_B = sample_tokens(logits_BV, batch.temps_B, batch.top_p_B, gens)
        for b, row in enumerate(batch.rows):
            if row.top is not None:
                row.top.append(top_logprobs(logits_BV[b], row.params.temperature, row.params.top_logprobs))
        keep = self._record(batch.rows, tokens_B.tolist(), logprobs_B.tolist(), self.version)
        for b, row in enumerate(batch.rows):
            if row.finish is not None:
                self._store_prefix(batch, b, row)
                self._hand_over(row)
        if not keep:
            return None, logits_BV
        if len(keep) < len(batch.rows):
            batch.keep(keep)
            tokens_B = tokens_B.index_select(0, torch.tensor(keep, dtype=torch.long))
            self.stats["compactions"] += 1
        self.apply_pending()
        return batch, self._decode_step(batch, tokens_B)

    def _evict(self, batch: Batch | None, logits_BV: torch.Tensor) -> tuple[Batch | None, torch.Tensor]:
        """End the rows whose callers cancelled them (a preempted scavenger row, a client gone) at
        this step boundary, before anything is admitted: an arrival then never joins, and pays for,
        a row that leaves anyway. Such a row ends with ``abort`` and the tokens it had (all of them
        forwarded, so all kept in the prefix cache)."""
        if batch is None:
            return None, logits_BV
        gone = [
            b for b, row in enumerate(batch.rows) if row.job.cancelled is not None and row.job.cancelled()
        ]
        if not gone:
            return batch, logits_BV
        for b in gone:
            row = batch.rows[b]
            row.finish = "abort"
            self.stats["aborted"] += 1
            self._store_prefix(batch, b, row, evicted=True)
            self._hand_over(row)
        keep = [b for b in range(len(batch.rows)) if b not in gone]
        if not keep:
            return None, torch.empty(0)
        batch.keep(keep)
        self.stats["compactions"] += 1
        return batch, logits_BV.index_select(0, torch.tensor(keep, dtype=torch.long))

    def _hand_over(self, row: Row) -> None:
        """Give a finished row's result to its caller."""
        row.done(
            GenerateResult(
                row.token_ids,
                row.logprobs,
                row.versions,
                row.finish,
                self._routes(row),
                row.top,
                cached_tokens=row.cached,
            )
        )

    def _routes(self, row: Row) -> dict[str, Any] | None:
        if self.seam is None:
            return None
        return encode_routes(torch.cat(row.routes), self.seam.layers, self.seam.num_experts)

    def _store_prefix(self, batch: Batch, b: int, row: Row, evicted: bool = False) -> None:
        """Keep a row's keys/values for reuse. A row just prefilled has forwarded its prompt, and one
        that finished sampling its prompt and its tokens but the last: all are kept. An ``evicted``
        row has forwarded every token; all but the last are kept, so its continuation (prompt and
        tokens) extends the entry."""
        if self.prefix is None or row.epoch != self._epoch:
            return
        forwarded = row.request.prompt_ids + (row.token_ids if evicted else row.token_ids[:-1])
        tokens = forwarded[:-1] if evicted else forwarded
        per_token = sum(2 * layer.keys[b, :, 0].nbytes for layer in batch.cache.layers)
        if len(tokens) * per_token > self.prefix.budget_bytes:
            return
        cols_N = batch.attn_BT[b].nonzero().flatten()
        assert len(cols_N) == len(forwarded), "a row's unmasked cache columns are its forwarded tokens"
        cols_N = cols_N[: len(tokens)]
        keys = [layer.keys[b][:, cols_N] for layer in batch.cache.layers]
        values = [layer.values[b][:, cols_N] for layer in batch.cache.layers]
        self.prefix.put(PrefixEntry(tokens, keys, values))

    def _new_row(self, job: Job) -> Row:
        req = job.request
        gen = torch.Generator()
        seed = req.params.seed if req.params.seed is not None else int(torch.randint(0, 2**62, ()).item())
        gen.manual_seed(seed)
        longest = max((len(s) for s in req.params.stop), default=0)
        row = Row(
            req, job.done, job, len(req.prompt_ids), req.params, gen, 2 * longest + 8, epoch=self._epoch
        )
        row.top = [] if req.params.top_logprobs > 0 else None
        return row

    # ---------------------------------------------------------------------------------- decoding

    def _prefill_sharing(self, rows: list[Row]) -> list[tuple[Batch, torch.Tensor]]:
        """Prefill ``rows`` with a prefix cache, each distinct prompt once.

        Every prefilled prompt's keys/values go into the cache at once, so a row of the same prompt
        (a GRPO group's sessions, admitted in this call or at a later step while these still run)
        is served from them with one token left to forward."""
        firsts: dict[tuple[int, ...], Row] = {}
        repeats: list[Row] = []
        for row in rows:
            if firsts.setdefault(tuple(row.request.prompt_ids), row) is not row:
                repeats.append(row)
        parts = self._prefill_rows(list(firsts.values()))
        for part, _ in parts:
            for b, row in enumerate(part.rows):
                self._store_prefix(part, b, row)
        parts += self._prefill_rows(repeats) if repeats else []
        self.stats["shared_prompts"] += sum(r.cached == len(r.request.prompt_ids) - 1 for r in repeats)
        return parts

    def _prefill_rows(self, rows: list[Row]) -> list[tuple[Batch, torch.Tensor]]:
        """Prefill ``rows``: those whose prompts extend a cached prefix in one forward from it, the
        others in one cold forward."""
        hits = [self._prefix_hit(r.request) for r in rows]
        cold = [row for row, hit in zip(rows, hits, strict=True) if hit is None]
        warm = [(row, hit) for row, hit in zip(rows, hits, strict=True) if hit is not None]
        return ([self._prefill(cold)] if cold else []) + ([self._prefill_from(warm)] if warm else [])

    def _prefix_hit(self, request: GenerateRequest) -> PrefixEntry | None:
        """The cached prefix ``request`` starts from: None without a prefix cache, without a hit, or
        when the request asks for a whole prefill (``reuse_prefix=False``)."""
        if self.prefix is None or not request.reuse_prefix:
            return None
        return self.prefix.lookup(request.prompt_ids)

    def _prefill(self, rows: list[Row]) -> tuple[Batch, torch.Tensor]:
        requests = [row.request for row in rows]
        prompts = [req.prompt_ids for req in requests]
        width = max(len(p) for p in prompts)
        ids_BT = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        attn_BT = torch.zeros((len(prompts), width), dtype=torch.long)
        for b, prompt in enumerate(prompts):
            ids_BT[b, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
            attn_BT[b, width - len(prompt) :] = 1
        pos_BT = (attn_BT.cumsum(dim=1) - 1).masked_fill(attn_BT == 0, 0)
        t0 = time.perf_counter()
        cache = slack_cache(self.model.config, self.kv_slack)
        plan = self._prompt_plan(requests, width)
        with nullcontext() if plan is None or self.seam is None else self.seam.plan(plan, replay=True):
            out = self.model(
                input_ids=ids_BT.to(self.device),
                attention_mask=None if bool(attn_BT.all()) else attn_BT.to(self.device),
                position_ids=pos_BT.to(self.device),
                **{self.cache_kw: cache},
                use_cache=True,
                logits_to_keep=1,
            )
        if self.seam is not None:
            used_BTLK = self._take_routes(len(rows), width)
            for b, (row, prompt) in enumerate(zip(rows, prompts, strict=True)):
                row.routes.append(used_BTLK[b, width - len(prompt) :])
        batch = Batch(rows, cache, attn_BT, pos_BT[:, -1].clone())
        logits_BV = out.logits[:, -1, :].float().cpu()
        self.stats["prefill_s"] += time.perf_counter() - t0
        self.stats["prefilled_tokens"] += ids_BT.numel()
        return batch, logits_BV

    def _prefill_from(self, warm: list[tuple[Row, PrefixEntry]]) -> tuple[Batch, torch.Tensor]:
        """Prefill rows whose prompts extend cached prefixes, in one forward: only the new tokens.

        Row b's columns: its cached ``n_b`` positions right-aligned in a width of the longest, then
        its ``m_b`` new tokens right-aligned in a width of the most new ones; the padding between
        is masked (causal attention never reads it), so each row sees exactly its own prefix."""
        t0 = time.perf_counter()
        n_B = [len(hit.tokens) for _, hit in warm]
        m_B = [len(row.request.prompt_ids) - n for (row, _), n in zip(warm, n_B, strict=True)]
        width_n, width_m = max(n_B), max(m_B)
        cache = slack_cache(self.model.config, self.kv_slack)
        for i in range(len(warm[0][1].keys_HND)):
            keys_BHND = torch.stack([left_pad(hit.keys_HND[i], width_n, 1) for _, hit in warm])
            values_BHND = torch.stack([left_pad(hit.values_HND[i], width_n, 1) for _, hit in warm])
            cache.update(keys_BHND, values_BHND, i)
        ids_BM = torch.full((len(warm), width_m), self.pad_id, dtype=torch.long)
        pos_BM = torch.zeros((len(warm), width_m), dtype=torch.long)
        attn_BT = torch.zeros((len(warm), width_n + width_m), dtype=torch.long)
        for b, ((row, _), n, m) in enumerate(zip(warm, n_B, m_B, strict=True)):
            ids_BM[b, width_m - m :] = torch.tensor(row.request.prompt_ids[n:], dtype=torch.long)
            pos_BM[b, width_m - m :] = torch.arange(n, n + m)
            attn_BT[b, width_n - n : width_n] = 1
            attn_BT[b, width_n + width_m - m :] = 1
            row.cached = n
        out = self.model(
            input_ids=ids_BM.to(self.device),
            attention_mask=None if bool(attn_BT.all()) else attn_BT.to(self.device),
            position_ids=pos_BM.to(self.device),
            **{self.cache_kw: cache},
            use_cache=True,
            logits_to_keep=1,
        )
        self.stats["prefix_hits"] += len(warm)
        self.stats["prefix_tokens"] += sum(n_B)
        self.stats["prefilled_tokens"] += ids_BM.numel()
        pos_B = torch.tensor([n + m - 1 for n, m in zip(n_B, m_B, strict=True)])
        batch = Batch([row for row, _ in warm], cache, attn_BT, pos_B)
        logits_BV = out.logits[:, -1, :].float().cpu()
        self.stats["prefix_prefill_s"] += time.perf_counter() - t0
        return batch, logits_BV

    def _decode_step(self, batch: Batch, tokens_B: torch.Tensor) -> torch.Tensor:
        t0 = time.perf_counter()
        batch.attn_BT = torch.cat([batch.attn_BT, torch.ones((len(batch.rows), 1), dtype=torch.long)], dim=1)
        batch.pos_B = batch.pos_B + 1
        mask_BT = batch.mask()
        if self.lean is not None:  # the same forward without transformers' per-module Python
            logits_BV = self.lean(tokens_B, mask_BT, batch.pos_B, batch.cache).float()
        else:
            out = self.model(
                input_ids=tokens_B[:, None].to(self.device),
                attention_mask=None if mask_BT is None else mask_BT.to(self.device),
                position_ids=batch.pos_B[:, None].to(self.device),
                **{self.cache_kw: batch.cache},
                use_cache=True,
            )
            logits_BV = out.logits[:, -1, :].float().cpu()
        self.stats["decode_steps"] += 1
        if self.seam is not None:
            used_BTLK = self._take_routes(len(batch.rows), 1)
            for b, row in enumerate(batch.rows):
                row.routes.append(used_BTLK[b])
        self.stats["decode_s"] += time.perf_counter() - t0
        return logits_BV

    def _prompt_plan(self, requests: list[GenerateRequest], width: int) -> torch.Tensor | None:
        """``[B, width, L, K]`` routes to replay in a left-padded prefill (-1: route freely); None if none."""
        if self.seam is None or all(req.prompt_routes is None for req in requests):
            return None
        starts = [width - len(req.prompt_ids) for req in requests]
        return route_plan([req.prompt_routes for req in requests], width, self.seam, starts)

    def _take_routes(self, rows: int, width: int) -> torch.Tensor:
        """The experts the last forward used, ``[B, T, L, K]`` int16, and clear the seam's record."""
        assert self.seam is not None and all(r is not None for r in self.seam.recorded)
        used = torch.stack([r for r in self.seam.recorded if r is not None], dim=1).cpu()
        self.seam.recorded = [None] * len(self.seam.recorded)
        return used.reshape(rows, width, len(self.seam.layers), self.seam.top_k)

    def _record(self, rows: list[Row], tokens: list[int], logprobs: list[float], version: int) -> list[int]:
        """Append each row's token; set finish reasons; return the batch positions still running."""
        keep: list[int] = []
        for b, (row, tok, lp) in enumerate(zip(rows, tokens, logprobs, strict=True)):
            row.token_ids.append(tok)
            row.logprobs.append(lp)
            row.versions.append(version)
            self.stats["generated_tokens"] += 1
            if (
                row.job.on_token is not None
                and not self._notify(row, tok, lp)
                or row.job.cancelled is not None
                and row.job.cancelled()
            ):
                row.finish = "abort"
                self.stats["aborted"] += 1
            elif tok in self.eos_ids and not row.params.ignore_eos:
                row.finish = "eos"
            elif row.params.stop and self._hit_stop(row):
                row.finish = "stop"
            elif (
                len(row.token_ids) >= row.params.max_tokens
                or row.prompt_len + len(row.token_ids) >= self.max_positions
            ):
                row.finish = "length"
            else:
                keep.append(b)
        return keep

    @staticmethod
    def _notify(row: Row, tok: int, lp: float) -> bool:
        """Hand the row's new token to its caller; False (the row is aborted, the batch goes on) if
        the caller's hook fails, e.g. a stream whose event loop has closed."""
        assert row.job.on_token is not None
        try:
            row.job.on_token(tok, lp, row.top[-1] if row.top else None)
        except Exception:
            return False
        return True

    def _hit_stop(self, row: Row) -> bool:
        tail = self.tokenizer.decode(row.token_ids[-row.stop_window :], skip_special_tokens=False)
        return any(s in tail for s in row.params.stop)
