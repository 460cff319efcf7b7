"""Tensor parallelism over I (issue 5): kx.shard and kx.TensorParallelExperts.

CPU: shard() shapes, dtypes, kinds and contents (dequantized shard == the slice of the
dequantized full weights, bit for bit), its errors; for tp = 2 and 4 the bf16 sum of
the ranks' combined outputs against the unsharded layer and the float64 reference
(small shapes, and k3-tp8 split into the TP16 shard (tp = 2) and I = 96 (tp = 4));
NumPy input never imports torch; a real 2-process gloo group end to end.
GPU (marked): shard() of CUDA tensors; TP = 1 equals the single layer; two shards on
one GPU summed equal the unsharded layer; two processes on two GPUs over NCCL (NVLS
off): eager, on a given stream, and replayed from a CUDA graph.

Why the tolerance is MOE_RTOL: the shards compute the unsharded layer's hidden values
exactly (shard bounds are MX block bounds); what differs is rounding: each rank's
partial is rounded to bf16 and the partials are summed in bf16 (as the all-reduce
does), beside the fp32 accumulation order differences MOE_RTOL already covers.
"""

from __future__ import annotations

import datetime
import os
import re
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from moe_check import bitwise_equal
from shapes import (K3_TP8, MOE_RTOL, ROOT, make_ids, make_route_weights, make_weights, make_x,
                    ref, rel_fro, seed_of)

WORKER_TIMEOUT_S = 60  # a hung collective fails the test instead of blocking CI
SMALL_TP_SHAPES = [
    dict(name="h128-i128-e5-k4", H=128, I=128, E=5, top_k=4, hidden_scale="rceil"),
    dict(name="h64-i256-e3-k7", H=64, I=256, E=3, top_k=7, hidden_scale="floor"),
    dict(name="h192-i512-e9-k16", H=192, I=512, E=9, top_k=16, hidden_scale="rceil"),
]


def _settings(shape):
    return dict(top_k=shape["top_k"], hidden_scale=shape["hidden_scale"])


def _inputs(shape, B, seed, device="cpu"):
    return (make_x(B, shape["H"], seed).to(device),
            make_ids(B, shape["top_k"], shape["E"], seed).to(device),
            make_route_weights(B, shape["top_k"], seed).to(device))


def _combined(kx, layer, x, ids, rw):
    """Prepare and run a PersistentExperts (combine=True) or a TensorParallelExperts;
    returns its combined output bf16 [B, H]."""
    if isinstance(layer, kx.TensorParallelExperts):
        moe, kw = layer.local, {}
    else:
        moe, kw = layer, {"combine": True}
    out = torch.empty((x.shape[0], moe.hidden), dtype=torch.bfloat16, device=x.device)
    layer.prepare(x.shape[0], kx.scratch(moe), out, **kw)
    return layer.run(x, ids, rw)


def _bf16_sum(parts):
    """Sum bf16 partials in bf16, one rounding per addition, as a ring all-reduce does."""
    total = parts[0].clone()
    for p in parts[1:]:
        total += p
    return total


def _rank_outputs(kx, weights, shape, tp, x, ids, rw):
    """Each rank's partial combined output, from TensorParallelExperts without a group."""
    return [_combined(kx, kx.TensorParallelExperts(*weights, tp=tp, rank=r, **_settings(shape)),
                      x, ids, rw) for r in range(tp)]


def _oracle(kx, weights, shape, x, ids, rw, cache):
    """The unsharded layer's combined output (bf16) and the float64 reference."""
    whole = _combined(kx, kx.PersistentExperts(*weights, **_settings(shape)), x, ids, rw)
    want = ref.moe_reference(*weights, x, ids, rw, hidden_scale=shape["hidden_scale"],
                             cache=cache, device=x.device)
    return whole, want


def _check_sum(parts, whole, want, what):
    """The bf16 sum of the ranks' partial outputs against the unsharded layer's output
    and the float64 reference; returns the two relative Frobenius errors."""
    total = _bf16_sum(parts)
    assert not torch.isnan(total).any(), f"{what}: NaN in the summed output"
    err_whole, err_ref = rel_fro(total.float(), whole.double()), rel_fro(total.float(), want)
    assert err_whole < MOE_RTOL, f"{what}: vs the unsharded layer: rel. Frobenius {err_whole:.3e}"
    assert err_ref < MOE_RTOL, f"{what}: vs the float64 reference: rel. Frobenius {err_ref:.3e}"
    return err_whole, err_ref


# --------------------------------------------------------------------------- shard()
def _numpy_weights(E, H, I, seed):
    """Random bytes, scales over the whole E8M0 range (0xFF: NaN blocks included)."""
    rng = np.random.default_rng(seed)
    return (rng.integers(0, 256, (E, 2 * I, H // 2), dtype=np.uint8),
            rng.integers(0, 256, (E, 2 * I, H // 32), dtype=np.uint8),
            rng.integers(0, 256, (E, H, I // 2), dtype=np.uint8),
            rng.integers(0, 256, (E, H, I // 32), dtype=np.uint8))


def _bits(a):
    return np.asarray(a).view(np.uint32)


@pytest.mark.parametrize("kind", ["numpy", "torch"])
@pytest.mark.parametrize("E,H,I,tp", [(3, 64, 128, 1), (3, 64, 128, 2), (3, 64, 128, 4),
                                      (2, 128, 192, 2), (2, 128, 192, 3), (1, 64, 256, 8)])
def test_shard_layout_bit_exact(kx, kind, E, H, I, tp):
    full = _numpy_weights(E, H, I, seed_of("shard", E, H, I, tp))
    if kind == "torch":
        full = tuple(torch.from_numpy(a) for a in full)
    before = [a.copy() if kind == "numpy" else a.clone() for a in full]
    deq13 = _bits(kx.dequantize(full[0], full[1], "mxfp4"))  # [E, 2I, H]
    deq2 = _bits(kx.dequantize(full[2], full[3], "mxfp4"))   # [E, H, I]
    n = I // tp
    for rank in range(tp):
        what = f"E={E} H={H} I={I} tp={tp} rank={rank} kind={kind}"
        w13, s13, w2, s2 = part = kx.shard(*full, tp, rank)
        assert [tuple(a.shape) for a in part] == [(E, 2 * n, H // 2), (E, 2 * n, H // 32),
                                                  (E, H, n // 2), (E, H, n // 32)], what
        for a in part:
            if kind == "numpy":
                assert isinstance(a, np.ndarray) and a.dtype == np.uint8, what
                assert a.flags.c_contiguous, f"{what}: not contiguous"
            else:
                assert isinstance(a, torch.Tensor) and a.dtype == torch.uint8, what
                assert a.is_contiguous(), f"{what}: not contiguous"
        rows = np.r_[rank * n:(rank + 1) * n, I + rank * n:I + (rank + 1) * n]
        got13 = _bits(kx.dequantize(w13, s13, "mxfp4"))
        assert np.array_equal(got13, deq13[:, rows]), f"{what}: w13/s13 differ from the slice"
        got2 = _bits(kx.dequantize(w2, s2, "mxfp4"))
        assert np.array_equal(got2, deq2[:, :, rank * n:(rank + 1) * n]), (
            f"{what}: w2/s2 differ from the slice")
    for a, b in zip(full, before):
        assert (a == b).all(), "shard() modified its input"


def test_numpy_path_never_imports_torch():
    """shard() and a tp = 2 TensorParallelExperts on NumPy input, torch-free."""
    code = (
        "import sys, numpy as np, kimi_experts as kx\n"
        "rng = np.random.default_rng(0)\n"
        "E, H, I, K, B = 3, 64, 128, 4, 2\n"
        "w = [rng.integers(0, 256, s, dtype=np.uint8) for s in "
        "((E, 2 * I, H // 2), (E, 2 * I, H // 32), (E, H, I // 2), (E, H, I // 32))]\n"
        "w[1][:] = 119; w[3][:] = 119\n"
        "assert [a.shape for a in kx.shard(*w, 2, 1)][0] == (E, I, H // 2)\n"
        "layer = kx.TensorParallelExperts(*w, tp=2, rank=1, top_k=K)\n"
        "x = kx.as_bfloat16(kx.float32_to_bf16(rng.standard_normal((B, H))))\n"
        "ids = rng.integers(0, E, (B, K)).astype(np.int32)\n"
        "rw = np.full((B, K), 0.25, np.float32)\n"
        "bits = np.zeros((B, H), np.uint16)\n"
        "layer.prepare(B, kx.scratch(layer.local), kx.as_bfloat16(bits))\n"
        "layer.run(x, ids, rw)\n"
        "assert np.isfinite(kx.bf16_to_float32(bits)).all() and bits.any()\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n")
    path = [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(path))
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=WORKER_TIMEOUT_S)
    assert res.returncode == 0, res.stderr


def _expect(exc, arg, fn, *args, **kwargs):
    """fn(*args, **kwargs) raises exc with a message that starts by naming `arg`."""
    with pytest.raises(exc) as info:
        fn(*args, **kwargs)
    head = str(info.value).split(":")[0]
    assert re.search(rf"\b{arg}\b", head), f"message does not start with {arg!r}: {info.value}"


def test_shard_errors(kx):
    w = _numpy_weights(2, 64, 192, seed_of("shard-err"))  # I = 192: the TP16 shard width
    for tp, rank, arg in [(0, 0, "tp"), (-2, 0, "tp"), (2, 2, "rank"), (2, -1, "rank"),
                          (4, 0, "tp"),    # I / tp = 48: blocks of 32 would straddle
                          (5, 0, "tp"),    # I % tp != 0
                          (12, 0, "tp")]:  # I / tp = 16 < 32
        _expect(ValueError, arg, kx.shard, *w, tp, rank)
    _expect(TypeError, "tp", kx.shard, *w, 2.0, 0)
    _expect(TypeError, "rank", kx.shard, *w, 2, "0")
    _expect(ValueError, "s13", kx.shard, w[0], w[1][:, :-1], w[2], w[3], 2, 0)
    _expect(ValueError, "w2", kx.shard, w[0], w[1], w[2][:, :, :-2], w[3], 2, 0)
    _expect(ValueError, "s2", kx.shard, w[0], w[1], w[2], w[3][None], 2, 0)
    _expect(ValueError, "w13", kx.shard, w[0].view(np.int8), *w[1:], 2, 0)
    _expect(ValueError, "w13", kx.shard, w[0][:, :-1], *w[1:], 2, 0)
    _expect(TypeError, "w13", kx.shard, w[0].tolist(), *w[1:], 2, 0)
    _expect(TypeError, "w13", kx.shard, torch.from_numpy(w[0]), *w[1:], 2, 0)  # mixed kinds


def test_tensor_parallel_errors(kx):
    shape = SMALL_TP_SHAPES[0]
    w = make_weights(shape, seed_of("tp-err"))
    _expect(ValueError, "rank", kx.TensorParallelExperts, *w, tp=2)
    _expect(ValueError, "rank", kx.TensorParallelExperts, *w, tp=2, rank=2)
    _expect(ValueError, "tp", kx.TensorParallelExperts, *w, tp=8, rank=0)  # I / tp = 16
    half = kx.shard(*w, 2, 0)
    _expect(ValueError, "rank", kx.TensorParallelExperts.from_shard, *half, tp=2, rank=3)
    layer = kx.TensorParallelExperts.from_shard(*half, tp=2, rank=0, top_k=shape["top_k"])
    assert (layer.tp, layer.rank, layer.group, layer.local.inter) == (2, 0, None, 64)


# --------------------------------------------------------------------------- sums over ranks
def test_tp1_equals_single_layer(kx):
    shape = SMALL_TP_SHAPES[2]
    w = make_weights(shape, seed_of("tp1", shape["name"]))
    x, ids, rw = _inputs(shape, 6, seed_of("tp1-x"))
    layer = kx.TensorParallelExperts(*w, **_settings(shape))
    assert (layer.tp, layer.rank) == (1, 0)
    whole = _combined(kx, kx.PersistentExperts(*w, **_settings(shape)), x, ids, rw)
    assert bitwise_equal(_combined(kx, layer, x, ids, rw), whole), "tp = 1 differs from the layer"


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("shape", SMALL_TP_SHAPES, ids=lambda s: s["name"])
def test_small_shapes_sum_over_ranks(kx, shape, tp):
    w = make_weights(shape, seed_of("tp-w", shape["name"]))
    cache: dict = {}
    for B in (1, 5, 33):
        seed = seed_of("tp-sum", shape["name"], tp, B)
        x, ids, rw = _inputs(shape, B, seed)
        _check_sum(_rank_outputs(kx, w, shape, tp, x, ids, rw),
                   *_oracle(kx, w, shape, x, ids, rw, cache),
                   f"shape={shape['name']} tp={tp} B={B} seed={seed}")


@pytest.fixture(scope="module")
def k3_oracle(kx, weights_for):
    """(weights, oracle): oracle(B) -> (x, ids, rw, unsharded output, reference), computed
    once for every tp (the reference dequantizes each routed expert: ~16 MB each)."""
    w = weights_for(K3_TP8, seed=0)
    cache, memo = {}, {}

    def oracle(B):
        if B not in memo:
            x, ids, rw = _inputs(K3_TP8, B, seed_of("k3-tp", B))
            memo[B] = (x, ids, rw, *_oracle(kx, w, K3_TP8, x, ids, rw, cache))
        return memo[B]

    yield w, oracle
    cache.clear()


@pytest.mark.parametrize("tp", [2, 4])
def test_k3_tp8_split_into_tp16_shards(kx, k3_oracle, tp):
    """k3-tp8 (I = 384) split in 2 gives the TP16 shard (I = 192), in 4 I = 96."""
    w, oracle = k3_oracle
    layers = [kx.TensorParallelExperts(*w, tp=tp, rank=r, **_settings(K3_TP8))
              for r in range(tp)]
    for B in (1, 3):
        x, ids, rw, whole, want = oracle(B)
        _check_sum([_combined(kx, layer, x, ids, rw) for layer in layers], whole, want,
                   f"shape=k3-tp8 tp={tp} B={B} ids={ids.tolist()}")


# --------------------------------------------------------------------------- process groups
DIST_SHAPE = dict(name="h256-i256-e8-k4", H=256, I=256, E=8, top_k=4, hidden_scale="floor")
DIST_B = 5


def _dist_worker(rank, world, init_file, backend, payload, out_dir):
    """One rank: TensorParallelExperts over the whole group, eager (and on CUDA also on
    another stream and replayed from a CUDA graph); saves the outputs to
    out_dir/rank{rank}.pt."""
    import torch.distributed as dist

    import kimi_experts as kx

    device = "cpu"
    if backend == "gloo" and sys.platform == "linux":
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # one host: no DNS or network needed
    if backend == "nccl":
        os.environ["NCCL_NVLS_ENABLE"] = "0"  # no NVLink multicast, explicitly
        torch.cuda.set_device(rank)
        device = f"cuda:{rank}"
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=WORKER_TIMEOUT_S))
    try:
        group = dist.group.WORLD
        w = [t.to(device) for t in payload["weights"]]
        x, ids, rw = (t.to(device) for t in payload["inputs"])
        shape = payload["shape"]
        with pytest.raises(ValueError, match="tp"):
            kx.TensorParallelExperts(*w, group=group, tp=world + 1, **_settings(shape))
        layer = kx.TensorParallelExperts(*w, group=group, **_settings(shape))
        assert (layer.tp, layer.rank, layer.local.inter) == (world, rank, shape["I"] // world)
        wide = torch.empty((x.shape[0], 2 * shape["H"]), dtype=torch.bfloat16, device=device)
        with pytest.raises(ValueError, match="^out: expected a contiguous"):  # the all-reduce's
            layer.prepare(x.shape[0], kx.scratch(layer.local), wide[:, :shape["H"]])
        out = torch.empty((x.shape[0], shape["H"]), dtype=torch.bfloat16, device=device)
        layer.prepare(x.shape[0], kx.scratch(layer.local), out)
        result = {"eager": layer.run(x, ids, rw).cpu().clone()}
        if backend == "nccl":
            out.zero_()
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            layer.run(x, ids, rw, stream=side.cuda_stream)  # an int handle
            torch.cuda.synchronize()
            result["stream"] = out.cpu().clone()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                layer.run(x, ids, rw)
            out.zero_()
            graph.replay()
            torch.cuda.synchronize()
            result["graph"] = out.cpu().clone()
            # NCCL's communicator teardown waits for every graph that captured one of its
            # collectives: without this, destroy_process_group() below hangs (pytorch#115388)
            graph.reset()
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _run_group(backend, world, tmp_path):
    """Spawn `world` ranks of _dist_worker on DIST_SHAPE; check every rank's result
    against the unsharded layer and the reference."""
    import torch.multiprocessing as mp

    import kimi_experts as kx

    shape = DIST_SHAPE
    w = make_weights(shape, seed_of("dist-w"))
    x, ids, rw = _inputs(shape, DIST_B, seed_of("dist-x"))
    payload = dict(shape=shape, weights=w, inputs=(x, ids, rw))
    ctx = mp.start_processes(_dist_worker, nprocs=world, join=False, start_method="spawn",
                             args=(world, tmp_path / "init", backend, payload, str(tmp_path)))
    deadline = time.monotonic() + WORKER_TIMEOUT_S
    while not ctx.join(timeout=1.0):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.terminate()
            pytest.fail(f"{backend} group of {world} did not finish in {WORKER_TIMEOUT_S} s")
    whole, want = _oracle(kx, w, shape, x, ids, rw, None)
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    what = f"{backend} world={world} shape={shape['name']} B={DIST_B}"
    for r, res in enumerate(results):
        for key, out in res.items():
            assert bitwise_equal(out, results[0]["eager"]), f"{what}: rank {r} {key} != rank 0 eager"
    err_whole = rel_fro(results[0]["eager"].float(), whole.double())
    err_ref = rel_fro(results[0]["eager"].float(), want)
    assert err_whole < MOE_RTOL, f"{what}: vs the unsharded layer: rel. Frobenius {err_whole:.3e}"
    assert err_ref < MOE_RTOL, f"{what}: vs the float64 reference: rel. Frobenius {err_ref:.3e}"


def test_gloo_two_processes(tmp_path):
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_gloo_available()):
        pytest.skip("torch.distributed with the gloo backend is not available in this torch build")
    _run_group("gloo", 2, tmp_path)


# --------------------------------------------------------------------------- GPU
@pytest.mark.gpu
def test_gpu_tp1_equals_single_layer(kx, weights_for):
    shape = K3_TP8
    w = tuple(t.cuda() for t in weights_for(shape, seed=0))
    x, ids, rw = _inputs(shape, 8, seed_of("gpu-tp1"), "cuda")
    layer = kx.TensorParallelExperts(*w, **_settings(shape))
    whole = _combined(kx, kx.PersistentExperts(*w, **_settings(shape)), x, ids, rw)
    got = _combined(kx, layer, x, ids, rw)
    torch.cuda.synchronize()
    assert bitwise_equal(got, whole), "tp = 1 differs from the single layer"


@pytest.mark.gpu
def test_gpu_shard_matches_cpu(kx):
    cpu = tuple(torch.from_numpy(a) for a in _numpy_weights(4, 128, 256, seed_of("gpu-shard")))
    gpu = tuple(t.cuda() for t in cpu)
    for tp in (1, 2, 4):
        for rank in range(tp):
            for name, got, want in zip(("w13", "s13", "w2", "s2"), kx.shard(*gpu, tp, rank),
                                       kx.shard(*cpu, tp, rank)):
                what = f"{name} tp={tp} rank={rank}"
                assert got.is_cuda and got.is_contiguous(), f"{what}: not a contiguous CUDA tensor"
                assert torch.equal(got.cpu(), want), f"{what}: CUDA shard differs from the CPU one"


@pytest.mark.gpu
@pytest.mark.parametrize("B", [1, 16, 64])
def test_gpu_two_shards_sum(kx, weights_for, B):
    """k3-tp8 split into two TP16 shards on one GPU; their bf16 sum against the
    unsharded layer and the float64 reference (computed on the GPU)."""
    shape = K3_TP8
    w = tuple(t.cuda() for t in weights_for(shape, seed=0))
    seed = seed_of("gpu-tp2", B)
    x, ids, rw = _inputs(shape, B, seed, "cuda")
    parts = _rank_outputs(kx, w, shape, 2, x, ids, rw)
    _check_sum(parts, *_oracle(kx, w, shape, x, ids, rw, {}),
               f"shape=k3-tp8 tp=2 B={B} seed={seed} (one GPU)")


@pytest.mark.gpu
def test_gpu_nccl_two_ranks(tmp_path):
    import torch.distributed as dist

    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 GPUs for the NCCL group, found {torch.cuda.device_count()}")
    if not (dist.is_available() and dist.is_nccl_available()):
        pytest.skip("torch.distributed with NCCL is not available in this torch build")
    _run_group("nccl", 2, tmp_path)
