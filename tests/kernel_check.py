"""The kernel tests' one error measure: a kernel's output against a reference (float64, or the plain PyTorch path).

Two criteria, both computed in float64:

* ``rel_l2``: the relative L2 error ``||got - want|| / ||want||`` must be below the bound (strictly). This is what
  a kernel that sums in another order or rounds its storage differs by: it averages over the tensor, so one
  unlucky element of a long reduction does not decide, while a wrong row or column still does.
* ``atol`` / ``rtol``: every element must satisfy ``|got - want| <= atol + rtol * |want|`` (``torch.allclose``'s
  rule), for outputs that must match element by element (a cache write, a decode step's logits). Unlike
  ``torch.testing.assert_close`` this does not compare dtypes: the reference is often float64.

A bound may be a number or a table by dtype (``{torch.float32: 1e-5, torch.bfloat16: 8e-3}``, or any key, e.g.
"fp32" / "bf16"); ``dtype`` picks the entry. Both tensors must be finite everywhere. A failure names the worst elements:

    rmsnorm weight grad (torch.bfloat16): relative L2 error 0.0314 >= 0.024; max abs error 0.19 at (3, 17) (got
    1.52, want 1.71); max relative error 2.4 at (0, 5) (got 0.012, want 0.0035); shape (4, 96)
"""

from __future__ import annotations

import torch


def _pick(bound, dtype):
    if isinstance(bound, dict):
        if dtype not in bound:
            raise KeyError(f"no tolerance for {dtype} in {bound}")
        return bound[dtype]
    return bound


def _where(flat_index: int, shape) -> tuple:
    return tuple(int(i) for i in torch.unravel_index(torch.tensor(flat_index), tuple(shape))) if shape else ()


def relative_l2_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """``||got - want|| / ||want||`` in float64 (a zero reference counts as norm 1e-30)."""
    got, want = got.detach().double(), want.detach().double().to(got.device)
    return ((got - want).norm() / want.norm().clamp_min(1e-30)).item()


def describe_error(got: torch.Tensor, want: torch.Tensor, rel_l2: bool = True) -> str:
    """The largest absolute and relative errors and where they are (and the relative L2 error)."""
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    err = (got - want).abs()
    parts = [f"relative L2 error {relative_l2_error(got, want):.3g}"] if rel_l2 else []
    if err.numel():
        i = int(err.argmax())
        parts.append(f"max abs error {err.flatten()[i].item():.3g} at {_where(i, err.shape)} "
                     f"(got {got.flatten()[i].item():.6g}, want {want.flatten()[i].item():.6g})")
        nonzero = want != 0
        if nonzero.any():
            rel = torch.where(nonzero, err / want.abs().where(nonzero, torch.ones_like(want)), torch.zeros_like(err))
            j = int(rel.argmax())
            parts.append(f"max relative error {rel.flatten()[j].item():.3g} at {_where(j, rel.shape)} "
                         f"(got {got.flatten()[j].item():.6g}, want {want.flatten()[j].item():.6g})")
    parts.append(f"shape {tuple(got.shape)}")
    return "; ".join(parts)


def assert_close_to_reference(got: torch.Tensor, want: torch.Tensor, dtype=None, *, rel_l2=None, atol=None,
                              rtol=None, what: str = "") -> None:
    """Assert ``got`` is within the tolerance of the reference ``want`` (see the module docstring).

    ``dtype``: the key of the tolerance tables (default: ``got.dtype``). Give ``rel_l2``, or ``atol`` and/or
    ``rtol`` (a missing one of the two is 0), or both kinds (both must hold).
    """
    dtype = got.dtype if dtype is None else dtype
    rel_l2, atol, rtol = _pick(rel_l2, dtype), _pick(atol, dtype), _pick(rtol, dtype)
    if rel_l2 is None and atol is None and rtol is None:
        raise ValueError("assert_close_to_reference: give rel_l2, or atol / rtol")
    label = f"{what} ({dtype})" if what else f"({dtype})"
    assert got.shape == want.shape, f"{label}: shape {tuple(got.shape)}, the reference's {tuple(want.shape)}"
    for name, t in (("got", got), ("the reference", want)):  # NaN would slip through a comparison
        finite = torch.isfinite(t)
        if not finite.all():
            i = int((~finite).flatten().nonzero()[0])
            raise AssertionError(f"{label}: {name} has {int((~finite).sum())} non-finite values, the first at "
                                 f"{_where(i, t.shape)} ({t.flatten()[i].item()})")
    failures = []
    if rel_l2 is not None:
        err = relative_l2_error(got, want)
        if not err < rel_l2:
            failures.append(f"relative L2 error {err:.3g} >= {rel_l2:.3g}")
    if atol is not None or rtol is not None:
        a, r = atol or 0.0, rtol or 0.0
        g, w = got.detach().double(), want.detach().double().to(got.device)
        outside = (g - w).abs() > a + r * w.abs()
        if outside.any():
            failures.append(f"{int(outside.sum())} of {outside.numel()} elements outside atol {a:g} + rtol {r:g}")
    if failures:
        raise AssertionError(f"{label}: {'; '.join(failures)}; {describe_error(got, want, rel_l2 is None)}")
