"""VAR-GP's region blocks (:mod:`.model`): where inducing points go, when a block opens, distillation of the
oldest blocks, and revisits of frozen blocks.

Blocks (the rule that opens one). For each batch, at the q(theta) mean, the residual prior variance of every batch
input given all blocks' inducing inputs is measured, relative to its prior variance. While the current block has
room, batch points are added to it by pivoted Cholesky on that residual (greedy largest residual, none below
1e-4 of the prior variance: ``inducing.DEFAULT_REL_TOL``); its q is extended by the prior conditional of the new
points (exact at the mean theta, so the map does not move). If after that some batch input still keeps more than
vargp_new_block of its prior variance, the region is not covered: the current block is frozen and a new block is
opened there with points placed the same way. A robot that returns to a mapped region opens nothing. Its
readings teach theta; the frozen blocks stay exactly as they were (``vargp_revisits: freeze``, the paper's). With
``refine`` (Gaussian likelihood) the readings where the current block has almost no say (below REVISIT_SAY of the
prior variance) also refine the frozen blocks there by streaming Bayes: q_new(v_j) is proportional to q_old(v_j)
times the readings' likelihood, the other blocks at their means, in the whitened coordinates at the mean theta,
one block after the other. That only adds information (no block's variance grows).

Bounded cost. (a) ``vargp_neighbours`` > 0: a block is conditioned only on the K blocks nearest to it (closest
inducing inputs) instead of all earlier ones: A_j and C_j use those K blocks (a block-Vecchia prior; 0 = all, the
paper's full conditioning), so the factors of a block cost O(K^3 vargp_block_size^3) instead of growing with its
age. A block that overlaps more than K earlier blocks then counts some of their information twice (measured in
the bench: K must cover the overlapping blocks). (b) Distillation: when the blocks hold more than num_inducing
points in all, the two oldest blocks are compressed into one: their joint q at the mean theta, pivoted Cholesky
(prior kernel) keeps as many of their inputs as bring the total back to num_inducing (the most redundant are
dropped), and the new block's q is the exact marginal of the joint at those inputs (later blocks conditioned on
either now condition on it; a block conditioned on either is re-expressed on the new one, its marginal mean kept
exactly). The blocks hold at most num_inducing + vargp_block_size points (the current block grows past the cap
until the next block opens), so memory and the cost of an update or a prediction stay bounded (O(M^2) per batch
input, O(M^3) per theta draw); the oldest regions lose resolution first.
"""
from __future__ import annotations

import torch

from ..inducing import DEFAULT_REL_TOL, pivoted_cholesky
from ..linalg import jittered_cholesky, symmetrise, tri_inv
from .factors import Factors, ar_joint

#: A reading refines the frozen blocks (vargp_revisits: refine) where the current block explains less than this
#: fraction of the prior variance.
REVISIT_SAY = 0.01


class RegionBlocks:
    """Mixin of :class:`~.model.VARGP`: the blocks' inducing inputs, their growth, distillation and revisits."""

    # ------------------------------------------------------------------ blocks
    def _nearest_blocks(self, z: torch.Tensor, candidates: list[int]) -> list[int]:
        """The vargp_neighbours blocks among ``candidates`` whose inducing inputs come closest to z (all if 0)."""
        k = int(self.config.vargp_neighbours)
        if k == 0 or len(candidates) <= k or z.shape[0] == 0:
            return list(candidates)
        dist = torch.stack([torch.cdist(z, self.Z[j, :int(self.counts[j])]).min() for j in candidates])
        keep = torch.topk(-dist, k).indices.tolist()
        return sorted(candidates[i] for i in keep)

    def _append_block(self) -> None:
        mb, d, p = self.Z.shape[1], self.input_dims, self.output_dims
        nb = self.num_blocks
        self.Z = torch.cat([self.Z, self.Z.new_zeros(1, mb, d)])
        self.m = torch.cat([self.m, self.m.new_zeros(1, mb, p)])
        eye = torch.eye(mb, dtype=torch.float64, device=self.device).expand(1, p, mb, mb)
        self.S_chol = torch.cat([self.S_chol, eye.clone()])
        self.counts = torch.cat([self.counts, self.counts.new_zeros(1)])
        mask = torch.zeros(nb + 1, nb + 1, dtype=torch.bool, device=self.device)
        mask[:nb, :nb] = self.parent_mask
        self.parent_mask = mask
        self.blocks_opened_t += 1

    def _grow_current(self, z_new: torch.Tensor) -> None:
        """Add inputs to the current (last) block; its q is extended by the prior conditional of the new points
        given the block's old points (and its parents) at the q(theta) mean: rows [B L, chol(C_new|old)] of the
        new factor, B = C_no C_oo^{-1}, m_new = B m_old. The parents are re-chosen for the grown block."""
        t = self.num_blocks - 1
        c = int(self.counts[t])
        z = torch.cat([self.Z[t, :c], z_new])
        self.parent_mask[t, :] = False
        for j in self._nearest_blocks(z, list(range(t))):
            self.parent_mask[t, j] = True
        blocks = [j for j in range(t) if bool(self.parent_mask[t, j])] + [t]
        fac = self._factors(self.q_mu.detach(), blocks, extra=(t, z))
        LC = fac.LC[-1]                                           # chol of C over [old; new]
        L_old = self.S_chol[t, :, :c, :c]
        # With C = LC LC^T, B = C_no C_oo^{-1} = LC_no LC_oo^{-1} and C_nn|o = LC_nn LC_nn^T.
        LC_oo, LC_no, LC_nn = LC[:c, :c], LC[c:, :c], LC[c:, c:]
        B = torch.linalg.solve_triangular(LC_oo, LC_no, upper=False, left=False) if c else LC_no[:, :0]
        n = z.shape[0]
        self.Z[t, :n] = z
        self.m[t, c:n] = B @ self.m[t, :c]
        self.S_chol[t, :, c:n, :c] = B @ L_old
        self.S_chol[t, :, c:n, c:n] = LC_nn
        self.counts[t] = n

    def _residual_gram(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(G (N, N), prior variances (N,)): the prior covariance of the batch given all blocks' inputs (the
        blocks' own prior: exact with full conditioning), at the q(theta) mean."""
        theta = self.q_mu.detach()
        kern, kdiag = self._kernel_at(theta)
        G = kern(x, x)
        if self.num_blocks:
            blocks = list(range(self.num_blocks))
            fac = self._factors(theta, blocks)
            A = fac.T @ kern(fac.Z, x)
            G = G - A.T @ A
        return symmetrise(G), kdiag(x)

    def _pick(self, G: torch.Tensor, prior: torch.Tensor, most: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Pivoted Cholesky on a residual Gram matrix: (picked indices, the residual Gram after them)."""
        n = G.shape[0]
        diag = torch.diagonal(G).clamp_min(0.0)
        top = float(diag.max()) if n else 0.0
        if most <= 0 or n == 0 or not top > DEFAULT_REL_TOL * float(prior.max()):
            return torch.zeros(0, dtype=torch.long, device=G.device), G
        index = torch.arange(n, dtype=torch.float64, device=G.device)[:, None]

        def gram(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return G[a[:, 0].long()][:, b[:, 0].long()]

        idx, rows = pivoted_cholesky(gram, diag, index, most, DEFAULT_REL_TOL * float(prior.max()) / top)
        return idx, symmetrise(G - rows.T @ rows)

    def _place(self, x: torch.Tensor) -> dict:
        """Grow the current block, or open a new one where the batch is not covered (module docstring); then
        distil while the blocks hold more than num_inducing points. The current block grows only in an update
        that opens no block: points added to a block that is frozen at once would never be fitted to data."""
        cfg = self.config
        mb = self.block_size
        opened, grown = 0, 0
        G, prior = self._residual_gram(x)
        grow = None
        if self.num_blocks:
            idx, G_after = self._pick(G, prior, mb - int(self.counts[-1]))
            rel = torch.diagonal(G_after).clamp_min(0.0) / prior
            if not bool((rel > cfg.vargp_new_block).any()):
                grow = idx
        if grow is not None:
            if grow.numel():
                self._grow_current(x[grow])
                grown = int(grow.numel())
        else:
            idx, _ = self._pick(G, prior, mb)
            if idx.numel():
                if self.num_blocks:  # the current block is frozen: its q(theta) anchors the next block's KL
                    self.prev_mu.copy_(self.q_mu.detach())
                    self.prev_logsd.copy_(self.q_logsd.detach())
                self._append_block()
                self._grow_current(x[idx])
                self._clear_buffer()
                opened = 1
        distilled = 0
        while self.num_inducing > cfg.num_inducing and self.num_blocks >= 3:
            self._distil_oldest()
            distilled += 1
        if opened or grown or distilled:
            self._drop_caches()
        return {"blocks_opened": opened, "points_added": grown + (int(self.counts[-1]) if opened else 0),
                "distilled": distilled}

    def _widen(self, width: int) -> None:
        """Pad the block storage to ``width`` points per block (unused entries: Z = 0, m = 0, S = I)."""
        nb, w, p = self.num_blocks, self.Z.shape[1], self.output_dims
        if width <= w:
            return
        self.Z = torch.cat([self.Z, self.Z.new_zeros(nb, width - w, self.input_dims)], 1)
        self.m = torch.cat([self.m, self.m.new_zeros(nb, width - w, p)], 1)
        S = torch.eye(width, dtype=torch.float64, device=self.device).expand(nb, p, width, width).clone()
        S[:, :, :w, :w] = self.S_chol
        self.S_chol = S

    def _dense_conditionals(self, fac: Factors) -> list[torch.Tensor]:
        """A_j over all earlier points of the set (zeros outside its parents), from the factors."""
        out = []
        for i, sl in enumerate(fac.slices):
            a = fac.Z.new_zeros(sl.stop - sl.start, sl.start)
            if fac.parents[i]:
                cols = torch.cat([torch.arange(fac.slices[k].start, fac.slices[k].stop, device=a.device)
                                  for k in fac.parents[i]])
                a[:, cols] = fac.G[i].T @ tri_inv(fac.LP[i])  # A_j = K_jP K_PP^{-1} = G^T chol(K_PP)^{-1}
            out.append(a)
        return out

    def _distil_oldest(self) -> None:
        """Compress blocks 0 and 1 into one block (module docstring, bounded cost (b)): pivoted Cholesky keeps as
        many of their points as bring the total back to num_inducing (the least redundant first), with q the
        marginal of the joint there. A later block that was conditioned on either is re-expressed on the new
        block: m_j = E[u_j] - A'_j E[u_P'] and S_j = Cov[u_j - A'_j u_P'] under the joint (all at the q(theta)
        mean), so its mean is kept exactly and its covariance stays positive."""
        theta = self.q_mu.detach()
        nb = self.num_blocks
        fac = self._factors(theta, list(range(nb)))
        c = [int(v) for v in self.counts]
        mean, cov = ar_joint([self.m[j, :c[j]] for j in range(nb)],
                             [self.S_chol[j, :, :c[j], :c[j]] for j in range(nb)], self._dense_conditionals(fac))
        kern, kdiag = fac.kern, fac.kdiag
        old01 = torch.arange(c[0] + c[1], device=self.device)
        keep_points = max(1, c[0] + c[1] - (self.num_inducing - int(self.config.num_inducing)))
        z01 = fac.Z[old01]
        idx, _ = self._pick(symmetrise(kern(z01, z01)), kdiag(z01), keep_points)
        idx = torch.sort(idx).values
        n = idx.numel()
        touched = [j for j in range(2, nb) if bool(self.parent_mask[j, 0] | self.parent_mask[j, 1])]
        self._widen(n)
        mb = self.Z.shape[1]
        jit = self.jitter * float(kdiag(fac.Z[:1])[0])
        L, _ = jittered_cholesky(symmetrise(cov[:, idx][:, :, idx]), jit)
        keep = [0] + list(range(2, nb))
        self.Z, self.m, self.S_chol = self.Z[keep].clone(), self.m[keep].clone(), self.S_chol[keep].clone()
        self.Z[0].zero_()
        self.Z[0, :n] = z01[idx]
        self.m[0].zero_()
        self.m[0, :n] = mean[idx]
        self.S_chol[0] = torch.eye(mb, dtype=torch.float64, device=self.device)
        self.S_chol[0, :, :n, :n] = L
        counts = self.counts[keep].clone()
        counts[0] = n
        mask = self.parent_mask.clone()
        mask[:, 0] = mask[:, 0] | mask[:, 1]
        mask = mask[keep][:, keep]
        mask[0, :] = False
        self.counts, self.parent_mask = counts, mask
        self.distillations_t += 1
        if not touched:
            return
        # where each new block's points sit in the old joint
        old_index = [idx] + [fac.slices[j].start + torch.arange(c[j], device=self.device) for j in range(2, nb)]
        new_fac = self._factors(theta, list(range(self.num_blocks)))
        A_new = self._dense_conditionals(new_fac)
        for j_old in touched:
            j = j_old - 1
            pos = torch.cat(old_index[:j])               # the earlier new blocks' points, in the old joint
            own = old_index[j]
            a = A_new[j]                                   # (c_j, points of blocks < j)
            sub = torch.cat([own, pos])
            B = torch.cat([torch.eye(own.numel(), dtype=torch.float64, device=self.device), -a], 1)
            S = symmetrise(B @ cov[:, sub][:, :, sub] @ B.T)
            Lj, _ = jittered_cholesky(S, jit)
            self.m[j, :own.numel()] = mean[own] - a @ mean[pos]
            self.S_chol[j, :, :own.numel(), :own.numel()] = Lj

    # ------------------------------------------------------------------ revisits
    def _revisits(self, x: torch.Tensor) -> torch.Tensor:
        """Which batch inputs (N,) lie in frozen regions: where the current block carries less than
        REVISIT_SAY of the latent's prior variance (its whitened features |a_{x,t}|^2 / k(x, x)), so the
        reading is about what the frozen blocks hold, not about the current block's region or its border."""
        if self.num_blocks < 2:
            return torch.zeros(x.shape[0], dtype=torch.bool, device=x.device)
        fac = self._factors(self.q_mu.detach(), list(range(self.num_blocks)))
        A = fac.T @ fac.kern(fac.Z, x)
        current = A[fac.slices[-1]]
        return (current * current).sum(0) < REVISIT_SAY * fac.kdiag(x)

    def _refine_frozen(self, x: torch.Tensor, ys: torch.Tensor) -> None:
        """Streaming Bayes for readings in frozen regions (``vargp_revisits: refine``, Gaussian likelihood): each
        frozen block with a say at x, in turn, takes q_new(v_j) proportional to q_old(v_j) p(y | v_j, the other
        blocks at their means), exact in the whitened coordinates at the q(theta) mean (one sweep of coordinate
        ascent in the family's block-diagonal whitened q). Information is only added: the block keeps what it
        knew, its variance can only shrink and its mean moves by the new readings' weight against its own."""
        blocks = list(range(self.num_blocks))
        fac = self._factors(self.q_mu.detach(), blocks)
        A = fac.T @ fac.kern(fac.Z, x)
        w_all, _ = self._whitened(fac, blocks)
        mean = A.T @ w_all                                                            # (N, P)
        s2 = self.likelihood.noise_variance.detach()
        for j in blocks[:-1]:
            sl = fac.slices[j]
            Aj = A[sl]
            if not float((Aj * Aj).sum(0).max()) > 1e-6:
                continue
            c, LC = Aj.shape[0], fac.LC[j]
            for p in range(self.output_dims):
                w_old = w_all[sl, p]
                R_inv = tri_inv(torch.linalg.solve_triangular(LC, self.S_chol[j, p, :c, :c], upper=False))
                lam_old = R_inv.T @ R_inv
                other = mean[:, p] - Aj.T @ w_old
                lam = symmetrise(lam_old + (Aj / s2[p]) @ Aj.T)
                eta = lam_old @ w_old + Aj @ (ys[:, p] - other) / s2[p]
                U, _ = jittered_cholesky(lam, 0.0)
                w_new = torch.cholesky_solve(eta[:, None], U)[:, 0]
                R_new, _ = jittered_cholesky(symmetrise(torch.cholesky_inverse(U)), 0.0)
                mean[:, p] = other + Aj.T @ w_new
                w_all[sl, p] = w_new
                self.m[j, :c, p] = LC @ w_new
                self.S_chol[j, p, :c, :c] = LC @ R_new
        self._drop_caches()
