"""Tensor parallelism over the intermediate size I: every rank keeps a 1/tp slice of
every expert, and the ranks' combined outputs are summed with one all-reduce.

Why this split: FC1's rows and SiTU are independent per intermediate index i, and the
hidden activation is quantized in MX blocks of 32 along I, so a shard whose bounds are
multiples of 32 computes exactly the unsharded layer's h[i] for its i. FC2 is a sum
over i, so the full output is the sum over ranks of each rank's partial FC2 output;
the routing weights are linear, so the ranks may combine their slots first and
all-reduce only the combined [B, H] output.

PyTorch is imported only inside TensorParallelExperts, when a process group is used;
shard() and NumPy input never need it.
"""

from __future__ import annotations

import operator

import numpy as np

from ._util import is_torch, torch_stream
from .experts import PersistentExperts, Scratch

_BLOCK = 32  # MX block along I: a shard bound inside a block would split its scale


def _contiguous(a):
    return a.contiguous() if is_torch(a) else np.ascontiguousarray(a)


def _check_weights(w13, s13, w2, s2) -> tuple[int, int, int]:
    """(E, H, I) of the standard layout; TypeError / ValueError naming the argument."""
    for name, a in (("w13", w13), ("s13", s13), ("w2", w2), ("s2", s2)):
        if not (is_torch(a) or isinstance(a, np.ndarray)):
            raise TypeError(f"{name}: expected a NumPy array or a torch tensor, "
                            f"got {type(a).__name__}")
        if str(a.dtype) not in ("uint8", "torch.uint8"):
            raise ValueError(f"{name}: expected dtype uint8, got {a.dtype}")
        if a.ndim != 3:
            raise ValueError(f"{name}: expected 3 dimensions, got shape {list(a.shape)}")
    if len({is_torch(a) for a in (w13, s13, w2, s2)}) > 1:
        raise TypeError("w13, s13, w2, s2: expected all NumPy arrays or all torch tensors")
    experts, two_i, half_h = w13.shape
    if two_i % 2:
        raise ValueError(f"w13: expected an even row count 2I, got shape {list(w13.shape)}")
    hidden, inter = 2 * half_h, two_i // 2
    want = {"s13": (experts, two_i, hidden // _BLOCK), "w2": (experts, hidden, inter // 2),
            "s2": (experts, hidden, inter // _BLOCK)}
    for name, a in (("s13", s13), ("w2", w2), ("s2", s2)):
        if tuple(a.shape) != want[name]:
            raise ValueError(f"{name}: expected shape {list(want[name])} (from w13 "
                             f"{list(w13.shape)}), got {list(a.shape)}")
    return experts, hidden, inter


def _check_tp_rank(tp, rank) -> tuple[int, int]:
    for name, value in (("tp", tp), ("rank", rank)):
        if not hasattr(value, "__index__"):
            raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
    tp, rank = operator.index(tp), operator.index(rank)
    if tp < 1:
        raise ValueError(f"tp: expected >= 1, got {tp}")
    if not 0 <= rank < tp:
        raise ValueError(f"rank: expected 0 <= rank < tp = {tp}, got {rank}")
    return tp, rank


def shard(w13, s13, w2, s2, tp: int, rank: int):
    """The rank's slice of the intermediate size I of every expert (standard layout).

    Rank r of tp keeps i in [r * I/tp, (r + 1) * I/tp): those rows of the gate half
    and the same rows of the up half of w13/s13, and those columns of w2/s2.

    Parameters
    ----------
    w13 : uint8 [E, 2I, H/2]
        FC1 weights, MXFP4; rows 0..I-1 gate, rows I..2I-1 up.
    s13 : uint8 [E, 2I, H/32]
        E8M0 scales of w13.
    w2 : uint8 [E, H, I/2]
        FC2 weights, MXFP4 (two e2m1 per byte along I).
    s2 : uint8 [E, H, I/32]
        E8M0 scales of w2 (one per 32 along I).
    tp : int
        Number of shards; I % tp == 0 and (I / tp) % 32 == 0.
    rank : int
        This shard, 0 <= rank < tp.

    Returns
    -------
    (w13, s13, w2, s2) of the shard, with i = I / tp:
        uint8 [E, 2i, H/2] (the gate rows first, then the up rows), [E, 2i, H/32],
        [E, H, i/2] and [E, H, i/32]. The same kind as the inputs (all NumPy arrays or
        all torch tensors, on the inputs' device), contiguous; new arrays, except that
        with tp == 1 contiguous inputs are returned as they are.

    Raises
    ------
    ValueError
        A bad tp or rank, or weights that are not the standard layout (uint8, 3-D,
        consistent shapes); the message names the argument.
    TypeError
        Inputs that are not NumPy arrays or torch tensors, or a mix of both.
    """
    experts, hidden, inter = _check_weights(w13, s13, w2, s2)
    tp, rank = _check_tp_rank(tp, rank)
    if inter % (_BLOCK * tp):
        raise ValueError(
            f"tp: expected I % tp == 0 and (I / tp) % {_BLOCK} == 0 (MX blocks of "
            f"{_BLOCK} along I must not straddle shards), got I = {inter} (from w13), "
            f"tp = {tp}, I / tp = {inter / tp:g}")
    n = inter // tp
    lo, hi = rank * n, (rank + 1) * n
    # [E, 2, I, .] views the gate and up halves separately; one slice takes both.
    w13_r = w13.reshape(experts, 2, inter, hidden // 2)[:, :, lo:hi]
    s13_r = s13.reshape(experts, 2, inter, hidden // _BLOCK)[:, :, lo:hi]
    return (_contiguous(w13_r).reshape(experts, 2 * n, hidden // 2),
            _contiguous(s13_r).reshape(experts, 2 * n, hidden // _BLOCK),
            _contiguous(w2[:, :, lo // 2:hi // 2]),
            _contiguous(s2[:, :, lo // _BLOCK:hi // _BLOCK]))


def _group_tp_rank(group, tp, rank) -> tuple[int, int]:
    """(tp, rank) from the process group, checked against the given ones if any."""
    if group is None:
        tp = 1 if tp is None else tp
        if rank is None and tp != 1:
            raise ValueError(f"rank: required when tp = {tp} and no group is given")
        return _check_tp_rank(tp, 0 if rank is None else rank)
    import torch.distributed as dist

    size, me = dist.get_world_size(group), dist.get_rank(group)
    if tp is not None and tp != size:
        raise ValueError(f"tp: expected the group's size {size} (or None), got {tp}")
    if rank is not None and rank != me:
        raise ValueError(f"rank: expected this process's rank {me} in the group "
                         f"(or None), got {rank}")
    return size, me


class TensorParallelExperts:
    """One MoE layer's routed experts split over ``tp`` ranks along I, summed with an
    all-reduce: each rank runs its shard with the combined output (``z`` of SPEC 3
    step 6, partial over its slice of I) and ``torch.distributed.all_reduce`` (SUM)
    adds the partials in place, so every rank ends with the layer's combined output.

    Parameters
    ----------
    w13, s13, w2, s2 : uint8 tensors
        The FULL layer in the standard layout ([E, 2I, H/2], [E, 2I, H/32],
        [E, H, I/2], [E, H, I/32]); this rank's shard is cut with :func:`shard` and
        packed (on CUDA the packed copy is the only one kept). Use :meth:`from_shard`
        for weights that are sharded already.
    group : torch.distributed.ProcessGroup, optional
        The ranks that share this layer (e.g. ``torch.distributed.group.WORLD``);
        ``tp`` and ``rank`` default to its size and this process's rank in it. With
        a group of size > 1, run() all-reduces the output; without a group it does
        not, and the caller sums the ranks' outputs.
    tp, rank : int, optional
        Shard count and this shard (checked against ``group`` when given). Without a
        group: tp defaults to 1 and rank is then required when tp > 1.
    top_k, beta, linear_beta, hidden_scale
        As for :class:`PersistentExperts`.

    Attributes
    ----------
    local : PersistentExperts
        This rank's shard (``local.inter`` = I / tp). Size the scratch from it:
        ``kx.scratch(layer.local)``, shareable with other layers on the same stream.
    tp, rank : int
    group : the process group, or None

    Notes
    -----
    Precision: the partials are bf16 (the layer's combined output) and the all-reduce
    sums them in bf16, so beside the unsharded layer's single bf16 rounding of z
    there are the tp partials' roundings and up to tp - 1 roundings of running sums,
    each up to a relative 2^-9 of what it rounds; partials of opposite sign make that
    larger relative to the sum. In the tests (tp = 2 and 4, up to k3-tp8's E = 384,
    H = 3584) the relative Frobenius error against the float64 reference is at most
    5e-3 (1.7e-3 for the unsharded layer; tolerance 2e-2). Summing fp32 partials
    would avoid the extra roundings, but the layer writes its combined output in
    bf16 only.

    The all-reduce is NCCL on CUDA (gloo on the CPU works too) and runs on the
    caller's stream after the layer, so a whole run() is capturable in a CUDA graph
    once the communicator is initialized (one eager run() before capturing). Free or
    ``reset()`` such graphs before ``torch.distributed.destroy_process_group()``:
    NCCL's communicator teardown waits for every graph that captured one of its
    collectives, and hangs while one is alive (pytorch/pytorch#115388; seen here with
    torch 2.11 and NCCL 2.28 on two H200s).

    Examples
    --------
    Under ``torchrun --nproc-per-node 8``, one layer of the full width (I = 3072,
    I / 8 = 384 per rank)::

        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl")
        layer = kx.TensorParallelExperts(w13, s13, w2, s2, group=dist.group.WORLD,
                                         top_k=16, hidden_scale="floor")
        z = torch.empty(B, 3584, dtype=torch.bfloat16, device="cuda")
        layer.prepare(B, kx.scratch(layer.local), z)
        layer.run(x, ids, weights)             # z: the whole layer on every rank
    """

    def __init__(self, w13, s13, w2, s2, *, group=None, tp=None, rank=None,
                 top_k: int = 16, beta: float = 4.0, linear_beta: float = 25.0,
                 hidden_scale: str = "rceil"):
        tp, rank = _group_tp_rank(group, tp, rank)
        self._init(shard(w13, s13, w2, s2, tp, rank), group, tp, rank, top_k=top_k,
                   beta=beta, linear_beta=linear_beta, hidden_scale=hidden_scale)

    @classmethod
    def from_shard(cls, w13, s13, w2, s2, *, group=None, tp=None, rank=None,
                   top_k: int = 16, beta: float = 4.0, linear_beta: float = 25.0,
                   hidden_scale: str = "rceil") -> "TensorParallelExperts":
        """Build from this rank's shard as :func:`shard` returns it (standard layout,
        I / tp rows per half): [E, 2I/tp, H/2], [E, 2I/tp, H/32], [E, H, I/(2tp)],
        [E, H, I/(32tp)]. Other arguments as for the constructor."""
        tp, rank = _group_tp_rank(group, tp, rank)
        layer = cls.__new__(cls)
        layer._init((w13, s13, w2, s2), group, tp, rank, top_k=top_k, beta=beta,
                    linear_beta=linear_beta, hidden_scale=hidden_scale)
        return layer

    def _init(self, local_weights, group, tp: int, rank: int, **settings) -> None:
        self.local = PersistentExperts(*local_weights, **settings)
        self.tp, self.rank = tp, rank
        self.group = group
        self._reduce = group is not None and tp > 1

    def prepare(self, batch: int, scratch: Scratch, out) -> None:
        """Prepare the local shard with ``combine=True`` into ``out``.

        Parameters
        ----------
        batch : int
            Tokens per run() call, >= 1.
        scratch : Scratch
            Large enough for ``self.local`` (``kx.scratch(layer.local)``).
        out : bf16 tensor [batch, H]
            The combined output: the rank's partial, then (with a group) the sum over
            the group. A torch tensor when a group is used (the all-reduce needs one);
            on the group's device (CUDA for NCCL, CPU for gloo), and contiguous.

        Raises
        ------
        ValueError, TypeError
            As :meth:`PersistentExperts.prepare`; TypeError also for a non-torch
            ``out`` when a group is used, ValueError for a strided one.
        """
        if self._reduce and not is_torch(out):
            raise TypeError("out: expected a torch tensor (it is all-reduced over the "
                            f"group), got {type(out).__name__}")
        if self._reduce and not out.is_contiguous():
            # all_reduce takes numel elements from data_ptr: a row-strided view would leave
            # its last rows unreduced and sum the caller's memory between its rows
            raise ValueError(f"out: expected a contiguous tensor (it is all-reduced in place over the "
                             f"group), got strides {tuple(out.stride())} for shape {tuple(out.shape)}")
        self.local.prepare(batch, scratch, out, combine=True)

    def run(self, x, ids, weights, *, stream=None):
        """The layer's combined output, in the ``out`` given to prepare().

        Parameters
        ----------
        x : bf16 tensor [batch, H]
            Hidden states, the same on every rank.
        ids : int32 tensor [batch, top_k]
            Experts of each (token, slot), the same on every rank.
        weights : float32 tensor [batch, top_k]
            Routing weights, the same on every rank.
        stream : int or stream object, optional
            CUDA: where the layer and the all-reduce run (default: PyTorch's current
            stream). Nothing is allocated and the host never waits, so the call can
            be captured in a CUDA graph.

        Returns
        -------
        The ``out`` given to prepare(): with a group, bf16 [batch, H] summed over the
        group (the same on every rank); without one, this rank's partial.
        """
        out = self.local.run(x, ids, weights, stream=stream)
        if self._reduce:
            self._all_reduce(out, stream)
        return out

    def check(self, *, stream=None) -> None:
        """As :meth:`PersistentExperts.check` for the local shard."""
        self.local.check(stream=stream)

    def _all_reduce(self, out, stream) -> None:
        import torch
        import torch.distributed as dist

        if stream is None or not out.is_cuda:  # PyTorch's current stream, as the layer's
            dist.all_reduce(out, group=self.group)
            return
        with torch.cuda.stream(torch_stream(stream, out.device)):
            dist.all_reduce(out, group=self.group)
