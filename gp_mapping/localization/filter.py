"""The particle filter over the pose (x, y, yaw) in the map frame and a magnetometer offset.

State. Each particle holds a pose and, Rao-Blackwellised, a joint Gaussian over two additive terms per map output
(|B| for a magnitude map, the map-frame x, y, z for a vector map): a constant magnetometer offset ``b`` and the
map's error ``e`` at the particle's place. Given a particle's pose the reading is linear-Gaussian in them,

    y = m(p) + b + e + n,    e ~ N(0, inflation * v_e(p)),    n ~ N(0, inflation * v_n(p) + variance_floor),

with ``m`` the map's predictive mean and ``v_e + v_n`` its calibrated *reading* variance at the sensor position
``p`` (:class:`~gp_mapping.localization.field_map.MagneticMap`): ``v_n`` the sensor's noise, new at every reading,
and ``v_e`` the rest, the map's own error. So ``b`` and ``e`` are integrated out exactly: the particle's weight is
the predictive density ``N(y; m + mu_b + mu_e, v_n + P_bb + 2 P_be + P_ee)`` and a Kalman update moves their
means and 2 x 2 covariance. This is the Rao-Blackwellised particle filter of Doucet et al. (2000) for a state whose
nonlinear part (the pose) is sampled and whose linear part is not: a few numpy operations per particle and output,
and unlike states sampled per particle they need no particles spread over their range, nor does resampling
deplete them.

Why the map's error is a state. Readings at successive updates (0.2 m apart) see nearly the same map error: a GP
map's errors vary on the scale of the field it learned. Taken as independent, a stretch of road where the map is
off by 3 uT counts as many independent 3 uT misfits, and a stretch the map is unsure of (a large ``v``) costs its
``log v`` at every update, so a path through well-mapped cells whose readings happen to fit beats the true path
through a poorly mapped one. Here the error is a process along the path: divided by the map's error standard
deviation it is an Ornstein-Uhlenbeck process in the distance the sensor travelled, correlation ``exp(-d / L)``
over ``d`` metres, ``L`` the map's correlation length (``error_correlation_length``, or measured on the map:
:func:`~gp_mapping.localization.field_map.correlation_length`). The first reading of a stretch pays for the map's
uncertainty; the next ones are weighed by what they add (``_propagate_error``). A robot at rest gets no new
evidence from its repeated readings but their noise, as it should. ``correlated_map_error`` false drops the state
(``v_e`` joins the noise: every update independent, the filter's model before).

The offset is constant (``bias_random_walk`` 0: a fixed offset with a Gaussian prior) or a random walk.
``bias_prior_std`` 0 removes the offset (``b`` = the prior mean). ``inflation`` (default 1: the calibrated
variance as it is) scales both variances.

Off the map. A particle whose sensor sits on an unknown cell or off the grid gets the map's marginal density of
readings (``off_map: prior``: the mean and spread of the map's readings, plus its offset) or a uniform density
over the map's range (``uniform``); its offset and error are not updated, and its error restarts from the map's
prior when it comes back on the map.

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
        # A map of several sessions states the spread of their offsets in every reading's variance (a reading of
        # a session it has not seen). With an offset state, that spread is this session's offset, constant along
        # the path: it goes into the offset's prior and out of each reading's map error, which would otherwise
        # count it again at every correlation length travelled. Without the state it stays in the readings.
        self._session_var = field_map.offset_var if cfg.bias_prior_std > 0 else np.zeros(p)
        self._bias_var0 = cfg.bias_prior_std ** 2 + self._session_var
        self.poses = np.zeros((n, 3))
        self.weights = np.full(n, 1.0 / n)
        self.bias_mean = np.tile(self._bias_prior, (n, 1))
        self.bias_var = np.tile(self._bias_var0, (n, 1))
        self._new_error_state(n)
        self.initialised = False
        self.updates = 0
        self.resamples = 0
        self.last_ess = float(n)
        self.last_nis = math.nan        # weighted normalised innovation squared of the last update (per output)
        self.last_off_map = 0.0         # weight share of particles off the map at the last update

    def _new_error_state(self, n: int) -> None:
        """The map-error state of ``n`` fresh particles: none yet (its prior is set at the first reading, from
        the map's latent variance where each particle is)."""
        p = self.map.outputs
        self.err_mean = np.zeros((n, p))
        self.err_var = np.zeros((n, p))
        self.cross_var = np.zeros((n, p))      # covariance of the offset and the map error
        self._err_prior = np.zeros((n, p))     # the latent variance at each particle's last update (0: none yet)
        self._last_sensor = np.full((n, 2), np.nan)

    @property
    def correlation_length(self) -> float:
        """The distance [m] over which the filter takes the map's errors along a path to decorrelate."""
        length = self.config.error_correlation_length
        return float(length) if length > 0 else float(self.map.correlation_length)

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
        n = self.config.max_particles
        self.poses = self._uniform_poses(n)
        self._reset(n)

    def _uniform_poses(self, n: int) -> np.ndarray:
        """``(n, 3)`` poses whose sensor is uniform over the map's known cells, heading uniform."""
        centres = self.map.known_cell_centres()
        res = self.map.spec.resolution
        cells = centres[self.rng.integers(0, centres.shape[0], n)]
        sensor = cells + (self.rng.random((n, 2)) - 0.5) * res
        yaw = self.rng.uniform(-math.pi, math.pi, n)
        # The sensor is what lies on the map; the body sits at the sensor minus the rotated offset.
        c, s = np.cos(yaw), np.sin(yaw)
        ox, oy = self.sensor_offset
        return np.column_stack([sensor[:, 0] - (c * ox - s * oy), sensor[:, 1] - (s * ox + c * oy), yaw])

    def _reset(self, n: int) -> None:
        self.weights = np.full(n, 1.0 / n)
        self.bias_mean = np.tile(self._bias_prior, (n, 1))
        self.bias_var = np.tile(self._bias_var0, (n, 1))
        self._new_error_state(n)
        self.initialised = True

    # ------------------------------------------------------------------------------------------ the two steps

    def predict(self, old_odom, new_odom, dt: float = 0.0) -> None:
        """Move every particle by the odometry increment from ``old_odom`` to ``new_odom`` (``(x, y, yaw)`` in the
        odom frame) with the motion noise; the offset's variance grows by its random walk over ``dt`` seconds."""
        self._need_init()
        sample_motion(self.poses, old_odom, new_odom, self._alphas, self.rng)
        q = self.config.bias_random_walk
        if q > 0 and dt > 0 and self.config.bias_prior_std > 0:
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
        sensor = self.sensor_positions()
        mean, var, latent, on_map = fmap.lookup_parts(sensor, cfg.position_std ** 2, full_floor=cfg.keep_noise_floor)
        if self._session_var.any():  # in the offset's prior instead (__init__); off the map var is the marginal
            var = np.where(on_map[:, None], np.maximum(var - self._session_var, 0.0), var)
            latent = np.maximum(latent - self._session_var, 0.0)
        if fmap.target == "vector":  # the levelled body-frame reading in the map frame, by each particle's yaw
            c, s = np.cos(self.poses[:, 2]), np.sin(self.poses[:, 2])
            y = np.column_stack([c * y[0] - s * y[1], s * y[0] + c * y[1], np.full(c.shape, y[2])])
        if not cfg.use_map_variance:
            var = np.where(on_map[:, None], cfg.fixed_variance, var)
            latent = np.zeros_like(var)
        elif not cfg.correlated_map_error:
            latent = np.zeros_like(var)
        white = cfg.inflation * (var - latent) + cfg.variance_floor  # the sensor's noise: new at every reading
        latent = cfg.inflation * latent                              # the map's error: shared along the path
        self._propagate_error(sensor, latent)
        # The reading y = m(p) + b + e + n: offset b and map error e per particle (Gaussian, jointly), noise n.
        s_tot = white + self.bias_var + 2.0 * self.cross_var + self.err_var
        innov = y - mean - self.bias_mean - self.err_mean
        loglik = -0.5 * np.sum(LOG_2PI + np.log(s_tot) + innov * innov / s_tot, axis=1)
        off = ~on_map
        any_off = bool(off.any())
        if any_off and cfg.off_map == "uniform":
            loglik[off] = float(np.sum(fmap.uniform_log_density))
        eps = cfg.outlier_probability
        if eps > 0:  # p = (1 - eps) N + eps U; resp = the Gaussian part's share (scales the states' update)
            log_u = math.log(eps) + float(np.sum(fmap.uniform_log_density))
            log_g = math.log1p(-eps) + loglik
            top = np.maximum(log_g, log_u)
            loglik = top + np.log(np.exp(log_g - top) + np.exp(log_u - top))
            resp = np.exp(log_g - loglik)
        # Offset and map error: a Kalman update per particle and output (observation b + e), on the map only.
        pb = self.bias_var + self.cross_var      # cov(b, y)
        pe = self.cross_var + self.err_var       # cov(e, y)
        gain_b, gain_e = pb / s_tot, pe / s_tot
        if eps > 0:
            gain_b *= resp[:, None]
            gain_e *= resp[:, None]
        if any_off:
            gain_b[off] = 0.0
            gain_e[off] = 0.0
        self.bias_mean += gain_b * innov
        self.err_mean += gain_e * innov
        self.bias_var -= gain_b * pb
        self.err_var -= gain_e * pe
        self.cross_var -= gain_b * pe
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

    def _propagate_error(self, sensor: np.ndarray, latent: np.ndarray) -> None:
        """Carry each particle's map error from its last update to this one. The error divided by the map's
        latent standard deviation is an Ornstein-Uhlenbeck process in the distance its sensor travelled: its
        correlation over a move of d metres is rho = exp(-d / L) (L: :attr:`correlation_length`), so

            e' = rho sqrt(v' / v) e + sqrt(v' (1 - rho^2)) w,    w ~ N(0, 1),

        with v, v' the latent variance at the old and the new place: a particle that has not moved keeps its
        error (a reading at rest says nothing new about the map there), one that moved far gets a fresh error of
        the map's variance. A particle without a previous update (after an initialisation or off the map) starts
        from the prior N(0, v')."""
        moved = np.hypot(*(sensor - self._last_sensor).T)
        had = np.isfinite(moved)[:, None] & (self._err_prior > 0)
        rho = np.exp(-np.where(np.isfinite(moved), moved, np.inf) / max(self.correlation_length, 1e-9))[:, None]
        scale = np.where(had, rho * np.sqrt(latent / np.where(had, self._err_prior, 1.0)), 0.0)
        self.err_mean *= scale
        self.cross_var *= scale
        self.err_var = scale * scale * self.err_var + np.where(had, 1.0 - rho * rho, 1.0) * latent
        self._err_prior = latent
        self._last_sensor = sensor

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
        self.err_mean, self.err_var, self.cross_var = self.err_mean[idx], self.err_var[idx], self.cross_var[idx]
        self._err_prior, self._last_sensor = self._err_prior[idx], self._last_sensor[idx]
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
