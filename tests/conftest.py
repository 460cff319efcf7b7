"""pytest configuration: the `gpu` marker, and fixtures shared by every test file.

GPU tests carry @pytest.mark.gpu and are skipped unless kimi_experts.cuda_available()
(built with CUDA kernels, a driver and an sm_90 device). Everything else runs on the
CPU backend with the plain-PyTorch reference (kimi_experts/reference.py) as oracle.
"""

from __future__ import annotations

import importlib.util
import sys

import pytest

from shapes import ROOT, make_weights, ref as _ref

if importlib.util.find_spec("kimi_experts") is None:
    # An in-place build (no install): make the checkout importable, after anything
    # installed so an installed copy wins.
    sys.path.append(str(ROOT))

try:
    import kimi_experts as _kx
    _KX_ERROR = None
except Exception as exc:  # the extension not built: CPU tests fail loudly in `kx`
    _kx = None
    _KX_ERROR = f"{type(exc).__name__}: {exc}"


def _cuda_skip_reason():
    if _kx is None:
        return f"kimi_experts not importable ({_KX_ERROR})"
    try:
        if _kx.cuda_available():
            return None
        return f"CUDA not available: {_kx.backend_info().get('reason')}"
    except Exception as exc:
        return f"cuda_available() failed: {exc!r}"


def pytest_collection_modifyitems(config, items):
    gpu_items = [it for it in items if "gpu" in it.keywords]
    if not gpu_items:
        return
    reason = _cuda_skip_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=reason)
    for it in gpu_items:
        it.add_marker(skip)


@pytest.fixture(scope="session")
def kx():
    """The kimi_experts module; a test that needs it fails (not skips) when the
    package does not import: a broken build must not pass CI."""
    if _kx is None:
        pytest.fail(f"import kimi_experts failed: {_KX_ERROR}", pytrace=False)
    return _kx


@pytest.fixture(scope="session")
def ref():
    """The plain-PyTorch reference (importable without the C extension)."""
    return _ref


_WEIGHTS_CACHE: dict = {}


@pytest.fixture(scope="session")
def weights_for():
    """weights_for(shape, seed=0) -> (w13, s13, w2, s2) on the CPU, built once per session
    (the model shapes are ~0.4-0.8 GB each)."""

    def get(shape: dict, seed: int = 0):
        key = (shape["name"], shape["E"], shape["H"], shape["I"], seed)
        if key not in _WEIGHTS_CACHE:
            _WEIGHTS_CACHE[key] = make_weights(shape, seed)
        return _WEIGHTS_CACHE[key]

    return get
