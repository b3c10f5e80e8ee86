"""``gp-mapping export STATE_OR_NPZ --out DIR``: a map as files that other tools open.

The input is a map state file (``~/save_map``, a checkpoint, ``gp-mapping replay --save-state``; safetensors)
or a replay's ``map.npz``. For each layer and statistic the export writes a nav2 ``map_server`` map, an
8-bit binary PGM plus its YAML::

    DIR/<layer>_mean.pgm      DIR/<layer>_mean.yaml
    DIR/<layer>_variance.pgm  DIR/<layer>_variance.yaml

The YAML has map_server's keys (``image``, ``mode``, ``resolution``, ``origin``, ``negate``,
``occupied_thresh``, ``free_thresh``) with ``mode: raw``: map_server then publishes each pixel value as the
OccupancyGrid cell value, so the grid it serves is the one the node publishes: 0..100, and 255 (-1 as int8)
where the cell is unknown. The thresholds are written because map_server requires them; raw mode does not
use them. Extra keys say how to read the values: ``field_unit`` (the variance's is the unit squared),
``value_offset`` and ``value_scale`` (a pixel ``p`` in 0..100 is the value ``offset + scale * p``, within half
a step), ``value_range`` (the values of pixels 0 and 100), ``layer``, ``statistic``, ``frame_id``,
``unknown_value`` (255). The colour range is the state's ``grid.mean_range`` / ``grid.variance_range`` when
set, else each image's own min..max. Image row 0 is the top of the map (largest y), as map_server expects.

Beside them, ``DIR/map.npz`` and ``DIR/map.png`` as the replay writes them.
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from gp_mapping.mapping.grid import OCCUPANCY_MAX, GridSpec, encode_occupancy

UNKNOWN_PIXEL = 255  # -1 as an unsigned byte: map_server's raw mode publishes it as unknown
NAV2_KEYS = ("image", "mode", "resolution", "origin", "negate", "occupied_thresh", "free_thresh")


class ExportError(Exception):
    """The input cannot be exported (the message says why)."""


def read_map_npz(path: str | Path):
    """A replay's ``map.npz`` (:func:`gp_mapping.replay.write_map_npz`) -> (MapGrid, trajectory (K, 2))."""
    from gp_mapping.mapping.mapper import MapGrid

    try:
        with np.load(path, allow_pickle=False) as npz:
            data = {k: npz[k] for k in npz.files}
    except (OSError, ValueError) as err:
        raise ExportError(f"{path} is not a readable map.npz: {err}") from err
    try:
        known = np.asarray(data["known"], dtype=bool)
        spec = GridSpec(float(data["origin"][0]), float(data["origin"][1]), float(data["resolution"]),
                        known.shape[1], known.shape[0])
        layers = {str(n): (np.asarray(data[f"{n}_mean"], np.float64), np.asarray(data[f"{n}_variance"], np.float64))
                  for n in data["layers"]}
        grid = MapGrid(spec, str(data["frame_id"]), str(data["field_unit"]), layers, known, float(data["stamp"]),
                       float(data.get("height", 0.0)))
    except (KeyError, IndexError, ValueError) as err:
        raise ExportError(f"{path} is not a gp_mapping map.npz (missing or malformed {err})") from err
    return grid, np.asarray(data.get("trajectory", np.zeros((0, 2))), dtype=np.float64).reshape(-1, 2)


def read_input(path: str | Path):
    """A state file or a map.npz -> (MapGrid, trajectory, mean_range, variance_range)."""
    path = Path(path)
    if not path.is_file():
        raise ExportError(f"{path} does not exist or is not a file")
    with open(path, "rb") as fh:
        zip_file = fh.read(4) == b"PK\x03\x04"
    if zip_file:
        grid, trajectory = read_map_npz(path)
        return grid, trajectory, None, None
    from gp_mapping.mapping.mapper import Mapper

    try:
        mapper = Mapper.load(path)
    except Exception as err:  # MapStateError and whatever an unreadable file raises
        raise ExportError(f"{path} is neither a map.npz nor a readable map state file: {err}") from err
    grid = mapper.export_grid()  # the whole map, or the window when the whole one exceeds grid.max_cells
    if grid is None:
        raise ExportError(f"the map state {path} holds no data yet (no update ran), so there is no map to export")
    return grid, mapper.trajectory, mapper.config.grid.mean_range, mapper.config.grid.variance_range


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
        raise ExportError(f"{path} is not an 8-bit binary PGM")
    width, height = int(fields[1]), int(fields[2])
    return np.frombuffer(data[pos + 1:pos + 1 + width * height], dtype=np.uint8).reshape(height, width)


def export_map(grid, out_dir: str | Path, trajectory=None, mean_range=None, variance_range=None,
               title: str = "map") -> dict[str, Path]:
    """Write the nav2 map pairs of every layer, map.npz and map.png into ``out_dir``; returns name -> path."""
    from gp_mapping.replay import NPZ_NAME, PNG_NAME, draw_map, write_map_npz
    from gp_mapping.mapping.publication import publishable_known  # the published map's rule

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    known = publishable_known(grid)
    spec = grid.spec
    files: dict[str, Path] = {}
    trajectory = np.zeros((0, 2)) if trajectory is None else trajectory
    for name, (mean, var) in grid.layers.items():
        for statistic, values, value_range in (("mean", mean, mean_range), ("variance", var, variance_range)):
            data, offset, scale = encode_occupancy(np.asarray(values, dtype=np.float64), known, value_range)
            cells = data.reshape(spec.shape)
            pixels = np.where(cells < 0, UNKNOWN_PIXEL, cells).astype(np.uint8)[::-1]  # row 0 = top (largest y)
            stem = f"{name}_{statistic}"
            write_pgm(out / f"{stem}.pgm", pixels)
            unit = grid.field_unit if statistic == "mean" else f"{grid.field_unit}^2"
            meta: dict[str, Any] = {
                "image": f"{stem}.pgm", "mode": "raw", "resolution": float(spec.resolution),
                "origin": [float(spec.origin_x), float(spec.origin_y), 0.0], "negate": 0,
                "occupied_thresh": 0.65, "free_thresh": 0.25,
                "layer": name, "statistic": statistic, "frame_id": grid.frame_id, "field_unit": unit,
                "value_offset": float(offset), "value_scale": float(scale),
                "value_range": [float(offset), float(offset + scale * OCCUPANCY_MAX)],
                "unknown_value": UNKNOWN_PIXEL,
            }
            (out / f"{stem}.yaml").write_text(yaml.safe_dump(meta, sort_keys=False))
            files[f"{stem}.pgm"], files[f"{stem}.yaml"] = out / f"{stem}.pgm", out / f"{stem}.yaml"
    files[NPZ_NAME] = write_map_npz(out / NPZ_NAME, grid, trajectory)
    files[PNG_NAME] = draw_map(out / PNG_NAME, grid, trajectory, title)
    return files


def decode_nav2_map(yaml_path: str | Path) -> np.ndarray:
    """Read an exported map back: (H, W) values in its ``field_unit``, row 0 at the grid origin, NaN unknown."""
    yaml_path = Path(yaml_path)
    meta = yaml.safe_load(yaml_path.read_text())
    pixels = read_pgm(yaml_path.parent / meta["image"])[::-1].astype(np.float64)
    values = meta["value_offset"] + meta["value_scale"] * pixels
    values[pixels == meta.get("unknown_value", UNKNOWN_PIXEL)] = math.nan
    return values


# ----------------------------------------------------------------------------------------------- command


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("input", type=Path, metavar="STATE_OR_NPZ",
                        help="a map state file (~/save_map, a checkpoint, replay --save-state) or a map.npz")
    parser.add_argument("--out", type=Path, default=Path("export"),
                        help="output folder (default: export): <layer>_{mean,variance}.{pgm,yaml}, map.npz, map.png")


def run(args: argparse.Namespace) -> int:
    from gp_mapping.mapping.grid import GridError

    try:
        grid, trajectory, mean_range, variance_range = read_input(args.input)
        files = export_map(grid, args.out, trajectory, mean_range, variance_range, title=args.input.name)
    except (ExportError, GridError, OSError) as err:
        print(f"gp-mapping export: error: {err}", file=sys.stderr)
        return 1
    for path in files.values():
        print(f"wrote {path.resolve()}")
    return 0
