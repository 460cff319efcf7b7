"""The skinny GEMM in front of the MoE (SPEC 4): a thin layer over ``_C.WsGemm``."""

from __future__ import annotations

from ._util import _C, resolve_run_stream


class WsGemm(_C.WsGemm):
    """``y[M, N] = x[M, K] @ W[N, K]^T`` for small M, bf16 in, fp32 accumulation.

    Parameters
    ----------
    W : bf16 tensor [N, K]
        Weights, contiguous, K % 64 == 0, on CUDA 16-byte aligned. Held (not copied):
        the kernel reads it in place, so keep it unchanged while the WsGemm is in use.
    split, valid : int, optional
        Both None: plain output, all N columns as bf16. Both given, with
        0 <= valid <= split <= N: the split epilogue, columns [0, valid) as float32
        logits and columns [split, N) as bf16 latent, each to its own tensor.

    Written values never contain -0.0 (it becomes +0.0), so a consumer may use -0.0
    as a not-yet-written sentinel. CPU tensors run the C CPU backend; CUDA tensors
    the Hopper kernel, which starts loading W before waiting on the previous kernel
    (programmatic dependent launch).

    Attributes
    ----------
    n, k : int
    split, valid : int or None
    m : int or None
        The prepared M.
    device : str

    Examples
    --------
    Router logits and the latent shard written into one mailbox row per token::

        gemm = kx.WsGemm(W, split=1024, valid=384)        # W bf16 [4096, 7168]
        box = torch.empty(m, 4096, dtype=torch.bfloat16, device="cuda")
        logits = box[:, :768].view(torch.float32)         # float32 [m, 384]
        latent = box[:, 1024:]                            # bf16 [m, 3072]
        gemm.prepare(m, logits=logits, latent=latent)
        gemm.run(x)                                       # every step
    """

    def __new__(cls, W, *, split: int | None = None, valid: int | None = None):
        return super().__new__(cls, W, split=split, valid=valid)

    def prepare(self, m: int, out=None, *, logits=None, latent=None) -> None:
        """Check and keep the outputs for ``m`` rows.

        Parameters
        ----------
        m : int
            Rows of x per run(), >= 1 (any m; the kernel is tuned for 1..64).
        out : bf16 tensor [m, N]
            Plain form only.
        logits : float32 tensor [m, valid]
            Split form only.
        latent : bf16 tensor [m, N - split]
            Split form only.

        Outputs need column stride 1 and may have any row stride (views of a wider
        buffer). Raises ValueError naming the argument on any mismatch.
        """
        return super().prepare(m, out, logits=logits, latent=latent)

    def run(self, x, *, stream=None):
        """Compute for the prepared m.

        Parameters
        ----------
        x : bf16 tensor [m, K]
            Column stride 1, any row stride >= K; on CUDA 16-byte aligned with a row
            stride that is a multiple of 8.
        stream : int or stream object, optional
            CUDA only (default: PyTorch's current stream for torch tensors, else 0).

        Returns
        -------
        ``out``, or the tuple ``(logits, latent)``, as given to prepare().
        """
        on_stream = False
        if self.device != "cpu":
            stream, on_stream = resolve_run_stream(stream, x)
        return super().run(x, stream=stream, inputs_on_stream=on_stream)
