"""SPEC 3 on the CPU backend: kx.PersistentExperts against moe_reference (float64).

Shapes: k3-tp8 (E=384, small B), the TP16 shard (I=192), small odd legal shapes with B
up to 300, top_k 1..32, repeated experts within a token; per-slot rows and the combined
output; every element written; determinism; strided outputs; several layers sharing
one scratch. Tolerance: see shapes.MOE_RTOL.
"""

from __future__ import annotations

import math

import pytest
import torch

from moe_check import Layer, bitwise_equal, check_close, check_combined_matches_rows, check_strided_inputs
from shapes import (K3_TP8, SMALL_SHAPES, TP16, count_bits, make_ids, make_route_weights,
                    make_weights, make_x, make_x_varied, poison_, rel_fro, seed_of)


@pytest.fixture(scope="module")
def model_layers(kx, weights_for):
    """The two model shards, built once for this module (random FP4 bytes, scales ~2^-8)."""
    layers = {s["name"]: Layer(kx, s, weights_for(s, seed=0)) for s in (K3_TP8, TP16)}
    yield layers
    for layer in layers.values():  # the reference's dequantized experts: up to GBs
        layer.cache.clear()


def _inputs(layer, B, seed, varied=False):
    H, E, K = layer.shape["H"], layer.shape["E"], layer.top_k
    x = (make_x_varied if varied else make_x)(B, H, seed)
    ids = make_ids(B, K, E, seed)
    rw = make_route_weights(B, K, seed)
    return x, ids, rw


# --------------------------------------------------------------------------- model shapes
MODEL_CASES = [(K3_TP8, 1), (K3_TP8, 2), (K3_TP8, 5), (K3_TP8, 16), (TP16, 1), (TP16, 4)]


def run_twice_against_reference(layer, x, ids, rw, what):
    """One run within the reference's tolerance, and a second run bit-identical to it."""
    out = layer.run(x, ids, rw).clone()
    check_close(out, layer.reference(x, ids, rw), what)
    again = layer.run(x, ids, rw)
    assert bitwise_equal(out, again), f"{what}: two runs differ (not deterministic)"
    return out


@pytest.mark.parametrize("shape,B", MODEL_CASES, ids=lambda p: p["name"] if isinstance(p, dict) else f"B{p}")
def test_model_shape_rows(model_layers, shape, B):
    layer = model_layers[shape["name"]]
    seed = seed_of("model-rows", shape["name"], B)
    x, ids, _ = _inputs(layer, B, seed)
    run_twice_against_reference(layer, x, ids, None, f"{layer.describe()} B={B} seed={seed} rows")


@pytest.mark.parametrize("shape,B", MODEL_CASES, ids=lambda p: p["name"] if isinstance(p, dict) else f"B{p}")
def test_model_shape_combined(model_layers, shape, B):
    layer = model_layers[shape["name"]]
    seed = seed_of("model-comb", shape["name"], B)
    x, ids, rw = _inputs(layer, B, seed)
    what = f"{layer.describe()} B={B} seed={seed} combined"
    out = run_twice_against_reference(layer, x, ids, rw, what)
    check_combined_matches_rows(out, layer.run(x, ids), rw, what)


def test_k3_tp8_repeated_experts_and_varied_x(model_layers):
    """Every token routes all 16 slots to 2-3 experts; x spans 1e-3..1e2 per token."""
    layer = model_layers["k3-tp8"]
    B, K = 2, layer.top_k
    seed = seed_of("k3-rep")
    x = make_x_varied(B, layer.hidden, seed)
    ids = torch.tensor([[5, 5, 383, 5] * 4, [0, 1, 2] * 5 + [0]], dtype=torch.int32)
    what = f"{layer.describe()} B={B} seed={seed} ids={ids.tolist()}"
    out = layer.run(x, ids)
    check_close(out, layer.reference(x, ids), what)
    for t in range(B):
        for j in range(K):
            first = int((ids[t] == ids[t, j]).nonzero()[0])
            assert bitwise_equal(out[t * K + j], out[t * K + first]), (
                f"{what}: token {t} slot {j} and slot {first} (same expert) differ")


# --------------------------------------------------------------------------- small shapes
SMALL_CASES = [(s, B) for s in SMALL_SHAPES for B in (1, 2, 5, 17, 64)]
SMALL_CASES += [(SMALL_SHAPES[0], 300), (SMALL_SHAPES[2], 300), (SMALL_SHAPES[4], 300)]


@pytest.fixture(scope="module")
def small_layers(kx):
    return {s["name"]: Layer(kx, s, make_weights(s, seed_of("small-w", s["name"])))
            for s in SMALL_SHAPES}


@pytest.mark.parametrize("shape,B", SMALL_CASES, ids=lambda p: p["name"] if isinstance(p, dict) else f"B{p}")
def test_small_shapes(small_layers, shape, B):
    layer = small_layers[shape["name"]]
    seed = seed_of("small", shape["name"], B)
    x, ids, rw = _inputs(layer, B, seed, varied=(B % 2 == 1))
    what = f"{layer.describe()} B={B} seed={seed}"
    rows = layer.run(x, ids)
    check_close(rows, layer.reference(x, ids), what + " rows")
    z = layer.run(x, ids, rw)
    check_close(z, layer.reference(x, ids, rw), what + " combined")
    check_combined_matches_rows(z, rows, rw, what)


@pytest.mark.parametrize("top_k", list(range(1, 17)) + [31, 32])
def test_top_k_sweep(kx, top_k):
    shape = dict(name=f"h128-i64-e9-k{top_k}", H=128, I=64, E=9, top_k=top_k,
                 hidden_scale="rceil" if top_k % 2 else "floor")
    seed = seed_of("topk", top_k)
    layer = Layer(kx, shape, make_weights(shape, seed))
    assert layer.moe.top_k == top_k and layer.moe.experts == 9
    assert layer.moe.hidden == 128 and layer.moe.inter == 64
    for B in (1, 3, 8):
        x, ids, rw = _inputs(layer, B, seed + B)
        what = f"{layer.describe()} B={B} seed={seed + B}"
        check_close(layer.run(x, ids), layer.reference(x, ids), what + " rows")
        check_close(layer.run(x, ids, rw), layer.reference(x, ids, rw), what + " combined")


@pytest.mark.parametrize("beta,linear_beta", [(math.inf, math.inf), (1.0, 2.0), (4.0, 25.0),
                                              (0.5, math.inf)])
@pytest.mark.parametrize("hidden_scale", ["rceil", "floor"])
def test_situ_caps_and_hidden_scale(kx, beta, linear_beta, hidden_scale):
    shape = dict(name="h192-i96-e4-k6", H=192, I=96, E=4, top_k=6, hidden_scale=hidden_scale)
    seed = seed_of("caps", beta, linear_beta, hidden_scale)
    # weights 8x larger (scales + 3): |a| ~ 1.7 rms, up to ~8, past the caps of 0.5-4 (25 only bends it)
    w = make_weights(shape, seed, kind="random")
    w = (w[0], w[1] + 3, w[2], w[3] + 3)
    layer = Layer(kx, shape, w, beta=beta, linear_beta=linear_beta)
    B = 7
    x, ids, rw = _inputs(layer, B, seed)
    what = f"{layer.describe()} B={B} seed={seed}"
    check_close(layer.run(x, ids), layer.reference(x, ids), what + " rows")
    check_close(layer.run(x, ids, rw), layer.reference(x, ids, rw), what + " combined")


def test_all_slots_one_expert(small_layers):
    """E=1: every slot of every token is expert 0; each slot gets its (identical) row."""
    layer = small_layers["h64-i32-e1-k4"]
    B, K = 9, layer.top_k
    seed = seed_of("e1")
    x = make_x(B, layer.hidden, seed)
    ids = torch.zeros((B, K), dtype=torch.int32)
    what = f"{layer.describe()} B={B} seed={seed}"
    out = layer.run(x, ids)
    check_close(out, layer.reference(x, ids), what)
    for t in range(B):
        for j in range(1, K):
            assert bitwise_equal(out[t * K + j], out[t * K]), f"{what}: token {t} slot {j} differs from slot 0"


def test_combined_weights_signs_and_zeros(small_layers):
    """Routing weights need not be normalized: zeros and negatives combine as given."""
    layer = small_layers["h128-i96-e3-k2"]
    B = 6
    seed = seed_of("wsign")
    x, ids, _ = _inputs(layer, B, seed)
    rw = torch.tensor([[0.0, 1.0], [1.0, 0.0], [-0.5, 2.0], [3.0, -3.0], [0.0, 0.0], [1e-3, 7.0]])
    what = f"{layer.describe()} B={B} seed={seed} weights={rw.tolist()}"
    out = layer.run(x, ids, rw)
    want = layer.reference(x, ids, rw)
    check_close(out[[0, 1, 2, 3, 5]], want.rows([0, 1, 2, 3, 5]), what)
    assert bool((out[4] == 0).all()), f"{what}: all-zero weights must give a zero row"


# --------------------------------------------------------------------------- prepare / run life
def test_prepare_once_run_many(small_layers):
    layer = small_layers["h192-i32-e7-k16"]
    B = 4
    scratch = layer.kx.scratch(layer.moe)
    out = layer.new_out(B, False)
    layer.moe.prepare(B, scratch, out)
    for step in range(5):
        seed = seed_of("many", step)
        x, ids, _ = _inputs(layer, B, seed)
        layer.run(x, ids, out=out, prepare=False)
        check_close(out, layer.reference(x, ids), f"{layer.describe()} B={B} step={step} seed={seed}")


def test_reprepare_changing_batch(small_layers):
    layer = small_layers["h64-i96-e7-k5"]
    scratch = layer.kx.scratch(layer.moe)
    for B in (1, 33, 2, 64, 1, 7):
        seed = seed_of("reprep", B)
        x, ids, rw = _inputs(layer, B, seed)
        what = f"{layer.describe()} B={B} seed={seed}"
        check_close(layer.run(x, ids, scratch=scratch), layer.reference(x, ids), what + " rows")
        check_close(layer.run(x, ids, rw, scratch=scratch), layer.reference(x, ids, rw),
                    what + " combined")


def test_layers_share_scratch(kx):
    """Four layers (different weights, two shapes) on one scratch, batch changing every
    call; each result equals that layer run alone."""
    shapes = [dict(name="a", H=128, I=64, E=5, top_k=4, hidden_scale="rceil"),
              dict(name="b", H=128, I=64, E=5, top_k=4, hidden_scale="floor"),
              dict(name="c", H=192, I=96, E=3, top_k=6, hidden_scale="rceil"),
              dict(name="d", H=64, I=32, E=8, top_k=8, hidden_scale="floor")]
    layers = [Layer(kx, s, make_weights(s, seed_of("share", s["name"]))) for s in shapes]
    shared = kx.scratch(*(lay.moe for lay in layers))
    for step, B in enumerate((3, 1, 17, 2, 64, 5, 1, 8)):
        for li, layer in enumerate(layers):
            seed = seed_of("share", step, li)
            x, ids, _ = _inputs(layer, B, seed)
            got = layer.run(x, ids, scratch=shared)
            alone = layer.run(x, ids)  # its own scratch
            what = f"layer {li} {layer.describe()} step={step} B={B} seed={seed}"
            assert bitwise_equal(got, alone), f"{what}: shared scratch result differs"
            check_close(got, layer.reference(x, ids), what)


def test_strided_out_rows(small_layers):
    """out may be a row-strided view (row stride > H, column offset): only the view's
    elements are written."""
    layer = small_layers["h128-i32-e3-k7"]
    B, K, H = 5, layer.top_k, layer.hidden
    seed = seed_of("stride-out")
    x, ids, rw = _inputs(layer, B, seed)
    for combine in (False, True):
        rows = B if combine else B * K
        big = torch.empty((rows + 2, H + 96), dtype=torch.bfloat16)
        poison_(big, 0x7BCD)
        view = big[1:1 + rows, 32:32 + H]
        assert view.stride() == (H + 96, 1)
        what = f"{layer.describe()} B={B} seed={seed} combine={combine} strided out"
        out = layer.run(x, ids, rw if combine else None, out=view)
        check_close(out, layer.reference(x, ids, rw if combine else None), what)
        mask = torch.ones_like(big, dtype=torch.bool)
        mask[1:1 + rows, 32:32 + H] = False
        outside = big[mask]
        assert count_bits(outside, 0x7BCD) == outside.numel(), f"{what}: bytes outside the view changed"


def test_strided_inputs(small_layers):
    layer = small_layers["h128-i32-e3-k7"]
    seed = seed_of("stride-in")
    x, ids, rw = _inputs(layer, 5, seed)
    check_strided_inputs(layer, x, ids, rw, f"{layer.describe()} B=5 seed={seed} strided inputs")


def test_weights_not_modified(kx):
    shape = SMALL_SHAPES[3]
    w = make_weights(shape, seed_of("nomod"))
    before = [t.clone() for t in w]
    layer = Layer(kx, shape, w)
    x, ids, rw = _inputs(layer, 3, 1)
    layer.run(x, ids)
    layer.run(x, ids, rw)
    for name, a, b in zip(("w13", "s13", "w2", "s2"), w, before):
        assert torch.equal(a, b), f"{name} was modified"
    assert layer.moe.packed_bytes == 0, "CPU backend: packed_bytes should be 0"
    assert layer.moe.device == "cpu"


def test_inputs_not_modified(small_layers):
    layer = small_layers["h192-i96-e7-k3"]
    x, ids, rw = _inputs(layer, 4, 3)
    xs, idss, rws = x.clone(), ids.clone(), rw.clone()
    layer.run(x, ids, rw)
    assert bitwise_equal(x, xs) and torch.equal(ids, idss) and torch.equal(rw, rws)


def check_per_token(out, want, B, rows_per_token, what, rtol=2e-2):
    """Per-token relative error (tokens of very different magnitudes): zero reference
    rows must come out exactly zero."""
    for t in range(B):
        o = out[t * rows_per_token:(t + 1) * rows_per_token]
        w = want.value[t * rows_per_token:(t + 1) * rows_per_token]
        assert not bool(torch.isnan(o).any()), f"{what}: token {t} has NaN"
        if bool((w == 0).all()):
            assert bool((o == 0).all()), f"{what}: token {t} should be exactly zero"
            continue
        err = rel_fro(o.float(), w)
        assert err < rtol, f"{what}: token {t} relative error {err:.3e}"


def test_extreme_token_magnitudes(small_layers):
    """Explicit edge cases: tokens of 1e-30 (FC1 ~1e-32: h underflows to 0), 1e-8, 1e20
    and 1e30 (FC1 far past the caps), all +0.0 and all -0.0: each matches the reference
    on its own scale, zero tokens give exactly zero rows, nothing is NaN."""
    layer = small_layers["h192-i96-e7-k3"]
    K, H = layer.top_k, layer.hidden
    seed = seed_of("extreme")
    mags = [1e-30, 1e-8, 1.0, 1e20, 1e30, 0.0, -0.0]
    x = make_x(len(mags), H, seed).float()
    for t, m in enumerate(mags):
        x[t] = x[t] * m if m != 0 else torch.full((H,), m)
    x = x.to(torch.bfloat16)
    ids = make_ids(len(mags), K, layer.shape["E"], seed)
    rw = make_route_weights(len(mags), K, seed)
    what = f"{layer.describe()} magnitudes={mags} seed={seed}"
    check_per_token(layer.run(x, ids), layer.reference(x, ids), len(mags), K, what + " rows")
    check_per_token(layer.run(x, ids, rw), layer.reference(x, ids, rw), len(mags), 1,
                    what + " combined")
