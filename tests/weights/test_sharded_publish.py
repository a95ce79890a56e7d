"""Sharded publishing: several encoders (a trainer group's ranks) each code and upload their share of
a version; one manifest names all their shards. Readers see exactly what one publisher would
have published: the same tensors bit for bit, the same state digest, deltas between versions."""

from __future__ import annotations

from pathlib import Path

import torch

from shipyard.store import LocalStore
from shipyard.trainer.distributed import rank_tensors
from shipyard.weights.publisher import WeightPublisher
from shipyard.weights.versions import load_version, read_manifest


def _states() -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    base = {f"layer{i}.w": torch.randn(64, 32 + i, generator=gen).bfloat16() for i in range(7)}
    base["norm"] = torch.ones(32).bfloat16()
    states = [base]
    for _ in range(3):  # RL-like steps: a few elements change
        nxt = {k: v.clone() for k, v in states[-1].items()}
        for v in nxt.values():
            flat = v.view(-1)
            idx = torch.randint(0, flat.numel(), (5,), generator=gen)
            flat[idx] = flat[idx] + 0.5
        states.append(nxt)
    return states


def test_three_ranks_publish_what_one_publisher_would(tmp_path: Path) -> None:
    states = _states()
    one = WeightPublisher(LocalStore(tmp_path / "one"), snapshot_every=3)
    store = LocalStore(tmp_path / "sharded")
    ranks = [WeightPublisher(store, snapshot_every=3) for _ in range(3)]  # rank 0's commits
    owned = rank_tensors(states[0], 3)
    assert sorted(n for names in owned for n in names) == sorted(states[0])
    for version, state in enumerate(states):
        single = one.publish(version, state)
        parts = []
        ready = all(
            p.delta_ready(version, {n: state[n] for n in names})
            for p, names in zip(ranks, owned, strict=True)
        )
        for r, (pub, names) in enumerate(zip(ranks, owned, strict=True)):
            mine = {n: state[n] for n in names}
            parts.append(
                pub.encode(
                    version, mine, delta=ready, snapshot=not ready or version % 3 == 0, prefix=f"r{r}-"
                )
            )
        manifest = ranks[0].commit(version, parts)
        assert manifest.state_digest == single.state_digest
        assert set(manifest.encodings) == set(single.encodings)
        loaded = load_version(store, version)
        assert all(torch.equal(loaded[k], state[k]) for k in state)
    last = read_manifest(store, 2)
    assert last.kind == "delta" and last.parent == 1 and set(last.encodings) == {"delta"}
    assert {s.name[:2] for s in last.encodings["delta"].shards} == {"r0", "r1", "r2"}
