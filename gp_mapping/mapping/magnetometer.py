"""The robot's own magnetism: the hard- and soft-iron correction of every reading, and its fit.

Convention (``sync.hard_iron``, ``sync.soft_iron``, docs/magnetometer.md). A raw reading ``m`` in the sensor frame
is corrected to ``S @ (m - h)``: ``h`` is the hard-iron offset (the robot's own constant field, sensor frame, in
the field unit), ``S`` the soft-iron matrix (3x3; it undoes the scaling and skew that the robot's steel and the
sensor's axes give the field). At the defaults (``h = 0``, ``S = I``) no arithmetic is done at all, so the readings
pass bit for bit. :class:`IronCorrection` is the one place that applies it: the sync (node and replay) and the
localizer call it.

The fit (:func:`fit_iron_calibration`) takes arrays: readings in the sensor frame, and where the recording has it
the sensor's orientation and position. The model is ``R_t S (m_t - h) = f(p_t)``: the world-frame field ``f`` does
not turn with the sensor and is a smooth function of position. Indoors ``f`` changes by tens of percent over a
room, so ``f`` is fitted with the calibration: the gradient of a polynomial potential in the position (a
curl-free field, as a magnetic field in free space is), of a degree chosen by cross-validation over blocks of
the recording. With ``c = S h`` the model is linear in ``(S, c, f)``; ``c`` and ``f`` are eliminated by least
squares and ``S`` minimises the rest under ``det S = 1``. Without orientation, an ellipsoid is fitted to the
readings alone (all readings are taken to have one strength: biased wherever the field's strength varies).

Scale. Turning a sensor cannot tell its overall gain: a field twice as strong read by a sensor half as sensitive
reads the same. The fit keeps the readings' volume, ``det S = 1``; the sensor's own gain is taken as right.

Observability. The spread of the field's direction in the sensor frame (its standard deviation along three
principal sensor axes, :attr:`IronCalibration.spread`) says what the turns can determine. Below
:data:`MIN_TURN` on the second axis the sensor was not turned: refused. A weakest axis below
:data:`MIN_TILT_RATIO` of the strongest is the ground robot's case, turning only about one axis: the offset across
that axis and the scale in the plane are fitted, the offset along the axis is kept at 0 and its gain at 1
(``planar``), and the result says so.

Both fits are equivariant: with ``m' = D m + e`` (``det D = 1``) they return ``S' = S D^-1`` and ``h' = D h + e``
exactly, so what is added to a recording is recovered however well ``f`` is modelled.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

#: The field direction's spread [rad, its std] along the second principal sensor axis below which the sensor
#: counts as not turned (about 4.6 degrees).
MIN_TURN = 0.08
#: The weakest axis's spread, relative to the strongest, below which that axis is not observable (planar fit).
MIN_TILT_RATIO = 0.06
#: The same without orientation: the readings' own spread holds the field's change from place to place too (a
#: ground robot's vertical reading changes with the floor's steel), so only a clearly tilted recording is 3-D.
MIN_TILT_RATIO_READINGS = 0.35
#: With positions: a reading "revisits" a place when another reading lies within REVISIT_RADIUS [m] whose field
#: direction in the sensor differs by REVISIT_ANGLE [deg] or more. Only such pairs tell the robot's own field
#: (it turns with the robot) from the world's (it stays with the place): a robot that turns only while driving on
#: (a loop) has its heading tied to its position, and the fit cannot tell them apart. Below MIN_REVISIT_SHARE of
#: the readings revisiting, the fit is refused.
REVISIT_RADIUS = 0.25
REVISIT_ANGLE = 20.0
MIN_REVISIT_SHARE = 0.05
REVISIT_SAMPLES = 1500
#: Readings the fit uses at most (evenly spaced in the recording); more add time, not accuracy.
MAX_SAMPLES = 4000
#: Fewest usable readings for a fit.
MIN_SAMPLES = 50
#: Degrees of the potential polynomial that cross-validation chooses from (1: a constant field).
DEGREES = (1, 2, 4, 6, 8)
#: Robust reweighting: Huber weights at this many robust standard deviations, this many passes.
HUBER_K = 3.0
#: Blocks of the recording that the degree's cross-validation alternates between (each about 2.5 % of it: close
#: enough for the held-out readings to lie among the fitted ones, long enough to hold their correlated errors).
CV_BLOCKS = 40
ROBUST_PASSES = 3
IDENTITY = (1.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0)


class CalibrationError(ValueError):
    """The readings cannot give a calibration (the message says why: too few, not turned enough, ...)."""


# --------------------------------------------------------------------------------------------- the correction


class IronCorrection:
    """``corrected = S @ (raw - h)`` on readings in tesla, with ``h`` given in the field unit (``unit_per_tesla``
    converts). Raises ValueError for a singular ``S`` or non-finite values."""

    def __init__(self, hard_iron=(0.0, 0.0, 0.0), soft_iron=IDENTITY, unit_per_tesla: float = 1e6) -> None:
        h = np.asarray(hard_iron, dtype=np.float64).reshape(-1)
        s = np.asarray(soft_iron, dtype=np.float64)
        if h.shape != (3,) or not np.all(np.isfinite(h)):
            raise ValueError(f"hard_iron must be 3 finite numbers, got {hard_iron!r}")
        if s.size != 9 or not np.all(np.isfinite(s)):
            raise ValueError(f"soft_iron must be 9 finite numbers (3x3, row-major), got {soft_iron!r}")
        s = s.reshape(3, 3)
        if not np.linalg.cond(s) <= 1e6:
            raise ValueError(f"soft_iron {s.ravel().tolist()} is singular")
        self.hard_iron = h            # field unit
        self.soft_iron = s
        self.unit_per_tesla = float(unit_per_tesla)
        self.identity = bool(not h.any() and np.array_equal(s, np.eye(3)))
        self._h_tesla = h / self.unit_per_tesla
        self._s_t = s.T.copy()

    @classmethod
    def from_sync(cls, sync: Any, unit_per_tesla: float) -> "IronCorrection":
        """The correction a ``sync`` config section names (``hard_iron`` in its ``field_unit``)."""
        return cls(sync.hard_iron, sync.soft_iron, unit_per_tesla)

    def apply(self, field_tesla: np.ndarray) -> np.ndarray:
        """Corrected readings, (3,) or (N, 3) tesla; the input itself when the correction is the identity."""
        if self.identity:
            return field_tesla
        return (np.asarray(field_tesla, dtype=np.float64) - self._h_tesla) @ self._s_t


# --------------------------------------------------------------------------------------------- the fit


@dataclass
class IronCalibration:
    """What :func:`fit_iron_calibration` found (fields in the unit of the readings given)."""

    hard_iron: np.ndarray            # (3,) sensor frame
    soft_iron: np.ndarray            # (3, 3): corrected = soft_iron @ (raw - hard_iron)
    method: str                      # "pose" (orientation and position used) or "ellipsoid" (readings alone)
    observable: str                  # "full" or "planar"
    spread: np.ndarray               # (3,) the field direction's std along the principal sensor axes, descending
    spread_axes: np.ndarray          # (3, 3) those axes, as columns (sensor frame)
    residual_before: float           # rms misfit of the raw readings [unit]
    residual_after: float            # rms misfit of the corrected readings [unit]
    samples_given: int
    samples_used: int
    rejected: dict[str, int] = field(default_factory=dict)
    degree: int = 0                  # "pose": degree of the potential polynomial of the world field
    revisit_share: float = math.nan  # "pose" with positions: share of readings that revisit a place turned
    notes: list[str] = field(default_factory=list)

    @property
    def axis(self) -> np.ndarray | None:
        """``planar``: the sensor axis the turns went about (its offset and gain are not fitted)."""
        return self.spread_axes[:, 2] if self.observable == "planar" else None

    def parameters(self) -> dict[str, list[float]]:
        """``{"hard_iron": [3], "soft_iron": [9, row-major]}`` as plain floats (the ``sync`` keys)."""
        return {"hard_iron": [float(v) for v in self.hard_iron],
                "soft_iron": [float(v) for v in self.soft_iron.ravel()]}

    def report(self, unit: str = "uT") -> str:
        """A few lines for a person: the result, its fit and what the turns could determine."""
        h = ", ".join(f"{v:.3f}" for v in self.hard_iron)
        rows = "; ".join("[" + ", ".join(f"{v:.5f}" for v in row) + "]" for row in self.soft_iron)
        spread = ", ".join(f"{math.degrees(v):.1f}" for v in self.spread)
        how = ("orientation and position (world field fitted as a curl-free polynomial of degree "
               f"{self.degree})" if self.method == "pose" else "an ellipsoid fitted to the readings alone")
        lines = [f"hard_iron [{unit}]: [{h}]",
                 f"soft_iron (row-major 3x3): {rows}",
                 f"fitted from {self.samples_used} of {self.samples_given} readings with {how}",
                 f"residual: {self.residual_before:.3f} {unit} rms before, {self.residual_after:.3f} {unit} after"
                 + (" (the misfit to a smooth world field)" if self.method == "pose" else
                    " (std of the field strength)"),
                 f"turns: the field direction spread {spread} deg (std) along three sensor axes; "
                 + ("all three observable" if self.observable == "full" else
                    "planar: turns about one axis only, " + _axis_words(self.spread_axes[:, 2]))]
        if self.rejected:
            lines.append("readings not used: " + ", ".join(f"{k} {v}" for k, v in self.rejected.items() if v))
        if math.isfinite(self.revisit_share):
            lines.append(f"places seen turned: {100 * self.revisit_share:.0f} % of the readings have another within "
                         f"{REVISIT_RADIUS} m whose field direction differs by {REVISIT_ANGLE:.0f} deg or more")
        lines += self.notes
        return "\n".join(lines)


def _axis_words(axis: np.ndarray) -> str:
    text = "[" + ", ".join(f"{v:.2f}" for v in axis) + "]"
    return (f"sensor axis {text}: the offset along it and its gain cannot be determined and are kept at 0 and 1; "
            "the offset across it and the scale and skew in the plane are fitted")


def fit_iron_calibration(readings, orientations_xyzw=None, positions=None, *, mode: str = "auto",
                         degree: int | None = None, max_samples: int = MAX_SAMPLES) -> IronCalibration:
    """Fit the hard- and soft-iron calibration to ``readings`` ((N, 3), sensor frame, any unit: the result is in
    it). With ``orientations_xyzw`` ((N, 4), sensor-to-world [x, y, z, w]) the world field is modelled as a
    smooth function of ``positions`` ((N, 3) [m]; None: a constant field); without, an ellipsoid is fitted.

    ``mode``: ``auto`` (full, or planar when the turns were about one axis), ``full`` or ``planar``. ``degree``:
    the world field's polynomial degree (None: chosen by cross-validation). Raises CalibrationError with the
    reason when the readings cannot give a calibration."""
    if mode not in ("auto", "full", "planar"):
        raise ValueError(f"mode must be 'auto', 'full' or 'planar', got {mode!r}")
    m = np.asarray(readings, dtype=np.float64)
    if m.ndim != 2 or m.shape[1] != 3:
        raise CalibrationError(f"readings must have shape (N, 3), got {m.shape}")
    n_given = m.shape[0]
    rejected = {"nonfinite_reading": 0, "zero_reading": 0, "nonfinite_pose": 0}
    ok = np.all(np.isfinite(m), axis=1)
    rejected["nonfinite_reading"] = int(np.count_nonzero(~ok))
    zero = ok & ~np.any(m, axis=1)
    rejected["zero_reading"] = int(np.count_nonzero(zero))
    ok &= ~zero
    q = p = None
    if orientations_xyzw is not None:
        q = np.asarray(orientations_xyzw, dtype=np.float64)
        if q.shape != (n_given, 4):
            raise CalibrationError(f"orientations must have shape ({n_given}, 4), got {q.shape}")
        good = np.all(np.isfinite(q), axis=1) & (np.linalg.norm(np.where(np.isfinite(q), q, 0.0), axis=1) > 1e-6)
        if positions is not None:
            p = np.asarray(positions, dtype=np.float64)
            if p.shape != (n_given, 3):
                raise CalibrationError(f"positions must have shape ({n_given}, 3), got {p.shape}")
            good &= np.all(np.isfinite(p), axis=1)
        rejected["nonfinite_pose"] = int(np.count_nonzero(ok & ~good))
        ok &= good
    elif positions is not None:
        raise CalibrationError("positions without orientations: the world field needs the orientation to be used")
    idx = np.flatnonzero(ok)
    if idx.size < MIN_SAMPLES:
        raise CalibrationError(f"only {idx.size} usable readings of {n_given} (at least {MIN_SAMPLES} needed)"
                               + _rejected_words(rejected))
    if idx.size > max_samples:
        idx = idx[np.linspace(0, idx.size - 1, max_samples).round().astype(int)]
    m = m[idx]
    rot = None
    if q is not None:
        from scipy.spatial.transform import Rotation

        rot = Rotation.from_quat(q[idx]).as_matrix()  # (n, 3, 3) sensor -> world
        p = p[idx] if p is not None else None
    spread, axes = _direction_spread(m, rot)
    chosen = _observability(spread, axes, mode, MIN_TILT_RATIO if rot is not None else MIN_TILT_RATIO_READINGS)
    common = dict(spread=spread, spread_axes=axes, samples_given=n_given, samples_used=int(idx.size),
                  rejected={k: v for k, v in rejected.items() if v}, observable=chosen)
    if rot is not None:
        share = math.nan
        if p is not None:
            share = revisit_share(m, rot, p)
            if share < MIN_REVISIT_SHARE:
                raise CalibrationError(
                    f"the sensor turned only while moving on: {100 * share:.1f} % of the readings have another within "
                    f"{REVISIT_RADIUS} m seen at a field direction {REVISIT_ANGLE:.0f} deg or more apart (at least "
                    f"{100 * MIN_REVISIT_SHARE:.0f} % needed), so the robot's own field, which turns with it, cannot be "
                    "told from the world's, which changes along the path. Turn in place, or drive over the same spots "
                    "in several directions")
        return _fit_with_pose(m, rot, p, degree, common, share)
    if chosen == "full" and mode == "auto":
        try:
            return _fit_ellipsoid(m, common)
        except CalibrationError:
            common["observable"] = "planar"
            result = _fit_ellipsoid(m, common)
            result.notes.append("the readings fit no ellipsoid: fitted as turns about one axis")
            return result
    return _fit_ellipsoid(m, common)


def revisit_share(m: np.ndarray, rot: np.ndarray, p: np.ndarray) -> float:
    """Share of readings with another within REVISIT_RADIUS whose field direction in the sensor differs by
    REVISIT_ANGLE or more (of at most REVISIT_SAMPLES readings, evenly spaced)."""
    from scipy.spatial import cKDTree

    if m.shape[0] > REVISIT_SAMPLES:
        keep = np.linspace(0, m.shape[0] - 1, REVISIT_SAMPLES).round().astype(int)
        m, rot, p = m[keep], rot[keep], p[keep]
    g = np.einsum("nij,nj->i", rot, m)
    g /= np.linalg.norm(g)
    u = np.einsum("nji,j->ni", rot, g)
    limit = math.cos(math.radians(REVISIT_ANGLE))
    neighbours = cKDTree(p).query_ball_point(p, REVISIT_RADIUS)
    turned = [bool(np.any(u[np.asarray(nb, dtype=int)] @ u[i] < limit)) for i, nb in enumerate(neighbours)]
    return float(np.mean(turned))


def _rejected_words(rejected: dict[str, int]) -> str:
    parts = [f"{k} {v}" for k, v in rejected.items() if v]
    return f" (not used: {', '.join(parts)})" if parts else ""


def _direction_spread(m: np.ndarray, rot: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """The field direction's std along its principal sensor axes (descending) and those axes (columns). With the
    orientation: the world field's mean direction seen from the sensor, ``R_t^T g``. Without: the readings over
    their typical strength (an offset does not change their spread)."""
    if rot is not None:
        g = np.einsum("nij,nj->i", rot, m)
        g /= np.linalg.norm(g)
        u = np.einsum("nji,j->ni", rot, g)
    else:
        u = m / np.median(np.linalg.norm(m, axis=1))
    values, vectors = np.linalg.eigh(np.cov(u.T))
    order = np.argsort(values)[::-1]
    return np.sqrt(np.clip(values[order], 0.0, None)), vectors[:, order]


def _observability(spread: np.ndarray, axes: np.ndarray, mode: str, tilt_ratio: float) -> str:
    turned = ", ".join(f"{math.degrees(v):.1f}" for v in spread)
    if spread[1] < MIN_TURN:
        raise CalibrationError(
            f"the sensor was not turned enough: the field's direction spread {turned} deg (std) along three sensor "
            f"axes, and a calibration needs at least {math.degrees(MIN_TURN):.1f} deg on two of them. Record the "
            "robot turning in place (two full turns or more), or the hand-held sensor in a figure eight")
    if mode == "full":
        if spread[2] < 1e-3 * spread[0]:
            raise CalibrationError(f"mode full: the sensor never turned about a second axis (spread {turned} deg); "
                                   "the offset along one axis cannot be determined (use mode auto or planar)")
        return "full"
    if mode == "planar":
        return "planar"
    return "full" if spread[2] >= tilt_ratio * spread[0] else "planar"


def _symmetric_from(params: np.ndarray) -> np.ndarray:
    """A 2x2 symmetric positive definite matrix of determinant 1 from (log-stretch, angle)."""
    lam, psi = params
    c, s = math.cos(psi), math.sin(psi)
    rot = np.array([[c, -s], [s, c]])
    return rot @ np.diag([math.exp(lam), math.exp(-lam)]) @ rot.T


# -------------------------------------------------------------------- with the pose: the world field is smooth


def _monomial_exponents(degree: int) -> np.ndarray:
    return np.array([e for d in range(1, degree + 1) for e in itertools.product(range(d + 1), repeat=3)
                     if sum(e) == d], dtype=int).reshape(-1, 3)


def _gradient_basis(x: np.ndarray, degree: int) -> np.ndarray:
    """(n, 3, K): the gradients of the monomials of degree 1..``degree`` in the (normalised) positions ``x``."""
    exps = _monomial_exponents(degree)
    out = np.zeros((x.shape[0], 3, exps.shape[0]))
    powers = [np.stack([x[:, a] ** k for k in range(degree + 1)], axis=1) for a in range(3)]  # (n, degree + 1)
    for k, e in enumerate(exps):
        for a in range(3):
            if e[a] == 0:
                continue
            term = e[a] * powers[a][:, e[a] - 1]
            for b in range(3):
                if b != a:
                    term = term * powers[b][:, e[b]]
            out[:, a, k] = term
    return out


class _PoseProblem:
    """The linear pieces of ``A m - c - R^T G w = 0`` on a set of readings (sensor frame)."""

    def __init__(self, m: np.ndarray, rot: np.ndarray, basis: np.ndarray, weights: np.ndarray,
                 frame: np.ndarray, planar: bool, project: bool = True) -> None:
        n = m.shape[0]
        sw = np.repeat(np.sqrt(weights), 3)[:, None]
        self.frame, self.planar = frame, planar
        mt = m @ frame                                                  # readings in the fit's sensor axes
        g = np.einsum("ji,njk->nik", frame, np.einsum("nji,njk->nik", rot, basis))  # frame^T R^T G
        ncols = 2 if planar else 3
        xc = np.zeros((n, 3, ncols))
        xc[:, np.arange(ncols), np.arange(ncols)] = -1.0
        other = np.concatenate([xc, -g], axis=2).reshape(3 * n, -1) * sw
        self.other = other
        if planar:  # A = [[a11, a12, 0], [a12, a22, 0], [0, 0, 1]]: the columns of a11, a12, a22, and the rest
            cols = np.zeros((n, 3, 4))
            cols[:, 0, 0], cols[:, 0, 1] = mt[:, 0], mt[:, 1]
            cols[:, 1, 1], cols[:, 1, 2] = mt[:, 0], mt[:, 1]
            cols[:, 2, 3] = mt[:, 2]
        else:       # A general: row-major vec(A)
            cols = np.zeros((n, 3, 9))
            for i in range(3):
                cols[:, i, 3 * i:3 * i + 3] = mt
        self.cols = cols.reshape(3 * n, -1) * sw
        if not project:  # held-out readings: only scored
            return
        u, s, _ = np.linalg.svd(other, full_matrices=False)
        self.orth = u[:, s > s[0] * 1e-10] if s.size and s[0] > 0 else u[:, :0]
        projected = self.cols - self.orth @ (self.orth.T @ self.cols)
        self.quad = projected.T @ projected

    def solve(self) -> np.ndarray:
        """The soft-iron matrix (in the fit's axes) minimising the misfit under det = 1."""
        from scipy.optimize import minimize

        if self.planar:
            h = self.quad

            def cost(params: np.ndarray) -> float:
                a2 = _symmetric_from(params)
                v = np.array([a2[0, 0], a2[0, 1], a2[1, 1], 1.0])
                return float(v @ h @ v)

            starts = [np.array([0.0, psi]) for psi in (0.0, math.pi / 4)]
            best = min((minimize(cost, s0, method="Nelder-Mead", options={"xatol": 1e-10, "fatol": 1e-14,
                                                                           "maxiter": 4000}) for s0 in starts),
                       key=lambda r: r.fun)
            out = np.eye(3)
            out[:2, :2] = _symmetric_from(best.x)
            return out
        quad = self.quad

        def cost(a: np.ndarray) -> tuple[float, np.ndarray]:
            mat = a.reshape(3, 3)
            det = np.linalg.det(mat)
            if det <= 0:
                return 1e300, np.zeros(9)
            value = float(a @ quad @ a)
            scale = det ** (-2.0 / 3.0)
            grad = 2.0 * (quad @ a) * scale - (2.0 / 3.0) * value * scale * np.linalg.inv(mat).T.ravel()
            return value * scale, grad

        res = minimize(cost, np.eye(3).ravel(), jac=True, method="BFGS", options={"gtol": 1e-12, "maxiter": 5000})
        mat = res.x.reshape(3, 3)
        return mat / np.linalg.det(mat) ** (1.0 / 3.0)

    def vector(self, a_fit: np.ndarray) -> np.ndarray:
        return (np.array([a_fit[0, 0], a_fit[0, 1], a_fit[1, 1], 1.0]) if self.planar else a_fit.ravel())

    def rest(self, a_fit: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The least-squares ``(c, w)`` for a soft-iron matrix, and the weighted residual (3n,)."""
        y = self.cols @ self.vector(a_fit)
        sol, *_ = np.linalg.lstsq(self.other, -y, rcond=None)
        return sol, y + self.other @ sol


def _positions_scaled(p: np.ndarray | None, n: int) -> tuple[np.ndarray, float, np.ndarray]:
    if p is None:
        return np.zeros((n, 3)), 1.0, np.zeros(3)
    centre = p.mean(axis=0)
    scale = float(np.abs(p - centre).max()) or 1.0
    return (p - centre) / scale, scale, centre


def _fit_pose_once(m, rot, x, degree, weights, frame, planar):
    problem = _PoseProblem(m, rot, _gradient_basis(x, degree), weights, frame, planar)
    a_fit = problem.solve()
    sol, residual = problem.rest(a_fit)
    return problem, a_fit, sol, residual


def _per_sample(residual: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Unweighted per-reading residual norms from the weighted stacked residual."""
    r = residual.reshape(-1, 3) / np.sqrt(np.maximum(weights, 1e-300))[:, None]
    return np.linalg.norm(r, axis=1)


def _huber(norms: np.ndarray) -> np.ndarray:
    scale = 1.4826 * float(np.median(norms)) + 1e-300
    return np.minimum(1.0, HUBER_K * scale / np.maximum(norms, 1e-300))


def _choose_degree(m, rot, x, weights, frame, planar, has_positions: bool) -> int:
    """Blocked two-fold cross-validation: fit on alternate blocks (CV_BLOCKS in all) of the recording, score on the
    others."""
    if not has_positions:
        return 1
    n = m.shape[0]
    block = (np.arange(n) * CV_BLOCKS) // n % 2
    best, best_score = 1, math.inf
    for degree in DEGREES:
        score = 0.0
        for fold in (0, 1):
            train, test = block == fold, block != fold
            problem, a_fit, sol, _ = _fit_pose_once(m[train], rot[train], x[train], degree, weights[train], frame,
                                                    planar)
            held = _PoseProblem(m[test], rot[test], _gradient_basis(x[test], degree), weights[test], frame, planar,
                                project=False)
            r = held.cols @ problem.vector(a_fit) + held.other @ sol
            score += float(np.sum(r ** 2))
        if score < best_score:
            best, best_score = degree, score
    return best


def _fit_with_pose(m: np.ndarray, rot: np.ndarray, p: np.ndarray | None, degree: int | None,
                   common: dict[str, Any], share: float) -> IronCalibration:
    planar = common["observable"] == "planar"
    frame = common["spread_axes"] if planar else np.eye(3)   # planar: the turn axis is the fit's third axis
    n = m.shape[0]
    x, _, _ = _positions_scaled(p, n)
    weights = np.ones(n)
    if degree is None:
        degree = _choose_degree(m, rot, x, weights, frame, planar, p is not None)
    elif p is None:
        degree = 1
    for _ in range(ROBUST_PASSES):
        problem, a_fit, sol, residual = _fit_pose_once(m, rot, x, degree, weights, frame, planar)
        weights = _huber(_per_sample(residual, weights))
    problem, a_fit, sol, residual = _fit_pose_once(m, rot, x, degree, weights, frame, planar)
    c_fit = np.zeros(3)
    c_fit[:2 if planar else 3] = sol[:2 if planar else 3]
    h_fit = np.linalg.solve(a_fit, c_fit)
    soft = frame @ a_fit @ frame.T
    hard = frame @ h_fit
    after = float(np.sqrt(np.mean(_per_sample(residual, weights) ** 2)))
    # Before: the raw readings with the same world-field model.
    raw = _PoseProblem(m, rot, _gradient_basis(x, degree), np.ones(n), np.eye(3), False)
    _, raw_residual = raw.rest(np.eye(3))
    before = float(np.sqrt(np.mean(np.sum(raw_residual.reshape(-1, 3) ** 2, axis=1))))
    notes = []
    if p is None:
        notes.append("no positions: the world field was taken as constant (fine for a turn in place; a drive "
                     "through a building needs the positions)")
    outliers = int(np.count_nonzero(weights < 0.5))
    if outliers:
        notes.append(f"{outliers} readings weighed down as outliers (misfit above {2 * HUBER_K:.0f} robust SDs)")
    return IronCalibration(hard_iron=hard, soft_iron=soft, method="pose", residual_before=before,
                           residual_after=after, degree=int(degree), notes=notes, revisit_share=share, **common)


# ------------------------------------------------------------------ without orientation: an ellipsoid fit


def _conic_fit(z: np.ndarray, weights: np.ndarray) -> tuple[np.ndarray, np.ndarray, float]:
    """Algebraic fit of ``z^T M z + 2 n^T z + d = 0`` (z: (n, k), k = 2 or 3); returns (M, n, d), M positive."""
    k = z.shape[1]
    pairs = [(i, j) for i in range(k) for j in range(i, k)]
    design = np.column_stack([z[:, i] * z[:, j] * (1.0 if i == j else 2.0) for i, j in pairs]
                             + [2.0 * z[:, i] for i in range(k)] + [np.ones(z.shape[0])])
    _, _, vt = np.linalg.svd(design * np.sqrt(weights)[:, None], full_matrices=False)
    v = vt[-1]
    mat = np.zeros((k, k))
    for value, (i, j) in zip(v, pairs):
        mat[i, j] = mat[j, i] = value
    lin, const = v[len(pairs):len(pairs) + k], v[-1]
    if np.trace(mat) < 0:
        mat, lin, const = -mat, -lin, -const
    return mat, lin, const


def _ellipse_to_calibration(mat: np.ndarray, lin: np.ndarray, const: float) -> tuple[np.ndarray, np.ndarray]:
    """Centre and the symmetric matrix A (det 1) with |A (z - centre)| constant on the conic."""
    centre = -np.linalg.solve(mat, lin)
    level = float(centre @ mat @ centre - const)
    values, vectors = np.linalg.eigh(mat / level)
    if level <= 0 or np.any(values <= 0):
        raise CalibrationError("the readings do not lie on an ellipsoid (the fitted quadric is not one): turn the "
                               "sensor through more orientations")
    a = vectors @ np.diag(np.sqrt(values)) @ vectors.T
    return centre, a / np.linalg.det(a) ** (1.0 / a.shape[0])


def _fit_ellipsoid(m: np.ndarray, common: dict[str, Any]) -> IronCalibration:
    planar = common["observable"] == "planar"
    frame = common["spread_axes"]
    mt = m @ frame
    k = 2 if planar else 3
    z = mt[:, :k]
    shift = z.mean(axis=0)
    scale = float(np.std(z - shift)) or 1.0
    zn = (z - shift) / scale
    weights = np.ones(z.shape[0])
    for _ in range(ROBUST_PASSES + 1):
        centre_n, a = _ellipse_to_calibration(*_conic_fit(zn, weights))
        radii = np.linalg.norm((zn - centre_n) @ a.T, axis=1)
        weights = _huber(np.abs(radii - np.median(radii)))
    h_fit = np.zeros(3)
    h_fit[:k] = shift + centre_n * scale
    a_fit = np.eye(3)
    a_fit[:k, :k] = a
    soft = frame @ a_fit @ frame.T
    hard = frame @ h_fit
    corrected = (m - hard) @ soft.T
    before = float(np.std(np.linalg.norm(m, axis=1)))
    after = float(np.std(np.linalg.norm(corrected, axis=1)))
    notes = ["no orientation in the recording: an ellipsoid fitted to the readings alone assumes one field strength "
             "everywhere; indoors, where the strength changes from place to place, it is biased (record the pose, "
             "or calibrate turning in place in one spot)"]
    if planar:
        notes.append("ellipse in the plane of the turns: the residual is the spread of the corrected readings' "
                     "strength in 3-D, the axis's share included")
    return IronCalibration(hard_iron=hard, soft_iron=soft, method="ellipsoid", residual_before=before,
                           residual_after=after, notes=notes, **common)


__all__ = ["CalibrationError", "DEGREES", "IDENTITY", "IronCalibration", "IronCorrection", "MAX_SAMPLES",
           "MIN_TILT_RATIO", "MIN_TURN", "fit_iron_calibration"]
