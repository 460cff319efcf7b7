"""benchmarks/common.py's source digest: what a result records to name the tree it ran."""

from __future__ import annotations

import importlib.util

from shapes import ROOT

_spec = importlib.util.spec_from_file_location("bench_common", ROOT / "benchmarks" / "common.py")
common = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(common)


def _tree(root, files):
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_digest_of_the_checkout_is_stable():
    first = common.source_digest(str(ROOT))
    assert len(first) == 64 and int(first, 16) >= 0
    assert common.source_digest(str(ROOT)) == first


def test_digest_follows_sources_only(tmp_path):
    _tree(tmp_path, {"setup.py": "x = 1\n", "kernels/a.cu": "int a;\n", "csrc/b.c": "int b;\n"})
    base = common.source_digest(str(tmp_path))
    # build outputs, caches and files outside the source folders do not count
    _tree(tmp_path, {"kernels/a.o": "obj", "kimi_experts/__pycache__/m.py": "cached",
                     "notes.md": "text"})
    assert common.source_digest(str(tmp_path)) == base
    # a changed byte, a new source and a moved source all do
    (tmp_path / "kernels/a.cu").write_text("int a;\n ")
    changed = common.source_digest(str(tmp_path))
    assert changed != base
    (tmp_path / "kernels/a.cu").write_text("int a;\n")
    assert common.source_digest(str(tmp_path)) == base
    _tree(tmp_path, {"kernels/c.cuh": ""})
    added = common.source_digest(str(tmp_path))
    assert added not in (base, changed)
    (tmp_path / "kernels/c.cuh").rename(tmp_path / "csrc/c.cuh")
    assert common.source_digest(str(tmp_path)) not in (base, changed, added)
