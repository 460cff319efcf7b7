"""benchmarks/common.py: the source digest (what a result records to name the tree it ran) and the
routed ids of the benchmarks' routings."""

from __future__ import annotations

import importlib.util

import pytest
import torch

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
    assert len(first) == 64 and set(first) <= set("0123456789abcdef"), first
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


def _ids(routing, seed=64, batch=64, top_k=16, experts=384):
    return common.ids_by_routing(torch, routing, torch.Generator().manual_seed(seed), batch, top_k, experts)


@pytest.mark.parametrize("routing", ["uniform", "same", "zipf-0.8", "zipf-1.2"])
def test_routed_ids_are_distinct_experts_per_token(routing):
    ids = _ids(routing)
    assert ids.dtype == torch.int32 and ids.shape == (64, 16)
    assert int(ids.min()) >= 0 and int(ids.max()) < 384
    assert all(len(set(row.tolist())) == 16 for row in ids)
    assert torch.equal(ids, _ids(routing)) and not torch.equal(ids, _ids(routing, seed=65))


def test_uniform_is_the_records_routing_and_skew_piles_tokens_up():
    generator = torch.Generator().manual_seed(64)
    assert torch.equal(_ids("uniform"), common.routed_ids(torch, generator, 64, 16, 384))
    most = {r: int(torch.bincount(_ids(r).flatten().long()).max()) for r in ("uniform", "zipf-0.8", "zipf-1.2", "same")}
    assert most["uniform"] <= 8 < most["zipf-0.8"] <= most["zipf-1.2"] <= most["same"] == 64, most
    assert int(torch.unique(_ids("same")).numel()) == 16


@pytest.mark.parametrize("text", ["zipf-", "zipf-0", "zipf--1", "zipf-nan", "zipf-inf", "zipf-x", "Uniform", ""])
def test_routing_names_checked(text):
    with pytest.raises(ValueError, match="uniform, same or zipf-S"):
        common.parse_routing(text)
