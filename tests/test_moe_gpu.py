"""SPEC 3 on the GPU engine (issue 3): the device quantizer bit-exact; rows and combined
output against the float64 reference (computed on the GPU) for every B in 1..64 on
k3-tp8 and tp16, for B > 64, and on other models' shards at B = 1, 8, 64; NaN/Inf
inputs; bad ids; CUDA-graph capture and replay; four layers sharing one scratch;
determinism over 100 runs, and over 1500 runs with every token on the same 16 experts;
2000 launches of the shape whose tiles are one ring stage each; streams; device
mismatches. Weights are built once per module; the reference caches each expert's
dequantized weights on the GPU."""

from __future__ import annotations

import math

import pytest
import torch

from gpu_util import sync_or_die, to_cuda
from moe_check import (Layer, assert_names_first_bad, bitwise_equal, check_close,
                       check_combined_matches_rows, check_rows_close, check_strided_inputs)
from shapes import (FINITE_SENTINEL, K3_TP8, MOE_EXACT, OTHER_MODEL_SHAPES, SMALL_SHAPES, TP16, count_bits,
                    every_scale_exponent, make_ids, make_route_weights, make_weights, make_x, make_x_varied,
                    poison_, ref, rel_fro, seed_of, shape_id)

pytestmark = pytest.mark.gpu
DEV = "cuda"


@pytest.fixture(scope="module")
def gpu_layers(kx, weights_for):
    layers = {}
    for s in (K3_TP8, TP16):
        layers[s["name"]] = Layer(kx, s, to_cuda(weights_for(s, seed=0)))
    yield layers
    layers.clear()
    torch.cuda.empty_cache()


@pytest.fixture(scope="module")
def scratches(kx, gpu_layers):
    return {name: kx.scratch(layer.moe) for name, layer in gpu_layers.items()}


def _inputs(layer, B, seed, varied=False):
    H, E, K = layer.hidden, layer.shape["E"], layer.top_k
    x = (make_x_varied if varied else make_x)(B, H, seed).to(DEV)
    return x, make_ids(B, K, E, seed).to(DEV), make_route_weights(B, K, seed).to(DEV)


# --------------------------------------------------------------------------- plan quantizer
@pytest.mark.parametrize("mode", ["rceil", "floor"])
@pytest.mark.parametrize("B", [1, 7, 64, 300])
def test_device_quantizer_bit_exact(kx, mode, B):
    seed = seed_of("dq", mode, B)
    x = make_x_varied(B, 3584, seed)
    if B > 2:
        x[1, 17] = math.nan
        x[2, 3000] = -math.inf
        x[0, :32] = 2.0**-133  # bf16 subnormals
        x[0, 32:64] = -0.0
    q, s = kx.quantize_mxfp8(x.to(DEV), scale=mode)
    assert q.is_cuda and s.is_cuda, "a CUDA bf16 input is quantized on the device"
    qc, sc = kx.quantize_mxfp8(x, scale=mode)
    what = f"device quantizer B={B} mode={mode} seed={seed}"
    assert torch.equal(s.cpu(), sc), f"{what}: scales differ from the CPU backend"
    assert torch.equal(q.cpu(), qc), f"{what}: elements differ from the CPU backend"
    rq, rs = ref.quantize_mxfp8(x, mode)
    assert torch.equal(s.cpu(), rs), f"{what}: scales differ from the reference"
    finite = torch.isfinite(x.float()).reshape(B, -1, 32).all(-1).repeat_interleave(32, 1)
    assert torch.equal(q.cpu()[finite], rq[finite]), f"{what}: elements differ from the reference"


@pytest.mark.parametrize("mode", ["rceil", "floor"])
def test_device_quantizer_every_scale_exponent(kx, mode):
    """Blocks at every binade bf16 has (subnormals included), amax at and around where the
    two scale rules part: the device's bytes are the CPU backend's and the reference's."""
    x = every_scale_exponent(torch.bfloat16, seed_of("dq-every-exponent")).reshape(-1, 128)
    q, s = kx.quantize_mxfp8(x.to(DEV), scale=mode)
    qc, sc = kx.quantize_mxfp8(x, scale=mode)
    rq, rs = ref.quantize_mxfp8(x, mode)
    what = f"device quantizer, every exponent, mode={mode}"
    assert torch.equal(s.cpu(), sc) and torch.equal(s.cpu(), rs), f"{what}: scales differ"
    assert torch.equal(q.cpu(), qc) and torch.equal(q.cpu(), rq), f"{what}: elements differ"


def test_device_quantizer_strided_input_and_unaligned_outputs(kx):
    """A row-strided CUDA input (its last axis contiguous) is quantized where it lies, into
    caller-given outputs that start off a 4-byte word as well as into aligned ones."""
    rows, K = 9, 3584
    x = make_x(rows, K + 64, seed_of("dq-stride")).to(DEV)
    view = x[:, 64:]
    qc, sc = kx.quantize_mxfp8(view.cpu().contiguous())
    q, s = kx.quantize_mxfp8(view)
    assert torch.equal(q.cpu(), qc) and torch.equal(s.cpu(), sc), "strided device input"
    for offset in (1, 2, 3):
        qbuf = torch.full((rows * K + offset,), 0x7F, dtype=torch.uint8, device=DEV)
        sbuf = torch.full((rows * K // 32 + offset,), 0x7F, dtype=torch.uint8, device=DEV)
        q, s = kx.quantize_mxfp8(view, out=(qbuf[offset:].view(rows, K), sbuf[offset:].view(rows, K // 32)))
        sync_or_die(f"unaligned outputs offset={offset}")
        assert torch.equal(q.cpu(), qc) and torch.equal(s.cpu(), sc), f"outputs {offset} bytes off a word"
        assert bool((qbuf[:offset] == 0x7F).all() and (sbuf[:offset] == 0x7F).all()), (
            f"offset={offset}: bytes before the outputs changed")


# --------------------------------------------------------------------------- every batch size
@pytest.mark.parametrize("B", list(range(1, 65)))
@pytest.mark.parametrize("shape", [K3_TP8, TP16], ids=shape_id)
def test_every_batch_size(kx, gpu_layers, scratches, shape, B):
    layer = gpu_layers[shape["name"]]
    scr = scratches[shape["name"]]
    seed = seed_of("gpu-B", shape["name"], B)
    x, ids, rw = _inputs(layer, B, seed, varied=(B % 3 == 0))
    what = f"{layer.describe()} B={B} seed={seed}"
    rows = layer.run(x, ids, scratch=scr)
    sync_or_die(what)
    want = layer.reference(x, ids)
    check_close(rows, want, what + " rows")
    z = layer.run(x, ids, rw, scratch=scr)
    sync_or_die(what + " combined")
    check_close(z, want.combined(rw), what + " combined")
    check_combined_matches_rows(z, rows, rw, what)


@pytest.mark.parametrize("B", [65, 100, 128, 256])
@pytest.mark.parametrize("shape", [K3_TP8, TP16], ids=shape_id)
def test_large_batch(kx, gpu_layers, scratches, shape, B):
    layer = gpu_layers[shape["name"]]
    seed = seed_of("gpu-bigB", shape["name"], B)
    x, ids, rw = _inputs(layer, B, seed)
    what = f"{layer.describe()} B={B} seed={seed}"
    rows = layer.run(x, ids, scratch=scratches[shape["name"]])
    sync_or_die(what)
    want = layer.reference(x, ids)
    check_close(rows, want, what + " rows")
    z = layer.run(x, ids, rw, scratch=scratches[shape["name"]])
    sync_or_die(what)
    check_close(z, want.combined(rw), what + " combined")


@pytest.mark.parametrize("B", [9, 20, 27, 64])
@pytest.mark.parametrize("case", ["one-hot-expert", "same-16-experts", "all-slots-repeat", "hot-pool"])
def test_skewed_routing(kx, gpu_layers, scratches, case, B):
    """Every token on one expert / the same 16 experts / one expert in all 16 slots / 16 of 24
    experts at random: experts of 9-64 tokens, so several units an expert, the last one full or
    partial (the units of session 53's two-tile branch, 9-16 tokens, ran these too)."""
    layer = gpu_layers["k3-tp8"]
    seed = seed_of("skew", case, B)
    x, ids, rw = _inputs(layer, B, seed)
    if case == "one-hot-expert":
        ids[:, 0] = 383
    elif case == "same-16-experts":
        ids[:] = torch.arange(100, 116, dtype=torch.int32, device=DEV)
    elif case == "hot-pool":
        g = torch.Generator().manual_seed(seed)
        pool = torch.randperm(layer.shape["E"], generator=g)[:24]
        ids[:] = torch.stack([pool[torch.randperm(24, generator=g)[:16]] for _ in range(B)]).to(DEV, torch.int32)
    else:
        ids[:] = ids[:, :1]
    what = f"{layer.describe()} B={B} seed={seed} routing={case}"
    rows = layer.run(x, ids, scratch=scratches["k3-tp8"])
    sync_or_die(what)
    check_close(rows, layer.reference(x, ids), what)
    z = layer.run(x, ids, rw, scratch=scratches["k3-tp8"])
    sync_or_die(what)
    check_combined_matches_rows(z, rows, rw, what)


def _seeded_layer(kx, shape):
    """A layer of `shape` on the GPU, its weights seeded by the shape's name."""
    return Layer(kx, shape, to_cuda(make_weights(shape, seed_of("gpu-small-w", shape["name"]))))


def _check_rows_and_combined(kx, shape, batches, tag):
    """Rows and the combined output of a fresh layer of `shape` against the reference."""
    layer = _seeded_layer(kx, shape)
    for B in batches:
        seed = seed_of(tag, shape["name"], B)
        x, ids, rw = _inputs(layer, B, seed)
        what = f"{layer.describe()} B={B} seed={seed}"
        rows = layer.run(x, ids)
        sync_or_die(what)
        want = layer.reference(x, ids)
        check_close(rows, want, what + " rows")
        z = layer.run(x, ids, rw)
        sync_or_die(what)
        check_close(z, want.combined(rw), what + " combined")


@pytest.mark.parametrize("shape", SMALL_SHAPES, ids=shape_id)
def test_small_shapes_gpu(kx, shape):
    _check_rows_and_combined(kx, shape, (1, 5, 64, 300), "gpu-small")


@pytest.mark.parametrize("shape", OTHER_MODEL_SHAPES, ids=shape_id)
def test_other_model_shapes_gpu(kx, shape):
    _check_rows_and_combined(kx, shape, (1, 8, 64), "gpu-other-models")


# The widest rows of the small shapes: local x takes most of shared memory at B = 1, and the row
# words (experts_layout.cuh: row_words_fit) take B = 1 and 2 of them, not 64
BIG_ROWS = dict(name="h24576-i32-e3-k16", H=24576, I=32, E=3, top_k=16, hidden_scale="rceil")


def test_combine_paths_at_wide_rows(kx):
    """The three combines at H = 24576: the MMA warps' row words at B = 1 (combine_by_words<true>),
    the epilogue warps' row words at B = 2 and 5 (combine_by_words; at B = 5 the launch has more
    items than the grid has MMA warps, so some warps take a second after their planned one) and y
    with its arrival counters at B = 64 (combine_by_counts): the reference's output and the
    slot-order sum of the layer's own rows."""
    layer = _seeded_layer(kx, BIG_ROWS)
    for B in (1, 2, 5, 64):
        seed = seed_of("big-rows", B)
        x, ids, rw = _inputs(layer, B, seed)
        what = f"{layer.describe()} B={B} seed={seed}"
        rows = layer.run(x, ids)
        sync_or_die(what)
        z = layer.run(x, ids, rw)
        sync_or_die(what)
        check_close(z, layer.reference(x, ids).combined(rw), what + " combined")
        check_combined_matches_rows(z, rows, rw, what)


def test_one_stage_tiles_many_launches(kx):
    """The shape whose every tile is one ring stage (H = 64, I = 32) with the most units
    (E = 4096; B = 300 is five launches of 64 tokens): the MMA warps run through stages
    fastest there, which once let an activation producer fall a barrier phase behind and
    hang the launch (the C harness hung at its launch 14, 18, 31 and 174 on four tries).
    200 row runs and 200 combined runs (2000 launches) must finish, and the last of each
    equal the first bit for bit."""
    shape = SMALL_SHAPES[-1]
    assert shape["E"] == 4096 and shape["H"] == 64 and shape["I"] == 32, shape
    layer = _seeded_layer(kx, shape)
    B = 300
    seed = seed_of("one-stage-tiles")
    x, ids, rw = _inputs(layer, B, seed)
    scratch = kx.scratch(layer.moe)
    firsts = {}
    for combine in (False, True):
        what = f"{layer.describe()} B={B} seed={seed} combine={combine}"
        out = layer.new_out(B, combine, DEV)
        layer.moe.prepare(B, scratch, out, combine=combine)
        args = (x, ids, rw) if combine else (x, ids)
        layer.moe.run(*args)
        sync_or_die(what)
        firsts[combine] = out.clone()
        for _ in range(200):
            poison_(out)
            layer.moe.run(*args)
        sync_or_die(what + ": 200 runs", seconds=60)
        assert bitwise_equal(out, firsts[combine]), f"{what}: the last of 200 more runs differs from the first"
    what = f"{layer.describe()} B={B} seed={seed}"
    check_close(firsts[False], layer.reference(x, ids), what + " rows")
    check_combined_matches_rows(firsts[True], firsts[False], rw, what + " combined")


def test_gpu_matches_cpu_backend(kx, gpu_layers, weights_for):
    """GPU and CPU backends on the same inputs: both within the reference's lawful range, and
    the same bf16 bits for at least MOE_EXACT of the elements."""
    layer = gpu_layers["tp16"]
    cpu = Layer(kx, TP16, weights_for(TP16, seed=0))
    B = 4
    seed = seed_of("gpu-vs-cpu")
    x, ids, rw = _inputs(layer, B, seed)
    what = f"{layer.describe()} B={B} seed={seed}"
    g = layer.run(x, ids)
    sync_or_die("gpu vs cpu")
    c = cpu.run(x.cpu(), ids.cpu())
    want = layer.reference(x, ids)
    check_close(g, want, what + " GPU")
    check_close(c, want, what + " CPU")
    same = float((g.cpu() == c).double().mean())
    assert same >= MOE_EXACT, f"{what}: only {same:.2%} of the elements are the same bits on GPU and CPU"


def _worst_rows(g, c, ids, x, top_k, n=4):
    """The n rows farthest from c: token, slot, expert, the token's |x| max, relative
    error, and the 64-column tiles off by more than 5 %."""
    rel = lambda a, b: (a - b).norm(dim=-1) / b.norm(dim=-1).clamp_min(1e-30)
    row_err = rel(g, c)
    out = []
    for r in torch.argsort(row_err, descending=True)[:n].tolist():
        t, j = divmod(r, top_k)
        tiles = torch.nonzero(rel(g[r].view(-1, 64), c[r].view(-1, 64)) > 0.05).flatten()
        out.append(f"row {r} (token {t}, slot {j}, expert {int(ids[t, j])}, |x| max "
                   f"{float(x[t].float().abs().max()):.3g}): rel {float(row_err[r]):.3g}, "
                   f"tiles {tiles.tolist()[:8]}")
    return "; ".join(out)


# GPU and CPU backend on wide-range inputs, the two ingredients of make_x_varied apart;
# a failure names the worst rows (this located a reference bug on 2026-11-29, see
# test_reference_same_on_cuda_and_cpu).
@pytest.mark.parametrize("kind", ["magnitudes", "outliers", "both"])
@pytest.mark.parametrize("shape,B", [(TP16, 9), (K3_TP8, 39)], ids=["tp16-9", "k3-tp8-39"])
def test_wide_range_inputs_match_cpu(kx, gpu_layers, weights_for, shape, B, kind):
    layer = gpu_layers[shape["name"]]
    cpu = Layer(kx, shape, weights_for(shape, seed=0))
    seed = seed_of("gpu-B", shape["name"], B)
    x = make_x_varied(B, shape["H"], seed, magnitudes=kind != "outliers",
                      outliers=kind != "magnitudes")
    ids = make_ids(B, layer.top_k, shape["E"], seed)
    g = layer.run(x.to(DEV), ids.to(DEV)).float().cpu()
    sync_or_die(f"wide range {kind}")
    c = cpu.run(x, ids).float()
    err = rel_fro(g, c)
    assert err < 2e-2, (f"{layer.describe()} B={B} seed={seed} x={kind}: GPU vs CPU rel "
                        f"{err:.3e}; {_worst_rows(g, c, ids, x, layer.top_k)}")


@pytest.mark.parametrize("mode", ["rceil", "floor"])
def test_reference_same_on_cuda_and_cpu(mode):
    """The oracle must not depend on the device it runs on: its quantizers on CUDA give
    the CPU's bits for wide-range bf16 inputs (many sit exactly on e4m3 midpoints).
    torch.ldexp on CUDA once moved 59 of 32256 codes (2026-11-29)."""
    x = make_x_varied(64, 3584, seed_of("ref-device", mode))
    qc, sc = ref.quantize_mxfp8(x, mode)
    qg, sg = ref.quantize_mxfp8(x.to(DEV), mode)
    assert torch.equal(sg.cpu(), sc), f"mode={mode}: scales differ between CUDA and CPU"
    assert torch.equal(qg.cpu(), qc), (f"mode={mode}: {int((qg.cpu() != qc).sum())} codes differ "
                                       "between CUDA and CPU")
    w = make_x_varied(64, 3584, seed_of("ref-device-w", mode)).float()
    assert all(torch.equal(a.cpu(), b) for a, b in
               zip(ref.quantize_mxfp4(w.to(DEV)), ref.quantize_mxfp4(w))), "MXFP4 differs"
    assert torch.equal(ref.dequantize_mxfp8(qg, sg).cpu(), ref.dequantize_mxfp8(qc, sc)), (
        "dequantized MXFP8 differs between CUDA and CPU")


# --------------------------------------------------------------------------- faults
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf], ids=["nan", "inf", "-inf"])
def test_nonfinite_x(kx, gpu_layers, value):
    layer = gpu_layers["k3-tp8"]
    B, K, H = 8, layer.top_k, layer.hidden
    seed = seed_of("gpu-nonfinite", str(value))
    x, ids, rw = _inputs(layer, B, seed)
    x[2, 100] = value
    x[5, H - 1] = value
    what = f"{layer.describe()} B={B} seed={seed} x[2,100]=x[5,{H - 1}]={value}"
    out = layer.run(x, ids, poison=FINITE_SENTINEL)
    sync_or_die(what)
    poisoned = [t * K + j for t in (2, 5) for j in range(K)]
    for r in poisoned:
        assert bool(torch.isnan(out[r]).all()), f"{what}: row {r} not all NaN"
    good = [r for r in range(B * K) if r not in poisoned]
    want = layer.reference(x, ids)
    check_rows_close(out, want, what + " other tokens", good)
    z = layer.run(x, ids, rw, poison=FINITE_SENTINEL)
    sync_or_die(what)
    assert bool(torch.isnan(z[[2, 5]]).all()), f"{what}: combined rows 2, 5 not all NaN"
    check_rows_close(z, want.combined(rw), what + " combined", [0, 1, 3, 4, 6, 7])
    layer.moe.check()  # not a routing error
    # the next clean call is correct (no stale state)
    x2, ids2, _ = _inputs(layer, B, seed + 1)
    out2 = layer.run(x2, ids2)
    sync_or_die(what)
    check_close(out2, layer.reference(x2, ids2), what + " next clean call")


def test_nonfinite_weights(kx, gpu_layers):
    """A NaN scale in expert 1's w13 poisons every row routed to expert 1; one in expert
    2's w2 row 33 poisons column 33 of rows routed to expert 2 only; no hang."""
    base = gpu_layers["tp16"]
    w13, s13, w2, s2 = (t.clone() for t in base.weights)
    s13[1, 7, 0] = 0xFF
    s2[2, 33, 1] = 0xFF
    lay = Layer(kx, TP16, (w13, s13, w2, s2))
    B = 6
    seed = seed_of("gpu-nan-weights")
    x, ids, _ = _inputs(lay, B, seed)
    ids[0, :4] = torch.tensor([1, 2, 0, 3], dtype=torch.int32, device=DEV)
    ids[1, :4] = torch.tensor([2, 2, 1, 9], dtype=torch.int32, device=DEV)
    what = f"{lay.describe()} B={B} seed={seed} s13[1,7,0]=s2[2,33,1]=0xFF"
    out = lay.run(x, ids, poison=FINITE_SENTINEL)
    sync_or_die(what)
    flat = ids.reshape(-1).tolist()
    nan = torch.isnan(out).cpu()
    for r, e in enumerate(flat):
        cols = torch.nonzero(nan[r]).flatten().tolist()
        if e == 1:
            assert len(cols) == TP16["H"], f"{what}: row {r} (expert 1) not all NaN"
        elif e == 2:
            assert cols == [33], f"{what}: row {r} (expert 2) NaN columns {cols[:8]}, want [33]"
        else:
            assert not cols, f"{what}: row {r} (expert {e}) has NaN"
    good = [r for r, e in enumerate(flat) if e not in (1, 2)]
    check_rows_close(out, lay.reference(x, ids), what, good)


def test_all_tokens_nan(kx, gpu_layers):
    layer = gpu_layers["tp16"]
    B = 16
    x, ids, _ = _inputs(layer, B, 5)
    x[:] = math.nan
    out = layer.run(x, ids)
    sync_or_die("all-NaN x")
    assert bool(torch.isnan(out).all()), "all-NaN x must give all-NaN rows"


def test_bad_ids(kx, gpu_layers):
    layer = gpu_layers["k3-tp8"]
    B, K, H, E = 6, layer.top_k, layer.hidden, layer.shape["E"]
    seed = seed_of("gpu-bad-ids")
    x, ids, rw = _inputs(layer, B, seed)
    bad = ids.clone()
    bad[3, 9] = E
    what = f"{layer.describe()} B={B} seed={seed} ids[3, 9] = {E}"
    out = poison_(torch.empty((B * K, H), dtype=torch.bfloat16, device=DEV), FINITE_SENTINEL)
    layer.run(x, bad, out=out, poison=FINITE_SENTINEL)
    sync_or_die(what)
    r = 3 * K + 9
    assert bool(torch.isnan(out[r]).all()), f"{what}: row {r} not all NaN"
    check_rows_close(out, layer.reference(x, bad), what, [i for i in range(B * K) if i != r])
    with pytest.raises(kx.BadRoutingError) as info:
        layer.moe.check()
    assert_names_first_bad(str(info.value), 3, 9, E)
    layer.moe.check()  # cleared
    # several bad ids, negative too: NaN rows exactly there; validate=True raises
    bad2 = ids.clone()
    bad2[0, 0], bad2[4, 15], bad2[5, 7] = -1, 2**31 - 1, E + 7
    with pytest.raises(kx.BadRoutingError):
        layer.run(x, bad2, out=out, poison=FINITE_SENTINEL, validate=True)
    assert count_bits(out, FINITE_SENTINEL) == 0, "validate=True: rows left unwritten"
    nan_rows = torch.isnan(out).all(1).nonzero().flatten().tolist()
    assert nan_rows == [0, 4 * K + 15, 5 * K + 7], f"NaN rows {nan_rows}"
    layer.moe.check()
    z = layer.run(x, bad2, rw, poison=FINITE_SENTINEL)
    sync_or_die(what)
    assert count_bits(z, FINITE_SENTINEL) == 0, "combined rows left unwritten"
    assert torch.isnan(z).all(1).nonzero().flatten().tolist() == [0, 4, 5]
    with pytest.raises(kx.BadRoutingError):
        layer.moe.check()
    # a clean run afterwards is right and leaves no fault
    out2 = layer.run(x, ids)
    sync_or_die(what)
    check_close(out2, layer.reference(x, ids), what + " clean run after bad ids")
    layer.moe.check()


def test_bad_id_record_is_per_layer(kx, gpu_layers):
    """Layer A meets a bad id, layer B (top_k 8, where A has 16) runs clean on the same
    scratch and stream: B.check() stays quiet, and A.check() raises for A's own (token,
    slot), also after A is prepared again on another scratch."""
    a = gpu_layers["tp16"]
    b = Layer(kx, TP16, a.weights, hidden_scale="floor", top_k=8, cache=a.cache)
    shared = kx.scratch(a.moe, b.moe)
    B, E = 5, a.shape["E"]
    x, ids, _ = _inputs(a, B, seed_of("gpu-shared-record"))
    bad = ids.clone()
    bad[4, 11] = E + 1
    a.run(x, bad, scratch=shared, poison=FINITE_SENTINEL)
    b.run(x, ids[:, :8].contiguous(), scratch=shared)
    sync_or_die("shared record")
    b.moe.check()
    a.run(x, ids, scratch=kx.scratch(a.moe))
    with pytest.raises(kx.BadRoutingError) as info:
        a.moe.check()
    assert_names_first_bad(str(info.value), 4, 11, E + 1)
    a.moe.check()


def test_device_mismatch_errors(kx, gpu_layers, scratches):
    layer = gpu_layers["tp16"]
    B, K, H = 2, layer.top_k, layer.hidden
    x, ids, _ = _inputs(layer, B, 1)
    out = poison_(torch.empty((B * K, H), dtype=torch.bfloat16, device=DEV), FINITE_SENTINEL)
    with pytest.raises(ValueError, match="out"):
        layer.moe.prepare(B, scratches["tp16"], out.cpu())
    cpu_moe = kx.PersistentExperts(*(t.cpu() for t in layer.weights), top_k=K,
                                   hidden_scale=layer.hidden_scale)
    with pytest.raises((ValueError, TypeError), match="scratch"):
        layer.moe.prepare(B, kx.scratch(cpu_moe), out)
    layer.moe.prepare(B, scratches["tp16"], out)
    with pytest.raises(ValueError, match="x"):
        layer.moe.run(x.cpu(), ids)
    with pytest.raises(ValueError, match="ids"):
        layer.moe.run(x, ids.cpu())
    sync_or_die("device mismatch")
    assert count_bits(out, FINITE_SENTINEL) == out.numel(), "written before the error"
    with pytest.raises(ValueError):
        kx.PersistentExperts(layer.weights[0], layer.weights[1].cpu(), *layer.weights[2:], top_k=K)


@pytest.mark.parametrize("B", [1, 5, 64])
def test_strided_inputs(kx, gpu_layers, B):
    layer = gpu_layers["tp16"]
    seed = seed_of("gpu-stride-in", B)
    x, ids, rw = _inputs(layer, B, seed)
    check_strided_inputs(layer, x, ids, rw, f"{layer.describe()} B={B} seed={seed} strided inputs")
    sync_or_die("strided inputs")


@pytest.mark.parametrize("H,I", [(65536 + 64, 32), (64, 65536 + 32)])
def test_cuda_dimension_limit(kx, H, I):
    """H or I past KX_MOE_MAX_DIM: a ValueError naming the limit, where the kernel's tile
    indices would no longer divide exactly (the CPU backend takes the same weights)."""
    w = [torch.zeros(s, dtype=torch.uint8) for s in ((1, 2 * I, H // 2), (1, 2 * I, H // 32),
                                                     (1, H, I // 2), (1, H, I // 32))]
    with pytest.raises(ValueError, match="65536"):
        kx.PersistentExperts(*(t.to(DEV) for t in w), top_k=1)
    kx.PersistentExperts(*w, top_k=1)


# --------------------------------------------------------------------------- graphs, streams, sharing
def _graph_capture(fn):
    """Warm up on a side stream, then capture fn() into a CUDA graph."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g


@pytest.fixture(scope="module")
def k3_twin(gpu_layers):
    """A second PersistentExperts on the k3-tp8 weights, for eager runs beside graphs
    captured on the first (so re-preparing it cannot disturb a captured graph)."""
    return gpu_layers["k3-tp8"].twin()


def _replay_fresh(layer, k3_twin, graph, x_s, ids_s, out, seed, what):
    """Fresh inputs into the captured buffers, poisoned output, one replay; returns the
    output after checking it bitwise against an eager run of the twin layer."""
    x, ids, _ = _inputs(layer, x_s.shape[0], seed)
    x_s.copy_(x)
    ids_s.copy_(ids)
    poison_(out)
    graph.replay()
    sync_or_die(f"{what}: replay")
    got = out.clone()
    eager = k3_twin.run(x, ids)
    sync_or_die(f"{what}: eager")
    assert bitwise_equal(got, eager), f"{what}: replay differs from an eager run"
    return got, x, ids


@pytest.mark.parametrize("B", [1, 16, 64])
def test_cuda_graph_capture_replay(kx, gpu_layers, k3_twin, B):
    layer = gpu_layers["k3-tp8"]
    moe, K, H = layer.moe, layer.top_k, layer.hidden
    scr = kx.scratch(moe)
    x_s, ids_s, _ = _inputs(layer, B, 0)
    rows = torch.empty((B * K, H), dtype=torch.bfloat16, device=DEV)
    moe.prepare(B, scr, rows)
    g = _graph_capture(lambda: moe.run(x_s, ids_s))
    for step in range(3):
        seed = seed_of("graph", B, step)
        what = f"{layer.describe()} B={B} seed={seed} graph replay"
        got, x, ids = _replay_fresh(layer, k3_twin, g, x_s, ids_s, rows, seed, what)
        check_close(got, layer.reference(x, ids), what)


def test_cuda_graphs_for_several_batch_sizes(kx, gpu_layers, k3_twin):
    """The serving pattern: one layer prepared and captured once per batch size, then
    the graphs replayed in any order (a later prepare must not break an earlier graph)."""
    layer = gpu_layers["k3-tp8"]
    moe, K, H = layer.moe, layer.top_k, layer.hidden
    scr = kx.scratch(moe)
    graphs = {}
    for B in (1, 8, 64):
        x_s, ids_s, _ = _inputs(layer, B, 0)
        out = torch.empty((B * K, H), dtype=torch.bfloat16, device=DEV)
        moe.prepare(B, scr, out)
        graphs[B] = (_graph_capture(lambda x_s=x_s, ids_s=ids_s: moe.run(x_s, ids_s)),
                     x_s, ids_s, out)
    for step, B in enumerate((64, 1, 8, 1, 64, 8)):
        g, x_s, ids_s, out = graphs[B]
        seed = seed_of("graphs-B", step)
        _replay_fresh(layer, k3_twin, g, x_s, ids_s, out, seed,
                      f"{layer.describe()} B={B} step={step} seed={seed}: the B={B} graph "
                      f"(captured before later prepares)")


def test_cuda_graph_four_layers_one_scratch(kx, gpu_layers, weights_for):
    """A graph of four layers' runs (different weights, shared scratch), as in decoding."""
    shape = TP16
    tp16 = gpu_layers["tp16"]
    layers = [tp16.twin(), Layer(kx, shape, to_cuda(weights_for(shape, seed=1)))]
    layers += [Layer(kx, shape, layers[i].weights, hidden_scale="floor" if i else "rceil",
                     beta=2.0 if i else 4.0, cache=layers[i].cache) for i in range(2)]
    B, K, H = 8, shape["top_k"], shape["H"]
    scr = kx.scratch(layers[0].moe)
    x_s, ids_s, _ = _inputs(layers[0], B, 0)
    outs = [torch.empty((B * K, H), dtype=torch.bfloat16, device=DEV) for _ in layers]
    for lay, o in zip(layers, outs):
        lay.moe.prepare(B, scr, o)

    def chain():
        for lay in layers:
            lay.moe.run(x_s, ids_s)

    g = _graph_capture(chain)
    twins = [lay.twin() for lay in layers]
    for step in range(2):
        x, ids, _ = _inputs(layers[0], B, seed_of("graph4", step))
        x_s.copy_(x)
        ids_s.copy_(ids)
        for o in outs:
            poison_(o)
        g.replay()
        sync_or_die(f"4-layer graph step {step}")
        for li, (lay, o) in enumerate(zip(twins, outs)):
            alone = lay.run(x, ids)
            sync_or_die("alone")
            assert bitwise_equal(o, alone), f"layer {li} step {step}: graph result differs from alone"


def test_four_layers_share_scratch_changing_batch(kx, gpu_layers):
    k3, tp16 = gpu_layers["k3-tp8"], gpu_layers["tp16"]
    layers = [k3.twin(), tp16.twin(),
              Layer(kx, K3_TP8, k3.weights, beta=math.inf, linear_beta=math.inf, cache=k3.cache),
              Layer(kx, TP16, tp16.weights, hidden_scale="floor", cache=tp16.cache)]
    shared = kx.scratch(*(lay.moe for lay in layers))  # sized for the largest layer
    for step, B in enumerate((3, 64, 1, 17, 2, 100, 5, 33, 1, 64)):
        results = []
        for li, lay in enumerate(layers):
            x, ids, _ = _inputs(lay, B, seed_of("share4", step, li))
            results.append((lay, x, ids, lay.run(x, ids, scratch=shared)))
        sync_or_die(f"shared scratch step {step}")
        for li, (lay, x, ids, got) in enumerate(results):
            alone = lay.run(x, ids, scratch=kx.scratch(lay.moe))
            sync_or_die("alone")
            what = f"layer {li} {lay.describe()} step={step} B={B}"
            assert bitwise_equal(got, alone), f"{what}: shared-scratch result differs from alone"
            if step < 3:
                check_close(got, lay.reference(x, ids), what)


def test_scratch_too_small_is_rejected(kx, gpu_layers):
    """A scratch sized for a smaller layer is 'mismatched scratch' (SPEC 7) for a larger
    one: ValueError at prepare, nothing written."""
    a, b = gpu_layers["k3-tp8"], gpu_layers["tp16"]
    sa, sb = kx.scratch(a.moe), kx.scratch(b.moe)
    if sa.nbytes == sb.nbytes:
        pytest.skip(f"both shapes need {sa.nbytes} scratch bytes")
    small, big = (a, b) if sa.nbytes < sb.nbytes else (b, a)
    out = big.new_out(4, False, DEV, FINITE_SENTINEL)
    with pytest.raises(ValueError, match="scratch"):
        big.moe.prepare(4, kx.scratch(small.moe), out)
    sync_or_die("refused prepare")
    assert count_bits(out, FINITE_SENTINEL) == out.numel(), "a refused prepare wrote its output"
    big.moe.prepare(4, kx.scratch(small.moe, big.moe), out)


def test_streams(kx, gpu_layers):
    layer = gpu_layers["tp16"]
    B = 12
    x, ids, _ = _inputs(layer, B, seed_of("streams"))
    want = layer.run(x, ids).clone()
    sync_or_die("streams")
    s = torch.cuda.Stream()
    out = layer.new_out(B, False, DEV)
    layer.moe.prepare(B, kx.scratch(layer.moe), out)
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # default stream= is torch's current stream
        layer.moe.run(x, ids)
    s.synchronize()
    assert bitwise_equal(out, want), "run on the current (side) stream differs"
    poison_(out)
    torch.cuda.synchronize()
    layer.moe.run(x, ids, stream=s)  # a torch.cuda.Stream object
    s.synchronize()
    assert bitwise_equal(out, want), "run(stream=Stream) differs"
    poison_(out)
    torch.cuda.synchronize()
    layer.moe.run(x, ids, stream=s.cuda_stream)  # an int handle
    s.synchronize()
    assert bitwise_equal(out, want), "run(stream=int) differs"
    poison_(out)
    torch.cuda.synchronize()
    with torch.cuda.stream(s):  # inputs written by kernels just enqueued on the run's stream,
        x_new, ids_new = x.clone(), ids.clone()  # which torch is not asked to order (DLPack -1)
        layer.moe.run(x_new, ids_new)
    s.synchronize()
    assert bitwise_equal(out, want), "run on inputs just written on its stream differs"


# --------------------------------------------------------------------------- determinism
def assert_runs_bit_identical(layer, scratch, x, ids, rw, runs, what):
    """Rows and combined: `runs` runs back to back, each on a poisoned output, each bit-identical
    to the first run (the differing runs counted on the GPU, so nothing syncs in between)."""
    B = x.shape[0]
    for combine in (False, True):
        out = layer.new_out(B, combine, DEV)
        layer.moe.prepare(B, scratch, out, combine=combine)
        layer.moe.run(x, ids, rw if combine else None)
        first = out.clone()
        differing = torch.zeros((), dtype=torch.int32, device=DEV)
        for _ in range(runs):
            poison_(out)
            layer.moe.run(x, ids, rw if combine else None)
            differing += (out.view(torch.int16) != first.view(torch.int16)).any()
        sync_or_die(f"{what} combine={combine}")
        assert differing.item() == 0, (
            f"{layer.describe()} B={B} {what} combine={combine}: {differing.item()} of {runs} runs differ "
            "from the first")


@pytest.mark.parametrize("B", [1, 7, 64])
def test_determinism_100_runs(kx, gpu_layers, scratches, B):
    layer = gpu_layers["k3-tp8"]
    x, ids, rw = _inputs(layer, B, seed_of("det", B))
    assert_runs_bit_identical(layer, scratches["k3-tp8"], x, ids, rw, 100, "random routing")


@pytest.mark.parametrize("B", [1, 2, 64])  # the one-token, tagged and wide kernels
def test_same_16_experts_bit_identical_over_1500_runs(kx, gpu_layers, scratches, B):
    """Every token on the same 16 experts (at B = 64, 8 full units an expert). Before session
    44 about one such call in 1500 at B = 64 had one strip of one tile wrong (a ring stage
    refilled before a warp had read it), which random routing never showed."""
    layer = gpu_layers["k3-tp8"]
    x, _, rw = _inputs(layer, B, seed_of("same-16-det"))
    ids = torch.arange(100, 100 + layer.top_k, dtype=torch.int32, device=DEV).repeat(B, 1)
    assert_runs_bit_identical(layer, scratches["k3-tp8"], x, ids, rw, 1500, "same 16 experts")


def test_packed_bytes_and_attributes(kx, gpu_layers):
    layer = gpu_layers["k3-tp8"]
    moe = layer.moe
    assert moe.device.startswith("cuda"), moe.device
    assert (moe.experts, moe.hidden, moe.inter, moe.top_k) == (384, 3584, 384, 16)
    E, H, I = 384, 3584, 384  # the kernel layout has no padding: FP4 and scale bytes of w13 and w2
    assert moe.packed_bytes == E * (2 * I * H // 2 + 2 * I * H // 32 + H * I // 2 + H * I // 32), (
        f"packed_bytes {moe.packed_bytes}: the benchmarks' floors take an expert's bytes from it")
