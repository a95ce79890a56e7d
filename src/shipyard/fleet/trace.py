"""A diurnal production trace, replayed as real requests against a server, and an RL load beside it.

Purpose: measure what the tiered scheduler (:mod:`shipyard.inference.engine.scheduler`, ``inference.scavenge``)
does to production traffic and how much of the idle capacity RL rollouts take
(``benchmarks/fleet_scavenge.py``).

Contract:
- :class:`DiurnalTrace` is the documented shape, deterministic in its seed: arrivals are a
  non-homogeneous Poisson process whose rate swings as a cosine from ``night_rps`` (at t = 0 and at
  each period's end) to ``day_rps`` (mid-period), plus bursts (Poisson, ``bursts_per_period`` a
  period) that add ``burst_rps`` for ``burst_s`` seconds. Each request has a log-normal prompt length
  (median ``prompt_median``, clipped to [16, 1024]) and a generation length drawn from
  ``gen_tokens``. :meth:`DiurnalTrace.arrivals` lists them; :meth:`DiurnalTrace.rate` is the rate curve.
- :func:`replay` sends each arrival at its time (real HTTP through an :class:`InferenceClient`, one
  thread per request in flight) as a ``production`` request that generates exactly its length (eos
  is masked, so with and without RL the work is the same) and returns one :class:`Served` per
  request: send time, latency, tokens.
- :class:`ScavengerLoad` keeps ``concurrency`` ``scavenger`` requests in flight until stopped (the
  demand of rollout workers, which always have more work) and counts their tokens.

Limits: prompts are token ids drawn from a fixed vocabulary range (their content does not change the
cost of serving them); one client per load.
"""

from __future__ import annotations

import math
import random
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from shipyard.inference.types import GenerateRequest, GenerateResult, Priority, SamplingParams

EOS_MASK = {0: -100.0, 1: -100.0, 2: -100.0}
"""Logit bias on SmolLM2's special tokens (eos among them): every request generates its full length."""


@dataclass(frozen=True)
class Arrival:
    t: float
    """Seconds from the start of the trace."""
    prompt_tokens: int
    gen_tokens: int


@dataclass(frozen=True)
class DiurnalTrace:
    """Production load over ``periods`` compressed days of ``period_s`` seconds (module doc)."""

    period_s: float = 120.0
    periods: int = 2
    night_rps: float = 0.05
    day_rps: float = 0.8
    bursts_per_period: float = 3.0
    burst_rps: float = 2.0
    burst_s: float = 4.0
    prompt_median: int = 160
    prompt_sigma: float = 0.6
    gen_tokens: tuple[int, ...] = (32, 48, 64)
    seed: int = 0

    @property
    def duration_s(self) -> float:
        return self.period_s * self.periods

    def rate(self, t: float, bursts: list[float] | None = None) -> float:
        """Requests per second at ``t`` (the diurnal swing, plus any burst running at ``t``)."""
        phase = (1 - math.cos(2 * math.pi * t / self.period_s)) / 2
        burst = sum(self.burst_rps for b in bursts or [] if b <= t < b + self.burst_s)
        return self.night_rps + (self.day_rps - self.night_rps) * phase + burst

    def bursts(self) -> list[float]:
        """Start times of the bursts (Poisson)."""
        rng = random.Random(f"{self.seed}/bursts")
        out: list[float] = []
        t = 0.0
        if self.bursts_per_period <= 0:
            return out
        while True:
            t += rng.expovariate(self.bursts_per_period / self.period_s)
            if t >= self.duration_s:
                return out
            out.append(t)

    def arrivals(self) -> list[Arrival]:
        """The trace's requests in time order (thinning of a Poisson process at the peak rate)."""
        rng = random.Random(self.seed)
        bursts = self.bursts()
        peak = self.day_rps + self.burst_rps * max(1, len(bursts))
        out, t = [], 0.0
        while True:
            t += rng.expovariate(peak)
            if t >= self.duration_s:
                return out
            if rng.random() * peak < self.rate(t, bursts):
                prompt = int(self.prompt_median * math.exp(rng.gauss(0, self.prompt_sigma)))
                out.append(Arrival(t, min(max(prompt, 16), 1024), rng.choice(self.gen_tokens)))


@dataclass
class Served:
    sent: float
    """Its arrival time, seconds from the start of the replay (latency counts from it)."""
    latency_s: float
    tokens: int
    error: str | None = None


def request_for(prompt_tokens: int, gen_tokens: int, seed: int, priority: Priority) -> GenerateRequest:
    """A request of this shape: ``prompt_tokens`` ids from a fixed range, exactly ``gen_tokens`` out."""
    rng = random.Random(seed)
    params = SamplingParams(temperature=0.7, max_tokens=gen_tokens, seed=seed, logit_bias=dict(EOS_MASK))
    return GenerateRequest(
        [rng.randrange(1000, 40000) for _ in range(prompt_tokens)], params, priority=priority
    )


Generate = Callable[[list[GenerateRequest]], list[GenerateResult]]


def replay(arrivals: list[Arrival], generate: Generate, seed: int = 0) -> list[Served]:
    """Send each arrival at its time as a production request; wait for all; one record per arrival."""
    out: list[Served | None] = [None] * len(arrivals)

    def one(i: int, a: Arrival, t0: float) -> None:
        start = t0 + a.t  # its arrival, even if a thread was late to send it
        try:
            [res] = generate([request_for(a.prompt_tokens, a.gen_tokens, seed * 1_000_003 + i, "production")])
            out[i] = Served(start - t0, time.monotonic() - start, len(res.token_ids))
        except Exception as e:  # a failed request is recorded, the replay goes on
            out[i] = Served(start - t0, time.monotonic() - start, 0, f"{type(e).__name__}: {e}")

    with ThreadPoolExecutor(64, thread_name_prefix="trace") as pool:
        t0 = time.monotonic()
        for i, a in enumerate(arrivals):
            time.sleep(max(0.0, t0 + a.t - time.monotonic()))
            pool.submit(one, i, a, t0)
    assert all(s is not None for s in out)
    return [s for s in out if s is not None]


def start_loops(loop: Callable[[int], None], n: int, name: str) -> list[threading.Thread]:
    """``n`` daemon threads running ``loop(k)``, named ``<name>-<k>``, started."""
    threads = [threading.Thread(target=loop, args=(k,), name=f"{name}-{k}", daemon=True) for k in range(n)]
    for th in threads:
        th.start()
    return threads


@dataclass
class ScavengerLoad:
    """``concurrency`` scavenger requests kept in flight (module doc); :meth:`stop` ends it."""

    generate: Generate
    concurrency: int = 16
    prompt_tokens: int = 300
    gen_tokens: int = 128
    tokens: int = 0
    requests: int = 0
    errors: list[str] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _threads: list[threading.Thread] = field(default_factory=list)

    def start(self) -> ScavengerLoad:
        self._threads = start_loops(self._loop, self.concurrency, "scavenger")
        return self

    def _loop(self, k: int) -> None:
        n = 0
        while not self._stop.is_set():
            req = request_for(self.prompt_tokens, self.gen_tokens, 7_000_000 + k * 100_000 + n, "scavenger")
            n += 1
            try:
                [res] = self.generate([req])
            except Exception as e:  # counted; the load goes on
                self.errors.append(f"{type(e).__name__}: {e}")
                time.sleep(0.5)
                continue
            with self._lock:
                self.tokens += len(res.token_ids)
                self.requests += 1

    def stop(self) -> None:
        self._stop.set()
        for th in self._threads:
            th.join(120)
