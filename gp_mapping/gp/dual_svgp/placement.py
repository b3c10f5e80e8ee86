"""Where the dual SVGP's inducing inputs go and how the old part follows them (:mod:`.model`): the transport of
the old part to a new prior (a new Z or new hyperparameters), growth and exchanges of Z, the cover check.

Inducing inputs: a fixed grid, or pivoted Cholesky over [Z; X_batch] in every full update (the current Z
kept first, then the greedy search over the batch), stopping at num_inducing points or when no candidate's
residual prior variance exceeds 1e-4 of the largest, so the number of inducing points starts small (a few
for a first batch along a short stretch of path) and grows up to num_inducing as the robot explores; no
point ever duplicates another.
When Z is full, re-selection only exchanges points: the batch point with the largest residual variance
replaces the most redundant inducing point (smallest variance given the others) while that increases the
smallest residual variance: Z changes only where the batch is poorly covered, because every change
projects the old part with A_p = K_old^{-1} K_{old,new} (eq. 27), a Nystrom step that loses what the new
columns cannot represent (growing Z loses nothing: kept points are carried exactly). Held data need no
projection (recomputed exactly).
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from ..errors import ModelInputError
from ..inducing import pivoted_cholesky
from ..linalg import jittered_cholesky, symmetrise

#: A scheduled fast update becomes full when a batch input keeps more than this fraction of its prior variance
#: given a full Z (see DualSVGP._leaves_the_cover).
COVER_LOST = 0.5


class InducingPlacement:
    """Mixin of :class:`~.model.DualSVGP`: moves of Z and the transport of the old part."""

    # ------------------------------------------------------------------ inducing inputs and the old part
    def _transport_old_part(self, L_old: torch.Tensor, cross: torch.Tensor, L_new: torch.Tensor) -> None:
        """Carry the old part to a new prior: a <- A_p^T a, B <- A_p^T B A_p with A_p = K_old^{-1} cross,
        cross = Cov(u_old, u_new); whitened, G = L_old^{-1} cross L_new^{-T}."""
        m_new = L_new.shape[0]
        if self.a_w_old.shape[0] == 0:
            self.a_w_old = self.a_w_old.new_zeros(m_new, self.output_dims)
            self.b_w_old = self.b_w_old.new_zeros(m_new, self.output_dims)
            self.b_w_session = self.b_w_session.new_zeros(m_new, self.output_dims)
            self.W_old = self.W_old.new_zeros(self.output_dims, m_new, m_new)
            return
        G = torch.linalg.solve_triangular(L_new, torch.linalg.solve_triangular(L_old, cross, upper=False).T,
                                          upper=False).T
        self.a_w_old = G.T @ self.a_w_old
        self.b_w_old = G.T @ self.b_w_old
        self.b_w_session = G.T @ self.b_w_session
        self.W_old = symmetrise(G.T @ self.W_old @ G)

    def _cross(self, z_old: torch.Tensor, z_new: torch.Tensor) -> torch.Tensor:
        # Identical points keep their dual exactly: the jitter belongs to the covariance of u with itself.
        same = (z_old[:, None, :] == z_new[None, :, :]).all(-1)
        return self.kernel(z_old, z_new) + self.jitter * same.to(z_old.dtype)

    def _move_inducing(self, z_new: torch.Tensor) -> torch.Tensor:
        """Set Z, projecting the old part; returns the new chol(K). Held data are the caller's."""
        z_old, m_old = self.Z, self.num_inducing
        L_old = self._chol_K() if m_old else None
        jitter = float(self.config.jitter)
        appended = m_old > 0 and self.jitter == jitter and self._extends_z(z_new)
        self.Z = z_new.clone()
        self.jitter_t.fill_(jitter)
        L_new = self._chol_K()
        if appended and self.jitter == jitter:  # (again: the new factor may have escalated the jitter)
            # Z grew with every old point kept first and in order (the common growth step), under the same jitter:
            # chol(K_new)'s leading block is chol(K_old), so the old whitened coordinates are the first new ones and
            # the transport G = L_old^{-1} Cov(u_old, u_new) L_new^{-T} is exactly [I 0]: zero rows and columns
            # (O(M^2) instead of the transport's ~3 M^3).
            k = z_new.shape[0] - m_old
            p = self.output_dims
            self.a_w_old = torch.cat([self.a_w_old, self.a_w_old.new_zeros(k, p)])
            self.b_w_old = torch.cat([self.b_w_old, self.b_w_old.new_zeros(k, p)])
            self.b_w_session = torch.cat([self.b_w_session, self.b_w_session.new_zeros(k, p)])
            W_old = self.W_old.new_zeros(p, m_old + k, m_old + k)
            W_old[:, :m_old, :m_old] = self.W_old
            self.W_old = W_old
        else:
            cross = self._cross(z_old, z_new)
            self._transport_old_part(L_new[:0, :0] if L_old is None else L_old, cross, L_new)
        return L_new

    def _extends_z(self, z_new: torch.Tensor) -> bool:
        """Whether z_new is the current Z followed by new points."""
        m = self.num_inducing
        return z_new.shape[0] > m and bool(torch.equal(z_new[:m], self.Z))

    def set_inducing_points(self, z, fixed: bool = True) -> None:
        """Use these inducing inputs (old part projected onto them); ``fixed`` stops re-selection."""
        zt = self._check_x(z, "z")
        if zt.shape[0] == 0:
            raise ModelInputError("z must hold at least one inducing point")
        with torch.no_grad():
            L = self._move_inducing(zt)
            self.z_fixed.fill_(bool(fixed))
            self._recompute_totals(L)
        self._refresh_cache()

    @contextlib.contextmanager
    def hyperparameter_change(self) -> Iterator[None]:
        """Change kernel or likelihood parameters inside this block; on exit the old part is transported to
        the new prior (its pseudo-likelihood on u = f(Z) kept) and held contributions are recomputed."""
        with torch.no_grad():
            L_old = self._chol_K() if self.num_inducing else None
        yield
        with torch.no_grad():
            if L_old is not None:
                L_new = self._chol_K()
                self._transport_old_part(L_old, L_new @ L_new.T, L_new)
                self._recompute_totals(L_new)
        self._refresh_cache()

    def _grow_inducing(self, bx: torch.Tensor) -> torch.Tensor | None:
        """Add batch points to Z by pivoted Cholesky over [Z; batch] (Z kept first) while below num_inducing;
        returns the new chol(K), or None if nothing was added. Growing loses nothing: kept points carry their
        part of the old duals exactly. Held data are the caller's."""
        m_max, m_old = self.config.num_inducing, self.num_inducing
        cand = torch.cat([self.Z, bx])
        idx, _ = pivoted_cholesky(self.kernel, self.kernel.diag(cand), cand, m_max, self.inducing_rel_tol,
                                  keep_first=m_old)
        if idx.numel() == m_old and bool((idx < m_old).all()):
            return None
        return self._move_inducing(cand[idx])

    def _reselect_inducing(self, bx: torch.Tensor) -> bool:
        """Grow Z by pivoted Cholesky over [Z; batch] while below num_inducing; once full, exchange points
        (see the module docstring). Returns whether Z changed."""
        if self.num_inducing < self.config.num_inducing:
            return self._grow_inducing(bx) is not None
        z = self.Z.clone()
        L = self._chol_K()
        Kinv = torch.cholesky_inverse(L)
        changed = False
        for _ in range(bx.shape[0]):
            # Residual variance of each batch point given Z, and of each z_j given the other inducing points.
            V = torch.linalg.solve_triangular(L, self.kernel(z, bx), upper=False)
            resid = self.kernel.diag(bx) - (V * V).sum(0)
            loo = 1.0 / torch.diagonal(Kinv)
            i, j = int(torch.argmax(resid)), int(torch.argmin(loo))
            if not float(resid[i]) > float(loo[j]) * (1.0 + 1e-9):
                break
            z[j] = bx[i]
            L, _ = jittered_cholesky(self.kernel(z, z), self.jitter)
            Kinv = torch.cholesky_inverse(L)
            changed = True
        if changed:
            self._move_inducing(z)
        return changed

    # ------------------------------------------------------------------ the cover check (update's schedule)
    def _cover_features(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(L, V = L^{-1} K_Zx) for the cover check, or None where the check does not apply: Z that can still
        grow, or a fixed Z, never promotes (growth is done in fast mode)."""
        if bool(self.z_fixed) or self.num_inducing < self.config.num_inducing or x.shape[0] == 0:
            return None
        with torch.no_grad():
            L = self._chol_K()
            return L, self._features(L, x)

    def _leaves_the_cover(self, x: torch.Tensor, V: torch.Tensor) -> bool:
        """Whether a batch reaches where a full Z no longer covers it: some input keeps more than COVER_LOST of
        its prior variance given Z (V = L^{-1} K_Zx from _cover_features). A fast update would count that variance
        as the readings' noise (sites.residual_weighted_sites) and so learn little from them; the scheduler
        promotes the update to a full one, which exchanges inducing points and re-learns."""
        with torch.no_grad():
            kxx = self.kernel.diag(x)
            lost = (kxx - (V * V).sum(0)) / kxx
            return bool(lost.max() > COVER_LOST)


__all__ = ["COVER_LOST", "InducingPlacement"]
