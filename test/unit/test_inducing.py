"""Pivoted Cholesky against an independent brute-force greedy selection; the grid; the projection of duals."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from gp_mapping.gp.inducing import grid_points, pivoted_cholesky, project_duals, projection_matrix
from gp_mapping.gp.kernels import Matern52Kernel, RBFKernel, SumKernel, ConstantKernel


def _brute_force_greedy(K: np.ndarray, m: int, rel_tol: float, start: list[int] | None = None) -> list[int]:
    """Pick the candidate with the largest conditional variance given the picked ones (``start`` first) until m
    are picked, by solving the conditional-variance formula from scratch each time (no Cholesky updates)."""
    chosen: list[int] = list(start or [])
    threshold = rel_tol * K.diagonal().max()
    for _ in range(m - len(chosen)):
        best, best_var = None, -np.inf
        for c in range(len(K)):
            if c in chosen:
                continue
            if chosen:
                kc = K[np.ix_(chosen, [c])]
                var = K[c, c] - (kc.T @ np.linalg.solve(K[np.ix_(chosen, chosen)], kc)).item()
            else:
                var = K[c, c]
            if var > best_var:
                best, best_var = c, var
        if best_var <= threshold:
            break
        chosen.append(best)
    return chosen


def test_pivoted_cholesky_equals_brute_force_greedy_selection():
    rng = np.random.default_rng(0)
    x = torch.tensor(rng.uniform(0, 5, (60, 2)))
    k = SumKernel(Matern52Kernel(2, lengthscale=0.8), ConstantKernel(2, variance=0.5))
    with torch.no_grad():
        idx, R = pivoted_cholesky(k, k.diag(x), x, 15, rel_tol=1e-8)
        K = k(x, x).numpy()
    assert idx.tolist() == _brute_force_greedy(K, 15, 1e-8)
    # R^T R is the Nystrom approximation through the picked points: exact on their rows and columns.
    approx = (R.T @ R).numpy()
    sel = idx.numpy()
    np.testing.assert_allclose(approx[np.ix_(sel, sel)], K[np.ix_(sel, sel)], atol=1e-10)
    np.testing.assert_allclose(approx[:, sel], K[:, sel], atol=1e-10)


def test_pivoted_cholesky_never_picks_duplicates_and_stops_at_the_threshold():
    base = torch.tensor([[0.0, 0.0], [1.0, 0.0], [0.0, 1.0]], dtype=torch.float64)
    x = torch.cat([base.repeat(5, 1), base + 1e-9])  # 3 distinct places, repeated and jittered
    k = RBFKernel(2, lengthscale=0.5)
    with torch.no_grad():
        idx, _ = pivoted_cholesky(k, k.diag(x), x, 10, rel_tol=1e-6)
    assert len(idx) == 3
    assert len({tuple(np.round(x[i].numpy(), 6)) for i in idx.tolist()}) == 3
    exact_repeats = base.repeat(5, 1)
    with torch.no_grad():
        idx, _ = pivoted_cholesky(k, k.diag(exact_repeats), exact_repeats, 10, rel_tol=1e-6)
    assert sorted(idx.tolist()) == [0, 1, 2]  # exact ties go to the first listed (the current Z in the model)
    with torch.no_grad():  # the current Z kept, a batch of its repeats: nothing is added
        idx, _ = pivoted_cholesky(k, k.diag(exact_repeats), exact_repeats, 10, rel_tol=1e-6, keep_first=3)
    assert idx.tolist() == [0, 1, 2]


def test_pivoted_cholesky_handles_empty_and_small_inputs():
    k = RBFKernel(2)
    empty = torch.zeros(0, 2, dtype=torch.float64)
    idx, R = pivoted_cholesky(k, k.diag(empty), empty, 5)
    assert idx.numel() == 0 and R.shape == (0, 0)
    one = torch.ones(1, 2, dtype=torch.float64)
    with torch.no_grad():
        idx, _ = pivoted_cholesky(k, k.diag(one), one, 5)
    assert idx.tolist() == [0]


def test_grid_points_cover_the_box_with_its_aspect():
    z = grid_points([-2.0, -4.0, 5.0, 2.0], 100).numpy()
    assert len(z) <= 100 and len(z) >= 90
    assert z[:, 0].min() == -2.0 and z[:, 0].max() == 5.0 and z[:, 1].min() == -4.0 and z[:, 1].max() == 2.0
    nx, ny = len(np.unique(z[:, 0])), len(np.unique(z[:, 1]))
    assert nx * ny == len(z) and nx >= ny  # wider than tall
    assert len(grid_points([0, 0, 1, 1], 1)) == 1
    with pytest.raises(ValueError, match="xmin < xmax"):
        grid_points([1.0, 0.0, 0.0, 1.0], 10)


def test_projection_is_exact_when_new_columns_lie_in_the_span_of_the_old():
    rng = np.random.default_rng(1)
    k = Matern52Kernel(2, lengthscale=1.0)
    z_old = torch.tensor(rng.uniform(0, 3, (20, 2)))
    z_new = torch.tensor(rng.uniform(0, 3, (14, 2)))
    x = z_old[:9]  # data at old inducing inputs: k(Z_new, x) = K_new,old K_old^-1 k(Z_old, x) exactly
    beta_y = torch.tensor(rng.standard_normal((9, 2)))
    beta = torch.tensor(rng.uniform(0.5, 3.0, (9, 2)))
    with torch.no_grad():
        def duals(z):
            kzx = k(z, x)
            return kzx @ beta_y, torch.einsum("mn,np,kn->pmk", kzx, beta, kzx)

        a_old, B_old = duals(z_old)
        A = projection_matrix(torch.linalg.cholesky(k(z_old, z_old)), k(z_old, z_new))
        a_proj, B_proj = project_duals(a_old, B_old, A)
        a_new, B_new = duals(z_new)
    np.testing.assert_allclose(a_proj.numpy(), a_new.numpy(), rtol=1e-7, atol=1e-9)
    np.testing.assert_allclose(B_proj.numpy(), B_new.numpy(), rtol=1e-7, atol=1e-9)
    # Data away from the old inputs: the projection is only a Nystrom approximation.
    x_far = torch.tensor(rng.uniform(3.5, 4.0, (5, 2)))
    with torch.no_grad():
        exact = k(z_new, x_far)
        approx = A.T @ k(z_old, x_far)
    assert float((exact - approx).abs().max()) > 1e-3


def test_keep_first_keeps_current_points_and_drops_only_redundant_ones():
    rng = np.random.default_rng(2)
    k = Matern52Kernel(2, lengthscale=0.6)
    z = torch.tensor(rng.uniform(0, 3, (6, 2)))
    z = torch.cat([z, z[2:3] + 1e-9])  # the last current point is redundant
    batch = torch.tensor(rng.uniform(0, 6, (30, 2)))
    cand = torch.cat([z, batch])
    with torch.no_grad():
        idx, _ = pivoted_cholesky(k, k.diag(cand), cand, 12, rel_tol=1e-6, keep_first=7)
    assert idx[:6].tolist() == list(range(6)) and 6 not in idx.tolist()
    assert len(idx) == 12 and bool((idx[6:] >= 7).all())


def test_keep_first_of_well_separated_points_equals_greedy_search_after_them():
    # The forced block is factorised at once (not one loop step per current point): same picks as a greedy
    # search that starts from the current points, and R still the exact Nystrom factor through the picks.
    rng = np.random.default_rng(5)
    k = SumKernel(Matern52Kernel(2, lengthscale=0.7), ConstantKernel(2, variance=0.5))
    cand = torch.tensor(rng.uniform(0, 6, (80, 2)))
    with torch.no_grad():
        idx, R = pivoted_cholesky(k, k.diag(cand), cand, 30, rel_tol=1e-8, keep_first=20)
        K = k(cand, cand).numpy()
    assert idx.tolist() == _brute_force_greedy(K, 30, 1e-8, start=list(range(20)))
    approx = (R.T @ R).numpy()
    np.testing.assert_allclose(approx[:, idx.numpy()], K[:, idx.numpy()], atol=1e-10)
    # more current points than max_points: the first max_points are kept, nothing else
    with torch.no_grad():
        idx, R = pivoted_cholesky(k, k.diag(cand), cand, 10, rel_tol=1e-8, keep_first=20)
    assert idx.tolist() == list(range(10)) and R.shape == (10, 80)


@pytest.mark.parametrize("keep_first", [0, 10])
def test_lapack_search_picks_what_the_loop_picks_ties_included(monkeypatch, keep_first):
    """Up to LAPACK_MAX_CANDIDATES the greedy search runs in LAPACK's pivoted Cholesky; it must pick what the
    loop picks, in the same order, with the same Nystrom factor, also where exact ties decide: points twenty
    lengthscales apart all keep their full prior variance, and the lower index (the current Z) must win."""
    import gp_mapping.gp.inducing as inducing

    rng = np.random.default_rng(7)
    k = SumKernel(Matern52Kernel(2, lengthscale=0.4), ConstantKernel(2, variance=0.3))
    far = torch.tensor([[20.0 * i, 20.0 * j] for i in range(4) for j in range(4)], dtype=torch.float64)
    cand = torch.cat([far[:8], torch.tensor(rng.uniform(0, 6, (90, 2))), far[8:], far[:5] + 1e-10])
    results = {}
    for limit in (inducing.LAPACK_MAX_CANDIDATES, 0):
        monkeypatch.setattr(inducing, "LAPACK_MAX_CANDIDATES", limit)
        with torch.no_grad():
            results[limit] = pivoted_cholesky(k, k.diag(cand), cand, 60, rel_tol=1e-6, keep_first=keep_first)
    (idx_lapack, R_lapack), (idx_loop, R_loop) = results.values()
    assert idx_lapack.tolist() == idx_loop.tolist()
    assert len(idx_loop) == 60 and not set(idx_loop.tolist()) & set(range(114, 119))  # no near-duplicate
    assert set(range(keep_first)) <= set(idx_loop.tolist())
    np.testing.assert_allclose(R_lapack.numpy(), R_loop.numpy(), atol=1e-9)
    # the far points tie exactly with each other; the lower index goes first in both
    far_order = [i for i in idx_loop.tolist() if i < 8 or i >= 98]
    assert far_order == sorted(far_order)


def test_lapack_search_breaks_exact_ties_by_index_as_the_loop():
    """Five points on a line, one lengthscale apart: after the ends and the middle are picked, the two left are
    mirror images with exactly equal residual variance. LAPACK alone would take the one its row swaps moved
    forward (index 3); the loop, and so the LAPACK search with its tie-break, takes the lower index (1)."""
    k = Matern52Kernel(2, lengthscale=1.0)
    cand = torch.tensor([[-2.0, 0.0], [-1.0, 0.0], [0.0, 0.0], [1.0, 0.0], [2.0, 0.0]], dtype=torch.float64)
    with torch.no_grad():
        idx, R = pivoted_cholesky(k, k.diag(cand), cand, 5, rel_tol=1e-8)
        K = k(cand, cand).numpy()
    assert idx.tolist() == [0, 4, 2, 1, 3] == _brute_force_greedy(K, 5, 1e-8)
    np.testing.assert_allclose((R.T @ R).numpy(), K, atol=1e-12)
