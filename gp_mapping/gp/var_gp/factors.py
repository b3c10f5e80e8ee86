"""The factors of VAR-GP's blocks (:mod:`.model`): the per-output KL of a block (:func:`block_kl`), the running
joint of the App. C.3 recursion (:func:`ar_joint`), and the theta-dependent factors of an ordered set of blocks,
whitened, and the latent's marginals through them."""
from __future__ import annotations

import torch

from ..linalg import jittered_cholesky, symmetrise, tri_inv


def block_kl(m: torch.Tensor, S_chol: torch.Tensor, C_chol: torch.Tensor) -> torch.Tensor:
    """D_t = KL[N(m_p, S_p) || N(0, C)] per output (P,), for m (M, P), S_p = S_chol[p] S_chol[p]^T (P, M, M) lower
    factors and C = C_chol C_chol^T: 1/2 [tr(C^{-1} S) + m^T C^{-1} m - M + log|C| - log|S|], computed whitened
    (chol(C)^{-1} S_chol is lower triangular, so its log-determinant is the sum of its diagonal's logs)."""
    c = m.shape[0]
    if c == 0:
        return m.new_zeros(m.shape[1])
    wm = torch.linalg.solve_triangular(C_chol, m, upper=False)
    wr = torch.linalg.solve_triangular(C_chol, S_chol, upper=False)
    logdet = torch.log(torch.diagonal(wr, dim1=-2, dim2=-1).abs()).sum(-1)
    return 0.5 * ((wr * wr).sum((-2, -1)) + (wm * wm).sum(0) - c) - logdet


def ar_joint(means: list[torch.Tensor], S_chols: list[torch.Tensor], A: list[torch.Tensor | None]
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """The joint q(u_<=t | theta) of App. C.3 (eq. 22), applied recursively: block j has mean m_j (M_j, P),
    covariance factors S_chols[j] (P, M_j, M_j) and A[j] (M_j, M_<j) (None or 0 columns for the first block);

        mean_j = A_j mean_<j + m_j,   Cov(u_<j, u_j) = Sigma_<j A_j^T,   Cov(u_j) = S_j + A_j Sigma_<j A_j^T.

    Returns (mean (M, P), covariance (P, M, M))."""
    p = means[0].shape[1]
    mean = means[0].new_zeros(0, p)
    cov = means[0].new_zeros(p, 0, 0)
    for m, L, a in zip(means, S_chols, A):
        S = L @ L.transpose(-1, -2)
        if a is None or a.shape[1] == 0:
            a = m.new_zeros(m.shape[0], mean.shape[0])
        mj = a @ mean + m
        cross = cov @ a.T                                   # (P, M_<j, M_j)
        cjj = S + a @ cross
        cov = torch.cat([torch.cat([cov, cross], 2), torch.cat([cross.transpose(-1, -2), cjj], 2)], 1)
        mean = torch.cat([mean, mj])
    return mean, symmetrise(cov)


class Factors:
    """Theta-dependent factors of an ordered set of blocks (each conditioned on its parents within the set):
    Z (M, D) stacked, per block its slice, chol(K_PP) and G = chol(K_PP)^{-1} K_Pj of its parents, chol(C_j),
    and T = L^{-1} (M, M), the whitening of the set's prior (block rows chol(C_j)^{-1} [-A_j, I])."""

    def __init__(self, Z, slices, parents, LP, G, LC, T, kern, kdiag):
        self.Z, self.slices, self.parents, self.LP, self.G, self.LC, self.T = Z, slices, parents, LP, G, LC, T
        self.kern, self.kdiag = kern, kdiag


class BlockFactors:
    """Mixin of :class:`~.model.VARGP`: the factors of a set of blocks under a theta, q whitened by them, and the
    latent's marginals at inputs."""

    # ------------------------------------------------------------------ factors of a set of blocks
    def _factors(self, theta: torch.Tensor, blocks: list[int], extra: tuple[int, torch.Tensor] | None = None
                 ) -> Factors:
        """Factors of the ordered blocks ``blocks`` at theta, each conditioned on its parents among them.
        ``extra`` = (block, Z): use these inputs for that block instead of its stored ones."""
        kern, kdiag = self._kernel_at(theta)
        zs, slices, off = [], [], 0
        for j in blocks:
            z = extra[1] if extra is not None and extra[0] == j else self.Z[j, :int(self.counts[j])]
            zs.append(z)
            slices.append(slice(off, off + z.shape[0]))
            off += z.shape[0]
        Z = torch.cat(zs) if zs else self.Z.new_zeros(0, self.input_dims)
        K = kern(Z, Z)
        jit = self.jitter * float(kdiag(Z[:1])[0].detach()) if Z.shape[0] else 0.0
        pos = {j: i for i, j in enumerate(blocks)}
        parents, LPs, Gs, LCs, rows = [], [], [], [], []
        for i, j in enumerate(blocks):
            sj = slices[i]
            par = [pos[k] for k in blocks[:i] if bool(self.parent_mask[j, k])]
            kjj = K[sj, sj]
            row = K.new_zeros(kjj.shape[0], off)
            if par:
                pidx = torch.cat([torch.arange(slices[k].start, slices[k].stop, device=K.device) for k in par])
                LP, _ = jittered_cholesky(K[pidx][:, pidx], jit)
                G = torch.linalg.solve_triangular(LP, K[pidx][:, sj], upper=False)
                LC, used = jittered_cholesky(symmetrise(kjj - G.T @ G), jit)
                LCi = tri_inv(LC)
                row[:, pidx] = -(LCi @ G.T) @ tri_inv(LP)
            else:
                LP, G = None, None
                LC, used = jittered_cholesky(kjj, jit)
                LCi = tri_inv(LC)
            row[:, sj] = LCi
            if used > jit and jit > 0:
                self.jitter_t.fill_(self.jitter * used / jit)
            parents.append(par)
            LPs.append(LP)
            Gs.append(G)
            LCs.append(LC)
            rows.append(row)
        T = torch.cat(rows) if rows else K.new_zeros(0, 0)
        return Factors(Z, slices, parents, LPs, Gs, LCs, T, kern, kdiag)

    def _whitened(self, fac: Factors, blocks: list[int], current: tuple[torch.Tensor, torch.Tensor] | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """Whitened q of the set: means (M, P) and the block-diagonal factor R (P, M, M) with Cov = R R^T;
        ``current`` = (m, L) replaces the stored q of the last block (the one being optimised)."""
        ws, Rs = [], []
        for i, j in enumerate(blocks):
            c = fac.slices[i].stop - fac.slices[i].start
            if current is not None and i == len(blocks) - 1:
                m, L = current
            else:
                m, L = self.m[j, :c], self.S_chol[j, :, :c, :c]
            ws.append(torch.linalg.solve_triangular(fac.LC[i], m, upper=False))
            Rs.append(torch.linalg.solve_triangular(fac.LC[i], L, upper=False))
        return torch.cat(ws), torch.stack([torch.block_diag(*[r[p] for r in Rs]) for p in range(self.output_dims)])

    @staticmethod
    def _marginals(fac: Factors, w: torch.Tensor, R: torch.Tensor, x: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """Latent mean and variance (N, P) at x given the set's factors and whitened q."""
        A = fac.T @ fac.kern(fac.Z, x)                              # (M, N): a_x = L^{-1} k_x
        mean = A.T @ w
        V = R.transpose(-1, -2) @ A                                 # (P, M, N)
        var = fac.kdiag(x)[:, None] - (A * A).sum(0)[:, None] + (V * V).sum(1).T
        return mean, var.clamp_min(1e-12)


__all__ = ["BlockFactors", "Factors", "ar_joint", "block_kl"]
