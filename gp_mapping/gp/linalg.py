"""Linear algebra the engines share: the jittered Cholesky factorisation, symmetrisation, triangular solves and
inverses, and autograd functions that reuse a factor or a solve already computed without a graph.

PyTorch only; nothing here knows of kernels, likelihoods or engines.
"""
from __future__ import annotations

import torch

from .errors import GPNumericalError

# The largest diagonal jitter, relative to the mean of the matrix diagonal, tried before giving up.
MAX_RELATIVE_JITTER = 1e-1
# A factor whose smallest squared pivot is below this (relative to the mean diagonal) is rounding noise of
# a singular matrix (LAPACK accepts any positive pivot): treated as a failure, so the jitter escalates.
MIN_RELATIVE_PIVOT = 1e-13


def symmetrise(a: torch.Tensor) -> torch.Tensor:
    """(A + A^T) / 2 over the last two dimensions (removes the round-off asymmetry of products).

    A and A^T never share a layout, and an elementwise pass over two layouts is several times slower than one
    over a single layout (8x at 256 x 256, 16x at 512 x 512, one thread): so A^T is copied into A's layout
    first (one blocked transposing copy), then added in place."""
    at = a.transpose(-1, -2)
    if at.is_contiguous() and not a.is_contiguous():  # column-major A (LAPACK's results): A^T is row-major
        return a.clone(memory_format=torch.contiguous_format).add_(at).mul_(0.5)
    return at.clone(memory_format=torch.contiguous_format).add_(a).mul_(0.5)


def jittered_cholesky(matrix: torch.Tensor, jitter: float, max_jitter: float | None = None
                      ) -> tuple[torch.Tensor, float]:
    """Lower Cholesky factor of ``matrix + jitter I`` and the jitter that was needed.

    Starts at ``jitter`` and multiplies it by 10 until the factorisation succeeds, up to ``max_jitter``
    (default MAX_RELATIVE_JITTER times the mean diagonal). Works on a batch (..., M, M) with one shared
    jitter. Raises GPNumericalError if even the largest jitter fails or the matrix is not finite.
    """
    m = matrix.shape[-1]
    if m == 0:
        return matrix.clone(), float(jitter)
    # A finite sum means finite entries (a NaN or an Inf entry makes it NaN or infinite): one reduction instead
    # of the four elementwise passes of isfinite, which cost as much as the factorisation at M = 256; the
    # entrywise test only confirms a sum that overflowed.
    if not bool(torch.isfinite(matrix.detach().sum())) and not bool(torch.isfinite(matrix).all()):
        raise GPNumericalError("cannot factorise a matrix with NaN or Inf entries")
    scale = float(matrix.diagonal(dim1=-2, dim2=-1).abs().mean().detach().clamp_min(1e-300))
    cap = MAX_RELATIVE_JITTER * scale if max_jitter is None else float(max_jitter)
    floor = MIN_RELATIVE_PIVOT * scale

    def attempt(a: torch.Tensor) -> torch.Tensor | None:
        factor, info = torch.linalg.cholesky_ex(a)
        if bool((info != 0).any()):
            return None
        pivots = factor.diagonal(dim1=-2, dim2=-1).detach()
        return factor if bool(((pivots * pivots) > floor).all()) else None

    current = float(jitter)
    if current <= 0.0:
        # Try the matrix as it is first, then escalate from a tiny relative jitter.
        factor = attempt(matrix)
        if factor is not None:
            return factor, 0.0
        current = 1e-12 * scale
    while True:
        jittered = matrix.clone()  # matrix + current I, the diagonal added in place (no dense identity)
        jittered.diagonal(dim1=-2, dim2=-1).add_(current)
        factor = attempt(jittered)
        if factor is not None:
            return factor, current
        if current >= cap:
            raise GPNumericalError(f"Cholesky factorisation failed even with jitter {current:.3g} "
                                   f"(matrix size {m}, mean diagonal {scale:.3g})")
        current = min(current * 10.0, cap)


def tril_solve(L: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
    """L^-1 B for a lower triangular L."""
    return torch.linalg.solve_triangular(L, B, upper=False)


def tri_inv(L: torch.Tensor) -> torch.Tensor:
    """L^-1 of a lower triangular L (..., M, M)."""
    eye = torch.eye(L.shape[-1], dtype=L.dtype, device=L.device)
    return torch.linalg.solve_triangular(L, eye.expand_as(L), upper=False)


def chol_inverse_factor(precision: torch.Tensor) -> torch.Tensor:
    """Lower L with L L^T = precision^-1, from the Cholesky factor of the flipped precision (no explicit
    inverse is ever factorised)."""
    flipped = torch.flip(precision, (0, 1))
    U, _ = jittered_cholesky(symmetrise(flipped), 0.0)
    eye = torch.eye(U.shape[0], dtype=U.dtype, device=U.device)
    return torch.flip(torch.linalg.solve_triangular(U, eye, upper=False).T, (0, 1))


class KnownCholesky(torch.autograd.Function):
    """L = chol(K) where L is already known (computed earlier, without a graph, from the same K): the forward
    returns it instead of factorising again; the backward is the Cholesky's, K_bar = sym(L^-T Phi(L^T L_bar) L^-1)
    with Phi the lower triangle, its diagonal halved."""

    @staticmethod
    def forward(ctx, K: torch.Tensor, L: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(L)
        return L

    @staticmethod
    def backward(ctx, L_bar: torch.Tensor):
        (L,) = ctx.saved_tensors
        phi = (L.mT @ L_bar).tril()
        phi.diagonal().mul_(0.5)
        K_bar = torch.linalg.solve_triangular(L.mT, torch.linalg.solve_triangular(L.mT, phi.mT, upper=True).mT,
                                              upper=True)  # L^-T phi L^-1
        return symmetrise(K_bar), None


class KnownSolve(torch.autograd.Function):
    """X = L^-1 B (L lower) where X is already known: the forward returns it instead of solving again; the
    backward is the triangular solve's, B_bar = L^-T X_bar and L_bar = -tril(B_bar X^T)."""

    @staticmethod
    def forward(ctx, L: torch.Tensor, B: torch.Tensor, X: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(L, X)
        return X

    @staticmethod
    def backward(ctx, X_bar: torch.Tensor):
        L, X = ctx.saved_tensors
        B_bar = torch.linalg.solve_triangular(L.mT, X_bar, upper=True)
        return -(B_bar @ X.mT).tril(), B_bar, None


__all__ = ["KnownCholesky", "KnownSolve", "MAX_RELATIVE_JITTER", "MIN_RELATIVE_PIVOT", "chol_inverse_factor",
           "jittered_cholesky", "symmetrise", "tri_inv", "tril_solve"]
