"""The routed experts (SPEC 3, 6) on the GPU against the HBM floor.

    python benchmarks/bench_experts.py [--replays 60] [--layers 8] [--rounds 1] [--warmup-ms 0] [--combine]
                                       [--routing uniform] [--out benchmarks/results/experts-h200.json]

Shapes: k3-tp8 (H=3584, I=384, E=384, top-16, hidden scales floor) and the TP16 shard
(I=192, rceil); B = 1, 2, 4, 8, 16, 32, 64 (and 128, 256 with --large, a study). Study: --shapes
names other models' layers too (OTHER_SHAPES: their H, I, E and top_k, with SiTU standing in
for each model's own activation; --out experts-models-h200.json).
- us: one layer call (PersistentExperts.run, per-slot rows; with --combine the fused combine
  z = sum_j w[:, j] rows[:, j], its own record experts-combined-h200.json), timed as a CUDA graph of
  --layers calls over --layers distinct weight sets sharing one scratch (so L2 cannot
  serve the weights), replayed --replays times: median / layers. That times a card as fresh
  as a run allows (10 + 60 replays last tens of ms), yet at B >= 8 the kernel draws more than
  the board's 700 W cap, which can act within those replays, so the larger B move by a few %
  with the board's state. Each row carries that state over its timed replays (board.py, NVML):
  board_W (median board power), sm_MHz (median SM clock) and power_capped (the share of ~2 ms
  samples with the power cap among the clock event reasons); "-" without NVML. NVML refreshes
  them about every 100 ms, so rows shorter than that read the state the run left the board in.
  Studies, never the record: --rounds R captures the calls R times into each graph (median /
  (layers R)), so that the replay's own start, which no kernel before it can overlap, weighs
  as little as in a model's decode graph of many layers; --warmup-ms T replays each graph for
  T ms more before timing it (a card under sustained load, its SM clock lowered by the cap).
- floor_us: the weight bytes (FP4 + scales) of the distinct routed experts over the HBM
  read bandwidth measured in this run (probe_read over 4 GiB).
- ratio = us / floor_us;  TBps = weight bytes / us.
Routing is uniform at random without repeats in a token (fixed seed), the case a
serving router produces. Study: --routing zipf-S or same (common.ids_by_routing) skews it, so
that experts get more than a unit's 8 tokens (max_expert_tokens in each row); the floor stays
the distinct experts' bytes. Writes JSON and a PNG (when matplotlib is there), prints a table.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from board import Board  # noqa: E402
from common import (ROUTINGS, graph_replay_time_us, ids_by_routing, measure_hbm_read_bandwidth,  # noqa: E402
                    parse_batches, parse_routing, print_table, random_mxfp4_layer, refuse_study_over_record, write_json)

SHAPES = {
    "k3-tp8": dict(H=3584, I=384, E=384, top_k=16, hidden_scale="floor"),
    "tp16": dict(H=3584, I=192, E=384, top_k=16, hidden_scale="rceil"),
}
# Other models' MoE layers as one GPU of a TP8 group holds them (gpt-oss-120b: the whole layer,
# its MXFP4 checkpoint's form), for studies; tests/shapes.py's OTHER_MODEL_SHAPES check them.
OTHER_SHAPES = {
    "dsv3-tp8": dict(H=7168, I=256, E=256, top_k=8, hidden_scale="rceil"),  # DeepSeek-V3 / R1
    "qwen3-235b-tp8": dict(H=4096, I=192, E=128, top_k=8, hidden_scale="rceil"),
    "gpt-oss-120b": dict(H=2880, I=2880, E=128, top_k=4, hidden_scale="rceil"),
    "llama4-maverick-tp8": dict(H=5120, I=1024, E=128, top_k=1, hidden_scale="rceil"),
    "mixtral-8x22b-tp8": dict(H=6144, I=2048, E=8, top_k=2, hidden_scale="rceil"),
}
BATCHES = [1, 2, 4, 8, 16, 32, 64]


def bench_shape(torch, kx, name, shape, batches, layers, replays, hbm, rounds=1, warmup_ms=0.0, combine=False,
                routing="uniform", board=None):
    top_k = shape["top_k"]
    moes = []
    for l in range(layers):
        w = random_mxfp4_layer(torch, shape["E"], shape["H"], shape["I"], seed=1000 + l)
        moes.append(kx.PersistentExperts(*w, top_k=top_k, hidden_scale=shape["hidden_scale"]))
        del w
    torch.cuda.empty_cache()
    scratch = kx.scratch(*moes)
    per_expert = moes[0].packed_bytes / shape["E"]
    rows = []
    for B in batches:
        x = torch.randn(B, shape["H"], device="cuda").to(torch.bfloat16)
        ids = ids_by_routing(torch, routing, torch.Generator().manual_seed(B), B, top_k, shape["E"]).cuda()
        weights = torch.rand(B, top_k, device="cuda") if combine else None
        out = torch.empty(B if combine else B * top_k, shape["H"], dtype=torch.bfloat16, device="cuda")
        for m in moes:
            m.prepare(B, scratch, out, combine=combine)
        us = graph_replay_time_us(lambda: [m.run(x, ids, weights) for _ in range(rounds) for m in moes],
                                  replays=replays, warmup_ms=warmup_ms, board=board) / (layers * rounds)
        tokens_per_expert = torch.bincount(ids.flatten().long())
        distinct = int((tokens_per_expert > 0).sum())
        weight_bytes = distinct * per_expert
        floor_us = weight_bytes / (hbm * 1e12) * 1e6
        rows.append(dict(shape=name, B=B, distinct_experts=distinct, max_expert_tokens=int(tokens_per_expert.max()),
                         weight_bytes=int(weight_bytes), us=us, floor_us=floor_us, ratio=us / floor_us,
                         TBps=weight_bytes / us / 1e6, **(board.reading if board else {})))
        print(f"  {name} B={B}: {us:.2f} us, floor {floor_us:.2f} us, ratio {us / floor_us:.2f}", flush=True)
    del moes, scratch
    torch.cuda.empty_cache()
    return rows


def plot(rows, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot")
        return
    fig, ax = plt.subplots(figsize=(9, 4))
    for name in sorted({r["shape"] for r in rows}):
        rs = [r for r in rows if r["shape"] == name]
        (line,) = ax.plot([r["B"] for r in rs], [r["us"] for r in rs], "o-", label=f"{name} kimi_experts")
        ax.plot([r["B"] for r in rs], [r["floor_us"] for r in rs], "--", color=line.get_color(), alpha=0.5,
                label=f"{name} HBM floor")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("tokens B")
    ax.set_ylabel("us per layer call")
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--replays", type=int, default=60)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=1, help="the layers' calls this many times a graph (a study)")
    ap.add_argument("--warmup-ms", type=float, default=0.0,
                    help="replay each graph this long before timing it (sustained load; a study)")
    ap.add_argument("--large", action="store_true", help="also B = 128, 256")
    ap.add_argument("--batches", help="only these B, comma-separated (a study, not the record)")
    ap.add_argument("--shapes", default=",".join(SHAPES),
                    help=f"comma-separated, of {', '.join(SHAPES)} (the record) and {', '.join(OTHER_SHAPES)}")
    ap.add_argument("--combine", action="store_true", help="time the fused combine (z [B, H]) instead of per-slot rows")
    ap.add_argument("--routing", default="uniform", help=f"{ROUTINGS} (a study unless uniform)")
    ap.add_argument("--out", help="the JSON (default: the record, results/experts-h200.json, or with --combine "
                                  "results/experts-combined-h200.json)")
    args = ap.parse_args()
    results = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
    records = {combine: os.path.join(results, name)
               for combine, name in ((False, "experts-h200.json"), (True, "experts-combined-h200.json"))}
    record = records[args.combine]
    args.out = args.out or record
    if os.path.abspath(args.out) == records[not args.combine]:
        ap.error(f"--out: {os.path.basename(args.out)} is the {'rows' if args.combine else 'combined'} output's record")
    if args.replays < 50:
        ap.error("--replays: use at least 50 (the median of many replays is the figure)")
    if args.layers < 1:
        ap.error("--layers: at least 1")
    if args.rounds < 1:
        ap.error("--rounds: at least 1")
    refuse_study_over_record(ap, "--rounds", args.rounds > 1, args.out, record)
    if args.warmup_ms < 0:
        ap.error("--warmup-ms: at least 0")
    refuse_study_over_record(ap, "--warmup-ms", args.warmup_ms > 0, args.out, record)
    try:
        parse_routing(args.routing)
    except ValueError as e:
        ap.error(f"--routing: {e}")
    refuse_study_over_record(ap, "--routing", args.routing != "uniform", args.out, record)
    shapes = {**SHAPES, **OTHER_SHAPES}
    names = args.shapes.split(",")
    unknown = [n for n in names if n not in shapes]
    if unknown:
        ap.error(f"--shapes: unknown {', '.join(unknown)}")
    refuse_study_over_record(ap, "--shapes", any(n in OTHER_SHAPES for n in names), args.out, record)
    refuse_study_over_record(ap, "--large", args.large, args.out, record)
    batches = BATCHES + ([128, 256] if args.large else [])
    if args.batches:
        refuse_study_over_record(ap, "--batches", True, args.out, record)
        batches = parse_batches(ap, args.batches)

    import torch
    import kimi_experts as kx

    if not kx.cuda_available():
        sys.exit(f"no usable GPU: {kx.backend_info()['reason']}")
    hbm = measure_hbm_read_bandwidth()
    print(f"HBM read bandwidth: {hbm:.3f} TB/s (probe_read over 4 GiB)", flush=True)
    board = Board.open()
    if board is None:
        print("NVML not available: rows without the board's power state", flush=True)
    rows = []
    for name in names:
        rows += bench_shape(torch, kx, name, shapes[name], batches, args.layers, args.replays, hbm, args.rounds,
                            args.warmup_ms, args.combine, args.routing, board)
    write_json(args.out, rows, hbm_read_TBps=hbm, layers=args.layers, rounds=args.rounds, replays=args.replays,
               warmup_ms=args.warmup_ms, output="combined" if args.combine else "rows", routing=args.routing)
    plot(rows, os.path.splitext(args.out)[0] + ".png")
    print_table(rows, ["shape", "B", "distinct_experts", "max_expert_tokens", "weight_bytes", "us", "floor_us", "ratio",
                       "TBps", "board_W", "sm_MHz", "power_capped"])


if __name__ == "__main__":
    main()
