"""One MoE layer under test beside its reference: shared by the CPU and GPU MoE tests
(the GPU tests pass CUDA tensors and compute the reference on the GPU)."""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from shapes import (FINITE_SENTINEL, MOE_EXACT, MOE_RTOL, POISON_BF16, count_bits, poison_, ref, rel_fro,
                    strided_rows)


@dataclass(frozen=True)
class Expected:
    """The float64 reference of an output (before its bf16 rounding) and, per element, how far
    the library may lawfully land from it before that rounding (reference.moe_reference's
    slack: fp32 sums in any order, and the hidden values they may round either way)."""
    value: torch.Tensor
    slack: torch.Tensor

    def rows(self, index) -> "Expected":
        index = torch.as_tensor(index, dtype=torch.long, device=self.value.device)
        return Expected(self.value[index], self.slack[index])

    def combined(self, route_weights) -> "Expected":
        """The combined output's (SPEC 3 step 6) from these per-slot rows."""
        return Expected(*ref.combine_rows(self.value, route_weights, row_slack=self.slack))


class Layer:
    """A kx.PersistentExperts and the reference for the same weights and settings."""

    def __init__(self, kx, shape: dict, weights, *, beta=4.0, linear_beta=25.0,
                 hidden_scale=None, top_k=None, cache=None):
        self.kx = kx
        self.shape = dict(shape)
        self.weights = weights
        self.beta, self.linear_beta = beta, linear_beta
        self.hidden_scale = hidden_scale or shape["hidden_scale"]
        self.top_k = top_k or shape["top_k"]
        self.moe = kx.PersistentExperts(*weights, top_k=self.top_k, beta=beta,
                                        linear_beta=linear_beta,
                                        hidden_scale=self.hidden_scale)
        # expert -> dequantized weights, for the reference; depends on the weights only,
        # so layers on the same weights may share one (GPU memory: up to 16 MB/expert).
        self.cache: dict = {} if cache is None else cache
        self.hidden = shape["H"]

    def describe(self) -> str:
        s = self.shape
        return (f"shape={s['name']} (H={s['H']} I={s['I']} E={s['E']} top_k={self.top_k} "
                f"hidden_scale={self.hidden_scale} beta={self.beta} "
                f"linear_beta={self.linear_beta})")

    def reference(self, x, ids, route_weights=None) -> Expected:
        """Rows [B*K, H] (or combined [B, H]): float64 before the bf16 rounding, and their slack."""
        return Expected(*ref.moe_reference(*self.weights, x, ids, route_weights, beta=self.beta,
                                           linear_beta=self.linear_beta,
                                           hidden_scale=self.hidden_scale, cache=self.cache,
                                           device=x.device, slack=True))

    def new_out(self, batch: int, combine: bool, device="cpu", poison=POISON_BF16):
        rows = batch if combine else batch * self.top_k
        out = torch.empty((rows, self.hidden), dtype=torch.bfloat16, device=device)
        return poison_(out, poison)

    def twin(self) -> "Layer":
        """Another PersistentExperts on the same weights and settings (its own prepared
        state), e.g. for eager runs beside a captured graph."""
        return Layer(self.kx, self.shape, self.weights, beta=self.beta,
                     linear_beta=self.linear_beta, hidden_scale=self.hidden_scale,
                     top_k=self.top_k, cache=self.cache)

    def run(self, x, ids, route_weights=None, *, scratch=None, out=None, prepare=True,
            poison=POISON_BF16, **run_kw):
        """(prepare and) run on an output poisoned with `poison` (default 0xFFFF, a NaN
        the library never writes for finite data; pass a finite pattern where NaN rows
        are expected); returns the output tensor."""
        combine = route_weights is not None
        batch = x.shape[0]
        if out is None:
            out = self.new_out(batch, combine, x.device)
        poison_(out, poison)
        if prepare:
            if scratch is None:
                scratch = self.kx.scratch(self.moe)
            self.moe.prepare(batch, scratch, out, combine=combine)
        if combine:
            res = self.moe.run(x, ids, route_weights, **run_kw)
        else:
            res = self.moe.run(x, ids, **run_kw)
        assert res is out, "run() must return the out object given to prepare()"
        return out


def check_close(out, want: Expected, what, *, rtol=MOE_RTOL, finite=True) -> float:
    """out: the library's bf16 result; want: the reference of the same shape. Every element
    written (no sentinel left), no NaN when finite, and close to the reference by all three
    of shapes.MOE_RTOL's measures (why not bit-exact: see there)."""
    assert tuple(out.shape) == tuple(want.value.shape), (
        f"{what}: shape {list(out.shape)} vs {list(want.value.shape)}")
    for sentinel in (POISON_BF16, FINITE_SENTINEL):
        left = count_bits(out, sentinel)
        assert left == 0, (f"{what}: {left} output elements never written "
                           f"({sentinel:#06x} sentinel left)")
    if finite:
        n_nan = int(torch.isnan(out).sum())
        assert n_nan == 0, f"{what}: {n_nan} NaN in the output for finite inputs"
    err = rel_fro(out.float(), want.value)
    assert err < rtol, f"{what}: relative Frobenius error {err:.3e} >= {rtol:g}"
    got, value, slack = out.to(want.value.device).double(), want.value.double(), want.slack.double()
    known = torch.isfinite(value)
    exact = float((got == ref.to_bf16(value).double())[known].double().mean()) if bool(known.any()) else 1.0
    assert exact >= MOE_EXACT, (f"{what}: only {exact:.2%} of the elements are the reference rounded "
                                f"to bf16 (at least {MOE_EXACT:.0%} must be)")
    lo, hi = ref.bf16_range(value, slack)
    bad = torch.nonzero(~((got >= lo) & (got <= hi)) & known)
    assert bad.numel() == 0, (
        f"{what}: {bad.shape[0]} elements outside the reference's lawful range; first at "
        f"{bad[0].tolist()}: got {got[tuple(bad[0])].item()!r}, want {value[tuple(bad[0])].item()!r} "
        f"+- {slack[tuple(bad[0])].item():.3g}")
    return err


def check_rows_close(out, want: Expected, what, rows, *, rtol=MOE_RTOL):
    """Like check_close on a subset of rows (finite ones), e.g. beside NaN rows."""
    rows = torch.as_tensor(rows, dtype=torch.long, device=out.device)
    return check_close(out[rows], want.rows(rows), what, rtol=rtol)


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int16), b.view(torch.int16))


def ulp_bf16(t: torch.Tensor) -> torch.Tensor:
    """One bf16 ulp at |t| (float64), for 'within one rounding' comparisons."""
    a = t.double().abs().clamp(min=2.0**-126)
    return torch.exp2(torch.floor(torch.log2(a)) - 7)


def row_strided(t: torch.Tensor, pad: int, fill) -> torch.Tensor:
    """t copied into a strided_rows view, the rest of its buffer `fill`."""
    buf, view = strided_rows(*t.shape, pad, t.dtype, t.device)
    buf.fill_(fill)
    view.copy_(t)
    return view


def check_strided_inputs(layer, x, ids, route_weights, what):
    """x, ids and the routing weights as row-strided views whose buffers hold other values
    around them (other ids, weights of 7): per-slot rows and the combined output are the
    contiguous inputs' bit for bit, and close to the reference."""
    xs, ids_s, rw_s = row_strided(x, 7, 1.0), row_strided(ids, 7, 0), row_strided(route_weights, 7, 7.0)
    for weights, weights_s in ((None, None), (route_weights, rw_s)):
        plain = layer.run(x, ids, weights).clone()
        strided = layer.run(xs, ids_s, weights_s)
        kind = "combined" if weights is not None else "rows"
        assert bitwise_equal(plain, strided), f"{what}: {kind} from strided inputs differ"
        check_close(strided, layer.reference(x, ids, weights), f"{what} {kind}")


def check_combined_matches_rows(z, rows, route_weights, what):
    """SPEC 3: z = bf16(sum_j w_j * out_j) over the library's own bf16 rows, fp32 in
    slot order: z must be that sum rounded to nearest, within half a bf16 ulp (the sum
    computed here in fp32 too; fma vs. separate rounding may differ in the last fp32 bit)."""
    want = ref.combine_rows(rows, route_weights, dtype=torch.float32).double()
    # fp32 rounding of each partial sum (fused multiply-add or not) moves the sum by up
    # to top_k * 2^-24 * sum_j |w_j row_j|: significant where the slots cancel.
    w = torch.as_tensor(route_weights).to(rows.device)
    top_k = w.shape[1]
    mag = ref.combine_rows(rows.float().abs(), w.abs(), dtype=torch.float64)
    err = (z.double() - want).abs()
    tol = 0.5 * ulp_bf16(want) + top_k * 2.0**-23 * mag + 1e-30
    bad = torch.nonzero(err > tol)
    assert bad.numel() == 0, (
        f"{what}: combined output is not the slot-order sum of the rows at "
        f"{bad[0].tolist()}: got {z[tuple(bad[0])].item()}, want {want[tuple(bad[0])].item()}")


def assert_names_first_bad(msg, t, j, v):
    """A BadRoutingError message names the first bad (token t, slot j) and the id v."""
    named = f"ids[{t}, {j}]" in msg or (re.search(rf"token\D*{t}\b", msg) and re.search(rf"slot\D*{j}\b", msg))
    assert named, f"message does not name the first bad (token {t}, slot {j}): {msg!r}"
    assert str(v) in msg, f"message does not give the bad id {v}: {msg!r}"
