"""MX number formats (SPEC 2): quantize and dequantize, bit-exact with the kernels.

The work runs in C (the CPU backend, or the CUDA quantizer for CUDA bfloat16 input).
Results are NumPy arrays for NumPy (or other CPU DLPack) input and torch tensors for
torch input (zero-copy views of the NumPy results on the CPU).

NumPy has no bfloat16 dtype: :func:`as_bfloat16` presents a uint16 array of bf16 bit
patterns to the library as bfloat16, and :func:`float32_to_bf16` /
:func:`bf16_to_float32` convert between such arrays and float32.
"""

from __future__ import annotations

import sys
from contextlib import nullcontext

import numpy as np

from ._util import _C, is_torch, resolve_stream, torch_stream

_BLOCK = 32


def _like_input(x, arrays):
    """NumPy results as torch tensors when the input was a torch tensor."""
    if is_torch(x):
        torch = sys.modules["torch"]
        return tuple(torch.from_numpy(a) for a in arrays)
    return arrays


def _via_cpu(x, fn):
    """Run a CPU-only helper on a CUDA torch tensor: copy in, compute, copy back."""
    results = fn(x.cpu())
    if isinstance(results, tuple):
        return tuple(r.to(x.device) for r in results)
    return results.to(x.device)


def quantize_mxfp8(x, scale: str = "rceil", *, stream=None, out=None):
    """Quantize to MXFP8 (e4m3 elements, one E8M0 scale per 32 along the last axis).

    Parameters
    ----------
    x : float32, bfloat16 or float16 tensor [..., K]
        K % 32 == 0; last axis contiguous.
    scale : {"rceil", "floor"}, default "rceil"
        rceil: the smallest e with amax <= 448 * 2^e; floor (OCP): floor(log2(amax)) - 8.
    stream : optional
        CUDA input only: where the quantizer runs (default: PyTorch's current stream for
        torch tensors, else 0). Outputs it allocates come from that stream's memory pool,
        so use them elsewhere as any tensor of a side stream (wait for it first).
    out : (q, scales), optional
        Tensors to write into instead of allocating (uint8, contiguous, the shapes
        below, on x's device). Needed for CUDA input that is neither a torch tensor
        nor a CuPy array (those get outputs of their own kind). With ``out``, a CUDA x
        must be bfloat16 (the device quantizer's input).

    Returns
    -------
    q : uint8 [..., K]
        e4m3 bit patterns.
    scales : uint8 [..., K/32]
        E8M0 scale bytes (0xFF for a block holding NaN or Inf, whose elements are NaN).

    A CUDA bfloat16 torch tensor runs the device quantizer on ``stream`` and returns
    CUDA tensors (bit-identical to the CPU result); other CUDA torch dtypes are
    quantized on the CPU and copied back.
    """
    if out is not None:
        q, s = out
        _C.quantize_mxfp8(x, scale, q=q, scales=s, stream=resolve_stream(stream, x))
        return q, s
    handle = resolve_stream(stream, x)
    if is_torch(x) and x.is_cuda:
        torch = sys.modules["torch"]
        if x.dtype != torch.bfloat16:
            return _via_cpu(x, lambda c: quantize_mxfp8(c, scale))
        # The outputs' memory belongs to the stream that writes it: the caching allocator
        # then neither hands out memory the current stream still uses nor reuses it there
        # while the quantizer may still be writing.
        with nullcontext() if stream is None else torch.cuda.stream(torch_stream(stream, x.device)):
            q = torch.empty(x.shape, dtype=torch.uint8, device=x.device)
            s = torch.empty(_scales_shape(x.shape), dtype=torch.uint8, device=x.device)
        _C.quantize_mxfp8(x, scale, q=q, scales=s, stream=handle)
        return q, s
    if type(x).__module__.startswith("cupy") and x.device is not None:
        cupy = sys.modules["cupy"]
        with x.device, _cupy_stream(cupy, stream, handle):  # CuPy's pool is per stream too
            q = cupy.empty(x.shape, dtype=cupy.uint8)
            s = cupy.empty(_scales_shape(x.shape), dtype=cupy.uint8)
        _C.quantize_mxfp8(x, scale, q=q, scales=s, stream=handle)
        return q, s
    return _like_input(x, _C.quantize_mxfp8(x, scale, stream=handle))


def _cupy_stream(cupy, stream, handle):
    """The CuPy stream object for ``handle``: the caller's own, or one wrapping it."""
    if type(stream).__module__.startswith("cupy"):
        return stream
    return cupy.cuda.Stream.null if handle == 0 else cupy.cuda.ExternalStream(handle)


def _scales_shape(shape):
    shape = tuple(shape)
    return shape[:-1] + (shape[-1] // _BLOCK,) if shape else shape


def quantize_mxfp4(w):
    """Quantize weights to MXFP4 (e2m1 elements, one E8M0 scale per 32 along K).

    Parameters
    ----------
    w : float32, bfloat16 or float16 tensor [..., K]
        K % 32 == 0; last axis contiguous.

    Returns
    -------
    q : uint8 [..., K/2]
        Two e2m1 codes per byte, the low nibble holding the even index.
    scales : uint8 [..., K/32]
        E8M0 scale bytes.

    Runs on the CPU; a CUDA torch tensor is copied to the CPU and the results back.
    """
    if is_torch(w) and w.is_cuda:
        return _via_cpu(w, quantize_mxfp4)
    return _like_input(w, _C.quantize_mxfp4(w))


def dequantize(q, scales, fmt: str):
    """Decode MXFP8 or MXFP4 to float32 (exact).

    Parameters
    ----------
    q : uint8 tensor [..., K] (mxfp8) or [..., K/2] (mxfp4), contiguous
    scales : uint8 tensor [..., K/32], contiguous
    fmt : {"mxfp8", "mxfp4"}

    Returns
    -------
    float32 [..., K]
        NumPy for NumPy input, torch for torch input (CUDA input is decoded on the
        CPU and copied back).
    """
    if is_torch(q) and q.is_cuda:
        return _via_cpu(q, lambda c: dequantize(c, scales.cpu(), fmt))
    return _like_input(q, (_C.dequantize(q, scales, fmt),))[0]


def as_bfloat16(bits):
    """Present a tensor of bf16 bit patterns (uint16 / int16) as bfloat16.

    NumPy cannot spell bfloat16; this returns a DLPack view of the same memory with
    dtype bfloat16, which every kimi_experts function accepts (and which stays valid
    as long as the view lives). Writes through the view (e.g. run()'s ``out``) land in
    ``bits``. An ``ml_dtypes.bfloat16`` array is accepted too.

    Examples
    --------
    >>> x = kx.as_bfloat16(kx.float32_to_bf16(np.random.randn(4, 3584)))
    >>> out_bits = np.empty((4 * 16, 3584), np.uint16)
    >>> moe.prepare(4, buffers, kx.as_bfloat16(out_bits))
    """
    if isinstance(bits, np.ndarray) and bits.dtype.name == "bfloat16":
        bits = bits.view(np.uint16)  # ml_dtypes.bfloat16, which DLPack cannot export
    return _C.reinterpret(bits, "bfloat16")  # refuses float16 and other values (TypeError)


def float32_to_bf16(x) -> np.ndarray:
    """float32 values -> uint16 bf16 bit patterns, round to nearest even (NaN kept)."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = ((u + np.uint32(0x7FFF) + ((u >> 16) & np.uint32(1))) >> 16).astype(np.uint16)
    nan = np.isnan(u.view(np.float32))
    if nan.any():
        rounded[nan] = ((u[nan] >> 16) | np.uint32(0x0040)).astype(np.uint16)  # quiet NaN
    return rounded


def bf16_to_float32(bits) -> np.ndarray:
    """uint16 bf16 bit patterns -> float32 values (exact)."""
    return (np.asarray(bits).astype(np.uint32) << 16).view(np.float32)
