"""benchmarks/compare_builds.py: the A/B table and the alternating runs behind it."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

from shapes import ROOT

SCRIPT = ROOT / "benchmarks" / "compare_builds.py"
_spec = importlib.util.spec_from_file_location("compare_builds", SCRIPT)
compare_builds = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(compare_builds)


def test_table_compares_fastest_passes_with_the_base():
    times = {("tp16", 1): {"base": [12.5, 12.0], "new": [11.4, 12.6]},
             ("k3-tp8", 64): {"base": [200.0, 210.0], "new": [205.0], "other": [190.0, 195.0]},
             ("k3-tp8", 8): {"base": [62.0]}}
    lines = compare_builds.compare_table(times, ["base", "new", "other"])
    assert lines[0] == "shape B | base | new | other"
    # sorted by shape, then B; a tree without passes for a row leaves its cell empty
    assert lines[1] == "k3-tp8 8 | 62.00 |  | "
    assert lines[2] == "k3-tp8 64 | 200.00/210.00 | 205.00 (+2.5 %) | 190.00/195.00 (-5.0 %)"
    assert lines[3] == "tp16 1 | 12.50/12.00 | 11.40/12.60 (-5.0 %) | "


def test_tree_names_are_folder_names_unless_they_clash():
    assert compare_builds.tree_names(["/tmp/a/", "/tmp/b"]) == ["a", "b"]
    assert compare_builds.tree_names(["/x/main", "/y/main"]) == ["/x/main", "/y/main"]


def _fake_tree(root, us, hbm=None):
    """A tree whose bench_experts.py checks how it was run and writes one row: us[i] on
    its i-th run, and the run's HBM read hbm[i] (none where hbm is None, as in older trees)."""
    bench = root / "benchmarks" / "bench_experts.py"
    bench.parent.mkdir(parents=True)
    hbm_line = f'run["hbm_read_TBps"] = {hbm!r}[n]' if hbm is not None else ""
    bench.write_text(f"""
import json, os, sys
root = {str(root)!r}
count = os.path.join(root, "runs")
n = int(open(count).read()) if os.path.exists(count) else 0
open(count, "w").write(str(n + 1))
assert os.getcwd() == root and os.environ["PYTHONPATH"] == root
assert sys.argv[1:3] == ["--shapes", "k3-tp8"] and sys.argv[3] == "--out"
run = {{"rows": [{{"shape": "k3-tp8", "B": 1, "us": {us!r}[n]}}]}}
{hbm_line}
json.dump(run, open(sys.argv[4], "w"))
""")
    return root


def test_runs_every_tree_in_turn_every_other_pass_reversed(tmp_path):
    base = _fake_tree(tmp_path / "base", [10.0, 9.0, 9.5], hbm=[4.541, 4.6, 4.5])
    new = _fake_tree(tmp_path / "new", [8.1, 9.9, 8.5])
    done = subprocess.run([sys.executable, str(SCRIPT), str(base), str(new), "--passes", "3", "--shapes", "k3-tp8"],
                          capture_output=True, text=True, check=True)
    assert done.stdout.splitlines() == ["shape B | base | new",
                                        "k3-tp8 1 | 10.00/9.00/9.50 | 8.10/9.90/8.50 (-10.0 %)",
                                        "HBM read TB/s, each pass | 4.54/4.60/4.50 | ?/?/?"]
    assert done.stderr.splitlines() == ["pass 1/3: base", "pass 1/3: new", "pass 2/3: new", "pass 2/3: base",
                                        "pass 3/3: base", "pass 3/3: new"]


def test_build_logs_under_build_and_stops_on_failure(tmp_path):
    good = _fake_tree(tmp_path / "good", [1.0])
    (good / "setup.py").write_text("print('built')\n")
    bad = _fake_tree(tmp_path / "bad", [1.0])
    (bad / "setup.py").write_text("raise SystemExit('no compiler')\n")
    done = subprocess.run([sys.executable, str(SCRIPT), str(good), str(bad), "--build", "--passes", "1",
                           "--shapes", "k3-tp8"], capture_output=True, text=True)
    assert done.returncode != 0 and done.stdout == ""
    assert f"building {bad} failed: see {bad / 'build' / 'compare_builds.log'}" in done.stderr
    assert (good / "build" / "compare_builds.log").read_text() == "built\n"
    assert "no compiler" in (bad / "build" / "compare_builds.log").read_text()


def test_batches_warmup_combine_and_routing_reach_each_run(tmp_path):
    tree = tmp_path / "t"
    bench = tree / "benchmarks" / "bench_experts.py"
    bench.parent.mkdir(parents=True)
    bench.write_text(f"""
import json, sys
open({str(tree / "argv")!r}, "a").write(" ".join(sys.argv[1:]) + "\\n")
json.dump({{"rows": [{{"shape": "tp16", "B": 2, "us": 3.0}}]}}, open(sys.argv[sys.argv.index("--out") + 1], "w"))
""")
    done = subprocess.run([sys.executable, str(SCRIPT), str(tree), "--passes", "2", "--shapes", "tp16",
                           "--batches", "1,2"], capture_output=True, text=True, check=True)
    assert done.stdout.splitlines()[1] == "tp16 2 | 3.00/3.00"
    runs = (tree / "argv").read_text().splitlines()
    assert len(runs) == 2 and all(r.startswith("--shapes tp16 --out ") and r.endswith(" --batches 1,2") for r in runs)
    subprocess.run([sys.executable, str(SCRIPT), str(tree), "--passes", "1", "--shapes", "tp16",
                    "--warmup-ms", "500"], capture_output=True, text=True, check=True)
    assert (tree / "argv").read_text().splitlines()[2].endswith(" --warmup-ms 500.0")
    subprocess.run([sys.executable, str(SCRIPT), str(tree), "--passes", "1", "--shapes", "tp16", "--combine"],
                   capture_output=True, text=True, check=True)
    assert (tree / "argv").read_text().splitlines()[3].endswith(" --combine")
    subprocess.run([sys.executable, str(SCRIPT), str(tree), "--passes", "1", "--shapes", "tp16",
                    "--routing", "zipf-1.2"], capture_output=True, text=True, check=True)
    assert (tree / "argv").read_text().splitlines()[4].endswith(" --routing zipf-1.2")


def test_placement_table_takes_each_trees_median_over_its_pads():
    times = {("tp16", 8): {"a@0": [40.0, 39.0], "a@144": [41.0], "a@256": [39.5],
                           "b@0": [38.0], "b@144": [40.0, 39.8], "b@256": [41.0]}}
    lines = compare_builds.placement_table(times, ["a", "b"], [0, 144, 256])
    assert lines == ["shape B | median over pads 0,144,256: a | b", "tp16 8 | 39.50 | 39.80 (+0.8 %)"]


def _padded_tree(root, base_us, builds):
    """A tree whose setup.py logs the pad and nvcc jobs it was built with and counts its builds in
    `builds` (shared by all trees), and whose bench_experts.py reports base_us + pad / 100."""
    (root / "benchmarks").mkdir(parents=True)
    (root / "kimi_experts").mkdir()
    (root / "kimi_experts" / "version.py").write_text("V = 1\n")
    (root / "setup.py").write_text(f"""
import os
os.makedirs("build", exist_ok=True)
open("build/pad", "w").write(os.environ["KIMI_EXPERTS_PLACEMENT_PAD"] + " " + os.environ["KIMI_EXPERTS_JOBS"])
open({str(builds)!r}, "a").write(os.getcwd() + "\\n")
""")
    (root / "benchmarks" / "bench_experts.py").write_text(f"""
import json, sys
pad = int(open("build/pad").read().split()[0])
json.dump({{"rows": [{{"shape": "tp16", "B": 8, "us": {base_us} + pad / 100}}]}},
          open(sys.argv[sys.argv.index("--out") + 1], "w"))
""")
    return root


def test_pads_build_every_copy_once_and_reuse_current_ones(tmp_path):
    builds = tmp_path / "builds"
    a = _padded_tree(tmp_path / "a", 40.0, builds)
    b = _padded_tree(tmp_path / "b", 39.0, builds)
    copies = tmp_path / "copies"
    cmd = [sys.executable, str(SCRIPT), str(a), str(b), "--pads", "0,144", "--copies", str(copies),
           "--passes", "1", "--shapes", "tp16"]
    done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    assert done.stdout.splitlines() == ["shape B | a@0 | a@144 | b@0 | b@144",
                                        "tp16 8 | 40.00 | 41.44 (+3.6 %) | 39.00 (-2.5 %) | 40.44 (+1.1 %)",
                                        "HBM read TB/s, each pass | ? | ? | ? | ?",
                                        "shape B | median over pads 0,144: a | b",
                                        "tp16 8 | 40.72 | 39.72 (-2.5 %)"]
    assert sorted(builds.read_text().split()) == sorted(str(copies / c) for c in ("0@0", "0@144", "1@0", "1@144"))
    assert all((copies / c / "build" / "pad").read_text().split()[0] == c.split("@")[1] for c in ("0@144", "1@0"))
    assert int((copies / "0@0" / "build" / "pad").read_text().split()[1]) >= 4  # nvcc jobs, each copy
    # the same sources: nothing is rebuilt; a tree's sources changed: its copies are
    subprocess.run(cmd, capture_output=True, text=True, check=True)
    assert len(builds.read_text().split()) == 4
    (b / "kimi_experts" / "version.py").write_text("V = 2\n")
    again = subprocess.run(cmd, capture_output=True, text=True, check=True)
    assert sorted(builds.read_text().split()[4:]) == [str(copies / "1@0"), str(copies / "1@144")]
    assert again.stdout.splitlines()[1] == done.stdout.splitlines()[1]


def test_a_failed_copy_stops_the_run_and_is_rebuilt_next_time(tmp_path):
    builds = tmp_path / "builds"
    a = _padded_tree(tmp_path / "a", 40.0, builds)
    (a / "setup.py").write_text((a / "setup.py").read_text() + "raise SystemExit('no compiler')\n")
    copies = tmp_path / "copies"
    cmd = [sys.executable, str(SCRIPT), str(a), "--pads", "8", "--copies", str(copies), "--passes", "1",
           "--shapes", "tp16"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    assert done.returncode != 0 and done.stdout == ""
    assert f"building {copies / '0@8'} failed" in done.stderr
    assert not (copies / "0@8" / "build" / "compare_builds.stamp").exists()
    subprocess.run(cmd, capture_output=True, text=True)
    assert len(builds.read_text().split()) == 2


def test_copies_needs_pads(tmp_path):
    done = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path), "--copies", str(tmp_path / "c")],
                          capture_output=True, text=True)
    assert done.returncode == 2 and "--copies keeps the copies that --pads builds" in done.stderr
