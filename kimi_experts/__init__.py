"""kimi_experts: Kimi-K3 routed experts and the MoE front's skinny GEMM on MXFP4 weights.

A C extension (``kimi_experts._C``) over hand-written CUDA kernels for Hopper (sm_90a),
with a C CPU backend used when no GPU is present. Tensors come in through DLPack
(PyTorch, CuPy, JAX, NumPy); importing this package never imports PyTorch.

Plan once, run every decode step::

    import kimi_experts as kx
    moe = kx.PersistentExperts(w13, s13, w2, s2, top_k=16, hidden_scale="floor")
    buffers = kx.scratch(moe)                  # shareable by every layer on one stream
    moe.prepare(batch, buffers, out)           # out bf16 [batch * 16, H]
    moe.run(x, ids)                            # x bf16 [batch, H], ids int32 [batch, 16]

See README.md for the full API, and ``python -m kimi_experts.demo`` for a worked run.
"""

from __future__ import annotations

from ._util import _C
from ._C import BadRoutingError, CudaError, KimiExpertsError
from .experts import PersistentExperts, Scratch, scratch
from .formats import (as_bfloat16, bf16_to_float32, dequantize, float32_to_bf16,
                      quantize_mxfp4, quantize_mxfp8)
from .gemm import WsGemm
from .parallel import TensorParallelExperts, shard

__version__ = "0.1.0"

__all__ = [
    "BadRoutingError",
    "CudaError",
    "KimiExpertsError",
    "PersistentExperts",
    "Scratch",
    "TensorParallelExperts",
    "WsGemm",
    "as_bfloat16",
    "backend_info",
    "bf16_to_float32",
    "cuda_available",
    "dequantize",
    "float32_to_bf16",
    "quantize_mxfp4",
    "quantize_mxfp8",
    "scratch",
    "shard",
]

_BACKEND_INFO: dict | None = None


def backend_info() -> dict:
    """Which backend runs, and why CUDA does not when it does not.

    Returns
    -------
    dict
        ``built_with_cuda`` (bool): the CUDA kernels were compiled into this build.
        ``cuda_available`` (bool): built with CUDA, a driver, and an sm_90 device.
        ``reason`` (str or None): why CUDA is not available, e.g. "no CUDA driver",
        "device sm_80 is not supported (needs sm_90)",
        "built without CUDA kernels (no nvcc at build time)".
        ``device`` (str or None): the current CUDA device's name.
        ``build`` (str): how this extension was built.
    """
    global _BACKEND_INFO
    if _BACKEND_INFO is None:  # the devices of a process do not change
        _BACKEND_INFO = _C.backend_info()
    return dict(_BACKEND_INFO)


def cuda_available() -> bool:
    """True when CUDA tensors can run here: built with the CUDA kernels, a CUDA driver,
    and an sm_90 (Hopper) device. CPU tensors always run on the CPU backend."""
    return backend_info()["cuda_available"]
