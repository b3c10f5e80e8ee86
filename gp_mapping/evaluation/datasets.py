"""Loaders for the public magnetometer recordings used by the tests and the benchmarks.

The project ships none of these files. They live in a folder beside the checkout (``../shared/data``) or
wherever the environment variable ``GP_MAPPING_DATA`` points; see :func:`shared_data_root`. Every loader
returns plain numpy arrays in the units its field names state, and refuses a missing or corrupt file with a
:class:`DatasetError` that names the file and what is wrong with it.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

DATA_ENV_VAR = "GP_MAPPING_DATA"
SOLIN2018_DIR = "solin2018_invensense"
OSMAN2021_DIR = "osman2021_optitrack"
OSMAN2021_FILE = "measurements_aligned_simple_trajectory.mat"
SOLIN2018_SEQUENCES = (1, 2, 3, 4, 5)

# A unit quaternion from motion capture is normalised to float precision; anything further off is corrupt.
_QUATERNION_NORM_TOLERANCE = 1e-3


class DatasetError(ValueError):
    """A recording is malformed: wrong shape, non-numeric or non-finite values, inconsistent lengths."""


class DatasetNotFoundError(DatasetError, FileNotFoundError):
    """A recording (or the folder holding the recordings) does not exist."""


def shared_data_root() -> Path:
    """The folder holding the recordings.

    ``$GP_MAPPING_DATA`` when set (it must exist); otherwise ``../shared/data`` beside the repository
    (the checkout that holds this package), then ``../shared/data`` relative to the working directory.
    """
    env = os.environ.get(DATA_ENV_VAR)
    if env:
        path = Path(env).expanduser()
        if not path.is_dir():
            raise DatasetNotFoundError(f"${DATA_ENV_VAR} points to {path}, which is not a directory")
        return path
    candidates = [Path(__file__).resolve().parents[2].parent / "shared" / "data",
                  Path.cwd().parent / "shared" / "data"]
    for path in candidates:
        if path.is_dir():
            return path
    raise DatasetNotFoundError(
        "no recordings folder found; set $" + DATA_ENV_VAR + " or place the data at one of: "
        + ", ".join(str(p) for p in candidates))


def _dataset_dir(root: str | Path | None, name: str) -> Path:
    """``root`` may be the data root (holding ``name``) or the dataset folder itself."""
    base = shared_data_root() if root is None else Path(root).expanduser()
    if (base / name).is_dir():
        return base / name
    if base.is_dir():
        return base
    raise DatasetNotFoundError(f"dataset folder {base} does not exist")


def _read_csv(path: Path, columns: int) -> np.ndarray:
    """A headerless comma-separated numeric table with exactly ``columns`` columns, all finite."""
    if not path.is_file():
        raise DatasetNotFoundError(f"missing file {path}")
    try:
        table = np.loadtxt(path, delimiter=",", dtype=np.float64, ndmin=2)
    except ValueError as err:
        raise DatasetError(f"{path} is not a numeric comma-separated table: {err}") from err
    if table.shape[0] == 0:
        raise DatasetError(f"{path} holds no rows")
    if table.shape[1] != columns:
        raise DatasetError(f"{path} has {table.shape[1]} columns, expected {columns}")
    bad = ~np.isfinite(table).all(axis=1)
    if bad.any():
        raise DatasetError(f"{path} has non-finite values in {int(bad.sum())} rows (first: row {int(np.argmax(bad))})")
    return table


@dataclass(frozen=True)
class Solin2018Sequence:
    """One trajectory of the Solin et al. (2018) wheeled-robot recording (50 Hz, 2-D positions)."""

    sequence: int
    t: np.ndarray         # (N,) seconds since the start of the trial
    xy: np.ndarray        # (N, 2) sensor position [m], room frame
    field_uT: np.ndarray  # (N, 3) calibrated field in the room frame [uT]

    @property
    def magnitude_uT(self) -> np.ndarray:
        """(N,) field strength |B| [uT], the target the reference experiments map."""
        return np.linalg.norm(self.field_uT, axis=1)

    def __len__(self) -> int:
        return self.t.shape[0]


def load_solin2018(root: str | Path | None, sequence: int) -> Solin2018Sequence:
    """Read sequence ``sequence`` (1..5) from ``N-time.csv``, ``N-loc.csv``, ``N-mag.csv`` (no header).

    ``root`` is the data root or the ``solin2018_invensense`` folder; None means :func:`shared_data_root`.
    """
    if isinstance(sequence, bool) or not isinstance(sequence, (int, np.integer)) or sequence not in SOLIN2018_SEQUENCES:
        raise DatasetError(f"Solin 2018 sequence must be one of {SOLIN2018_SEQUENCES}, got {sequence!r}")
    folder = _dataset_dir(root, SOLIN2018_DIR)
    t = _read_csv(folder / f"{sequence}-time.csv", 1)[:, 0]
    xy = _read_csv(folder / f"{sequence}-loc.csv", 2)
    field = _read_csv(folder / f"{sequence}-mag.csv", 3)
    if not (len(t) == len(xy) == len(field)):
        raise DatasetError(f"Solin 2018 sequence {sequence} in {folder}: row counts differ "
                           f"(time {len(t)}, loc {len(xy)}, mag {len(field)})")
    if np.any(np.diff(t) <= 0):
        raise DatasetError(f"{folder / f'{sequence}-time.csv'}: time stamps are not strictly increasing")
    return Solin2018Sequence(sequence=int(sequence), t=t, xy=xy, field_uT=field)


@dataclass(frozen=True)
class Osman2021Recording:
    """The Osman et al. (2021) handheld IMU recording with OptiTrack pose (200 Hz, 6-DoF)."""

    t: np.ndarray                 # (N,) seconds, k * T
    position: np.ndarray          # (N, 3) OptiTrack position [m]
    orientation_xyzw: np.ndarray  # (N, 4) unit quaternion [x, y, z, w], sensor-to-world (ROS order)
    field_sensor_nT: np.ndarray   # (N, 3) magnetometer, sensor frame [nT], as recorded
    field_world_uT: np.ndarray    # (N, 3) R(q) field_sensor, world frame [uT]
    accelerometer: np.ndarray     # (N, 3) sensor frame [m/s^2]
    gyroscope: np.ndarray         # (N, 3) sensor frame [rad/s]

    @property
    def magnitude_uT(self) -> np.ndarray:
        """(N,) field strength |B| [uT] (frame independent)."""
        return np.linalg.norm(self.field_world_uT, axis=1)

    def __len__(self) -> int:
        return self.t.shape[0]


def _mat_array(contents: dict, key: str, rows: int, path: Path) -> np.ndarray:
    if key not in contents:
        raise DatasetError(f"{path} lacks the variable '{key}'")
    value = np.asarray(contents[key], dtype=np.float64)
    if value.ndim != 2 or value.shape[0] != rows:
        raise DatasetError(f"{path}: variable '{key}' has shape {value.shape}, expected ({rows}, N)")
    if not np.isfinite(value).all():
        raise DatasetError(f"{path}: variable '{key}' holds non-finite values")
    return value.T.copy()


def load_osman2021(path: str | Path | None = None) -> Osman2021Recording:
    """Read the MATLAB file; ``path`` may be the .mat file, its folder or the data root (None: shared root).

    The file stores ``q_opti`` scalar first ([w, x, y, z]) as the body-to-world rotation; it is returned
    scalar last ([x, y, z, w], the ROS order) and used to rotate the sensor-frame field into the world frame.
    """
    from scipy.io import loadmat

    from gp_mapping.mapping.frames import rotate_vectors

    p = Path(path).expanduser() if path is not None else None
    if p is None or not p.suffix == ".mat":
        p = _dataset_dir(p, OSMAN2021_DIR) / OSMAN2021_FILE
    if not p.is_file():
        raise DatasetNotFoundError(f"missing file {p}")
    try:
        contents = loadmat(str(p))
    except Exception as err:  # scipy raises several unrelated types for a damaged file
        raise DatasetError(f"{p} is not a readable MATLAB v5 file: {err}") from err
    u = _mat_array(contents, "u", 9, p)
    position = _mat_array(contents, "p_opti", 3, p)
    q_wxyz = _mat_array(contents, "q_opti", 4, p)
    period = _mat_array(contents, "T", 1, p)
    if period.size != 1 or not period[0, 0] > 0:
        raise DatasetError(f"{p}: sample period 'T' must be one positive number, got {period.ravel()}")
    n = u.shape[0]
    if not (position.shape[0] == q_wxyz.shape[0] == n):
        raise DatasetError(f"{p}: sample counts differ (u {n}, p_opti {position.shape[0]}, q_opti {q_wxyz.shape[0]})")
    norms = np.linalg.norm(q_wxyz, axis=1)
    off = np.abs(norms - 1.0) > _QUATERNION_NORM_TOLERANCE
    if off.any():
        raise DatasetError(f"{p}: {int(off.sum())} orientation quaternions are not unit length "
                           f"(first at sample {int(np.argmax(off))}, norm {norms[np.argmax(off)]:.6f})")
    q_xyzw = np.concatenate([q_wxyz[:, 1:4], q_wxyz[:, :1]], axis=1) / norms[:, None]
    field_sensor_nT = u[:, 6:9]
    field_world_uT = rotate_vectors(q_xyzw, field_sensor_nT) * 1e-3
    t = np.arange(n, dtype=np.float64) * float(period[0, 0])
    return Osman2021Recording(t=t, position=position, orientation_xyzw=q_xyzw, field_sensor_nT=field_sensor_nT,
                              field_world_uT=field_world_uT, accelerometer=u[:, 0:3], gyroscope=u[:, 3:6])
