"""The routed experts of one MoE layer (SPEC 3, 5): a thin layer over ``_C.Experts``.

All checks, packing and launches happen in C; this file resolves the stream argument
and documents the API.
"""

from __future__ import annotations

from ._util import _C, resolve_run_stream, resolve_stream

Scratch = _C.Scratch


class PersistentExperts(_C.Experts):
    """One MoE layer's routed experts on MXFP4 weights with MXFP8 activations.

    Per token t and slot j with expert e = ids[t, j]: x is quantized to MXFP8 (rceil),
    FC1 gives a = W13[e] @ xq, SiTU gives h = silu(cap(a[:I], beta)) * cap(a[I:],
    linear_beta), h is quantized to MXFP8 (``hidden_scale``), and FC2 gives the bf16
    row ``out[t * top_k + j] = W2[e] @ hq``; with ``combine=True`` the rows are summed
    with the routing weights into ``z[t]`` instead.

    Parameters
    ----------
    w13 : uint8 tensor [E, 2I, H/2]
        FC1 weights, MXFP4 (two e2m1 per byte, low nibble = even index); rows 0..I-1
        are the gate (w1), rows I..2I-1 the up projection (w3). Contiguous.
    s13 : uint8 tensor [E, 2I, H/32]
        E8M0 scales of w13, one per 32 elements along H.
    w2 : uint8 tensor [E, H, I/2]
        FC2 weights, MXFP4.
    s2 : uint8 tensor [E, H, I/32]
        E8M0 scales of w2.
    top_k : int, default 16
        Routed slots per token, 1..32.
    beta, linear_beta : float, default 4.0 and 25.0
        SiTU caps on the gate and up halves; ``float("inf")`` turns a cap off
        (both inf: SwiGLU).
    hidden_scale : {"rceil", "floor"}, default "rceil"
        Scale rule of the hidden activation's MXFP8 (Kimi-K3 TP8 uses "floor").
    stream : int or stream object, optional
        CUDA only: the stream the weights are packed on (default: PyTorch's current
        stream for torch tensors, else 0). The constructor waits for the packing.

    All four weights live on one device: CPU tensors select the C CPU backend (the
    tensors are kept, not copied); CUDA tensors the GPU engine, which packs a device
    copy in its kernel layout (``packed_bytes`` extra bytes) and does not keep the
    caller's tensors. Requires H % 64 == 0, I % 32 == 0, 1 <= E <= 4096.

    Attributes
    ----------
    experts, hidden, inter, top_k : int
        E, H, I and K_top.
    beta, linear_beta : float
    hidden_scale : str
    device : str
        "cpu" or "cuda:N".
    packed_bytes : int
        Extra device memory of the kernel-layout weight copy (0 on the CPU).
    scratch_bytes : int
        Scratch bytes this layer needs (0 on the CPU).
    batch, combine
        The prepared batch size and combine flag, or None before prepare().

    Examples
    --------
    Plan once per batch size, run every layer every decode step::

        import kimi_experts as kx
        layers = [kx.PersistentExperts(*w, top_k=16, hidden_scale="floor") for w in weights]
        buffers = kx.scratch(*layers)              # one workspace for all layers
        outs = [torch.empty(B * 16, 3584, dtype=torch.bfloat16, device="cuda")
                for _ in layers]
        for layer, out in zip(layers, outs):
            layer.prepare(B, buffers, out)         # checks and choices happen here
        ...
        for layer, out in zip(layers, outs):       # per step; CUDA-graph capturable
            layer.run(x, ids)                      # writes out [B * 16, 3584]
    """

    def __new__(cls, w13, s13, w2, s2, *, top_k: int = 16, beta: float = 4.0,
                linear_beta: float = 25.0, hidden_scale: str = "rceil", stream=None):
        return super().__new__(cls, w13, s13, w2, s2, top_k=top_k, beta=beta,
                               linear_beta=linear_beta, hidden_scale=hidden_scale,
                               stream=resolve_stream(stream, w13))

    def prepare(self, batch: int, scratch: Scratch, out, *, combine: bool = False) -> None:
        """Check and fix everything for one batch size; keeps ``out``.

        Parameters
        ----------
        batch : int
            Tokens per run() call, >= 1.
        scratch : Scratch
            From :func:`scratch`, on this layer's device, large enough for this layer.
            Every layer that runs on one stream may share one.
        out : bf16 tensor [batch * top_k, H], or [batch, H] when ``combine``
            Where run() writes. Rows contiguous (column stride 1); the row stride may
            exceed H. Kept alive until the next prepare().
        combine : bool, default False
            False: one row per (token, slot), ``out[t * top_k + j]``. True: the rows
            weighted by run()'s ``weights`` and summed per token (fp32, slot order).

        Raises
        ------
        ValueError
            A wrong batch, device, dtype, shape, strides, or a scratch too small or on
            another device; the message names the argument. The previous prepared
            state is kept.
        TypeError
            ``scratch`` is not a Scratch, or ``out`` is not a tensor.
        """
        return super().prepare(batch, scratch, out, combine=combine)

    def run(self, x, ids, weights=None, *, stream=None, validate: bool = False):
        """Run the layer for the prepared batch; returns the ``out`` given to prepare().

        Parameters
        ----------
        x : bf16 tensor [batch, H]
            Hidden states; column stride 1, any row stride.
        ids : int32 tensor [batch, top_k]
            Expert of each (token, slot); repeats are legal. Column stride 1.
        weights : float32 tensor [batch, top_k], optional
            Routing weights: required iff prepared with ``combine=True``.
        stream : int or stream object, optional
            CUDA only: where the work runs (default: PyTorch's current stream for torch
            tensors, else 0). run() launches once per 64 tokens (1024 // top_k at top_k > 16),
            allocates nothing and never synchronizes (unless ``validate``), so it can be
            captured in a CUDA graph.
        validate : bool, default False
            Wait for the result and raise BadRoutingError at once, as check() does.

        Returns
        -------
        The ``out`` object given to prepare().

        Raises
        ------
        RuntimeError
            Not prepared.
        ValueError
            x, ids or weights do not match the prepared batch, device, dtype or layout
            (raised before anything is launched or written).
        BadRoutingError
            Only with ``validate=True``: an id outside [0, E) (its rows are NaN).
        CudaError
            A CUDA launch failed.
        """
        on_stream = False
        if self.device != "cpu":
            stream, on_stream = resolve_run_stream(stream, x, ids, weights)
        return super().run(x, ids, weights, stream=stream, validate=validate,
                           inputs_on_stream=on_stream)

    def check(self, *, stream=None) -> None:
        """Raise BadRoutingError for this layer's first out-of-range id since its last check.

        Rows of bad ids come out NaN; the first bad (token, slot) is recorded by the layer
        itself, apart from other layers that share its scratch (on CUDA: on the device,
        so check() waits for ``stream``, by default the stream of the last run(), which
        must still exist). The record is cleared.
        """
        return super().check(stream=None if stream is None else resolve_stream(stream))


def scratch(*layers: PersistentExperts) -> Scratch:
    """Workspace for the given layers, sized for the largest; on their device.

    Every layer that runs on one stream may share one Scratch: kernels of one layer
    finish with it before the next layer's start. On CUDA it is device memory zeroed
    once here; on the CPU it holds nothing (the CPU backend allocates per call).

    Parameters
    ----------
    *layers : PersistentExperts
        At least one, all on one device.

    Returns
    -------
    Scratch
        Pass it to each layer's prepare(). ``.nbytes`` and ``.device`` describe it.
    """
    return _C.Scratch(*layers)
