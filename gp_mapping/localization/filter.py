"""The particle filter over the pose (x, y, yaw) in the map frame and a magnetometer offset.

State. Each particle holds a pose and, Rao-Blackwellised, a Gaussian over the offset ``b`` (one per map output:
|B| for a magnitude map, the map-frame x, y, z for a vector map): its mean and variance per output. Given a
particle's pose the reading is linear-Gaussian in ``b``,

    y = m(p) + b + e,    e ~ N(0, R(p)),    R(p) = inflation * v(p) + variance_floor,

with ``m`` and ``v`` the map's predictive mean and *reading* variance (latent + noise) at the sensor position
``p`` (:class:`~gp_mapping.localization.field_map.MagneticMap`), so the offset is integrated out exactly: the
particle's weight is the predictive density ``N(y; m + mu_b, R + P_b)`` (the reading's variance plus the
offset's), and a scalar Kalman update per output moves ``(mu_b, P_b)``. This is the Rao-Blackwellised particle
filter of Doucet et al. (2000) for a state whose nonlinear part (the pose) is sampled and whose linear part (the
offset) is not: the offset costs one Kalman update per particle and output (a few numpy operations), and unlike
an offset sampled per particle it does not need particles spread over its range to be estimated, nor does
resampling deplete it. Why ``inflation`` multiplies the map's part only: the map's error is what successive
readings along a path share (readings a few centimetres apart see the same error of a map whose lengthscale is
a metre), so its weight is the thing to tune; the offset's variance is the filter's own and stays exact, so the
Kalman update of the offset stays consistent whatever the inflation.

The offset is constant (``bias_random_walk`` 0: a fixed offset with a Gaussian prior) or a random walk.
``bias_prior_std`` 0 removes the state (``b`` = the prior mean).

Off the map. A particle whose sensor sits on an unknown cell or off the grid gets the map's marginal density of
readings (``off_map: prior``: the mean and spread of the map's readings, plus its offset) or a uniform density
over the map's range (``uniform``); its offset is not updated.

Resampling is systematic (Kitagawa 1996) when the effective sample size ``1 / sum w^2`` drops below
``ess_threshold * N``. With ``kld_err`` > 0 the number of particles adapts at each resampling (KLD-sampling, Fox
2003, as AMCL): as many as bound the Kullback-Leibler error of the particles' histogram (bins KLD_BINS) by
``kld_err`` with probability KLD_QUANTILE, between ``num_particles`` and ``max_particles``; a cloud spread over the
map keeps many, a cloud that has found the robot comes down to ``num_particles``. Initialisation: a Gaussian
around a pose (``num_particles``), or uniform over the map's known cells with a uniform heading (global
localization, ``max_particles``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from gp_mapping.localization.config import LocalizationError, LocalizerConfig
from gp_mapping.localization.field_map import MagneticMap
from gp_mapping.localization.motion import sample_motion, wrap_angle

LOG_2PI = math.log(2.0 * math.pi)
#: KLD-sampling histogram bins: x [m], y [m], yaw [rad] (AMCL's), and the standard normal quantile of 0.99
KLD_BINS = (0.5, 0.5, math.radians(10.0))
KLD_QUANTILE = 2.3263478740408408


def kld_particles(bins: int, err: float, z: float = KLD_QUANTILE) -> int:
    """Fox (2003): the sample size that keeps the KL divergence between the histogram of ``bins`` occupied bins
    and the true posterior below ``err`` with the probability whose standard normal quantile is ``z``."""
    if bins <= 1:
        return 1
    k = bins - 1.0
    a = 2.0 / (9.0 * k)
    return int(math.ceil(k / (2.0 * err) * (1.0 - a + math.sqrt(a) * z) ** 3))


@dataclass
class PoseEstimate:
    """The filter's estimate after an update: the weighted mean pose and its covariance, the offset, and health."""

    stamp: float
    pose: np.ndarray        # (3,) x [m], y [m], yaw [rad] in the map frame
    covariance: np.ndarray  # (3, 3) over (x, y, yaw), yaw residuals wrapped
    bias: np.ndarray        # (P,) offset estimate [map unit]
    bias_std: np.ndarray    # (P,)
    ess: float              # effective sample size after the update (before any resampling)
    converged: bool         # the position's standard deviation (larger axis) is below converged_std
    odom_pose: np.ndarray = field(default_factory=lambda: np.zeros(3))  # the odometry pose at ``stamp``

    @property
    def std(self) -> np.ndarray:
        """(3,) standard deviations of x, y, yaw."""
        return np.sqrt(np.maximum(np.diag(self.covariance), 0.0))

    def map_to_odom(self) -> np.ndarray:
        """The ``map -> odom`` transform ``(x, y, yaw)`` this estimate implies (AMCL's published transform):
        ``T_map_base * T_odom_base^-1``."""
        from gp_mapping.localization.motion import compose, inverse

        return compose(self.pose, inverse(self.odom_pose))


class ParticleFilter:
    """Particles over (x, y, yaw) with a Rao-Blackwellised offset (module docstring). Readings are in the map's
    field unit; a vector reading is the sensor's in a levelled body frame (the caller removes roll and pitch)."""

    def __init__(self, field_map: MagneticMap, config: LocalizerConfig | None = None,
                 sensor_offset=(0.0, 0.0)) -> None:
        self.map = field_map
        self.config = config if config is not None else LocalizerConfig()
        self.rng = np.random.default_rng(self.config.seed)
        self.sensor_offset = np.asarray(sensor_offset, dtype=np.float64).reshape(-1)[:2]
        if self.sensor_offset.shape != (2,) or not np.all(np.isfinite(self.sensor_offset)):
            raise LocalizationError(f"sensor_offset must be two finite numbers [m], got {sensor_offset!r}")
        cfg = self.config
        n, p = cfg.num_particles, field_map.outputs
        if cfg.max_particles < n:
            raise LocalizationError(f"max_particles {cfg.max_particles} is below num_particles {n}")
        self._alphas = (cfg.alpha1, cfg.alpha2, cfg.alpha3, cfg.alpha4)
        self._bias_prior = np.asarray(cfg.bias_mean(p), dtype=np.float64)
        self._bias_var0 = cfg.bias_prior_std ** 2
        self.poses = np.zeros((n, 3))
        self.weights = np.full(n, 1.0 / n)
        self.bias_mean = np.tile(self._bias_prior, (n, 1))
        self.bias_var = np.full((n, p), self._bias_var0)
        self.initialised = False
        self.updates = 0
        self.resamples = 0
        self.last_ess = float(n)
        self.last_nis = math.nan        # weighted normalised innovation squared of the last update (per output)
        self.last_off_map = 0.0         # weight share of particles off the map at the last update

    @property
    def num_particles(self) -> int:
        return self.poses.shape[0]

    # ------------------------------------------------------------------------------------------ initialisation

    def initialise_gaussian(self, pose, std=None) -> None:
        """Particles drawn from N(pose, diag(std^2)) (``std`` default ``initial_std``); weights uniform."""
        pose = np.asarray(pose, dtype=np.float64).reshape(-1)
        std = np.asarray(self.config.initial_std if std is None else std, dtype=np.float64).reshape(-1)
        if pose.shape != (3,) or not np.all(np.isfinite(pose)):
            raise LocalizationError(f"an initial pose is three finite numbers x, y, yaw; got {pose.tolist()}")
        if std.shape != (3,) or not np.all(np.isfinite(std)) or np.any(std < 0):
            raise LocalizationError(f"initial standard deviations are three finite numbers >= 0; got {std.tolist()}")
        n = self.config.num_particles
        self.poses = pose + self.rng.standard_normal((n, 3)) * std
        self.poses[:, 2] = wrap_angle(self.poses[:, 2])
        self._reset(n)

    def initialise_global(self) -> None:
        """Particles uniform over the map's known cells (a uniform point in a uniformly drawn cell, so the
        density is uniform over the known area) with a uniform heading."""
        centres = self.map.known_cell_centres()
        n, res = self.config.max_particles, self.map.spec.resolution
        cells = centres[self.rng.integers(0, centres.shape[0], n)]
        sensor = cells + (self.rng.random((n, 2)) - 0.5) * res
        yaw = self.rng.uniform(-math.pi, math.pi, n)
        # The sensor is what lies on the map; the body sits at the sensor minus the rotated offset.
        c, s = np.cos(yaw), np.sin(yaw)
        ox, oy = self.sensor_offset
        self.poses = np.column_stack([sensor[:, 0] - (c * ox - s * oy), sensor[:, 1] - (s * ox + c * oy), yaw])
        self._reset(n)

    def _reset(self, n: int) -> None:
        self.weights = np.full(n, 1.0 / n)
        self.bias_mean = np.tile(self._bias_prior, (n, 1))
        self.bias_var = np.full((n, self.map.outputs), self._bias_var0)
        self.initialised = True

    # ------------------------------------------------------------------------------------------ the two steps

    def predict(self, old_odom, new_odom, dt: float = 0.0) -> None:
        """Move every particle by the odometry increment from ``old_odom`` to ``new_odom`` (``(x, y, yaw)`` in the
        odom frame) with the motion noise; the offset's variance grows by its random walk over ``dt`` seconds."""
        self._need_init()
        sample_motion(self.poses, old_odom, new_odom, self._alphas, self.rng)
        q = self.config.bias_random_walk
        if q > 0 and dt > 0 and self._bias_var0 > 0:
            self.bias_var += q * q * dt

    def sensor_positions(self) -> np.ndarray:
        """``(N, 2)`` the magnetometer's position for every particle."""
        ox, oy = self.sensor_offset
        if ox == 0.0 and oy == 0.0:
            return self.poses[:, :2]
        c, s = np.cos(self.poses[:, 2]), np.sin(self.poses[:, 2])
        return np.column_stack([self.poses[:, 0] + c * ox - s * oy, self.poses[:, 1] + s * ox + c * oy])

    def correct(self, reading) -> float:
        """Weight the particles by a reading (map units: ``(1,)`` |B| for a magnitude map, ``(3,)`` levelled
        body-frame vector for a vector map), update their offsets, resample when the ESS is low. Returns the
        effective sample size before resampling."""
        self._need_init()
        cfg, fmap = self.config, self.map
        y = np.asarray(reading, dtype=np.float64).reshape(-1)
        if y.shape != (fmap.outputs,) or not np.all(np.isfinite(y)):
            raise LocalizationError(f"a reading for this {fmap.target} map is {fmap.outputs} finite number(s), got "
                                    f"{y.tolist()}")
        mean, var, on_map = fmap.lookup(self.sensor_positions(), cfg.position_std ** 2)
        if fmap.target == "vector":  # the levelled body-frame reading in the map frame, by each particle's yaw
            c, s = np.cos(self.poses[:, 2]), np.sin(self.poses[:, 2])
            y = np.column_stack([c * y[0] - s * y[1], s * y[0] + c * y[1], np.full(c.shape, y[2])])
        base = var if cfg.use_map_variance else np.where(on_map[:, None], cfg.fixed_variance, var)
        r = cfg.inflation * base + cfg.variance_floor
        s_tot = r + self.bias_var
        innov = y - mean - self.bias_mean
        loglik = -0.5 * np.sum(LOG_2PI + np.log(s_tot) + innov * innov / s_tot, axis=1)
        off = ~on_map
        any_off = bool(off.any())
        if any_off and cfg.off_map == "uniform":
            loglik[off] = float(np.sum(fmap.uniform_log_density))
        eps = cfg.outlier_probability
        if eps > 0:  # p = (1 - eps) N + eps U; resp = the Gaussian part's share (scales the offset's update)
            log_u = math.log(eps) + float(np.sum(fmap.uniform_log_density))
            log_g = math.log1p(-eps) + loglik
            top = np.maximum(log_g, log_u)
            loglik = top + np.log(np.exp(log_g - top) + np.exp(log_u - top))
            resp = np.exp(log_g - loglik)
        # Offsets: a Kalman update per particle and output, on the map only.
        if self._bias_var0 > 0:
            gain = self.bias_var / s_tot
            if eps > 0:
                gain *= resp[:, None]
            if any_off:
                gain[off] = 0.0
            self.bias_mean += gain * innov
            self.bias_var -= gain * self.bias_var
        logw = np.log(np.maximum(self.weights, 1e-300)) + loglik
        logw -= logw.max()
        w = np.exp(logw)
        w /= w.sum()
        self.last_nis = float(np.sum(w[:, None] * innov * innov / s_tot) / fmap.outputs)
        self.last_off_map = float(w[off].sum()) if any_off else 0.0
        self.weights = w
        ess = 1.0 / float(np.dot(w, w))
        self.last_ess = ess
        self.updates += 1
        if ess < cfg.ess_threshold * self.num_particles:
            self.resample()
        return ess

    def _systematic(self, n: int) -> np.ndarray:
        """Indices of n systematic draws: evenly spaced pointers with one random offset into the cumulative
        weights (each particle drawn floor(n w) or ceil(n w) times)."""
        positions = (self.rng.random() + np.arange(n)) / n
        cumulative = np.cumsum(self.weights)
        cumulative[-1] = 1.0
        return np.searchsorted(cumulative, positions, side="left")

    def target_count(self, idx: np.ndarray | None = None) -> int:
        """The KLD-sampling count for the particles ``idx`` (default all), clipped to [num_particles,
        max_particles]; the current count when kld_err is 0."""
        cfg = self.config
        if cfg.kld_err <= 0:
            return self.num_particles
        p = self.poses if idx is None else self.poses[idx]
        cells = np.floor(np.column_stack([p[:, 0] / KLD_BINS[0], p[:, 1] / KLD_BINS[1],
                                          (p[:, 2] + math.pi) / KLD_BINS[2]])).astype(np.int64)
        # one integer per bin (x and y offset to be non-negative within the particles' span)
        cells -= cells.min(axis=0)
        span = cells.max(axis=0) + 1
        keys = (cells[:, 0] * span[1] + cells[:, 1]) * span[2] + cells[:, 2]
        bins = int(np.unique(keys).size)
        return int(min(max(kld_particles(bins, cfg.kld_err), cfg.num_particles), cfg.max_particles))

    def resample(self) -> None:
        """Systematic resampling; with kld_err > 0 to the KLD-sampling count of the resampled cloud."""
        n = self.num_particles
        idx = self._systematic(n)
        target = self.target_count(idx)
        if target != n:
            idx = self._systematic(target)
            n = target
        self.poses = self.poses[idx]
        self.bias_mean = self.bias_mean[idx]
        self.bias_var = self.bias_var[idx]
        self.weights = np.full(n, 1.0 / n)
        self.resamples += 1

    # ------------------------------------------------------------------------------------------ estimate

    def estimate(self, stamp: float = 0.0, odom_pose=None) -> PoseEstimate:
        """The weighted mean pose (circular mean heading), its covariance, the offset and its spread."""
        self._need_init()
        w = self.weights
        x, y = float(w @ self.poses[:, 0]), float(w @ self.poses[:, 1])
        yaw = math.atan2(float(w @ np.sin(self.poses[:, 2])), float(w @ np.cos(self.poses[:, 2])))
        d = np.column_stack([self.poses[:, 0] - x, self.poses[:, 1] - y, wrap_angle(self.poses[:, 2] - yaw)])
        cov = (d * w[:, None]).T @ d
        bias = w @ self.bias_mean
        bias_var = w @ (self.bias_var + (self.bias_mean - bias) ** 2)
        pos_std = math.sqrt(max(float(np.linalg.eigvalsh(cov[:2, :2]).max()), 0.0))
        return PoseEstimate(stamp=float(stamp), pose=np.array([x, y, yaw]), covariance=cov, bias=np.asarray(bias),
                            bias_std=np.sqrt(np.maximum(bias_var, 0.0)), ess=self.last_ess,
                            converged=pos_std < self.config.converged_std,
                            odom_pose=np.zeros(3) if odom_pose is None else np.asarray(odom_pose, dtype=np.float64))

    def _need_init(self) -> None:
        if not self.initialised:
            raise LocalizationError("the filter has no initial pose yet: call initialise_gaussian(pose) or "
                                    "initialise_global() first")


__all__ = ["KLD_BINS", "KLD_QUANTILE", "ParticleFilter", "PoseEstimate", "kld_particles"]
