"""Inducing inputs: greedy selection by pivoted Cholesky, a fixed grid, and moving dual parameters to new Z.

Pivoted Cholesky (Burt et al. 2020; Chang et al. 2023, eq. 27) picks, one at a time, the candidate with the largest
residual (conditional) prior variance given the points already picked, and stops at ``max_points`` or when no
candidate has a residual variance above ``rel_tol`` times the largest prior variance. The threshold is what
keeps a new inducing point from duplicating (or nearly duplicating) an existing one, so K_ZZ stays well
conditioned whatever the data (repeated positions, a robot standing still).
"""
from __future__ import annotations

import math
from typing import Callable

import numpy as np
import torch

# Default residual-variance threshold, relative to the largest prior variance among the candidates.
DEFAULT_REL_TOL = 1e-4
# Up to this many candidates the greedy search runs in LAPACK's pivoted Cholesky (?pstrf: the same largest-
# residual pivot at every step, blocked) on the candidates' full kernel matrix: one call instead of a Python loop
# step per pick, ~10x faster for 300 candidates. Above it the C^2 matrix costs more than the loop's m columns.
LAPACK_MAX_CANDIDATES = 1024
# ?pstrf breaks a tie by the position a candidate has reached after its row swaps, the loop by the original
# index. Exact ties are common (points many lengthscales from every pick all keep their full prior variance), so
# candidate i's diagonal is raised by (C - i) * TIE_BREAK * (largest variance), a few units in the last place:
# exact ties go to the lower index, as in the loop (residuals closer than that are rounding noise in both).
TIE_BREAK = 4 * 2.0 ** -52

KernelFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def pivoted_cholesky(kernel: KernelFn, diag: torch.Tensor, candidates: torch.Tensor, max_points: int,
                     rel_tol: float = DEFAULT_REL_TOL, keep_first: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy maximum-residual-variance selection among ``candidates`` (C, D).

    ``kernel(x1, x2)`` gives the cross-covariance and ``diag`` (C,) the prior variances of the candidates.
    Returns (indices (m,) in pick order, R (m, C)) where R^T R is the rank-m Nystrom approximation of K_CC.
    Only m kernel columns are evaluated (O(C m) memory), so large first batches are fine. Ties go to the
    lower index, so listing the current Z first keeps it where the new points add nothing.
    ``keep_first``: the first candidates (the current Z) are picked first, in order, before the greedy search
    (except one whose residual variance has fallen below the threshold: it is redundant and dropped).
    """
    c = candidates.shape[0]
    max_points = min(int(max_points), c)
    with torch.no_grad():
        d = diag.detach().clone().to(candidates.dtype)
        rows = torch.zeros(max_points, c, dtype=candidates.dtype, device=candidates.device)
        if c == 0 or max_points == 0:
            return torch.zeros(0, dtype=torch.long, device=candidates.device), rows
        threshold = float(rel_tol) * float(d.max())
        picked = torch.zeros(c, dtype=torch.bool, device=candidates.device)
        order: list[int] = []
        forced = list(range(min(int(keep_first), c, max_points)))
        block = _forced_block(kernel, candidates, len(forced), threshold)
        if block is not None:
            # All forced points stay: their rows are one triangular solve, not one loop step each.
            m = len(forced)
            rows[:m] = block
            d = d - (block * block).sum(0)
            picked[:m] = True
            order, forced = forced, []
        if not forced and c <= LAPACK_MAX_CANDIDATES:
            m = len(order)
            rest = torch.arange(m, c, device=candidates.device)
            residual = kernel(candidates[rest], candidates[rest])
            if m:
                residual = residual - rows[:m, rest].T @ rows[:m, rest]
            residual.diagonal().copy_(d[rest])
            piv, factor = _lapack_greedy(residual, threshold, max_points - m, float(diag.max()))
            rows[m:m + len(piv), rest] = factor.to(rows.device).T
            order = order + rest[piv.to(rest.device)].tolist()
            return torch.as_tensor(order, dtype=torch.long, device=candidates.device), rows[:len(order)]
        for _ in range(c):
            m = len(order)
            if m >= max_points:
                break
            if forced:
                p = forced.pop(0)
                if not float(d[p]) > threshold:
                    continue
            else:
                p = int(torch.argmax(torch.where(picked, torch.full_like(d, -math.inf), d)))
                if not float(d[p]) > threshold:
                    break
            dp = float(d[p])
            column = kernel(candidates, candidates[p:p + 1])[:, 0]
            r = (column - rows[:m].T @ rows[:m, p]) / math.sqrt(dp)
            rows[m] = r
            d = d - r * r
            picked[p] = True
            order.append(p)
        return torch.as_tensor(order, dtype=torch.long, device=candidates.device), rows[:len(order)]


def _lapack_greedy(gram: torch.Tensor, threshold: float, most: int, scale: float
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """The greedy loop on a (C, C) Gram matrix, by LAPACK: (positions picked (r,) in order, the factor's
    columns (C, r): gram ~ F F^T exactly on the picked rows and columns), at most ``most``, stopping when the
    largest residual variance is not above ``threshold``."""
    from scipy.linalg import lapack

    n = gram.shape[0]
    a = gram.detach().to("cpu", torch.float64).numpy().copy(order="F")
    a[np.diag_indices(n)] += np.arange(n, 0, -1) * (TIE_BREAK * scale)
    if most <= 0 or n == 0 or not float(a.diagonal().max()) > threshold:  # ?pstrf takes its first pivot if > 0
        return torch.zeros(0, dtype=torch.long), torch.zeros(n, 0, dtype=torch.float64)
    factor, piv, rank, info = lapack.dpstrf(a, lower=1, tol=threshold)
    if info < 0:
        raise ValueError(f"pivoted_cholesky: LAPACK dpstrf refused argument {-info}")
    r = min(int(rank), int(most))
    piv = piv[:n] - 1  # 1-based
    columns = np.zeros((n, r))
    columns[piv] = np.tril(factor[:, :r])  # rows back in candidate order (the strict upper part is stale input)
    return torch.as_tensor(piv[:r].copy(), dtype=torch.long), torch.as_tensor(columns, dtype=gram.dtype)


def _forced_block(kernel: KernelFn, candidates: torch.Tensor, k: int, threshold: float) -> torch.Tensor | None:
    """The first k rows of R (k, C) when the greedy loop would keep all k forced candidates: L^{-1} K_FC with
    L = chol(K_FF), since the loop's step m is the m-th column of that Cholesky factor and its residual variance
    is L_mm^2. None when k is 0 or some L_mm^2 is not clearly above the threshold (within round-off of it, or
    below: the loop then decides which forced points to drop)."""
    if k == 0:
        return None
    forced = candidates[:k]
    L, info = torch.linalg.cholesky_ex(kernel(forced, forced))
    if int(info) != 0:
        return None
    pivots = torch.diagonal(L) ** 2
    if not bool((pivots > threshold * (1.0 + 1e-6)).all()):
        return None
    # L^{-1} K_FF = L^T: only the other candidates' columns need the solve
    return torch.cat([L.T, torch.linalg.solve_triangular(L, kernel(forced, candidates[k:]), upper=False)], 1)


def grid_points(bounds, num_points: int, dtype=torch.float64, device=None) -> torch.Tensor:
    """A regular 2-D grid of at most ``num_points`` points over [xmin, ymin, xmax, ymax], edges included.

    The grid's aspect follows the box: nx/ny ~ width/height, nx*ny <= num_points.
    """
    xmin, ymin, xmax, ymax = (float(v) for v in bounds)
    if not (xmax > xmin and ymax > ymin):
        raise ValueError(f"inducing_bounds must be [xmin, ymin, xmax, ymax] with xmin < xmax and ymin < ymax, "
                         f"got {list(bounds)}")
    if num_points < 1:
        raise ValueError(f"a grid needs at least one point, got {num_points}")
    w, h = xmax - xmin, ymax - ymin
    nx = max(1, min(num_points, int(round(math.sqrt(num_points * w / h)))))
    ny = max(1, num_points // nx)
    xs = torch.linspace(xmin, xmax, nx, dtype=dtype, device=device) if nx > 1 else \
        torch.tensor([(xmin + xmax) / 2], dtype=dtype, device=device)
    ys = torch.linspace(ymin, ymax, ny, dtype=dtype, device=device) if ny > 1 else \
        torch.tensor([(ymin + ymax) / 2], dtype=dtype, device=device)
    gx, gy = torch.meshgrid(xs, ys, indexing="ij")
    return torch.stack([gx.reshape(-1), gy.reshape(-1)], dim=1)


def projection_matrix(chol_old: torch.Tensor, cross: torch.Tensor) -> torch.Tensor:
    """A_p = K_old^{-1} K_{old,new} (M_old, M_new) from the Cholesky factor of K_old and the cross-covariance.

    Nystrom: k(Z_new, x) ~ A_p^T k(Z_old, x), exact when k(Z_new, x) lies in the span of the old columns.
    """
    if chol_old.shape[0] == 0:
        return cross.new_zeros(0, cross.shape[1])
    return torch.cholesky_solve(cross, chol_old)


def project_duals(a: torch.Tensor, B: torch.Tensor, A: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Move dual parameters a (M_old, P), B (P, M_old, M_old) to new inducing inputs: (A^T a, A^T B A)."""
    a_new = A.T @ a
    B_new = A.T @ B @ A
    return a_new, 0.5 * (B_new + B_new.transpose(-1, -2))
