"""benchmarks/ncu_blocks.py: ncu's SASS source page read into basic blocks and their stalls."""

from __future__ import annotations

import importlib.util
import sys

from shapes import ROOT

SCRIPT = ROOT / "benchmarks" / "ncu_blocks.py"
_spec = importlib.util.spec_from_file_location("ncu_blocks", SCRIPT)
ncu_blocks = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = ncu_blocks  # its dataclasses look their module up
_spec.loader.exec_module(ncu_blocks)

# the layout of `ncu -i REP --page source --csv --print-source sass`: a kernel-name row, then the
# header; columns that are not counts ("-"); each stall reason twice (all samples, and not-issued samples)
CSV = """\
"Kernel Name","void k(int)",
"Address","Source","# Samples","Instructions Executed","Address Space","stall_no_inst","stall_wait","stall_no_inst (Not Issued)"
"0x1000","      ISETP.NE.AND P0, PT, R14, 0x3, PT","10","4","-","8","2","8"
"0x1010","      @P0   BRA 0x1030","0","4","-","0","0","0"
"0x1020","      IADD3 R1, R1, 0x1, RZ","2","2","-","0","2","0"
"0x1030","      EXIT","4","4","-","4","0","4"
"""


def test_reads_instructions_and_the_all_samples_stall_columns():
    ins = ncu_blocks.read_source_csv(CSV.splitlines())
    assert [i.address for i in ins] == [0x1000, 0x1010, 0x1020, 0x1030]
    assert ins[0].sass == "ISETP.NE.AND P0, PT, R14, 0x3, PT"
    assert (ins[0].samples, ins[0].executed) == (10, 4)
    assert ins[0].stalls == {"no_inst": 8, "wait": 2}  # not the "(Not Issued)" twin


def test_blocks_end_at_branches_and_start_at_their_targets():
    blocks = ncu_blocks.basic_blocks(ncu_blocks.read_source_csv(CSV.splitlines()))
    assert [[i.address for i in b.instructions] for b in blocks] == [[0x1000, 0x1010], [0x1020], [0x1030]]
    assert (blocks[0].samples, blocks[0].runs) == (10, 4)
    assert blocks[0].stalls()["no_inst"] == 8


def test_report_orders_blocks_by_the_reason_and_gives_cycles_per_run():
    # 14 warp instructions x 8 cycles over 16 samples: 7 warp cycles a sample
    lines = ncu_blocks.report(ncu_blocks.read_source_csv(CSV.splitlines()), 8.0, top=2, by="no_inst")
    assert lines[0].startswith("samples 16, warp cycles per sample 7; kernel: no_inst=75.0% wait=25.0%")
    first, second = lines[2], lines[3]
    # block 0: 10 samples x 7 / 4 runs = 17.5 cycles a run, 8 x 7 / 4 = 14 of them no_inst
    assert first.startswith("+000000 n=   2 runs=      4 samples=    10 (62.5%) per run     18     14 no_inst=80")
    assert first.endswith("| @P0   BRA 0x1030")
    assert second.startswith("+000030 n=   1 runs=      4 samples=     4 (25.0%) per run      7      7 no_inst=100")
