"""A simulated magnetic world, robot trajectories and a magnetometer, deterministic by seed and ROS-free.

Frames and units
----------------
- The map frame is ENU: x east, y north, z up, metres. Fields are in tesla unless a name says otherwise.
- The Earth's field with total intensity F, inclination I (positive: the field points down, as in the
  northern hemisphere) and declination D (positive: magnetic north is east of true north) is, in ENU,
  ``B_earth = F * [cos I sin D, cos I cos D, -sin I]``.
- Steel objects are point dipoles with moment m [A m^2] at position p; at r = x - p their field is
  ``B = mu0 / (4 pi) * (3 r (m . r) / |r|^5 - m / |r|^3)``.
- Orientations are unit quaternions ``[x, y, z, w]`` (scalar last, as in ROS) rotating body vectors into
  the map frame: ``v_map = R(q) v_body``. The body (``base_link``) heads along the direction of travel
  (body x forward, z up). The sensor (``magnetometer``) frame is fixed in the body by an extrinsic
  (translation, rotation sensor-to-body), so ``R_sensor_to_map = R(q_body) R(q_ext)`` and the sensor sits
  at ``p_body + R(q_body) t_ext``.
- A magnetometer reading is ``D R_sensor_to_map^T B_map(p_sensor) + bias + noise (+ spike)``, in the sensor frame:
  ``bias`` is the robot's hard iron and ``D`` (``SensorConfig.distortion``, identity by default) its soft iron, so
  the calibration that undoes them is ``sync.hard_iron = bias``, ``sync.soft_iron = D^-1``.

The trajectory is sampled on one timeline ``t_k = k / rate`` (k = 0..N-1); the magnetometer reads at those
same instants except the dropped ones. Three independent random streams (world, trajectory, sensor) are
spawned from the seed, so changing the sensor's noise does not move the dipoles or the path.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np
from scipy.spatial.transform import Rotation

MU0 = 4e-7 * math.pi  # vacuum permeability [T m / A] (the pre-2019 exact value; the 2019 SI differs by 1e-10)

PATTERNS = ("lawnmower", "loop", "random_walk")


class SimulationError(ValueError):
    """A simulation parameter is out of range, or the field was asked for at a dipole's position."""


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise SimulationError(message)


def _finite(values, name: str, length: int | None = None) -> np.ndarray:
    arr = np.asarray(values, dtype=float)
    _require(np.all(np.isfinite(arr)), f"{name} must be finite numbers, got {values!r}")
    if length is not None:
        _require(arr.shape == (length,), f"{name} must have {length} numbers, got {values!r}")
    return arr


def _check_area(area: Sequence[float], name: str) -> None:
    a = _finite(area, name, 4)
    _require(a[2] > a[0] and a[3] > a[1], f"{name} must be [xmin, ymin, xmax, ymax] with xmax > xmin and "
             f"ymax > ymin, got {tuple(area)!r}")


# --------------------------------------------------------------------------------------------------- field


def earth_field(intensity: float, inclination_deg: float, declination_deg: float) -> np.ndarray:
    """The Earth's field in the ENU map frame [T]: ``F [cos I sin D, cos I cos D, -sin I]``."""
    inc, dec = math.radians(inclination_deg), math.radians(declination_deg)
    return intensity * np.array([math.cos(inc) * math.sin(dec), math.cos(inc) * math.cos(dec), -math.sin(inc)])


def dipole_field(points: np.ndarray, positions: np.ndarray, moments: np.ndarray) -> np.ndarray:
    """Sum of point-dipole fields at ``points`` (N, 3) [m] for dipoles at ``positions`` (K, 3) with
    ``moments`` (K, 3) [A m^2]; returns (N, 3) tesla. Raises SimulationError at a dipole's own position."""
    points = np.asarray(points, dtype=float)
    positions = np.asarray(positions, dtype=float).reshape(-1, 3)
    moments = np.asarray(moments, dtype=float).reshape(-1, 3)
    _require(points.ndim == 2 and points.shape[1] == 3, f"points must have shape (N, 3), got {points.shape}")
    out = np.zeros_like(points)
    for p, m in zip(positions, moments):  # K is small: a loop keeps memory at O(N)
        r = points - p
        d2 = np.einsum("ij,ij->i", r, r)
        if np.any(d2 == 0.0):
            raise SimulationError(f"field requested at the position of the dipole at {p.tolist()}: it is infinite")
        inv_d = 1.0 / np.sqrt(d2)
        inv_d3 = inv_d**3
        m_dot_r = r @ m
        out += 3.0 * r * (m_dot_r * inv_d3 * inv_d * inv_d)[:, None] - m[None, :] * inv_d3[:, None]
    return out * (MU0 / (4.0 * math.pi))


@dataclass(frozen=True)
class WorldConfig:
    """How a random world is drawn: the Earth's field plus buried steel objects (dipoles).

    Dipoles are placed uniformly over ``area`` grown by ``margin`` and ``depth`` metres below the plane
    ``z = plane_height`` (the sensor's height). Each one's moment is chosen so that its on-axis anomaly at the
    plane, ``mu0 |m| / (2 pi depth^3)``, is log-uniform in ``anomaly_range`` [T]: deep objects are broad,
    shallow ones sharp, all of a realistic strength. Moment directions mix the Earth's field direction
    (induced magnetisation, weight ``induced_fraction``) with a random direction (remanence).
    """

    intensity: float = 50e-6
    inclination_deg: float = 60.0
    declination_deg: float = 5.0
    area: tuple = (-5.0, -5.0, 5.0, 5.0)
    margin: float = 1.0
    plane_height: float = 0.0
    n_dipoles: int = 14
    depth_range: tuple = (0.5, 2.0)
    anomaly_range: tuple = (2e-6, 20e-6)
    induced_fraction: float = 0.5

    def __post_init__(self) -> None:
        _require(math.isfinite(self.intensity) and 0.0 <= self.intensity <= 1e-3,
                 f"intensity must be in [0, 1e-3] T, got {self.intensity!r}")
        _require(-90.0 <= self.inclination_deg <= 90.0, f"inclination_deg must be in [-90, 90], got "
                 f"{self.inclination_deg!r}")
        _require(-180.0 <= self.declination_deg <= 180.0, f"declination_deg must be in [-180, 180], got "
                 f"{self.declination_deg!r}")
        _check_area(self.area, "area")
        _require(math.isfinite(self.margin) and self.margin >= 0.0, f"margin must be >= 0, got {self.margin!r}")
        _require(math.isfinite(self.plane_height), f"plane_height must be finite, got {self.plane_height!r}")
        _require(isinstance(self.n_dipoles, int) and 0 <= self.n_dipoles <= 10_000,
                 f"n_dipoles must be an integer in [0, 10000], got {self.n_dipoles!r}")
        d = _finite(self.depth_range, "depth_range", 2)
        _require(0.0 < d[0] <= d[1], f"depth_range must be (low, high) with 0 < low <= high, got {self.depth_range!r}")
        a = _finite(self.anomaly_range, "anomaly_range", 2)
        _require(0.0 < a[0] <= a[1] <= 1e-3, f"anomaly_range must be (low, high) T with 0 < low <= high <= 1e-3, "
                 f"got {self.anomaly_range!r}")
        _require(0.0 <= self.induced_fraction <= 1.0, f"induced_fraction must be in [0, 1], got "
                 f"{self.induced_fraction!r}")


class World:
    """The Earth's field plus point dipoles; ``field(points)`` is the ground truth anywhere."""

    def __init__(self, earth: Sequence[float], dipole_positions: np.ndarray | None = None,
                 dipole_moments: np.ndarray | None = None) -> None:
        self.earth = _finite(earth, "earth", 3).copy()
        pos = np.zeros((0, 3)) if dipole_positions is None else np.asarray(dipole_positions, dtype=float)
        mom = np.zeros((0, 3)) if dipole_moments is None else np.asarray(dipole_moments, dtype=float)
        pos, mom = pos.reshape(-1, 3), mom.reshape(-1, 3)
        _require(pos.shape == mom.shape, f"dipole_positions {pos.shape} and dipole_moments {mom.shape} differ")
        _require(bool(np.all(np.isfinite(pos)) and np.all(np.isfinite(mom))), "dipole parameters must be finite")
        self.dipole_positions = pos
        self.dipole_moments = mom

    @classmethod
    def from_config(cls, config: WorldConfig, rng: np.random.Generator) -> "World":
        """Draw a world as ``config`` describes, from ``rng``."""
        earth = earth_field(config.intensity, config.inclination_deg, config.declination_deg)
        k = config.n_dipoles
        xmin, ymin, xmax, ymax = config.area
        xy = rng.uniform([xmin - config.margin, ymin - config.margin],
                         [xmax + config.margin, ymax + config.margin], size=(k, 2))
        depth = rng.uniform(*config.depth_range, size=k)
        positions = np.column_stack([xy, config.plane_height - depth])
        log_a = rng.uniform(math.log(config.anomaly_range[0]), math.log(config.anomaly_range[1]), size=k)
        strength = np.exp(log_a) * 2.0 * math.pi * depth**3 / MU0  # |m| giving that on-axis anomaly
        random_dir = rng.normal(size=(k, 3))
        random_dir /= np.linalg.norm(random_dir, axis=1, keepdims=True)
        earth_dir = earth / np.linalg.norm(earth) if np.linalg.norm(earth) > 0 else np.zeros(3)
        direction = config.induced_fraction * earth_dir + (1.0 - config.induced_fraction) * random_dir
        norms = np.linalg.norm(direction, axis=1, keepdims=True)
        direction = np.where(norms > 1e-9, direction / np.maximum(norms, 1e-12), random_dir)
        return cls(earth, positions, direction * strength[:, None])

    def field(self, points: np.ndarray) -> np.ndarray:
        """True field (N, 3) [T] in the map frame at ``points`` (N, 3) [m]."""
        points = np.asarray(points, dtype=float)
        _require(points.ndim == 2 and points.shape[1] == 3, f"points must have shape (N, 3), got {points.shape}")
        return self.earth[None, :] + dipole_field(points, self.dipole_positions, self.dipole_moments)

    def magnitude(self, points: np.ndarray) -> np.ndarray:
        """True |B| (N,) [T] at ``points`` (N, 3)."""
        return np.linalg.norm(self.field(points), axis=1)


# ---------------------------------------------------------------------------------------------- trajectory


@dataclass(frozen=True)
class TrajectoryConfig:
    """A path over ``area`` driven at constant ``speed``, sampled at ``rate`` for ``duration`` seconds.

    ``patterns`` are driven in order, joined by straight connectors: ``lawnmower`` (rows along x,
    ``line_spacing`` apart, half-circle turns), ``loop`` (``loops`` turns of a circle of ``loop_radius``
    about the area's centre; default 0.35 of the shorter side) and ``random_walk`` (``random_walk_length``
    metres with a random turn rate, steered back inside the area). If the patterns end before ``duration``,
    the path is closed back to its start and driven again. The robot follows this reference by pure pursuit
    (``lookahead`` metres ahead) with a turning radius of at least ``min_turn_radius``, so corners are
    rounded, the heading (body x) is the direction of travel and the turn rate is at most
    speed / min_turn_radius.
    Optional wobble: roll and pitch sinusoids [deg] at ``wobble_frequency``, and height ``height_amplitude`` [m].
    """

    patterns: tuple = ("lawnmower", "loop")
    area: tuple = (-5.0, -5.0, 5.0, 5.0)
    inset: float = 0.5
    height: float = 0.0
    speed: float = 0.6
    duration: float = 180.0
    rate: float = 50.0
    line_spacing: float = 1.0
    loop_radius: float | None = None
    loops: int = 1
    random_walk_length: float = 60.0
    turn_rate_std: float = 0.6
    lookahead: float = 0.5
    min_turn_radius: float = 0.4
    roll_amplitude_deg: float = 0.0
    pitch_amplitude_deg: float = 0.0
    wobble_frequency: float = 0.5
    height_amplitude: float = 0.0

    def __post_init__(self) -> None:
        _require(isinstance(self.patterns, (tuple, list)) and len(self.patterns) > 0,
                 f"patterns must be a non-empty sequence of {PATTERNS}, got {self.patterns!r}")
        for p in self.patterns:
            _require(p in PATTERNS, f"unknown trajectory pattern {p!r}; choose from {', '.join(PATTERNS)}")
        _check_area(self.area, "area")
        xmin, ymin, xmax, ymax = self.area
        _require(math.isfinite(self.inset) and self.inset >= 0.0, f"inset must be >= 0, got {self.inset!r}")
        _require(2 * self.inset < min(xmax - xmin, ymax - ymin),
                 f"inset {self.inset} leaves no room inside area {tuple(self.area)!r}")
        _require(math.isfinite(self.height), f"height must be finite, got {self.height!r}")
        _require(math.isfinite(self.speed) and 0.0 < self.speed <= 100.0, f"speed must be in (0, 100] m/s, got "
                 f"{self.speed!r}")
        _require(math.isfinite(self.duration) and 0.0 < self.duration <= 86_400.0,
                 f"duration must be in (0, 86400] s, got {self.duration!r}")
        _require(math.isfinite(self.rate) and 0.0 < self.rate <= 10_000.0, f"rate must be in (0, 10000] Hz, got "
                 f"{self.rate!r}")
        _require(self.duration * self.rate >= 2.0, f"duration * rate must give at least 2 samples, got "
                 f"{self.duration} s at {self.rate} Hz")
        _require(self.duration * self.rate <= 50_000_000, "duration * rate exceeds 5e7 samples")
        _require(math.isfinite(self.line_spacing) and self.line_spacing > 0.0,
                 f"line_spacing must be > 0, got {self.line_spacing!r}")
        if self.loop_radius is not None:
            _require(math.isfinite(self.loop_radius) and self.loop_radius > 0.0,
                     f"loop_radius must be > 0, got {self.loop_radius!r}")
        _require(isinstance(self.loops, int) and 1 <= self.loops <= 10_000, f"loops must be an integer >= 1, got "
                 f"{self.loops!r}")
        _require(math.isfinite(self.random_walk_length) and self.random_walk_length > 0.0,
                 f"random_walk_length must be > 0, got {self.random_walk_length!r}")
        _require(math.isfinite(self.turn_rate_std) and self.turn_rate_std >= 0.0,
                 f"turn_rate_std must be >= 0, got {self.turn_rate_std!r}")
        _require(math.isfinite(self.lookahead) and 0.0 < self.lookahead <= 100.0,
                 f"lookahead must be in (0, 100] m, got {self.lookahead!r}")
        _require(math.isfinite(self.min_turn_radius) and 0.0 < self.min_turn_radius <= 100.0,
                 f"min_turn_radius must be in (0, 100] m, got {self.min_turn_radius!r}")
        for name in ("roll_amplitude_deg", "pitch_amplitude_deg"):
            v = getattr(self, name)
            _require(math.isfinite(v) and 0.0 <= v < 90.0, f"{name} must be in [0, 90), got {v!r}")
        _require(math.isfinite(self.wobble_frequency) and self.wobble_frequency >= 0.0,
                 f"wobble_frequency must be >= 0, got {self.wobble_frequency!r}")
        _require(math.isfinite(self.height_amplitude) and self.height_amplitude >= 0.0,
                 f"height_amplitude must be >= 0, got {self.height_amplitude!r}")

    @property
    def num_samples(self) -> int:
        return int(math.floor(self.duration * self.rate + 1e-9))


_PATH_STEP = 0.02  # metres between points of the dense path


def _lawnmower(cfg: TrajectoryConfig) -> np.ndarray:
    xmin, ymin, xmax, ymax = cfg.area
    r = cfg.line_spacing / 2.0
    x0, x1 = xmin + cfg.inset + r, xmax - cfg.inset - r
    if x1 <= x0:  # area too narrow for half-circle turns: straight rows only
        x0, x1 = xmin + cfg.inset, xmax - cfg.inset
    y_rows = np.arange(ymin + cfg.inset, ymax - cfg.inset + 1e-9, cfg.line_spacing)
    pts: list[np.ndarray] = []
    for i, y in enumerate(y_rows):
        xs = np.array([x0, x1]) if i % 2 == 0 else np.array([x1, x0])
        pts.append(np.column_stack([xs, [y, y]]))
        if i + 1 < len(y_rows):  # half circle to the next row, bulging outwards
            side = 1.0 if i % 2 == 0 else -1.0
            th = np.linspace(-math.pi / 2, math.pi / 2, 24)[1:-1]
            pts.append(np.column_stack([xs[1] + side * r * np.cos(th), y + r + r * np.sin(th)]))
    return np.vstack(pts)


def _loop(cfg: TrajectoryConfig, start: np.ndarray | None) -> np.ndarray:
    xmin, ymin, xmax, ymax = cfg.area
    centre = np.array([(xmin + xmax) / 2.0, (ymin + ymax) / 2.0])
    radius = cfg.loop_radius if cfg.loop_radius is not None else 0.35 * min(xmax - xmin, ymax - ymin)
    phase = -math.pi / 2 if start is None else math.atan2(start[1] - centre[1], start[0] - centre[0])
    n = max(8, int(2 * math.pi * radius * cfg.loops / 0.05))
    th = phase + np.linspace(0.0, 2 * math.pi * cfg.loops, n)
    return centre + radius * np.column_stack([np.cos(th), np.sin(th)])


def _random_walk(cfg: TrajectoryConfig, start: np.ndarray | None, rng: np.random.Generator) -> np.ndarray:
    xmin, ymin, xmax, ymax = cfg.area
    lo = np.array([xmin + cfg.inset, ymin + cfg.inset])
    hi = np.array([xmax - cfg.inset, ymax - cfg.inset])
    centre = (lo + hi) / 2.0
    ds = 0.05
    n = int(math.ceil(cfg.random_walk_length / ds)) + 1
    p = centre.copy() if start is None else np.clip(start, lo, hi)
    yaw = rng.uniform(-math.pi, math.pi)
    omega = 0.0  # turn rate per metre, an Ornstein-Uhlenbeck process with a 2 m correlation length
    out = np.empty((n, 2))
    lookahead = min(1.0, 0.25 * float(np.min(hi - lo)))
    for i in range(n):
        out[i] = p
        omega += -omega * ds / 2.0 + cfg.turn_rate_std * math.sqrt(ds) * rng.normal()
        ahead = p + lookahead * np.array([math.cos(yaw), math.sin(yaw)])
        if np.any(ahead < lo) or np.any(ahead > hi):  # about to leave: steer back towards the centre
            to_c = math.atan2(centre[1] - p[1], centre[0] - p[0])
            err = (to_c - yaw + math.pi) % (2 * math.pi) - math.pi
            yaw += float(np.clip(err, -1.5 * ds, 1.5 * ds))
        yaw += omega * ds
        p = np.clip(p + ds * np.array([math.cos(yaw), math.sin(yaw)]), lo, hi)
    return out


def _densify(poly: np.ndarray, step: float) -> np.ndarray:
    """Points every ``step`` metres along the polyline (its vertices' order kept)."""
    seg = np.linalg.norm(np.diff(poly, axis=0), axis=1)
    s = np.concatenate([[0.0], np.cumsum(seg)])
    keep = np.concatenate([[True], seg > 1e-12])
    s, poly = s[keep], poly[keep]
    if s[-1] <= 0.0:
        return poly[:1]
    grid = np.linspace(0.0, s[-1], int(math.ceil(s[-1] / step)) + 1)
    return np.column_stack([np.interp(grid, s, poly[:, 0]), np.interp(grid, s, poly[:, 1])])


def _fillet(poly: np.ndarray, radius: float) -> np.ndarray:
    """Round every corner of the polyline with a circular arc of ``radius`` tangent to both segments (smaller
    where a segment is too short). The arc lies inside the corner's angle, so a path inside a convex area
    stays inside it, and a vehicle with that turning radius can follow it."""
    keep = np.concatenate([[True], np.linalg.norm(np.diff(poly, axis=0), axis=1) > 1e-9])
    poly = poly[keep]
    if len(poly) < 3:
        return poly
    seg = np.diff(poly, axis=0)
    length = np.linalg.norm(seg, axis=1)
    unit = seg / length[:, None]
    out = [poly[:1]]
    for i in range(1, len(poly) - 1):
        a, b = unit[i - 1], unit[i]
        cross = a[0] * b[1] - a[1] * b[0]
        theta = math.atan2(abs(cross), float(a @ b))  # turning angle in [0, pi]
        if theta < 1e-6:
            out.append(poly[i:i + 1])
            continue
        d = min(radius * math.tan(theta / 2) if theta < math.pi - 1e-6 else math.inf,
                0.5 * length[i - 1], 0.5 * length[i])
        r = d / math.tan(theta / 2)
        sign = 1.0 if cross > 0 else -1.0
        t1 = poly[i] - a * d
        centre = t1 + sign * r * np.array([-a[1], a[0]])
        k = max(2, int(math.ceil(theta * max(r, 1e-3) / 0.02)) + 1)
        phi = np.linspace(0.0, sign * theta, k)
        v = t1 - centre
        out.append(centre + np.column_stack([v[0] * np.cos(phi) - v[1] * np.sin(phi),
                                             v[0] * np.sin(phi) + v[1] * np.cos(phi)]))
    out.append(poly[-1:])
    return np.vstack(out)


def _reference(cfg: TrajectoryConfig, rng: np.random.Generator, length: float) -> np.ndarray:
    """Dense (M, 2) reference path of the patterns joined by straight connectors with rounded corners,
    closed and repeated until at least ``length`` metres."""
    parts: list[np.ndarray] = []
    for name in cfg.patterns:
        start = parts[-1][-1] if parts else None
        if name == "lawnmower":
            parts.append(_lawnmower(cfg))
        elif name == "loop":
            parts.append(_loop(cfg, start))
        else:
            parts.append(_random_walk(cfg, start, rng))
    coarse = np.vstack(parts)
    one_len = float(np.linalg.norm(np.diff(coarse, axis=0), axis=1).sum())
    if one_len < length:  # close the circuit and drive it again
        circuit = np.linalg.norm(coarse[-1] - coarse[0]) + one_len
        coarse = np.vstack([coarse] * (int(math.ceil(length / max(circuit, 1e-9))) + 1))
    return _densify(_fillet(coarse, 1.25 * cfg.min_turn_radius), _PATH_STEP)


def _drive(cfg: TrajectoryConfig, ref: np.ndarray, length: float, step: float = 0.05) -> np.ndarray:
    """A unicycle at constant speed following ``ref`` by pure pursuit: rows (x, y, yaw) every ``step``
    metres of travel. The curvature is bounded by 1 / min_turn_radius, so the heading (the direction of
    travel) is continuous and the turn rate never exceeds speed / min_turn_radius."""
    n = int(math.ceil(length / step)) + 1
    k_max = 1.0 / cfg.min_turn_radius
    look = cfg.lookahead
    rx, ry = ref[:, 0].tolist(), ref[:, 1].tolist()
    last = len(rx) - 1
    x, y = rx[0], ry[0]
    j = 0
    while j < last and math.hypot(rx[j] - x, ry[j] - y) < look:
        j += 1
    yaw = math.atan2(ry[j] - y, rx[j] - x) if j > 0 else 0.0
    out = np.empty((n, 3))
    for i in range(n):
        out[i] = (x, y, yaw)
        while j < last and math.hypot(rx[j] - x, ry[j] - y) < look:
            j += 1
        alpha = math.atan2(ry[j] - y, rx[j] - x) - yaw
        alpha = (alpha + math.pi) % (2.0 * math.pi) - math.pi
        kappa = max(-k_max, min(k_max, 2.0 * math.sin(alpha) / look))
        mid = yaw + 0.5 * kappa * step  # exact chord direction of a constant-curvature step
        x += step * math.cos(mid)
        y += step * math.sin(mid)
        yaw += kappa * step
    return out


def _orientations(yaw: np.ndarray, pitch: np.ndarray, roll: np.ndarray) -> np.ndarray:
    """Body-to-map quaternions [x, y, z, w] from Z-Y-X (yaw, pitch, roll) angles, signs kept continuous."""
    q = Rotation.from_euler("ZYX", np.column_stack([yaw, pitch, roll])).as_quat()
    flip = np.concatenate([[False], np.einsum("ij,ij->i", q[1:], q[:-1]) < 0.0])
    sign = np.where(np.logical_xor.accumulate(flip), -1.0, 1.0)
    q = q * sign[:, None]
    return q * np.where(q[:1, 3] < 0.0, -1.0, 1.0)  # first sample with w >= 0


def make_trajectory(cfg: TrajectoryConfig, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Times (N,) [s from start], body positions (N, 3) [m] and body-to-map quaternions (N, 4) [x, y, z, w]."""
    n = cfg.num_samples
    t = np.arange(n) / cfg.rate
    length = cfg.speed * t[-1]
    step = 0.05
    driven = _drive(cfg, _reference(cfg, rng, 1.5 * length + 10.0 * cfg.lookahead + 5.0), length + step, step)
    s = step * np.arange(len(driven))
    s_t = cfg.speed * t
    xy = np.column_stack([np.interp(s_t, s, driven[:, 0]), np.interp(s_t, s, driven[:, 1])])
    yaw = np.interp(s_t, s, driven[:, 2])
    phases = rng.uniform(0.0, 2 * math.pi, size=3)
    w = 2 * math.pi * cfg.wobble_frequency * t
    roll = math.radians(cfg.roll_amplitude_deg) * np.sin(w + phases[0])
    pitch = math.radians(cfg.pitch_amplitude_deg) * np.sin(1.37 * w + phases[1])
    z = cfg.height + cfg.height_amplitude * np.sin(0.61 * w + phases[2])
    return t, np.column_stack([xy, z]), _orientations(yaw, pitch, roll)


# -------------------------------------------------------------------------------------------------- sensor


@dataclass(frozen=True)
class SensorConfig:
    """A 3-axis magnetometer: white noise (``noise_std`` per axis [T]), a constant sensor-frame ``bias`` [T],
    spikes (each sample independently with probability ``spike_rate``, adding a vector of random direction
    and magnitude uniform in ``spike_magnitude_range`` [T]) and dropouts (each sample independently missing
    with probability ``dropout_rate``). The extrinsic places the sensor in the body: ``translation`` [m] and
    ``rotation`` (sensor-to-body quaternion [x, y, z, w]). ``distortion`` (3x3 row-major, invertible) is the robot's
    soft iron: the reading is ``distortion @ field + bias``."""

    noise_std: float = 0.1e-6
    bias: tuple = (0.0, 0.0, 0.0)
    spike_rate: float = 0.0
    spike_magnitude_range: tuple = (20e-6, 100e-6)
    dropout_rate: float = 0.0
    translation: tuple = (0.0, 0.0, 0.0)
    rotation: tuple = (0.0, 0.0, 0.0, 1.0)
    distortion: tuple = (1.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0)

    def __post_init__(self) -> None:
        d = _finite(self.distortion, "distortion", 9).reshape(3, 3)
        _require(np.linalg.cond(d) < 1e3 and np.all(np.abs(d) <= 10.0), f"distortion must be an invertible 3x3 "
                 f"matrix (row-major, entries within +-10, condition number below 1000), got {self.distortion!r}")
        _require(math.isfinite(self.noise_std) and 0.0 <= self.noise_std <= 1e-3,
                 f"noise_std must be in [0, 1e-3] T, got {self.noise_std!r}")
        b = _finite(self.bias, "bias", 3)
        _require(bool(np.all(np.abs(b) <= 1e-3)), f"bias components must be within +-1e-3 T, got {self.bias!r}")
        _require(0.0 <= self.spike_rate <= 1.0, f"spike_rate must be in [0, 1], got {self.spike_rate!r}")
        _require(0.0 <= self.dropout_rate < 1.0, f"dropout_rate must be in [0, 1), got {self.dropout_rate!r}")
        sm = _finite(self.spike_magnitude_range, "spike_magnitude_range", 2)
        _require(0.0 <= sm[0] <= sm[1] <= 1e-2, f"spike_magnitude_range must be (low, high) T with "
                 f"0 <= low <= high <= 1e-2, got {self.spike_magnitude_range!r}")
        _finite(self.translation, "translation", 3)
        q = _finite(self.rotation, "rotation", 4)
        _require(abs(np.linalg.norm(q) - 1.0) < 1e-6, f"rotation must be a unit quaternion [x, y, z, w], got "
                 f"{self.rotation!r}")

    @property
    def covariance(self) -> np.ndarray:
        """Per-axis noise covariance [T^2], row-major 3x3 (what MagneticField.magnetic_field_covariance holds)."""
        return np.eye(3) * self.noise_std**2


@dataclass
class SimRecording:
    """A simulated run. Every array has one row per instant of the timeline ``t``; ``dropped`` marks the
    instants at which the magnetometer delivered nothing (their readings are kept, but no message exists)."""

    t: np.ndarray  # (N,) seconds from the start
    position: np.ndarray  # (N, 3) body (base_link) position in the map [m]
    orientation_xyzw: np.ndarray  # (N, 4) body-to-map quaternion
    sensor_position: np.ndarray  # (N, 3) sensor position in the map [m]
    sensor_orientation_xyzw: np.ndarray  # (N, 4) sensor-to-map quaternion
    field_map_tesla_true: np.ndarray  # (N, 3) true field at the sensor, map frame [T]
    field_sensor_tesla_true: np.ndarray  # (N, 3) the same field in the sensor frame, noise-free [T]
    field_sensor_tesla: np.ndarray  # (N, 3) the reading: true + bias + noise (+ spike), sensor frame [T]
    is_spike: np.ndarray  # (N,) bool
    dropped: np.ndarray  # (N,) bool
    world: World
    trajectory: TrajectoryConfig
    sensor: SensorConfig
    seed: int

    @property
    def received(self) -> np.ndarray:
        """Mask of the samples the magnetometer delivered."""
        return ~self.dropped

    def __len__(self) -> int:
        return len(self.t)


def simulate(world: World | WorldConfig, trajectory: TrajectoryConfig, sensor: SensorConfig,
             seed: int = 0) -> SimRecording:
    """Drive ``trajectory`` through ``world`` (a World, or a WorldConfig drawn from the seed) and read
    ``sensor`` at every instant. Deterministic for a given seed."""
    _require(isinstance(seed, (int, np.integer)) and not isinstance(seed, bool) and seed >= 0,
             f"seed must be a non-negative integer, got {seed!r}")
    world_ss, traj_ss, sensor_ss = np.random.SeedSequence(int(seed)).spawn(3)
    if isinstance(world, WorldConfig):
        world = World.from_config(world, np.random.default_rng(world_ss))
    _require(isinstance(world, World), f"world must be a World or a WorldConfig, got {type(world).__name__}")
    t, pos, q_body = make_trajectory(trajectory, np.random.default_rng(traj_ss))
    r_body = Rotation.from_quat(q_body)
    r_ext = Rotation.from_quat(np.asarray(sensor.rotation, dtype=float))
    sensor_pos = pos + r_body.apply(np.asarray(sensor.translation, dtype=float))
    r_sensor = r_body * r_ext
    q_sensor = r_sensor.as_quat()
    q_sensor *= np.where(np.einsum("ij,ij->i", q_sensor, q_body) < 0.0, -1.0, 1.0)[:, None]
    b_map = world.field(sensor_pos)
    b_sensor_true = r_sensor.apply(b_map, inverse=True)

    rng = np.random.default_rng(sensor_ss)
    n = len(t)
    noise = rng.normal(scale=sensor.noise_std, size=(n, 3)) if sensor.noise_std > 0 else np.zeros((n, 3))
    is_spike = rng.random(n) < sensor.spike_rate
    dropped = rng.random(n) < sensor.dropout_rate
    spike_dir = rng.normal(size=(n, 3))
    spike_dir /= np.linalg.norm(spike_dir, axis=1, keepdims=True)
    spike_mag = rng.uniform(*sensor.spike_magnitude_range, size=n)
    spikes = np.where(is_spike[:, None], spike_dir * spike_mag[:, None], 0.0)
    distorted = b_sensor_true
    if tuple(sensor.distortion) != (1.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0):  # soft iron (skipped: bit for bit)
        distorted = b_sensor_true @ np.asarray(sensor.distortion, dtype=float).reshape(3, 3).T
    reading = distorted + np.asarray(sensor.bias, dtype=float)[None, :] + noise + spikes
    return SimRecording(t=t, position=pos, orientation_xyzw=q_body, sensor_position=sensor_pos,
                        sensor_orientation_xyzw=q_sensor, field_map_tesla_true=b_map,
                        field_sensor_tesla_true=b_sensor_true, field_sensor_tesla=reading, is_spike=is_spike,
                        dropped=dropped, world=world, trajectory=trajectory, sensor=sensor, seed=int(seed))


def truth_grid(world: World, area: Sequence[float], resolution: float, height: float
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The true field on a grid: cell centres ``xs`` (nx,), ``ys`` (ny,) from the area's corner in steps of
    ``resolution``, and the field (ny, nx, 3) [T] at z = ``height`` (rows are y, as in OccupancyGrid)."""
    _check_area(area, "area")
    _require(math.isfinite(resolution) and resolution > 0.0, f"resolution must be > 0, got {resolution!r}")
    xmin, ymin, xmax, ymax = (float(v) for v in area)
    nx = int(math.floor((xmax - xmin) / resolution + 1e-9)) + 1
    ny = int(math.floor((ymax - ymin) / resolution + 1e-9)) + 1
    _require(nx * ny <= 25_000_000, f"grid of {nx} x {ny} cells is too large; use a coarser resolution")
    xs = xmin + resolution * np.arange(nx)
    ys = ymin + resolution * np.arange(ny)
    gx, gy = np.meshgrid(xs, ys)
    pts = np.column_stack([gx.ravel(), gy.ravel(), np.full(gx.size, float(height))])
    return xs, ys, world.field(pts).reshape(ny, nx, 3)


__all__ = [
    "MU0", "PATTERNS", "SimulationError", "earth_field", "dipole_field", "WorldConfig", "World",
    "TrajectoryConfig", "make_trajectory", "SensorConfig", "SimRecording", "simulate", "truth_grid",
]
