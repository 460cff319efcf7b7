"""The build links the CUDA kernels and the device is the one they are built for."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu


def test_backend_info_reports_cuda(kx):
    info = kx.backend_info()
    assert info["built_with_cuda"] is True, info
    assert info["cuda_available"] is True, info
    assert info["reason"] is None, info
    assert isinstance(info["device"], str) and info["device"], info
    assert kx.cuda_available() is True


def test_probe_add_round_trip(kx):
    n = 1 << 20
    a = torch.randn(n, device="cuda")
    out = torch.full_like(a, float("nan"))
    ret = kx._C.probe_add(a, out, 1.5)
    assert ret is None, f"probe_add returns nothing, got {ret!r}"
    torch.cuda.synchronize()
    assert torch.equal(out, a + 1.5), "probe_add: out != in + 1.5"


def test_probe_add_on_a_side_stream(kx):
    s = torch.cuda.Stream()
    a = torch.arange(4096, dtype=torch.float32, device="cuda")
    out = torch.zeros_like(a)
    torch.cuda.synchronize()
    with torch.cuda.stream(s):
        kx._C.probe_add(a, out, -2.0, s.cuda_stream)
    s.synchronize()
    assert torch.equal(out, a - 2.0)


def test_probe_add_rejects_cpu_tensor(kx):
    with pytest.raises(ValueError):
        kx._C.probe_add(torch.zeros(8), torch.zeros(8), 1.0)


def test_probe_read_runs(kx):
    buf = torch.ones(1 << 24, dtype=torch.uint8, device="cuda")
    assert kx._C.probe_read(buf, torch.cuda.current_stream().cuda_stream) is None
    torch.cuda.synchronize()


def test_default_stream_is_torchs_current_stream(kx):
    """run()'s default stream (the raw getter where torch has it) is the handle of
    torch.cuda.current_stream() on the tensor's device, on the default and on a side stream."""
    from kimi_experts._util import resolve_stream

    t = torch.zeros(4, device="cuda")
    assert resolve_stream(None, t) == torch.cuda.current_stream(t.device).cuda_stream
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        assert resolve_stream(None, t) == s.cuda_stream != torch.cuda.default_stream().cuda_stream
    assert resolve_stream(None, torch.zeros(4), t) == torch.cuda.current_stream().cuda_stream
