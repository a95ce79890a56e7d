"""Delta weight codec: bit-exact round trips, adversarial bit patterns, in-place apply, a 100-version
chain, corruption detection and the per-tensor scheme choices."""

import numpy as np
import pytest
import torch

from shipyard.weights import bits, order
from shipyard.weights.codec import decode_delta, decode_snapshot, describe_blob, encode_delta, encode_snapshot
from shipyard.weights.states import decode_state, digest_matches, encode_state, entropy_bound, tensor_digest

DTYPES = list(bits.SUPPORTED_DTYPES)
DENSITIES = [0.0, 0.001, 0.015, 0.3, 1.0]
INT_VIEW = {8: torch.uint8, 16: torch.int16, 32: torch.int32}
MANTISSA_BITS = {torch.float16: 10, torch.bfloat16: 7, torch.float32: 23}


def _ints(t: torch.Tensor) -> torch.Tensor:
    """Raw bit patterns of ``t`` as integers (so NaNs and -0.0 compare exactly)."""
    return t.contiguous().view(INT_VIEW[t.element_size() * 8])


def assert_bits_equal(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(_ints(a), _ints(b))


def _from_ints(ints: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return ints.view(dtype)


def _random_bits(n: int, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    """Uniformly random bit patterns (every class of value, NaNs included)."""
    width = torch.finfo(dtype).bits
    raw = torch.randint(0, 256, (n * width // 8,), generator=g, dtype=torch.uint8)
    return raw.view(INT_VIEW[width]).view(dtype)


def _weights_and_update(
    n: int, density: float, dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Weight-like parent (shape (n/50, 50)) and a new version where ``density`` of the elements
    changed: most by +-1 ulp, a tenth to random bit patterns; 5% of the parent are tiny weights."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, generator=g) * 0.05
    tiny = torch.rand(n, generator=g) < 0.05
    w[tiny] *= 1e-5
    parent = w.to(dtype)
    ints = _ints(parent).clone()
    k = round(density * n)
    idx = torch.randperm(n, generator=g)[:k]
    steps = torch.where(torch.rand(k, generator=g) < 0.5, 1, -1).to(ints.dtype)
    ints[idx] = ints[idx] + steps
    wild = idx[: k // 10]
    ints[wild] = _ints(_random_bits(wild.numel(), dtype, g))
    new = _from_ints(ints, dtype)
    assert (_ints(new) != _ints(parent)).sum().item() <= k
    return parent.reshape(-1, 50), new.reshape(-1, 50)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("density", DENSITIES)
def test_roundtrip_at_change_densities(dtype: torch.dtype, density: float) -> None:
    parent, new = _weights_and_update(20_000, density, dtype, seed=int(density * 1000))
    blob = encode_delta(parent, new)
    assert_bits_equal(decode_delta(parent, blob), new)
    info = describe_blob(blob)
    assert info["kind"] == "delta" and info["shape"] == list(parent.shape)
    assert info["changed"] == int((_ints(parent) != _ints(new)).sum())
    raw = parent.numel() * parent.element_size()
    if density == 0.0:
        assert info["pos_scheme"] == "none" and len(blob) < 40
    if density <= 0.015:
        assert len(blob) < raw / 4, f"{len(blob)} bytes for {raw} raw at density {density}"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_every_16bit_pattern(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(1)
    every = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dtype)
    shuffled = every[torch.randperm(every.numel(), generator=g)]
    for parent, new in ((every, shuffled), (shuffled, every), (every, every.flip(0))):
        assert_bits_equal(decode_delta(parent, encode_delta(parent, new)), new)
        assert_bits_equal(decode_snapshot(encode_snapshot(new)), new)


@pytest.mark.parametrize("dtype", [d for d in DTYPES if torch.finfo(d).bits == 8], ids=str)
def test_every_8bit_pattern(dtype: torch.dtype) -> None:
    every = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype)
    for shift in (1, 7, 128):
        new = every.roll(shift)
        assert_bits_equal(decode_delta(every, encode_delta(every, new)), new)


def test_random_32bit_patterns() -> None:
    g = torch.Generator().manual_seed(2)
    parent, new = _random_bits(50_000, torch.float32, g), _random_bits(50_000, torch.float32, g)
    new[::3] = parent[::3]
    assert_bits_equal(decode_delta(parent, encode_delta(parent, new)), new)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
def test_special_values(dtype: torch.dtype) -> None:
    """NaN payloads, +-inf, -0.0 vs +0.0 and subnormals, changing into one another."""
    width = torch.finfo(dtype).bits
    ints = INT_VIEW[width]
    top = 1 << (width - 1)
    mant = MANTISSA_BITS[dtype]
    exp_all = ((1 << (width - 1)) - 1) ^ ((1 << mant) - 1)  # exponent all ones
    patterns = [
        0,  # +0.0
        top,  # -0.0
        exp_all,  # +inf
        top | exp_all,  # -inf
        exp_all | 1,  # signalling NaN, payload 1
        exp_all | (1 << (mant - 1)),  # quiet NaN
        exp_all | ((1 << mant) - 1),  # NaN, all payload bits
        top | exp_all | 5,  # negative NaN with a payload
        1,  # smallest subnormal
        top | 1,
        (1 << mant) - 1,  # largest subnormal
        1 << mant,  # smallest normal
    ]
    as_signed = [p - (1 << width) if p >= top else p for p in patterns]
    parent = torch.tensor(as_signed, dtype=torch.int64).to(ints).view(dtype)
    for shift in range(1, len(patterns)):
        new = parent.roll(shift)
        out = decode_delta(parent, encode_delta(parent, new))
        assert_bits_equal(out, new)
    plus, minus = parent[:1], parent[1:2]
    assert describe_blob(encode_delta(plus, minus))["changed"] == 1  # -0.0 is a change
    assert tensor_digest(plus) != tensor_digest(minus)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(0,), (3, 0, 5), (), (1,)], ids=str)
def test_empty_and_scalar_tensors(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    parent = torch.zeros(shape).to(dtype)
    new = torch.full(shape, 0.5).to(dtype)
    for a, b in ((parent, new), (parent, parent)):
        out = decode_delta(a, encode_delta(a, b))
        assert out.shape == torch.Size(shape)
        assert_bits_equal(out, b)
        assert_bits_equal(decode_snapshot(encode_snapshot(b)), b)


def test_decode_into_out_in_place() -> None:
    parent, new = _weights_and_update(10_000, 0.015, torch.bfloat16, seed=3)
    blob = encode_delta(parent, new)
    live = parent.clone()
    ptr = live.data_ptr()
    result = decode_delta(live, blob, out=live)  # apply to the live parameter itself
    assert result is live and live.data_ptr() == ptr
    assert_bits_equal(live, new)
    other = torch.empty_like(parent)
    assert decode_delta(parent, blob, out=other) is other
    assert_bits_equal(other, new)
    assert_bits_equal(parent, _weights_and_update(10_000, 0.015, torch.bfloat16, seed=3)[0])  # untouched
    strided = torch.empty(parent.shape[1], parent.shape[0], dtype=parent.dtype).t()  # not contiguous
    assert decode_delta(parent, blob, out=strided) is strided
    assert_bits_equal(strided, new)
    with pytest.raises(ValueError, match="out is"):
        decode_delta(parent, blob, out=torch.empty(7, dtype=parent.dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_encode_updates_the_parent_in_place(dtype: torch.dtype) -> None:
    """update_parent=True: the same blob, and the parent equals new bit for bit afterwards (every
    bit pattern class: random bits on a third of the elements), with its memory kept."""
    parent, new = _weights_and_update(20_000, 0.02, dtype, seed=11)
    g = torch.Generator().manual_seed(12)
    new = new.clone().reshape(-1)
    new[::3] = _random_bits(new[::3].numel(), dtype, g)
    new = new.reshape(parent.shape)
    plain = encode_delta(parent, new)
    kept, ptr = parent.clone(), parent.data_ptr()
    assert encode_delta(parent, new, order.MinorityIndex(), update_parent=True) == plain
    assert parent.data_ptr() == ptr
    assert_bits_equal(parent, new)
    assert_bits_equal(decode_delta(kept, plain), new)
    with pytest.raises(ValueError, match="contiguous CPU"):
        encode_delta(kept.t(), new.t(), update_parent=True)


def test_non_contiguous_inputs() -> None:
    parent, new = _weights_and_update(10_000, 0.05, torch.float16, seed=4)
    pt, nt = parent.t(), new.t()
    assert not pt.is_contiguous()
    assert_bits_equal(decode_delta(pt, encode_delta(pt, nt)), nt.contiguous())


def test_tiny_weights_form_the_minority_and_pay_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """Weights far below the step size change every time; the split codes them almost for free."""
    g = torch.Generator().manual_seed(5)
    master = torch.randn(200_000, generator=g) * 0.05
    master[torch.rand(master.numel(), generator=g) < 0.03] *= 1e-5
    update = torch.where(torch.rand(master.numel(), generator=g) < 0.5, 1e-6, -1e-6)
    parent, new = master.to(torch.bfloat16), (master + update).to(torch.bfloat16)
    blob = encode_delta(parent, new)
    info = describe_blob(blob)
    assert info["split_exp"] > 0 and info["minority"] > 0
    assert_bits_equal(decode_delta(parent, blob), new)
    monkeypatch.setattr(order, "SPLIT_COST_BITS", 1e9)  # forbid the split
    plain = encode_delta(parent, new)
    assert describe_blob(plain)["split_exp"] == 0
    assert len(blob) < 0.7 * len(plain), (len(blob), len(plain))


def test_position_scheme_follows_density() -> None:
    sparse = describe_blob(encode_delta(*_weights_and_update(100_000, 0.002, torch.bfloat16, seed=6)))
    dense = describe_blob(encode_delta(*_weights_and_update(100_000, 0.5, torch.bfloat16, seed=7)))
    assert sparse["pos_scheme"] == "gaps" and sparse["gap_width"] in (1, 2, 4)
    assert dense["pos_scheme"] == "bitmap"


def test_value_scheme_picks_the_smaller() -> None:
    g = torch.Generator().manual_seed(8)
    parent = (torch.randn(50_000, generator=g) * 0.05).to(torch.bfloat16)
    ints = _ints(parent)
    ulp_steps = (ints + torch.where(torch.rand(ints.shape, generator=g) < 0.5, 1, -1).to(ints.dtype)).view(
        torch.bfloat16
    )
    low_bit_flips = (ints ^ 1).view(torch.bfloat16)  # +-1 ulp by parity: xor is constant
    assert describe_blob(encode_delta(parent, ulp_steps))["val_scheme"] == "ulp"
    assert describe_blob(encode_delta(parent, low_bit_flips))["val_scheme"] == "xor"


def test_hundred_version_chain_replays_to_the_same_digest() -> None:
    """AdamW on an fp32 master, bf16 serving copies; deltas replayed from version 0 in place."""
    torch.manual_seed(9)
    master = {"w": torch.randn(64, 96) * 0.05, "b": torch.zeros(96), "e": torch.randn(200, 32) * 0.02}
    master["e"][::7] *= 1e-4  # some tiny weights
    params = [torch.nn.Parameter(t) for t in master.values()]
    opt = torch.optim.AdamW(params, lr=3e-5)
    serve = lambda: {k: p.detach().to(torch.bfloat16) for k, p in zip(master, params, strict=True)}  # noqa: E731
    versions = [serve()]
    deltas = []
    sent: dict[str, order.MinorityIndex] = {}  # the sender's and receiver's carried minority indexes
    for i in range(100):
        loss = sum((p * torch.randn_like(p)).sum() for p in params)
        loss.backward()
        opt.step()
        opt.zero_grad()
        versions.append(serve())
        deltas.append(encode_state(versions[-2], versions[-1], workers=2, indexes=sent))
        if i % 25 == 0:  # the blobs never depend on the index
            assert deltas[-1] == encode_state(versions[-2], versions[-1])
    assert sum(x.builds for x in sent.values()) >= 1
    live = {k: v.clone() for k, v in versions[0].items()}
    received: dict[str, order.MinorityIndex] = {}
    for i, blobs in enumerate(deltas, start=1):
        decode_state(live, blobs, workers=2, out=live, indexes=received)
        if i in (1, 50):
            assert {k: tensor_digest(v) for k, v in live.items()} == {
                k: tensor_digest(v) for k, v in versions[i].items()
            }
    assert {k: tensor_digest(v) for k, v in live.items()} == {
        k: tensor_digest(v) for k, v in versions[-1].items()
    }
    changed = sum(describe_blob(b)["changed"] for d in deltas for b in d.values())
    assert 0 < changed < 0.5 * 100 * sum(v.numel() for v in versions[0].values())


def _tiny_churn_step(cur: torch.Tensor, tiny: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """One step in which tiny weights nearly all move by an ulp, others rarely, and 0.3% jump to
    random bit patterns (crossing any exponent cap both ways)."""
    ints = _ints(cur.reshape(-1)).clone()
    rate = torch.where(tiny, 0.9, 0.01)
    moved = torch.rand(ints.shape, generator=g) < rate
    ints[moved] += torch.where(torch.rand(int(moved.sum()), generator=g) < 0.5, 1, -1).to(ints.dtype)
    wild = torch.rand(ints.shape, generator=g) < 0.003
    ints[wild] = _ints(_random_bits(int(wild.sum()), cur.dtype, g))
    return _from_ints(ints, cur.dtype).reshape(cur.shape)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_minority_index_follows_a_chain(dtype: torch.dtype) -> None:
    """A carried MinorityIndex stays equal to one built afresh from each version, while elements
    cross its cap both ways; the blobs are the same with or without it."""
    spec = bits._BY_DTYPE[dtype]
    g = torch.Generator().manual_seed(5)
    n = 40_000
    tiny = torch.rand(n, generator=g) < 0.04
    w = torch.randn(n, generator=g).abs() + 0.5
    w[tiny] = w[tiny] * 2.0 ** -(spec.mant_bits + 2) if spec.width > 8 else w[tiny] / 16
    cur = w.to(dtype).reshape(-1, 40)
    sent, received = order.MinorityIndex(), order.MinorityIndex()
    live = cur.clone()
    splits = []
    for _ in range(10):
        new = _tiny_churn_step(cur, tiny, g)
        blob = encode_delta(cur, new, sent)
        assert blob == encode_delta(cur, new), "the index never changes the bytes"
        decode_delta(live, blob, out=live, index=received)
        assert_bits_equal(live, new)
        splits.append(describe_blob(blob)["split_exp"])
        for index in (sent, received):
            if index.built:
                idx, exps = order._scan_below(bits._bits(new, spec), index.cap, spec)
                assert np.array_equal(index.idx_K, idx) and np.array_equal(index.exp_K, exps)
        cur = new
    assert sum(x > 0 for x in splits) >= 5 and sent.built and received.built, splits


def test_corrupted_blobs_raise_value_error() -> None:
    parent, new = _weights_and_update(5_000, 0.05, torch.bfloat16, seed=10)
    blob = encode_delta(parent, new)
    info = describe_blob(blob)
    assert info["pos_bytes"] > 0 and info["val_bytes"] > 0
    for pos in range(0, len(blob), max(1, len(blob) // 97)):
        bad = bytearray(blob)
        bad[pos] ^= 0x5A
        with pytest.raises(ValueError):
            decode_delta(parent, bytes(bad))
    for bad in (blob[:-1], blob + b"\0", blob[:10], b"", b"not a weight blob at all"):
        with pytest.raises(ValueError):
            decode_delta(parent, bad)
    snap = bytearray(encode_snapshot(new))
    snap[len(snap) // 2] ^= 1
    with pytest.raises(ValueError):
        decode_snapshot(bytes(snap))
    with pytest.raises(ValueError, match="snapshot|delta"):
        decode_delta(parent, encode_snapshot(new))


def test_mismatched_parent_raises() -> None:
    parent, new = _weights_and_update(5_000, 0.05, torch.bfloat16, seed=11)
    blob = encode_delta(parent, new)
    with pytest.raises(ValueError, match="parent is"):
        decode_delta(parent.reshape(-1)[:4000], blob)
    with pytest.raises(ValueError, match="parent is"):
        decode_delta(parent.to(torch.float16), blob)


def test_user_errors_name_the_problem() -> None:
    x = torch.zeros(4)
    with pytest.raises(ValueError, match="int64"):
        encode_delta(torch.zeros(4, dtype=torch.int64), torch.zeros(4, dtype=torch.int64))
    with pytest.raises(ValueError, match="float64"):
        encode_snapshot(torch.zeros(4, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"does not match parent"):
        encode_delta(x, torch.zeros(5))
    with pytest.raises(ValueError, match=r"does not match parent"):
        encode_delta(x, x.to(torch.bfloat16))
    with pytest.raises(ValueError, match=r"missing \['b'\]"):
        encode_state({"a": x, "b": x}, {"a": x})
    with pytest.raises(ValueError, match="'a'"):
        encode_state({"a": x}, {"a": torch.zeros(3)})
    with pytest.raises(ValueError, match="workers"):
        encode_state({"a": x}, {"a": x}, workers=0)


def test_state_round_trip_parallel_is_deterministic() -> None:
    parent, new = {}, {}
    for i, dtype in enumerate(DTYPES):
        parent[f"t{i}"], new[f"t{i}"] = _weights_and_update(3_000, 0.01 * (i + 1), dtype, seed=20 + i)
    one, two = encode_state(parent, new, workers=1), encode_state(parent, new, workers=2)
    assert one == two
    out = decode_state(parent, two, workers=2)
    for k in new:
        assert_bits_equal(out[k], new[k])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_snapshot_round_trip(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(12)
    t = (torch.randn(300, 70, generator=g) * 0.05).to(dtype)
    blob = encode_snapshot(t)
    assert_bits_equal(decode_snapshot(blob), t)
    assert describe_blob(blob)["kind"] == "snapshot"
    if dtype == torch.bfloat16:
        assert len(blob) < t.numel() * 2 * 0.85  # the sign/exponent plane compresses


def test_digest_and_entropy_bound() -> None:
    parent, new = _weights_and_update(20_000, 0.01, torch.bfloat16, seed=13)
    assert tensor_digest(parent) == tensor_digest(parent.clone())
    assert tensor_digest(parent) != tensor_digest(new)
    assert tensor_digest(parent) != tensor_digest(parent.reshape(-1))
    assert tensor_digest(parent).startswith("xxh3:")
    assert tensor_digest(parent, "sha256").startswith("sha256:")
    assert digest_matches(parent, tensor_digest(parent, "sha256")) and digest_matches(
        parent, tensor_digest(parent)
    )
    assert not digest_matches(new, tensor_digest(parent)) and not digest_matches(parent, "md5:00")
    assert entropy_bound(parent, parent) == float("inf")
    plain = entropy_bound(parent, new)
    conditioned = entropy_bound({"x": parent}, {"x": new}, conditioned=True)
    assert 10 < plain < 1000 and conditioned >= plain * 0.95
