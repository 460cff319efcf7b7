"""Glue shared by the Python layer: loading the C core, spotting torch tensors
without importing torch, and resolving the CUDA stream argument."""

from __future__ import annotations

import sys

try:
    from . import _C  # noqa: F401  (re-exported by the package)
except ImportError as exc:  # pragma: no cover - only without a build
    raise ImportError(
        "kimi_experts._C (the C extension) is not built or does not load: "
        f"{exc}. Build it from the repository root with `make demo` (or "
        "`python -m pip install --no-build-isolation -e .`)."
    ) from exc


def is_torch(obj) -> bool:
    """True for torch tensors (and subclasses such as Parameter), without importing torch."""
    return type(obj).__module__.startswith("torch")


def is_cuda_torch(obj) -> bool:
    return is_torch(obj) and obj.is_cuda


def torch_current_stream(t) -> int:
    """PyTorch's current stream handle on CUDA torch tensor t's device.

    torch.cuda.current_stream(dev).cuda_stream builds a device and a Stream object (~4 us
    a call on the H200 host, a quarter of an eager run()); the raw getter that Triton's and
    Inductor's launchers call returns the same handle as an int. Builds without it take
    the public path.
    """
    torch = sys.modules["torch"]  # imported: t is a torch tensor
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None:
        return raw(t.get_device())
    return torch.cuda.current_stream(t.device).cuda_stream


def resolve_stream(stream, *tensors) -> int:
    """The cudaStream_t handle (an int) that CUDA work runs on.

    ``stream`` may be an int handle, an object with ``.cuda_stream`` (torch.cuda.Stream)
    or ``.ptr`` (cupy.cuda.Stream), or None: then PyTorch's current stream on the
    device of the first CUDA torch tensor among ``tensors``, else 0 (the legacy default
    stream).
    """
    if stream is None:
        for t in tensors:
            if is_cuda_torch(t):
                return torch_current_stream(t)
        return 0
    if isinstance(stream, int) and not isinstance(stream, bool):
        return stream
    for attr in ("cuda_stream", "ptr"):
        handle = getattr(stream, attr, None)
        if isinstance(handle, int):
            return handle
    raise TypeError(
        "stream: expected an int cudaStream_t handle, a torch.cuda.Stream (.cuda_stream) "
        f"or a cupy.cuda.Stream (.ptr), got {type(stream).__name__}"
    )


def torch_stream(stream, device):
    """``stream`` (anything :func:`resolve_stream` takes but None) as a torch.cuda.Stream on
    ``device``, for work and allocations that PyTorch must place on it."""
    torch = sys.modules["torch"]  # imported: the caller holds CUDA torch tensors
    if isinstance(stream, torch.cuda.Stream):
        return stream
    return torch.cuda.ExternalStream(resolve_stream(stream), device=device)


def resolve_run_stream(stream, *inputs) -> tuple[int, bool]:
    """A run's stream handle (as :func:`resolve_stream`) and whether its inputs are ordered
    on it already: True when no stream was given and every input (None skipped) is a CUDA
    torch tensor, for then the handle is their own current stream, where PyTorch orders
    their producers. The C run then imports them without asking torch to synchronize
    (DLPack stream -1) or where they live, which skips most of an eager call's host time."""
    on_stream = stream is None and all(is_cuda_torch(t) for t in inputs if t is not None)
    return resolve_stream(stream, *inputs), on_stream
