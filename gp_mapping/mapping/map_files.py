"""Map files: a :class:`~gp_mapping.mapping.mapper.MapGrid` as the files that people and other tools open, written
and read in this one place (the replay, ``gp-mapping export`` and ``gp-mapping merge`` write them; the localizer
and the tests read them).

- ``map.npz`` (:func:`write_map_npz`, :func:`read_map_npz`): the map as plain arrays, no pickles;
- ``map.png`` (:func:`draw_map`): every layer's mean, its opacity from the variance, the trajectory;
- nav2 ``map_server`` maps (:func:`write_nav2_maps`, :func:`decode_nav2_map`): per layer and statistic an 8-bit
  binary PGM (or PNG) and its YAML, the grid the node publishes (0..100, 255 unknown; :func:`nav2_cells`);
- ``maps/`` (:data:`MAP_BAG_NAME`; with ``--bare-mcap`` the bare file ``maps.mcap``, :data:`MCAP_NAME`), the
  published maps as a ROS 2 bag, is written by :class:`gp_mapping.bag.MapBagWriter`: it renders the same
  publication in ROS messages through rosbags, so it lives in the bag adapter, above this layer.

The map state (``.safetensors``: the model itself, which a node, export and merge start from) is
:mod:`gp_mapping.mapping.state`'s.
"""
from __future__ import annotations

import math
import struct
import tempfile
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from gp_mapping.mapping.grid import OCCUPANCY_MAX, GridSpec, encode_occupancy

NPZ_NAME = "map.npz"
PNG_NAME = "map.png"
MAP_BAG_NAME = "maps"  # the replay's map bag: a rosbag2 folder (metadata.yaml, maps.mcap)
MCAP_NAME = "maps.mcap"  # the same bag as one bare MCAP file (gp-mapping replay --bare-mcap)
UNKNOWN_PIXEL = 255  # -1 as an unsigned byte: map_server's raw mode publishes it as unknown
NAV2_KEYS = ("image", "mode", "resolution", "origin", "negate", "occupied_thresh", "free_thresh")


class MapFileError(Exception):
    """A file is not the map file it should be (the message says why)."""


def unwritable_folder(folder: Path | None) -> str:
    """Why files cannot be written into ``folder`` (made if missing), or "" when they can (None: nothing to
    check). A command checks its output folder before its work, so a typo costs no replay."""
    if folder is None:
        return ""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as err:
        return f"cannot write into {folder}: {err.strerror or err}"
    return ""


# -------------------------------------------------------------------------------------------------- map.npz


def write_map_npz(path: str | Path, grid, trajectory, provenance: dict[str, str] | None = None) -> Path:
    """Write a map as plain arrays (loadable with ``allow_pickle=False``).

    Keys: ``x`` (W,) and ``y`` (H,) cell-centre coordinates [m]; ``origin`` (2,) corner of cell (0, 0);
    ``resolution``; ``known`` (H, W) bool; ``layers`` (names); per layer ``<layer>_mean`` and
    ``<layer>_variance`` (H, W) in ``field_unit`` (variance in unit squared; rows are y, columns x, as the
    OccupancyGrid): the latent field's; ``<layer>_reading_variance`` (when the grid has it): a reading's,
    latent plus noise, calibrated (docs/calibration.md), what a localizer's measurement model needs; ``field_unit``, ``frame_id``, ``stamp`` (newest sample [s]), ``height`` (z of the cells);
    ``extent`` ("full": the whole visited area plus margin; "window": grow mode's window around the newest
    position, when the whole map exceeds ``grid.max_cells``); ``trajectory`` (K, 2) accepted sensor positions;
    ``provenance`` strings (the replay: ``bag``, ``mag_topic``, ``pose_source``; a merge: ``merged_from``).
    :func:`read_map_npz` reads it back.
    """
    spec = grid.spec
    arrays: dict[str, np.ndarray] = {
        "x": spec.column_centres(), "y": spec.row_centres(),
        "origin": np.array([spec.origin_x, spec.origin_y], dtype=np.float64),
        "resolution": np.float64(spec.resolution), "known": np.asarray(grid.known, dtype=bool),
        "layers": np.array(list(grid.layers), dtype=str), "field_unit": np.array(grid.field_unit),
        "frame_id": np.array(grid.frame_id), "stamp": np.float64(grid.stamp), "height": np.float64(grid.height),
        "extent": np.array(grid.extent),
        "trajectory": np.asarray(trajectory, dtype=np.float64).reshape(-1, 2),
    }
    arrays.update({key: np.array(str(value)) for key, value in (provenance or {}).items()})
    for name, (mean, var) in grid.layers.items():
        arrays[f"{name}_mean"] = np.asarray(mean, dtype=np.float64)
        arrays[f"{name}_variance"] = np.asarray(var, dtype=np.float64)
    for name, var in (grid.reading_variance or {}).items():
        arrays[f"{name}_reading_variance"] = np.asarray(var, dtype=np.float64)
    path = Path(path)
    with open(path, "wb") as fh:  # a file object keeps numpy from appending ".npz" to another suffix
        np.savez_compressed(fh, **arrays)
    return path


def read_map_npz(path: str | Path):
    """A ``map.npz`` (:func:`write_map_npz`) -> (MapGrid, trajectory (K, 2)); MapFileError if it is none."""
    from gp_mapping.mapping.drawing import MapGrid

    try:
        with np.load(path, allow_pickle=False) as npz:
            data = {k: npz[k] for k in npz.files}
    except (OSError, ValueError) as err:
        raise MapFileError(f"{path} is not a readable map.npz: {err}") from err
    try:
        known = np.asarray(data["known"], dtype=bool)
        spec = GridSpec(float(data["origin"][0]), float(data["origin"][1]), float(data["resolution"]),
                        known.shape[1], known.shape[0])
        layers = {str(n): (np.asarray(data[f"{n}_mean"], np.float64), np.asarray(data[f"{n}_variance"], np.float64))
                  for n in data["layers"]}
        reading = {str(n): np.asarray(data[f"{n}_reading_variance"], np.float64) for n in data["layers"]
                   if f"{n}_reading_variance" in data}
        grid = MapGrid(spec, str(data["frame_id"]), str(data["field_unit"]), layers, known, float(data["stamp"]),
                       float(data.get("height", 0.0)), reading_variance=reading or None)
    except (KeyError, IndexError, ValueError) as err:
        raise MapFileError(f"{path} is not a gp_mapping map.npz (missing or malformed {err})") from err
    return grid, np.asarray(data.get("trajectory", np.zeros((0, 2))), dtype=np.float64).reshape(-1, 2)


# -------------------------------------------------------------------------------------------------- map.png


def opacity_from_variance(var: np.ndarray, known: np.ndarray, floor: float = 0.25) -> np.ndarray:
    """Per-cell alpha: 1 at the smallest std among known cells, ``floor`` at the largest, 0 where unknown."""
    std = np.sqrt(np.maximum(np.asarray(var, dtype=np.float64), 0.0))
    alpha = np.zeros(std.shape)
    if not np.any(known):
        return alpha
    lo, hi = float(std[known].min()), float(std[known].max())
    spread = (std - lo) / (hi - lo) if hi > lo else np.zeros(std.shape)
    alpha[known] = 1.0 - (1.0 - floor) * spread[known]
    return alpha


def draw_map(path: str | Path, grid, trajectory, title: str) -> Path:
    """Draw every layer's mean, its opacity from the variance, and the trajectory (matplotlib Agg)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import Normalize
    from matplotlib.cm import ScalarMappable

    from gp_mapping.mapping.measurements import UNIT_SYMBOL

    spec = grid.spec
    known = np.asarray(grid.known, dtype=bool)
    unit = UNIT_SYMBOL.get(grid.field_unit, grid.field_unit)
    extent = (spec.origin_x, spec.origin_x + spec.width * spec.resolution,
              spec.origin_y, spec.origin_y + spec.height * spec.resolution)
    names = list(grid.layers)
    fig, axes = plt.subplots(1, len(names), figsize=(6.4 * len(names), 5.6), squeeze=False)
    trajectory = np.asarray(trajectory, dtype=np.float64).reshape(-1, 2)
    cmap = plt.get_cmap("viridis")
    for ax, name in zip(axes[0], names):
        mean, var = (np.asarray(a, dtype=np.float64) for a in grid.layers[name])
        values = mean[known] if np.any(known) else mean.ravel()
        # The 1st-99th percentile of the known cells: a few extrapolated edge cells must not wash out the rest.
        lo, hi = (float(v) for v in np.percentile(values, [1.0, 99.0]))
        norm = Normalize(vmin=lo, vmax=hi if hi > lo else lo + 1e-12)
        rgba = cmap(norm(mean))
        rgba[..., 3] = opacity_from_variance(var, known)
        ax.set_facecolor("0.85")  # unknown cells show as grey
        ax.imshow(rgba, origin="lower", extent=extent, interpolation="nearest")
        if trajectory.size:
            ax.plot(trajectory[:, 0], trajectory[:, 1], color="white", lw=0.6, alpha=0.8)
            ax.plot(trajectory[:, 0], trajectory[:, 1], color="black", lw=0.25, alpha=0.8)
        label = "|B|" if name in ("magnitude", "norm") else f"B{name}"
        fig.colorbar(ScalarMappable(norm=norm, cmap=cmap), ax=ax, shrink=0.85, extend="both",
                     label=f"{label} [{unit}]")
        ax.set_xlabel(f"x [m] ({grid.frame_id})")
        ax.set_ylabel("y [m]")
        ax.set_aspect("equal")
        ax.set_xlim(extent[0], extent[1])
        ax.set_ylim(extent[2], extent[3])
        ax.set_title(f"{title}: {label} mean\nopacity 1 - normalised std; grey unknown", fontsize=10)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# ------------------------------------------------------------------------------------- nav2 map_server maps


def write_pgm(path: Path, pixels: np.ndarray) -> None:
    """Binary 8-bit PGM (P5) of ``pixels`` (H, W) uint8, row 0 first."""
    pixels = np.ascontiguousarray(pixels, dtype=np.uint8)
    with open(path, "wb") as fh:
        fh.write(f"P5\n{pixels.shape[1]} {pixels.shape[0]}\n255\n".encode("ascii"))
        fh.write(pixels.tobytes())


def read_pgm(path: str | Path) -> np.ndarray:
    """An 8-bit binary PGM (as :func:`write_pgm` writes, comments allowed) -> (H, W) uint8."""
    data = Path(path).read_bytes()
    fields, pos = [], 0
    while len(fields) < 4:
        while data[pos:pos + 1].isspace():
            pos += 1
        if data[pos:pos + 1] == b"#":
            pos = data.index(b"\n", pos) + 1
            continue
        end = pos
        while not data[end:end + 1].isspace():
            end += 1
        fields.append(data[pos:end].decode("ascii"))
        pos = end
    if fields[0] != "P5" or int(fields[3]) != 255:
        raise MapFileError(f"{path} is not an 8-bit binary PGM")
    width, height = int(fields[1]), int(fields[2])
    return np.frombuffer(data[pos + 1:pos + 1 + width * height], dtype=np.uint8).reshape(height, width)


NAV2_IMAGE_FORMATS = ("pgm", "png")  # 8-bit grey images that map_server reads, and :func:`read_image` too
NAV2_THRESHOLDS = (0.25, 0.65)  # free_thresh, occupied_thresh written into the YAML (map_saver's defaults)


PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def write_png(path: Path, pixels: np.ndarray) -> None:
    """8-bit greyscale PNG of ``pixels`` (H, W) uint8, row 0 first (zlib only: filter type 0 on every row)."""
    pixels = np.ascontiguousarray(pixels, dtype=np.uint8)
    height, width = pixels.shape
    rows = np.hstack([np.zeros((height, 1), dtype=np.uint8), pixels])  # each row: filter byte 0, then the pixels
    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)  # 8 bits, greyscale, deflate, no interlace
    with open(path, "wb") as fh:
        fh.write(PNG_SIGNATURE + _png_chunk(b"IHDR", header) + _png_chunk(b"IDAT", zlib.compress(rows.tobytes(), 9))
                 + _png_chunk(b"IEND", b""))


def read_png(path: str | Path) -> np.ndarray:
    """An 8-bit greyscale, non-interlaced PNG whose rows all use filter type 0 (as :func:`write_png` writes)
    -> (H, W) uint8; MapFileError for any other PNG."""
    data = Path(path).read_bytes()
    if not data.startswith(PNG_SIGNATURE):
        raise MapFileError(f"{path} is not a PNG")
    pos, header, idat = len(PNG_SIGNATURE), None, []
    try:
        while pos < len(data):
            (length,) = struct.unpack(">I", data[pos:pos + 4])
            kind, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + length]
            pos += 12 + length
            if kind == b"IHDR":
                header = struct.unpack(">IIBBBBB", body)
            elif kind == b"IDAT":
                idat.append(body)
            elif kind == b"IEND":
                break
        if header is None or header[2:] != (8, 0, 0, 0, 0):
            raise MapFileError(f"{path} is not an 8-bit greyscale, non-interlaced PNG")
        width, height = header[:2]
        rows = np.frombuffer(zlib.decompress(b"".join(idat)), dtype=np.uint8).reshape(height, width + 1)
    except (struct.error, zlib.error, ValueError) as err:
        raise MapFileError(f"{path} is not a readable PNG: {err}") from err
    if np.any(rows[:, 0] != 0):
        raise MapFileError(f"{path} uses PNG row filters; only unfiltered rows (as gp_mapping writes) are read")
    return rows[:, 1:].copy()


def write_image(path: Path, pixels: np.ndarray) -> None:
    """An 8-bit grey image of ``pixels`` (H, W) uint8, row 0 first: PNG for a ``.png`` path, else PGM."""
    (write_png if Path(path).suffix.lower() == ".png" else write_pgm)(path, pixels)


def read_image(path: str | Path) -> np.ndarray:
    """An 8-bit grey image (:func:`write_image`'s PGM or PNG) -> (H, W) uint8."""
    return (read_png if Path(path).suffix.lower() == ".png" else read_pgm)(path)


def nav2_cells(grid, values: np.ndarray, value_range=None, known: np.ndarray | None = None
               ) -> tuple[np.ndarray, float, float]:
    """One statistic of one layer as a nav2 map's cells: (H, W) int8 in 0..100 and -1 where unknown (the
    published map's rule, :func:`gp_mapping.mapping.publication.publishable_known`), row 0 at the grid origin,
    and the ``offset``, ``scale`` that decode a cell ``c`` as ``offset + scale * c``. ``value_range``: the
    colour range (empty or None: the values' own min..max)."""
    from gp_mapping.mapping.publication import publishable_known

    known = publishable_known(grid) if known is None else known
    data, offset, scale = encode_occupancy(np.asarray(values, dtype=np.float64), known, value_range)
    return np.asarray(data, dtype=np.int8).reshape(grid.spec.shape), float(offset), float(scale)


def write_nav2_maps(out: Path, grid, mean_range=None, variance_range=None, image_format: str = "pgm",
                    thresholds: tuple[float, float] = NAV2_THRESHOLDS) -> dict[str, Path]:
    """Per layer and statistic, ``<layer>_<statistic>.<image_format>`` and its ``.yaml`` in ``out``; returns name
    -> path.

    The YAML has map_server's keys (:data:`NAV2_KEYS`) with ``mode: raw``: map_server then publishes each pixel
    value as the OccupancyGrid cell value, so the grid it serves is the one the node publishes: 0..100, and 255
    (-1 as int8) where the cell is unknown (:func:`nav2_cells`). Extra keys say how to read the values:
    ``field_unit``, ``value_offset`` and ``value_scale`` (a pixel ``p`` in 0..100 is ``offset + scale * p``),
    ``value_range``, ``layer``, ``statistic``, ``frame_id``, ``unknown_value``. ``mean_range`` /
    ``variance_range``: the colour range (``grid.mean_range`` / ``grid.variance_range``; empty or None: each
    image's own min..max). ``image_format``: one of :data:`NAV2_IMAGE_FORMATS`. ``thresholds``: the YAML's
    ``free_thresh`` and ``occupied_thresh`` (map_server requires them; raw mode does not use them). Image row 0
    is the top of the map (largest y), as map_server expects.
    """
    from gp_mapping.mapping.publication import publishable_known

    if image_format not in NAV2_IMAGE_FORMATS:
        raise MapFileError(f"image format {image_format!r} is not one of {', '.join(NAV2_IMAGE_FORMATS)}")
    free, occupied = (float(t) for t in thresholds)
    if not 0.0 <= free < occupied <= 1.0:
        raise MapFileError(f"thresholds must satisfy 0 <= free_thresh < occupied_thresh <= 1, got {free} and "
                           f"{occupied}")
    known = publishable_known(grid)
    spec = grid.spec
    files: dict[str, Path] = {}
    for name, (mean, var) in grid.layers.items():
        for statistic, values, value_range in (("mean", mean, mean_range), ("variance", var, variance_range)):
            cells, offset, scale = nav2_cells(grid, values, value_range, known)
            pixels = np.where(cells < 0, UNKNOWN_PIXEL, cells).astype(np.uint8)[::-1]  # row 0 = top (largest y)
            stem = f"{name}_{statistic}"
            image = f"{stem}.{image_format}"
            write_image(out / image, pixels)
            unit = grid.field_unit if statistic == "mean" else f"{grid.field_unit}^2"
            meta: dict[str, Any] = {
                "image": image, "mode": "raw", "resolution": float(spec.resolution),
                "origin": [float(spec.origin_x), float(spec.origin_y), 0.0], "negate": 0,
                "occupied_thresh": occupied, "free_thresh": free,
                "layer": name, "statistic": statistic, "frame_id": grid.frame_id, "field_unit": unit,
                "value_offset": offset, "value_scale": scale,
                "value_range": [offset, float(offset + scale * OCCUPANCY_MAX)],
                "unknown_value": UNKNOWN_PIXEL,
            }
            (out / f"{stem}.yaml").write_text(yaml.safe_dump(meta, sort_keys=False))
            files[image], files[f"{stem}.yaml"] = out / image, out / f"{stem}.yaml"
    return files


def decode_nav2_map(yaml_path: str | Path) -> np.ndarray:
    """Read a nav2 map back: (H, W) values in its ``field_unit``, row 0 at the grid origin, NaN unknown."""
    yaml_path = Path(yaml_path)
    meta = yaml.safe_load(yaml_path.read_text())
    pixels = read_image(yaml_path.parent / meta["image"])[::-1].astype(np.float64)
    values = meta["value_offset"] + meta["value_scale"] * pixels
    values[pixels == meta.get("unknown_value", UNKNOWN_PIXEL)] = math.nan
    return values
