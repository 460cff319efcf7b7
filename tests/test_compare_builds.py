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
