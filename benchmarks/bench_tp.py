"""Tensor-parallel routed experts (issue 5): layer time at TP = 1..8, all-reduce share.

Per-layer time at TP = 1, 2, 4, 8 for the full Kimi-K3 expert width split over the
ranks, and the share of it the all-reduce takes.

    torchrun --nproc-per-node 8 benchmarks/bench_tp.py [--replays 60] [--layers 8] \\
        [--out benchmarks/results/tp-h200.json]

Shape: H=3584, E=384, top-16, I = 3072 split over tp ranks (I/tp = 3072, 1536, 768,
384 per rank), hidden scales floor; B = 1, 2, 4, 8, 16, 32, 64. For each tp, ranks
0..tp-1 form a group (the others wait); a tp above the world size is skipped with a
printed reason (`python benchmarks/bench_tp.py` alone runs tp = 1). Each rank packs
random MXFP4 bytes for its own shard (TensorParallelExperts.from_shard), --layers
distinct layers so L2 (50 MB) cannot serve the weights. Routing is uniform at random
without repeats in a token (fixed seed, the same on every rank).
- us: one layer call, TensorParallelExperts.run = the shard with the fused combine, then
  the NCCL all-reduce (SUM) of the bf16 [B, H] output; a CUDA graph of --layers calls
  replayed --replays times, median / layers, the slowest rank.
- local_us: the same graph without the all-reduce (the shard alone).
- allreduce_us: a graph of --layers all-reduces of the [B, H] bf16 output alone.
- allreduce_share = (us - local_us) / us: the all-reduce's share of a layer call.
- floor_us: a rank's weight bytes of the distinct routed experts (packed FP4 + scales)
  over its HBM read bandwidth measured in this run (probe_read over 4 GiB), the largest
  over the ranks; ratio = us / floor_us.
NVLink multicast (NVLS) is off (NCCL_NVLS_ENABLE=0). Rank 0 writes the JSON and prints
the table.
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (graph_replay_time_us, measure_hbm_read_bandwidth, parse_batches,  # noqa: E402
                    print_table, random_mxfp4_layer, routed_ids, write_json)

SHAPE = dict(H=3584, I=3072, E=384, top_k=16, hidden_scale="floor")  # the full expert width
TP_SIZES = [1, 2, 4, 8]
BATCHES = [1, 2, 4, 8, 16, 32, 64]
COLUMNS = ["tp", "I_rank", "B", "distinct_experts", "weight_bytes", "us", "local_us",
           "allreduce_us", "allreduce_share", "floor_us", "ratio"]


def _int_list(text: str) -> list[int]:
    return [int(v) for v in text.split(",")]


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--replays", type=int, default=60)
    ap.add_argument("--layers", type=int, default=8,
                    help="distinct layers per graph, rotated so L2 cannot serve the weights")
    ap.add_argument("--tp", type=_int_list, default=TP_SIZES, help="TP sizes, e.g. 1,2,4,8")
    ap.add_argument("--batches", default=",".join(map(str, BATCHES)), help="e.g. 1,2,4,8,16,32,64")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                  "results", "tp-h200.json"))
    args = ap.parse_args(argv)
    args.batches = parse_batches(ap, args.batches)
    if args.replays < 50:
        ap.error("--replays: use at least 50 (the median of many replays is the figure)")
    if args.layers < 1:
        ap.error(f"--layers: expected >= 1, got {args.layers}")
    bad = [tp for tp in args.tp if tp < 1 or SHAPE["I"] % (32 * tp)]
    if bad:
        ap.error(f"--tp: {bad} do not split I = {SHAPE['I']} into multiples of 32")
    return args


def random_shard(torch, tp, rank, seed):
    """Random MXFP4 bytes with realistic scales (about 2^-8) for one rank's shard."""
    return random_mxfp4_layer(torch, SHAPE["E"], SHAPE["H"], SHAPE["I"] // tp, seed * 1000 + rank)


def routed_inputs(torch, B):
    """x, ids (no repeats in a token), routing weights: the same on every rank."""
    g = torch.Generator().manual_seed(B)
    E, K = SHAPE["E"], SHAPE["top_k"]
    ids = routed_ids(torch, g, B, K, E)
    x = torch.randn(B, SHAPE["H"], generator=g).to(torch.bfloat16)
    w = torch.rand(B, K, generator=g)
    return x.cuda(), ids.cuda(), (w / w.sum(1, keepdim=True)).cuda()


def bench_tp(torch, dist, kx, tp, group, rank, args, hbm):
    """Rows for one tp on a rank of `group` (None for tp = 1); the slowest rank's times."""
    layers = []
    for seed in range(args.layers):
        w = random_shard(torch, tp, rank, seed)
        layers.append(kx.TensorParallelExperts.from_shard(
            *w, group=group, tp=tp, rank=rank, top_k=SHAPE["top_k"],
            hidden_scale=SHAPE["hidden_scale"]))
        del w
    torch.cuda.empty_cache()
    scratch = kx.scratch(*(layer.local for layer in layers))
    per_expert = layers[0].local.packed_bytes / SHAPE["E"]
    rows = []
    for B in args.batches:
        x, ids, rw = routed_inputs(torch, B)
        out = torch.empty(B, SHAPE["H"], dtype=torch.bfloat16, device="cuda")
        for layer in layers:
            layer.prepare(B, scratch, out)
        n = args.layers
        us = graph_replay_time_us(lambda: [m.run(x, ids, rw) for m in layers], args.replays) / n
        local_us = graph_replay_time_us(lambda: [m.local.run(x, ids, rw) for m in layers],
                                        args.replays) / n
        reduce_us = 0.0
        if group is not None:
            reduce_us = graph_replay_time_us(
                lambda: [dist.all_reduce(out, group=group) for _ in layers], args.replays) / n
        distinct = int(torch.unique(ids).numel())
        floor_us = distinct * per_expert / (hbm * 1e12) * 1e6
        if group is not None:  # the slowest rank's figures
            times = torch.tensor([us, local_us, reduce_us, floor_us], device="cuda")
            dist.all_reduce(times, op=dist.ReduceOp.MAX, group=group)
            us, local_us, reduce_us, floor_us = times.tolist()
        rows.append(dict(tp=tp, I_rank=SHAPE["I"] // tp, B=B, distinct_experts=distinct,
                         weight_bytes=int(distinct * per_expert), us=us, local_us=local_us,
                         allreduce_us=reduce_us, allreduce_share=(us - local_us) / us,
                         floor_us=floor_us, ratio=us / floor_us))
        if rank == 0:
            print(f"  tp={tp} B={B}: {us:.2f} us, shard alone {local_us:.2f} us, "
                  f"all-reduce alone {reduce_us:.2f} us, floor {floor_us:.2f} us", flush=True)
    return rows


def main():
    args = parse_args()

    import torch
    import torch.distributed as dist

    import kimi_experts as kx

    if not kx.cuda_available():
        sys.exit(f"no usable GPU: {kx.backend_info()['reason']}")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    if world > 1:
        os.environ["NCCL_NVLS_ENABLE"] = "0"  # no NVLink multicast
        dist.init_process_group("nccl", timeout=datetime.timedelta(minutes=30))
    hbm = measure_hbm_read_bandwidth()
    if rank == 0:
        print(f"world size {world}; HBM read bandwidth (rank 0): {hbm:.3f} TB/s", flush=True)
    rows = []
    for tp in args.tp:
        if tp > world:
            if rank == 0:
                print(f"tp={tp}: skipped, larger than the world size {world} "
                      f"(launch with torchrun --nproc-per-node {tp})", flush=True)
            continue
        # every rank creates every group (a collective); ranks >= tp wait for the others
        group = dist.new_group(ranks=list(range(tp))) if tp > 1 else None
        if rank < tp:
            rows += bench_tp(torch, dist, kx, tp, group, rank, args, hbm)
            torch.cuda.empty_cache()  # this tp's layers are gone
        if world > 1:
            dist.barrier(device_ids=[local_rank])
    if rank == 0:
        write_json(args.out, rows, hbm_read_TBps=hbm, world_size=world, layers=args.layers,
                   replays=args.replays, shape=SHAPE, nccl_nvls_enable="0",
                   nccl_version=".".join(map(str, torch.cuda.nccl.version())))
        print_table(rows, COLUMNS)
        print(f"wrote {args.out}")
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
