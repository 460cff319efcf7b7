"""DLPack import on the CPU: NumPy and torch inputs, strided and offset views, legacy
capsules, objects that only speak __dlpack__, and reference counting / leaks over many
calls."""

from __future__ import annotations

import ctypes
import gc
import sys
import tracemalloc
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from moe_check import Layer, bitwise_equal, check_close
from shapes import (count_bits, make_ids, make_route_weights, make_weights, make_x, poison_,
                    seed_of)

SHAPE = dict(name="dl-h128-i64-e6-k4", H=128, I=64, E=6, top_k=4, hidden_scale="floor")
H, I, E, K = SHAPE["H"], SHAPE["I"], SHAPE["E"], SHAPE["top_k"]


@pytest.fixture(scope="module")
def weights():
    return make_weights(SHAPE, seed_of("dl-weights"))


@pytest.fixture(scope="module")
def layer(kx, weights):
    return Layer(kx, SHAPE, weights)


class OnlyDLPack:
    """An array-like that is nothing but the DLPack protocol (like a JAX/CuPy array)."""

    def __init__(self, arr):
        self._arr = arr

    def __dlpack__(self, *args, **kwargs):
        return self._arr.__dlpack__(*args, **kwargs)

    def __dlpack_device__(self):
        return self._arr.__dlpack_device__()


def test_numpy_weights(kx, weights, layer):
    moe_np = kx.PersistentExperts(*(t.numpy() for t in weights), top_k=K, hidden_scale="floor")
    B = 5
    seed = seed_of("np-weights")
    x, ids = make_x(B, H, seed), make_ids(B, K, E, seed)
    out = poison_(torch.empty((B * K, H), dtype=torch.bfloat16))
    moe_np.prepare(B, kx.scratch(moe_np), out)
    moe_np.run(x, ids)
    check_close(out, layer.reference(x, ids), f"numpy weights B={B} seed={seed}")
    assert bitwise_equal(out, layer.run(x, ids)), "numpy and torch weights give different results"


def test_numpy_ids_and_route_weights(kx, layer):
    B = 4
    seed = seed_of("np-ids")
    x, ids, rw = make_x(B, H, seed), make_ids(B, K, E, seed), make_route_weights(B, K, seed)
    out = layer.run(x, ids.numpy(), rw.numpy())
    check_close(out, layer.reference(x, ids, rw), f"numpy ids/weights B={B} seed={seed}")


def test_dlpack_only_objects(kx, weights, layer):
    moe = kx.PersistentExperts(*(OnlyDLPack(t.numpy()) for t in weights), top_k=K,
                               hidden_scale="floor")
    B = 3
    seed = seed_of("only-dlpack")
    x, ids, rw = make_x(B, H, seed), make_ids(B, K, E, seed), make_route_weights(B, K, seed)
    out = poison_(torch.empty((B, H), dtype=torch.bfloat16))
    moe.prepare(B, kx.scratch(moe), out, combine=True)
    moe.run(x, OnlyDLPack(ids.numpy()), OnlyDLPack(rw.numpy()))
    check_close(out, layer.reference(x, ids, rw), f"__dlpack__-only inputs B={B} seed={seed}")


class ClaimsCuda(OnlyDLPack):
    """Says it lives on CUDA, so run() hands its __dlpack__ a stream, which it records with
    how often its device was asked; the capsule it returns is its CPU tensor's, so the CPU
    backend runs on it."""

    def __init__(self, arr):
        super().__init__(arr)
        self.streams = []
        self.device_queries = 0

    def __dlpack__(self, *, stream=None, **kwargs):
        self.streams.append(stream)
        return self._arr.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        self.device_queries += 1
        return (2, 0)  # kDLCUDA, device 0


def test_run_asks_cuda_producers_for_its_stream(kx, layer):
    """DLPack's stream argument: the run's stream (the legacy default 0 spelled 1), or -1 (no
    synchronization) when inputs_on_stream says the inputs are CUDA tensors ordered on it
    already, as the Python layer says when it resolved the stream to the inputs' own PyTorch
    current stream; then their device is not asked (their word is taken)."""
    B = 2
    seed = seed_of("dl-streams")
    x, ids = make_x(B, H, seed), make_ids(B, K, E, seed)
    want = layer.run(x, ids).clone()
    out = torch.empty((B * K, H), dtype=torch.bfloat16)
    moe = layer.moe
    moe.prepare(B, kx.scratch(moe), out)
    for kwargs, asked in [({"stream": 7}, 7), ({"stream": 0}, 1),
                          ({"stream": 7, "inputs_on_stream": False}, 7),
                          ({"stream": 7, "inputs_on_stream": True}, -1)]:
        xr, idsr = ClaimsCuda(x), ClaimsCuda(ids)
        poison_(out)
        kx._C.Experts.run(moe, xr, idsr, **kwargs)
        assert xr.streams == [asked] and idsr.streams == [asked], (kwargs, xr.streams, idsr.streams)
        queries = 0 if kwargs.get("inputs_on_stream") else 1
        assert xr.device_queries == idsr.device_queries == queries, (kwargs, xr.device_queries)
        assert bitwise_equal(out, want), f"run({kwargs}) differs"
    gemm = kx.WsGemm(torch.randn(64, H).to(torch.bfloat16))
    y = torch.empty((1, 64), dtype=torch.bfloat16)
    gemm.prepare(1, y)
    xg = ClaimsCuda(make_x(1, H, seed))
    kx._C.WsGemm.run(gemm, xg, stream=5, inputs_on_stream=True)
    kx._C.WsGemm.run(gemm, xg, stream=5)
    assert xg.streams == [-1, 5] and xg.device_queries == 1, (xg.streams, xg.device_queries)
    with pytest.raises(ValueError, match="x: __dlpack__"):  # a CPU producer is not asked its device
        kx._C.Experts.run(moe, x.float().numpy(), ids.numpy(), stream=7, inputs_on_stream=True)


@pytest.mark.parametrize("B", [1, 4, 9])
def test_x_row_slice_of_wider_buffer(layer, B):
    """x as rows [2, 2+B) and columns [64, 64+H) of a wider buffer: row stride H+192,
    storage offset; same result as a contiguous x."""
    seed = seed_of("x-slice", B)
    x, ids = make_x(B, H, seed), make_ids(B, K, E, seed)
    buf = torch.full((B + 4, H + 192), float("nan"), dtype=torch.bfloat16)
    buf[2:2 + B, 64:64 + H] = x
    xv = buf[2:2 + B, 64:64 + H]
    assert xv.stride() == (H + 192, 1) and xv.storage_offset() > 0
    got = layer.run(xv, ids).clone()
    assert bitwise_equal(got, layer.run(x, ids)), f"B={B} seed={seed}: strided x differs"
    check_close(got, layer.reference(x, ids), f"strided x B={B} seed={seed}")


def test_x_offset_contiguous(layer):
    B = 3
    seed = seed_of("x-offset")
    big = make_x(B + 5, H, seed)
    xv = big[5:]
    ids = make_ids(B, K, E, seed)
    check_close(layer.run(xv, ids), layer.reference(xv.clone(), ids), f"offset x B={B}")


def test_transposed_x_rejected_with_stride_message(kx, layer):
    B = 4
    buf = make_x(H, B, 3)  # [H, B]
    xt = buf.T             # [B, H] with column stride B
    ids = make_ids(B, K, E, 3)
    out = poison_(torch.empty((B * K, H), dtype=torch.bfloat16), 0x1234)
    layer.moe.prepare(B, kx.scratch(layer.moe), out)
    with pytest.raises(ValueError) as info:
        layer.moe.run(xt, ids)
    msg = str(info.value)
    assert "x" in msg and ("stride" in msg or "contiguous" in msg), msg
    assert count_bits(out, 0x1234) == out.numel(), "out written before the error"


def test_legacy_capsules(kx, weights, layer):
    from torch.utils.dlpack import to_dlpack
    moe = kx.PersistentExperts(*(to_dlpack(t) for t in weights), top_k=K, hidden_scale="floor")
    B = 3
    seed = seed_of("capsule")
    x, ids, rw = make_x(B, H, seed), make_ids(B, K, E, seed), make_route_weights(B, K, seed)
    out = poison_(torch.empty((B * K, H), dtype=torch.bfloat16))
    moe.prepare(B, kx.scratch(moe), to_dlpack(out))
    moe.run(to_dlpack(x), to_dlpack(ids))
    check_close(out, layer.reference(x, ids), f"capsule inputs B={B} seed={seed}")
    # a consumed capsule cannot be used again
    cap = to_dlpack(x)
    moe.run(cap, ids)
    with pytest.raises((TypeError, ValueError)):
        moe.run(cap, ids)
    # combined with capsules
    z = poison_(torch.empty((B, H), dtype=torch.bfloat16))
    moe.prepare(B, kx.scratch(moe), z, combine=True)
    moe.run(to_dlpack(x), to_dlpack(ids), to_dlpack(rw))
    check_close(z, layer.reference(x, ids, rw), f"capsule combined B={B} seed={seed}")


def test_library_keeps_out_and_scratch_alive(kx, layer):
    """prepare() must hold references to out and scratch: the caller may drop theirs."""
    B = 2
    seed = seed_of("alive")
    x, ids = make_x(B, H, seed), make_ids(B, K, E, seed)
    moe = kx.PersistentExperts(*layer.weights, top_k=K, hidden_scale="floor")
    out = poison_(torch.empty((B * K, H), dtype=torch.bfloat16))
    moe.prepare(B, kx.scratch(moe), out)
    out_id = id(out)
    del out
    gc.collect()
    res = moe.run(x, ids)
    assert id(res) == out_id
    check_close(res, layer.reference(x, ids), f"B={B} seed={seed} after dropping out")


def test_refcounts_stable(kx, layer):
    B = 2
    seed = seed_of("refcount")
    x, ids, rw = make_x(B, H, seed), make_ids(B, K, E, seed), make_route_weights(B, K, seed)
    out = poison_(torch.empty((B * K, H), dtype=torch.bfloat16))
    z = poison_(torch.empty((B, H), dtype=torch.bfloat16))
    scratch = kx.scratch(layer.moe)
    objs = dict(x=x, ids=ids, rw=rw, out=out, z=z, scratch=scratch, moe=layer.moe)
    layer.moe.prepare(B, scratch, out)
    layer.moe.run(x, ids)
    gc.collect()
    before = {k: sys.getrefcount(v) for k, v in objs.items()}
    for _ in range(200):
        layer.moe.prepare(B, scratch, out)
        layer.moe.run(x, ids)
    layer.moe.prepare(B, scratch, z, combine=True)
    for _ in range(200):
        layer.moe.run(x, ids, rw)
    layer.moe.prepare(B, scratch, out)  # back to the first out, as before
    gc.collect()
    after = {k: sys.getrefcount(v) for k, v in objs.items()}
    assert after == before, f"refcounts changed: before {before}, after {after}"
    xn = np.random.default_rng(1).standard_normal((4, 64), dtype=np.float32)
    rc = sys.getrefcount(xn)
    for _ in range(200):
        q, s = kx.quantize_mxfp8(xn)
        kx.dequantize(q, s, "mxfp8")
        kx.quantize_mxfp4(xn)
    del q, s
    assert sys.getrefcount(xn) == rc, "quantize_mxfp8 leaks references to its input"


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_no_leak_over_many_calls(kx, layer):
    """tracemalloc (Python allocations) and RSS (C allocations too) stay flat over
    thousands of prepare/run/format calls."""
    B = 3
    seed = seed_of("leak")
    x, ids, rw = make_x(B, H, seed), make_ids(B, K, E, seed), make_route_weights(B, K, seed)
    out = torch.empty((B * K, H), dtype=torch.bfloat16)
    z = torch.empty((B, H), dtype=torch.bfloat16)
    scratch = kx.scratch(layer.moe)
    xq = torch.randn(8, 128)

    def step():
        layer.moe.prepare(B, scratch, out)
        layer.moe.run(x, ids)
        layer.moe.prepare(B, scratch, z, combine=True)
        layer.moe.run(x, ids, rw)
        q, s = kx.quantize_mxfp8(xq)
        kx.dequantize(q, s, "mxfp8")
        try:
            layer.moe.run(x.float(), ids, rw)  # the error path must not leak either
        except ValueError:
            pass

    for _ in range(200):
        step()
    gc.collect()
    tracemalloc.start()
    rss0 = _rss_bytes()
    snap0 = tracemalloc.take_snapshot()
    for _ in range(1500):
        step()
    gc.collect()
    snap1 = tracemalloc.take_snapshot()
    rss1 = _rss_bytes()
    tracemalloc.stop()
    grown = sum(st.size_diff for st in snap1.compare_to(snap0, "filename"))
    assert grown < 256 * 1024, f"Python allocations grew by {grown} bytes over 1500 steps"
    assert rss1 - rss0 < 32 * 2**20, f"RSS grew by {(rss1 - rss0) / 2**20:.1f} MiB over 1500 steps"


class CopyingExporter(OnlyDLPack):
    """Exports a copy of its array, flagged IS_COPIED (what the array API lets a producer do
    when it cannot share its memory): writes into it would never reach the array."""

    def __dlpack__(self, *args, **kwargs):
        kwargs["copy"] = True
        return self._arr.__dlpack__(*args, **kwargs)


def _read_only(a: np.ndarray) -> np.ndarray:
    a.flags.writeable = False
    return a


@pytest.mark.parametrize("make", [_read_only, CopyingExporter], ids=["read-only", "exported-copy"])
def test_outputs_must_be_the_callers_writable_memory(kx, layer, make):
    """Every output (run()'s out, WsGemm's out / logits / latent, quantize_mxfp8's q and
    scales) is refused when its producer exports it read-only or as a copy; the same arrays
    are fine as inputs."""
    B = 2
    rows = np.zeros((B * K, H), np.uint16)
    with pytest.raises(ValueError, match=r"^out: .*(read-only|copy)"):
        layer.moe.prepare(B, kx.scratch(layer.moe), kx.as_bfloat16(make(rows)))
    W = torch.zeros((96, 64), dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"^out: .*(read-only|copy)"):
        kx.WsGemm(W).prepare(1, kx.as_bfloat16(make(np.zeros((1, 96), np.uint16))))
    gemm = kx.WsGemm(W, split=32, valid=16)
    with pytest.raises(ValueError, match=r"^logits: .*(read-only|copy)"):
        gemm.prepare(1, logits=make(np.zeros((1, 16), np.float32)),
                     latent=torch.zeros((1, 64), dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"^latent: .*(read-only|copy)"):
        gemm.prepare(1, logits=np.zeros((1, 16), np.float32),
                     latent=kx.as_bfloat16(make(np.zeros((1, 64), np.uint16))))
    x = kx.as_bfloat16(make(kx.float32_to_bf16(np.ones((1, 64), np.float32))))
    q_ok, s_ok = np.zeros((1, 64), np.uint8), np.zeros((1, 2), np.uint8)
    with pytest.raises(ValueError, match=r"^q: .*(read-only|copy)"):
        kx.quantize_mxfp8(x, out=(make(np.zeros((1, 64), np.uint8)), s_ok))
    with pytest.raises(ValueError, match=r"^scales: .*(read-only|copy)"):
        kx.quantize_mxfp8(x, out=(q_ok, make(np.zeros((1, 2), np.uint8))))
    kx.quantize_mxfp8(x, out=(q_ok, s_ok))  # as an input it is fine
    assert int(s_ok[0, 0]) == 127 - 8, "x read through the read-only / copied export"


def test_as_bfloat16_takes_bit_patterns_only(kx):
    """float16 has bf16's width but holds values: viewing it as bf16 would make every number
    wrong (1.0 would read 0.0078125), so it is refused, as are other dtypes; uint16 / int16
    bits and bfloat16 tensors are views of the same memory."""
    for bad in (np.ones(4, np.float16), torch.ones(4, dtype=torch.float16), np.ones(4, np.float32),
                OnlyDLPack(np.ones(4, np.float16))):
        with pytest.raises(TypeError, match=r"^bits: .*got (float16|float32)"):
            kx.as_bfloat16(bad)
    bits = kx.float32_to_bf16(np.tile(np.array([1.0, -2.5], np.float32), 16))  # one MX block
    for good in (bits, bits.view(np.int16), torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16)):
        q, s = kx.quantize_mxfp8(kx.as_bfloat16(good))
        assert np.array_equal(np.asarray(kx.dequantize(q, s, "mxfp8"))[:2], [1.0, -2.5]), type(good)


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device_type", ctypes.c_int32),
                ("device_id", ctypes.c_int32), ("ndim", ctypes.c_int32), ("code", ctypes.c_uint8),
                ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16),
                ("shape", ctypes.POINTER(ctypes.c_int64)), ("strides", ctypes.c_void_p),
                ("byte_offset", ctypes.c_uint64)]


class _DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p),
                ("deleter", ctypes.c_void_p)]


class UnseenCudaMemory:
    """A producer of a (legacy) DLPack capsule that says its uint16 vector lives on CUDA
    device 0, at an address nobody reads (the view only passes it on). Records the streams
    its __dlpack__ is asked for."""

    def __init__(self, n):
        self.streams = []
        self._shape = (ctypes.c_int64 * 1)(n)
        self._managed = _DLManagedTensor(_DLTensor(0x7F0000000000, 2, 0, 1, 1, 16, 1, self._shape))

    def __dlpack__(self, *, stream=None):
        self.streams.append(stream)
        new_capsule = ctypes.pythonapi.PyCapsule_New
        new_capsule.restype, new_capsule.argtypes = ctypes.py_object, [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
        return new_capsule(ctypes.addressof(self._managed), b"dltensor", None)

    def __dlpack_device__(self):
        return (2, 0)


def test_view_orders_its_source_on_the_consumers_stream(kx):
    """A consumer asks a view for its stream so that the memory's pending writes come first;
    those are the source's, so the view passes the request on to the source's __dlpack__
    (none when the consumer names no stream)."""
    source = UnseenCudaMemory(64)
    view = kx.as_bfloat16(source)
    assert source.streams == [-1]  # viewing reads nothing, so it asks for no ordering
    view.__dlpack__(stream=7)
    view.__dlpack__()
    view.__dlpack__(stream=1, max_version=(1, 0))
    assert source.streams == [-1, 7, 1], source.streams


def test_unconsumed_export_keeps_the_pending_exception(kx):
    """A DLPackView's capsule that dies unconsumed while an exception is being raised frees
    its memory and leaves that exception as it was."""
    view = kx.as_bfloat16(np.zeros(4, np.uint16))
    with pytest.raises(IndexError):
        [view.__dlpack__()][1]


def test_gemm_numpy_weights_and_capsules(kx):
    from torch.utils.dlpack import to_dlpack
    from gemm_check import abs_products, assert_gemm_close, make_gemm_inputs, want_for
    M, N, Kd = 3, 192, 128
    x, W = make_gemm_inputs(M, N, Kd, seed_of("gemm-dl"))
    out = poison_(torch.empty((M, N), dtype=torch.bfloat16))
    gemm = kx.WsGemm(to_dlpack(W))
    gemm.prepare(M, to_dlpack(out))
    gemm.run(to_dlpack(x))
    assert_gemm_close(out, want_for(x, W), abs_products(x, W), "gemm capsules", bf16=True)


class FakeCudaTensor:
    """Passes for a CUDA torch tensor on device 3 (what resolve_stream looks at)."""

    __module__ = "torch.fake"
    is_cuda = True
    device = "cuda:3"

    def get_device(self):
        return 3


def test_default_stream_from_torchs_raw_getter_or_its_public_api(monkeypatch):
    """The raw getter where torch has one, else torch.cuda.current_stream; both asked for the
    first CUDA tensor's device."""
    from kimi_experts._util import resolve_stream

    asked = []
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream",
                        lambda index: asked.append(("raw", index)) or 0x5000 + index, raising=False)
    monkeypatch.setattr(torch.cuda, "current_stream",
                        lambda dev: asked.append(("public", dev)) or SimpleNamespace(cuda_stream=0x7000))
    assert resolve_stream(None, torch.zeros(2), FakeCudaTensor()) == 0x5003
    monkeypatch.delattr(torch._C, "_cuda_getCurrentRawStream")
    assert resolve_stream(None, FakeCudaTensor()) == 0x7000
    assert resolve_stream(None, torch.zeros(2)) == 0  # no CUDA tensor: the legacy default stream
    assert asked == [("raw", 3), ("public", "cuda:3")]
