"""Stream ordering on CUDA of what the library views and allocates: work a caller left
pending on PyTorch's current stream comes before the library's on another stream, and
memory the library allocates for another stream is not handed to the current one while
that stream may still write it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gpu_util import sync_or_die

pytestmark = pytest.mark.gpu

SLEEP_CYCLES = 1 << 27  # ~70 ms at the H200's clock: the pending work is still pending when the
                        # other stream's kernel would run unordered


def test_bf16_view_waits_for_its_sources_pending_writes(kx):
    """as_bfloat16 of a CUDA tensor, used on a side stream while the tensor's own write still
    waits on the current stream: the quantizer must read the written values. The outputs are
    views too, so nothing but the views' ordering puts the side stream after that write."""
    bits = kx.float32_to_bf16(np.random.default_rng(90).standard_normal((8, 256), np.float32))
    want_q, want_s = kx.quantize_mxfp8(kx.as_bfloat16(bits))
    src = torch.from_numpy(bits.view(np.int16)).cuda()
    x = torch.zeros_like(src)
    q = torch.full(want_q.shape, 0xFF, dtype=torch.uint8, device="cuda")
    s = torch.full(want_s.shape, 0xFF, dtype=torch.uint8, device="cuda")
    side = torch.cuda.Stream()
    kx.quantize_mxfp8(src.view(torch.bfloat16))  # the quantizer's first launch loads its module,
    sync_or_die("setup")                          # which would wait for the sleep below
    torch.cuda._sleep(SLEEP_CYCLES)
    x.copy_(src)  # pending on the current stream behind the sleep
    kx.quantize_mxfp8(kx.as_bfloat16(x), stream=side,
                      out=(kx._C.reinterpret(q, "uint8"), kx._C.reinterpret(s, "uint8")))
    sync_or_die("quantize on the side stream")
    assert np.array_equal(q.cpu().numpy(), want_q), "the quantizer read x before its write"
    assert np.array_equal(s.cpu().numpy(), want_s)


def test_quantize_outputs_belong_to_the_stream_that_writes_them(kx):
    """quantize_mxfp8(x, stream=side) returns outputs the side stream writes. Freed at once,
    their memory must not go to the current stream while that write is still queued (behind a
    sleep here): a tensor allocated and filled there right after keeps its values."""
    x = torch.randn((2048, 4096), device="cuda").to(torch.bfloat16)
    side = torch.cuda.Stream()
    sync_or_die("setup")
    with torch.cuda.stream(side):
        torch.cuda._sleep(SLEEP_CYCLES)
    q, s = kx.quantize_mxfp8(x, stream=side)
    shapes = q.shape, s.shape
    del q, s
    later_q = torch.full(shapes[0], 7, dtype=torch.uint8, device="cuda")
    later_s = torch.full(shapes[1], 7, dtype=torch.uint8, device="cuda")
    sync_or_die("quantize on the side stream")
    assert bool((later_q == 7).all()) and bool((later_s == 7).all()), \
        "the side stream's quantizer wrote into memory the current stream had been given"


def test_quantize_on_a_side_stream_matches_the_cpu(kx):
    """The outputs allocated for a side stream hold the quantization of x, bit for bit."""
    x = torch.randn((64, 512), device="cuda").to(torch.bfloat16)
    side = torch.cuda.Stream()
    q, s = kx.quantize_mxfp8(x, "floor", stream=side)
    side.synchronize()
    want_q, want_s = kx.quantize_mxfp8(x.cpu(), "floor")
    assert torch.equal(q.cpu(), want_q) and torch.equal(s.cpu(), want_s)


def test_cupy_bfloat16_quantized_on_a_side_stream(kx):
    """A CuPy bfloat16 array gets CuPy outputs, allocated for the stream that writes them:
    bit for bit the CPU's quantization, and memory that, freed at once, does not go to the
    current stream while the side stream's quantizer still waits (behind a sleep)."""
    cupy = pytest.importorskip("cupy")
    bits = kx.float32_to_bf16(np.random.default_rng(91).standard_normal((2048, 4096), np.float32))
    want_q, want_s = kx.quantize_mxfp8(kx.as_bfloat16(bits))
    x = cupy.asarray(bits).view(cupy.dtype("bfloat16"))
    side = cupy.cuda.Stream(non_blocking=True)  # no implicit order with the legacy default stream
    for handle in (side, side.ptr):
        q, s = kx.quantize_mxfp8(x, stream=handle)
        assert type(q).__module__.startswith("cupy") and type(s).__module__.startswith("cupy")
        side.synchronize()
        assert np.array_equal(q.get(), want_q) and np.array_equal(s.get(), want_s)
        del q, s
    for attempt in range(3):  # the allocator may hand out other memory; three chances to reuse
        with torch.cuda.stream(torch.cuda.ExternalStream(side.ptr)):
            torch.cuda._sleep(SLEEP_CYCLES)
        q, s = kx.quantize_mxfp8(x, stream=side)
        shape = q.shape
        del q, s
        later = cupy.full(shape, 7, dtype=cupy.uint8)
        sync_or_die("quantize on the side stream")
        assert bool((later == 7).all()), \
            f"the side stream's quantizer wrote into memory the current stream had been given ({attempt})"
        del later
