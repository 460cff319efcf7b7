"""SPEC 7 on the CPU backend: every bad-input class raises its documented error
(ValueError for a wrong dtype/shape/stride/batch, TypeError for a non-tensor,
RuntimeError before prepare) naming the argument, BEFORE anything is written; bad
routing ids give NaN rows only for those (token, slot) and BadRoutingError from
check() / validate=True; NaN/Inf in x or weights poison only the affected rows."""

from __future__ import annotations

import math
import re
from types import SimpleNamespace

import pytest
import torch

from gemm_check import abs_products, assert_gemm_close, want_for
from moe_check import Layer, assert_names_first_bad, check_close, check_rows_close
from shapes import (FINITE_SENTINEL, count_bits, make_ids, make_route_weights, make_weights, make_x, poison_,
                    seed_of)

SHAPE = dict(name="err-h128-i64-e5-k4", H=128, I=64, E=5, top_k=4, hidden_scale="rceil")
H, I, E, K = SHAPE["H"], SHAPE["I"], SHAPE["E"], SHAPE["top_k"]
B = 3
SENTINEL = FINITE_SENTINEL  # "not written" must stay distinguishable from a written NaN
# the host-code paths both backends share, also run against CUDA tensors (on the GPU machine)
BOTH_DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.fixture(scope="module")
def weights():
    return make_weights(SHAPE, seed_of("err-weights"))


@pytest.fixture()
def layer(kx, weights):
    return Layer(kx, SHAPE, weights)


def inputs(seed, batch=B):
    return (make_x(batch, H, seed), make_ids(batch, K, E, seed),
            make_route_weights(batch, K, seed))


def expect(exc, fn, *args, arg=None, untouched=(), **kwargs):
    """fn(*args, **kwargs) raises exc whose message names `arg`; every tensor in
    `untouched` keeps its bits."""
    before = [t.clone() for t in untouched]
    with pytest.raises(exc) as info:
        fn(*args, **kwargs)
    msg = str(info.value)
    if arg is not None:
        assert re.search(rf"\b{re.escape(arg)}\b", msg), f"message does not name {arg!r}: {msg!r}"
    for t, b in zip(untouched, before):
        assert torch.equal(t.view(torch.uint8) if t.dtype != torch.uint8 else t,
                           b.view(torch.uint8) if b.dtype != torch.uint8 else b), (
            f"output written before the error ({msg!r})")
    return msg


# --------------------------------------------------------------------------- constructor
def _ctor_cases(w):
    w13, s13, w2, s2 = w
    f = torch.float32
    return {
        "w13 float32": (ValueError, "w13", (w13.to(f), s13, w2, s2), {}),
        "w13 int8": (ValueError, "w13", (w13.view(torch.int8), s13, w2, s2), {}),
        "s13 float32": (ValueError, "s13", (w13, s13.to(f), w2, s2), {}),
        "w2 int16": (ValueError, "w2", (w13, s13, w2.to(torch.int16), s2), {}),
        "s2 float32": (ValueError, "s2", (w13, s13, w2, s2.to(f)), {}),
        "w13 2-D": (ValueError, "w13", (w13.reshape(E * 2 * I, H // 2), s13, w2, s2), {}),
        "s13 wrong blocks": (ValueError, "s13", (w13, s13[:, :, :-1], w2, s2), {}),
        "s13 wrong rows": (ValueError, "s13", (w13, s13[:, :-1], w2, s2), {}),
        "w2 wrong H": (ValueError, "w2", (w13, s13, w2[:, :-1], s2[:, :-1]), {}),
        "s2 wrong blocks": (ValueError, "s2", (w13, s13, w2, torch.cat([s2, s2], 2)), {}),
        "w2 wrong E": (ValueError, None, (w13, s13, w2[:-1], s2[:-1]), {}),
        "w2 wrong I": (ValueError, None, (w13, s13, w2[:, :, :16], s2[:, :, :1]), {}),
        "w13 list": (TypeError, "w13", (w13.tolist(), s13, w2, s2), {}),
        "s2 None": (TypeError, "s2", (w13, s13, w2, None), {}),
        "top_k 0": (ValueError, "top_k", (w13, s13, w2, s2), dict(top_k=0)),
        "top_k 33": (ValueError, "top_k", (w13, s13, w2, s2), dict(top_k=33)),
        "hidden_scale": (ValueError, "hidden_scale", (w13, s13, w2, s2), dict(hidden_scale="nearest")),
        "beta 0": (ValueError, "beta", (w13, s13, w2, s2), dict(beta=0.0)),
        "linear_beta nan": (ValueError, "linear_beta", (w13, s13, w2, s2), dict(linear_beta=math.nan)),
        # positive, but 0 in float32, where the cap would be 0 * tanh(0 / 0) = NaN
        "beta under float32": (ValueError, "beta", (w13, s13, w2, s2), dict(beta=1e-46)),
    }


def test_constructor_errors(kx, weights):
    for name, (exc, arg, args, kw) in _ctor_cases(weights).items():
        try:
            expect(exc, kx.PersistentExperts, *args, arg=arg, **kw)
        except AssertionError as e:
            raise AssertionError(f"case {name!r}: {e}") from None
        except pytest.fail.Exception as e:
            raise AssertionError(f"case {name!r}: {e}") from None


@pytest.mark.parametrize("h,i", [(96, 64), (160, 64), (128, 48), (128, 16)])
def test_constructor_illegal_dims(kx, h, i):
    """H % 64 != 0 or I % 32 != 0 (with otherwise self-consistent shapes)."""
    w13 = torch.zeros((2, 2 * i, h // 2), dtype=torch.uint8)
    s13 = torch.full((2, 2 * i, max(1, h // 32)), 120, dtype=torch.uint8)
    w2 = torch.zeros((2, h, i // 2), dtype=torch.uint8)
    s2 = torch.full((2, h, max(1, i // 32)), 120, dtype=torch.uint8)
    expect(ValueError, kx.PersistentExperts, w13, s13, w2, s2, top_k=2)


def test_constructor_experts_range(kx):
    w13 = torch.zeros((0, 64, 32), dtype=torch.uint8)
    s13 = torch.zeros((0, 64, 2), dtype=torch.uint8)
    w2 = torch.zeros((0, 64, 16), dtype=torch.uint8)
    s2 = torch.zeros((0, 64, 1), dtype=torch.uint8)
    expect(ValueError, kx.PersistentExperts, w13, s13, w2, s2, top_k=1)
    n = 4097
    big = [torch.zeros((n, *t.shape[1:]), dtype=torch.uint8) for t in (w13, s13, w2, s2)]
    expect(ValueError, kx.PersistentExperts, *big, top_k=1)


def test_constructor_noncontiguous_weights(kx, weights):
    """A non-contiguous w13 is either rejected (ValueError) or handled correctly."""
    w13, s13, w2, s2 = weights
    buf = torch.zeros((E, 2 * I, H), dtype=torch.uint8)
    buf[:, :, : H // 2] = w13
    view = buf[:, :, : H // 2]
    assert not view.is_contiguous()
    try:
        moe = kx.PersistentExperts(view, s13, w2, s2, top_k=K)
    except ValueError as e:
        assert "w13" in str(e), str(e)
        return
    x, ids, _ = inputs(seed_of("noncontig"))
    lay = Layer(kx, SHAPE, weights)
    lay.moe = moe
    check_close(lay.run(x, ids), lay.reference(x, ids), "non-contiguous w13 accepted")


# --------------------------------------------------------------------------- prepare
def test_prepare_errors(kx, layer):
    moe = layer.moe
    scr = kx.scratch(moe)
    bf = torch.bfloat16
    good = torch.empty((B * K, H), dtype=bf)
    cases = [
        ("batch 0", ValueError, "batch", (0, scr, torch.empty((0, H), dtype=bf)), {}),
        ("batch -1", ValueError, "batch", (-1, scr, good), {}),
        ("batch str", TypeError, "batch", ("3", scr, good), {}),
        ("out float32", ValueError, "out", (B, scr, torch.empty((B * K, H))), {}),
        ("out float16", ValueError, "out", (B, scr, torch.empty((B * K, H), dtype=torch.float16)), {}),
        ("out too few rows", ValueError, "out", (B, scr, torch.empty((B * K - 1, H), dtype=bf)), {}),
        ("out too many rows", ValueError, "out", (B, scr, torch.empty((B * K + 1, H), dtype=bf)), {}),
        ("out wrong width", ValueError, "out", (B, scr, torch.empty((B * K, H + 64), dtype=bf)), {}),
        ("out 1-D", ValueError, "out", (B, scr, torch.empty((B * K * H,), dtype=bf)), {}),
        ("out column-strided", ValueError, "out",
         (B, scr, torch.empty((H, B * K), dtype=bf).T), {}),
        ("out rows for combine", ValueError, "out", (B, scr, good), dict(combine=True)),
        ("out combined w/o combine", ValueError, "out", (B, scr, torch.empty((B, H), dtype=bf)), {}),
        ("out list", TypeError, "out", (B, scr, [[0.0] * H] * (B * K)), {}),
        ("scratch None", TypeError, "scratch", (B, None, good), {}),
        ("scratch tensor", TypeError, "scratch", (B, torch.empty(16), good), {}),
    ]
    for name, exc, arg, args, kw in cases:
        try:
            expect(exc, moe.prepare, *args, arg=arg, **kw)
        except (AssertionError, pytest.fail.Exception) as e:
            raise AssertionError(f"prepare case {name!r}: {e}") from None
    # after all that, a correct prepare + run works
    x, ids, _ = inputs(seed_of("after-prepare-errors"))
    check_close(layer.run(x, ids), layer.reference(x, ids), "run after prepare errors")


# --------------------------------------------------------------------------- run
def test_run_before_prepare(kx, layer):
    x, ids, _ = inputs(1)
    msg = expect(RuntimeError, layer.moe.run, x, ids)
    assert "prepare" in msg, msg


def _prepared(kx, layer, combine=False):
    out = poison_(torch.empty((B if combine else B * K, H), dtype=torch.bfloat16), SENTINEL)
    layer.moe.prepare(B, kx.scratch(layer.moe), out, combine=combine)
    return out


def test_run_errors_rows(kx, layer):
    out = _prepared(kx, layer)
    x, ids, rw = inputs(seed_of("run-err"))
    xt = torch.empty((H, B), dtype=torch.bfloat16)
    xt.copy_(x.T)
    cases = [
        ("x float32", ValueError, "x", (x.float(), ids), {}),
        ("x float16", ValueError, "x", (x.half(), ids), {}),
        ("x wrong batch +1", ValueError, "x", (make_x(B + 1, H, 1), ids), {}),
        ("x wrong batch -1", ValueError, "x", (make_x(B - 1, H, 1), ids), {}),
        ("x wrong width", ValueError, "x", (make_x(B, H + 64, 1), ids), {}),
        ("x 1-D", ValueError, "x", (x.reshape(-1), ids), {}),
        ("x 3-D", ValueError, "x", (x.reshape(1, B, H), ids), {}),
        ("x column-strided", ValueError, "x", (xt.T, ids), {}),
        ("x list", TypeError, "x", (x.float().tolist(), ids), {}),
        ("x None", TypeError, "x", (None, ids), {}),
        ("ids int64", ValueError, "ids", (x, ids.long()), {}),
        ("ids int16", ValueError, "ids", (x, ids.short()), {}),
        ("ids float", ValueError, "ids", (x, ids.float()), {}),
        ("ids wrong top_k", ValueError, "ids", (x, make_ids(B, K + 1, E, 1)), {}),
        ("ids wrong batch", ValueError, "ids", (x, make_ids(B + 1, K, E, 1)), {}),
        ("ids 1-D", ValueError, "ids", (x, ids.reshape(-1)), {}),
        ("ids list", TypeError, "ids", (x, ids.tolist()), {}),
        ("weights without combine", ValueError, "weights", (x, ids, rw), {}),
    ]
    for name, exc, arg, args, kw in cases:
        try:
            expect(exc, layer.moe.run, *args, arg=arg, untouched=[out], **kw)
        except (AssertionError, pytest.fail.Exception) as e:
            raise AssertionError(f"run case {name!r} (B={B}): {e}") from None
    # the layer still works after the errors
    res = layer.moe.run(x, ids)
    check_close(res, layer.reference(x, ids), "run after run errors")


def test_run_errors_combined(kx, layer):
    out = _prepared(kx, layer, combine=True)
    x, ids, rw = inputs(seed_of("run-err-comb"))
    cases = [
        ("combine without weights", ValueError, "weights", (x, ids), {}),
        ("weights None", ValueError, "weights", (x, ids, None), {}),
        ("weights float64", ValueError, "weights", (x, ids, rw.double()), {}),
        ("weights bf16", ValueError, "weights", (x, ids, rw.bfloat16()), {}),
        ("weights wrong top_k", ValueError, "weights", (x, ids, make_route_weights(B, K + 1, 1)), {}),
        ("weights wrong batch", ValueError, "weights", (x, ids, make_route_weights(B + 1, K, 1)), {}),
        ("weights list", TypeError, "weights", (x, ids, rw.tolist()), {}),
    ]
    for name, exc, arg, args, kw in cases:
        try:
            expect(exc, layer.moe.run, *args, arg=arg, untouched=[out], **kw)
        except (AssertionError, pytest.fail.Exception) as e:
            raise AssertionError(f"combined run case {name!r} (B={B}): {e}") from None
    res = layer.moe.run(x, ids, rw)
    check_close(res, layer.reference(x, ids, rw), "combined run after errors")


# --------------------------------------------------------------------------- bad ids
BAD = {(1, 0): E, (2, 3): -1, (2, 1): 2**31 - 1}  # (token, slot) -> id; first is (1, 0)


def _with_bad_ids(ids):
    ids = ids.clone()
    for (t, j), v in BAD.items():
        ids[t, j] = v
    return ids


def test_bad_ids_rows_and_check(kx, layer):
    x, ids, _ = inputs(seed_of("bad-ids"))
    bad_ids = _with_bad_ids(ids)
    out = poison_(torch.empty((B * K, H), dtype=torch.bfloat16), SENTINEL)
    layer.run(x, bad_ids, out=out, poison=SENTINEL)
    what = f"{layer.describe()} B={B} bad ids {BAD}"
    bad_rows = sorted(t * K + j for (t, j) in BAD)
    for r in range(B * K):
        n_nan = int(torch.isnan(out[r]).sum())
        if r in bad_rows:
            assert n_nan == H, f"{what}: row {r} has {n_nan}/{H} NaN, want all NaN"
    good = [r for r in range(B * K) if r not in bad_rows]
    check_rows_close(out, layer.reference(x, bad_ids), what + " good rows", good)
    with pytest.raises(kx.BadRoutingError) as info:
        layer.moe.check(stream=SimpleNamespace(cuda_stream=0))  # a stream object, as run() takes
    assert_names_first_bad(str(info.value), 1, 0, E)
    assert isinstance(info.value, ValueError) and isinstance(info.value, kx.KimiExpertsError)
    layer.moe.check()  # the record was cleared


def test_bad_ids_combined(kx, layer):
    x, ids, rw = inputs(seed_of("bad-ids-comb"))
    bad_ids = ids.clone()
    bad_ids[1, 2] = -5
    out = poison_(torch.empty((B, H), dtype=torch.bfloat16), SENTINEL)
    layer.run(x, bad_ids, rw, out=out, poison=SENTINEL)
    what = f"{layer.describe()} B={B} combined, ids[1, 2] = -5"
    assert bool(torch.isnan(out[1]).all()), f"{what}: combined row 1 not all NaN"
    check_rows_close(out, layer.reference(x, bad_ids, rw), what, [0, 2])
    with pytest.raises(kx.BadRoutingError) as info:
        layer.moe.check()
    assert_names_first_bad(str(info.value), 1, 2, -5)


def test_bad_ids_validate_and_persistence(kx, layer):
    x, ids, _ = inputs(seed_of("validate"))
    bad_ids = _with_bad_ids(ids)
    out = _prepared(kx, layer)
    layer.moe.run(x, ids, validate=True)  # clean: no error
    with pytest.raises(kx.BadRoutingError) as info:
        layer.moe.run(x, bad_ids, validate=True)
    assert_names_first_bad(str(info.value), 1, 0, E)
    assert bool(torch.isnan(out[1 * K + 0]).all()), "validate: the bad row must still be NaN"
    layer.moe.check()  # validate behaves like check(): cleared
    # the record persists over a later clean run until check()
    layer.moe.run(x, bad_ids)
    layer.moe.run(x, ids)
    check_close(out, layer.reference(x, ids), "clean run after a bad one")
    with pytest.raises(kx.BadRoutingError) as info:
        layer.moe.check()
    assert_names_first_bad(str(info.value), 1, 0, E)
    layer.moe.check()


# --------------------------------------------------------------------------- non-finite data
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf], ids=["nan", "inf", "-inf"])
def test_nonfinite_x_poisons_only_its_token(kx, layer, value):
    Bn = 5
    seed = seed_of("nonfinite-x", str(value))
    x, ids, rw = inputs(seed, Bn)
    x[1, 5] = value
    x[3, H - 1] = value
    what = f"{layer.describe()} B={Bn} seed={seed} x[1,5]=x[3,{H - 1}]={value}"
    out = layer.run(x, ids, poison=SENTINEL)
    want = layer.reference(x, ids)
    poisoned = [t * K + j for t in (1, 3) for j in range(K)]
    for r in poisoned:
        assert bool(torch.isnan(out[r]).all()), f"{what}: row {r} not all NaN"
    good = [r for r in range(Bn * K) if r not in poisoned]
    check_rows_close(out, want, what + " other tokens", good)
    z = layer.run(x, ids, rw, poison=SENTINEL)
    assert bool(torch.isnan(z[[1, 3]]).all()), f"{what}: combined rows 1, 3 not all NaN"
    check_rows_close(z, layer.reference(x, ids, rw), what + " combined others", [0, 2, 4])
    layer.moe.check()  # non-finite data is not a routing error


def test_nonfinite_weights_poison_only_affected(kx, weights):
    """A NaN scale in expert 1's w13 poisons every row routed to expert 1; a NaN scale in
    expert 2's w2 row n poisons column n of rows routed to expert 2 only."""
    w13, s13, w2, s2 = (t.clone() for t in weights)
    s13[1, 7, 0] = 0xFF
    s2[2, 33, 1] = 0xFF
    lay = Layer(kx, SHAPE, (w13, s13, w2, s2))
    Bn = 6
    seed = seed_of("nan-weights")
    x = make_x(Bn, H, seed)
    ids = make_ids(Bn, K, E, seed)
    ids[0] = torch.tensor([1, 2, 0, 3])
    ids[1] = torch.tensor([4, 4, 3, 0])
    what = f"{lay.describe()} B={Bn} seed={seed} s13[1,7,0]=s2[2,33,1]=0xFF ids={ids.tolist()}"
    out = lay.run(x, ids, poison=SENTINEL)
    flat = ids.reshape(-1)
    for r in range(Bn * K):
        nan = torch.isnan(out[r])
        if flat[r] == 1:
            assert bool(nan.all()), f"{what}: row {r} (expert 1) not all NaN"
        elif flat[r] == 2:
            assert torch.nonzero(nan).flatten().tolist() == [33], (
                f"{what}: row {r} (expert 2) NaN columns {torch.nonzero(nan).flatten().tolist()}, want [33]")
        else:
            assert not bool(nan.any()), f"{what}: row {r} (expert {int(flat[r])}) has NaN"
    good = [r for r in range(Bn * K) if int(flat[r]) not in (1, 2)]
    check_rows_close(out, lay.reference(x, ids), what, good)


# --------------------------------------------------------------------------- formats
def test_format_errors(kx):
    x = torch.randn(4, 64)
    expect(ValueError, kx.quantize_mxfp8, torch.randn(4, 48), arg="x")
    expect(ValueError, kx.quantize_mxfp8, torch.randint(0, 9, (4, 64), dtype=torch.int32), arg="x")
    expect(ValueError, kx.quantize_mxfp8, x, scale="nearest", arg="scale")
    expect(TypeError, kx.quantize_mxfp8, [1.0] * 32, arg="x")
    expect(ValueError, kx.quantize_mxfp4, torch.randn(4, 16), arg="w")
    expect(ValueError, kx.quantize_mxfp4, torch.zeros((4, 64), dtype=torch.uint8), arg="w")
    q, s = kx.quantize_mxfp8(x)
    expect(ValueError, kx.dequantize, q, s, "fp8", arg="fmt")
    expect(ValueError, kx.dequantize, q, s[:, :1], "mxfp8", arg="scales")
    expect(ValueError, kx.dequantize, q.float(), s, "mxfp8", arg="q")
    q4, s4 = kx.quantize_mxfp4(x)
    expect(ValueError, kx.dequantize, q4, s4[:3], "mxfp4", arg="scales")


# --------------------------------------------------------------------------- GEMM
def test_gemm_constructor_errors(kx):
    W = torch.randn(128, 64).bfloat16()
    expect(ValueError, kx.WsGemm, W.float(), arg="W")
    expect(ValueError, kx.WsGemm, torch.randn(128, 96).bfloat16(), arg="W")
    expect(ValueError, kx.WsGemm, W.reshape(-1), arg="W")
    expect(TypeError, kx.WsGemm, W.tolist(), arg="W")
    expect(ValueError, kx.WsGemm, W, split=64)               # valid missing
    expect(ValueError, kx.WsGemm, W, valid=64)               # split missing
    expect(ValueError, kx.WsGemm, W, split=32, valid=64)     # valid > split
    expect(ValueError, kx.WsGemm, W, split=129, valid=64)    # split > N
    expect(ValueError, kx.WsGemm, W, split=64, valid=-1)


def test_gemm_prepare_and_run_errors(kx):
    N, Kd, M = 128, 64, 3
    W = torch.randn(N, Kd).bfloat16()
    x = torch.randn(M, Kd).bfloat16()
    gemm = kx.WsGemm(W)
    expect(RuntimeError, gemm.run, x)
    bf = torch.bfloat16
    expect(ValueError, gemm.prepare, M, torch.empty((M, N)), arg="out")
    expect(ValueError, gemm.prepare, M, torch.empty((M + 1, N), dtype=bf), arg="out")
    expect(ValueError, gemm.prepare, M, torch.empty((M, N - 1), dtype=bf), arg="out")
    expect(ValueError, gemm.prepare, M, torch.empty((N, M), dtype=bf).T, arg="out")
    expect(ValueError, gemm.prepare, 0, torch.empty((0, N), dtype=bf))
    expect(TypeError, gemm.prepare, M, "out", arg="out")
    out = poison_(torch.empty((M, N), dtype=bf), SENTINEL)
    gemm.prepare(M, out)
    xt = torch.empty((Kd, M), dtype=bf)
    for name, bad in [("x float32", x.float()), ("x wrong M", torch.randn(M + 1, Kd).bfloat16()),
                      ("x wrong K", torch.randn(M, Kd + 64).bfloat16()),
                      ("x column-strided", xt.T), ("x 1-D", x.reshape(-1))]:
        try:
            expect(ValueError, gemm.run, bad, arg="x", untouched=[out])
        except (AssertionError, pytest.fail.Exception) as e:
            raise AssertionError(f"gemm run case {name!r}: {e}") from None
    expect(TypeError, gemm.run, x.tolist(), arg="x", untouched=[out])
    gemm.run(x)
    assert count_bits(out, SENTINEL) == 0, f"M={M} N={N} K={Kd}: run after errors left elements unwritten"

    split = kx.WsGemm(W, split=64, valid=32)
    L = torch.empty((M, 32))
    T = torch.empty((M, 64), dtype=bf)
    expect(ValueError, split.prepare, M, logits=torch.empty((M, 33)), latent=T, arg="logits")
    expect(ValueError, split.prepare, M, logits=L.bfloat16(), latent=T, arg="logits")
    expect(ValueError, split.prepare, M, logits=L, latent=torch.empty((M, 63), dtype=bf), arg="latent")
    expect(ValueError, split.prepare, M, logits=L, latent=T.float(), arg="latent")
    expect((ValueError, TypeError), split.prepare, M, torch.empty((M, N), dtype=bf))
    expect((ValueError, TypeError), gemm.prepare, M, logits=L, latent=T)


def test_bad_id_record_is_per_layer_on_shared_scratch(kx, weights):
    """Layer A meets a bad id, then layer B (another top_k) runs clean on the same scratch:
    B.check() stays quiet, A.check() raises for A's own (token, slot), also after A is
    prepared again on another scratch (each layer keeps its record until its check)."""
    a = Layer(kx, SHAPE, weights)
    b = Layer(kx, SHAPE, weights, hidden_scale="floor", top_k=K - 1)
    shared = kx.scratch(a.moe, b.moe)
    x, ids, _ = inputs(seed_of("shared-record"))
    bad_ids = ids.clone()
    bad_ids[2, 1] = E + 3
    a.run(x, bad_ids, scratch=shared, poison=SENTINEL)
    b.run(x, ids[:, :K - 1].contiguous(), scratch=shared)
    b.moe.check()
    a.run(x, ids, scratch=kx.scratch(a.moe))
    with pytest.raises(kx.BadRoutingError) as info:
        a.moe.check()
    assert_names_first_bad(str(info.value), 2, 1, E + 3)
    a.moe.check()


class RepreparesOnExport:
    """An input whose __dlpack__ runs `hook` first: Python code inside run(), where another
    thread could as well re-prepare the layer."""

    def __init__(self, t, hook):
        self.t, self.hook = t, hook

    def __dlpack_device__(self):
        return self.t.__dlpack_device__()

    def __dlpack__(self, **kwargs):
        self.hook()
        return self.t.__dlpack__(**kwargs)


@pytest.mark.parametrize("device", BOTH_DEVICES)
def test_run_reads_the_prepared_state_after_its_inputs(kx, weights, device):
    """prepare() from inside run() (an input's __dlpack__): run() checks its inputs against
    the state it then runs with, so a larger batch prepared meanwhile is a shape error, not a
    read past x and ids (before: ids read out of bounds, a segfault at larger batches), and a
    new out of the same batch is the one written and returned."""
    layer = Layer(kx, SHAPE, tuple(t.to(device) for t in weights))
    x, ids, _ = (t.to(device) for t in inputs(seed_of("reprepare")))
    scratch = kx.scratch(layer.moe)
    layer.moe.prepare(B, scratch, torch.empty((B * K, H), dtype=torch.bfloat16, device=device))
    big = poison_(torch.empty((64 * B * K, H), dtype=torch.bfloat16, device=device), SENTINEL)
    grow = RepreparesOnExport(x, lambda: layer.moe.prepare(64 * B, scratch, big))
    expect(ValueError, layer.moe.run, grow, ids, arg="x", untouched=[big])
    fresh = poison_(torch.empty((B * K, H), dtype=torch.bfloat16, device=device), SENTINEL)
    swap = RepreparesOnExport(ids, lambda: layer.moe.prepare(B, scratch, fresh))
    assert layer.moe.run(x, swap) is fresh, "run() returned another out than the one it wrote"
    check_close(fresh, layer.reference(x, ids), "out prepared inside run()")

    W = torch.randn(128, 64).bfloat16().to(device)
    gemm = kx.WsGemm(W)
    gemm.prepare(1, torch.empty((1, 128), dtype=torch.bfloat16, device=device))
    y_big = poison_(torch.empty((256, 128), dtype=torch.bfloat16, device=device), SENTINEL)
    xg = torch.randn(1, 64).bfloat16().to(device)
    expect(ValueError, gemm.run, RepreparesOnExport(xg, lambda: gemm.prepare(256, y_big)), arg="x",
           untouched=[y_big])
    y = poison_(torch.empty((1, 128), dtype=torch.bfloat16, device=device), SENTINEL)
    assert gemm.run(RepreparesOnExport(xg, lambda: gemm.prepare(1, y))) is y
    assert count_bits(y, SENTINEL) == 0, "the out prepared inside run() was not written"


@pytest.mark.parametrize("device", BOTH_DEVICES)
def test_outputs_may_not_overlap_inputs(kx, weights, device):
    """An output sharing memory with an input (or, for WsGemm, with the other output or W)
    would be read after it was written: refused naming both, nothing written. Views of one
    buffer that share no element are fine."""
    bf = torch.bfloat16
    layer = Layer(kx, SHAPE, tuple(t.to(device) for t in weights))
    x, ids, rw = (t.to(device) for t in inputs(seed_of("overlap")))
    scratch = kx.scratch(layer.moe)
    z = poison_(torch.empty((B, H), dtype=bf, device=device), SENTINEL)
    layer.moe.prepare(B, scratch, z, combine=True)
    msg = expect(ValueError, layer.moe.run, z, ids, rw, arg="out")
    assert "x" in msg, f"message does not name x: {msg!r}"
    inside = z[:2].view(torch.float32)[:, :K]  # the routing weights stored in z's rows
    inside.copy_(rw[:2])
    layer.moe.prepare(2, scratch, z[:2], combine=True)
    msg = expect(ValueError, layer.moe.run, x[:2].clone(), ids[:2], inside, arg="out")
    assert "weights" in msg, f"message does not name weights: {msg!r}"
    box = poison_(torch.empty((2 * B * K, H), dtype=bf, device=device), SENTINEL)  # out and x side by side
    layer.moe.prepare(B, scratch, box[:B * K])
    box[B * K:B * K + B].copy_(x)
    layer.moe.run(box[B * K:B * K + B], ids)
    check_close(box[:B * K], layer.reference(x, ids), "out beside x in one buffer")
    comb = poison_(torch.empty((2 * B * K, H), dtype=bf, device=device), SENTINEL)  # rows interleaved: even / odd
    layer.moe.prepare(B, scratch, comb[0::2][:B * K])
    comb[1::2][:B].copy_(x)
    layer.moe.run(comb[1::2][:B], ids)
    check_close(comb[0::2][:B * K], layer.reference(x, ids), "out and x on alternate rows of one buffer")
    straddling = torch.as_strided(comb, (B, H), (2 * H, 1), H + H // 2)  # half an odd row, half an even
    expect(ValueError, layer.moe.run, straddling, ids, arg="out")

    W = torch.randn(128, 64).bfloat16().to(device)
    xg = torch.randn(2, 64).bfloat16().to(device)
    gemm = kx.WsGemm(W)
    buf = torch.zeros((2, 128), dtype=bf, device=device)
    gemm.prepare(2, buf)
    expect(ValueError, gemm.run, buf[:, :64], arg="out")
    msg = expect(ValueError, gemm.prepare, 2, W.view(-1)[:256].view(2, 128), arg="out")
    assert "W" in msg
    split = kx.WsGemm(W, split=64, valid=48)
    shared = torch.zeros((2, 512), dtype=bf, device=device)
    msg = expect(ValueError, split.prepare, 2, logits=shared[:, :96].view(torch.float32),
                 latent=shared[:, 40:104], arg="logits")
    assert "latent" in msg
    split.prepare(2, logits=shared[:, :96].view(torch.float32), latent=shared[:, 96:160])
    logits, latent = split.run(xg)
    want, mag = want_for(xg, W), abs_products(xg, W)
    assert_gemm_close(logits, want[:, :48], mag[:, :48], "logits beside latent in one buffer", bf16=False)
    assert_gemm_close(latent, want[:, 64:], mag[:, 64:], "latent beside logits in one buffer", bf16=True)
