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

Beside them, ``DIR/map.npz`` and ``DIR/map.png`` as the replay writes them. The formats are
:mod:`gp_mapping.mapping.map_files`'.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from gp_mapping.mapping.map_files import (NAV2_THRESHOLDS, NPZ_NAME, PNG_NAME, MapFileError, draw_map, read_map_npz,
                                          write_map_npz, write_nav2_maps)


class ExportError(Exception):
    """The input cannot be exported (the message says why)."""


def read_input(path: str | Path):
    """A state file or a map.npz -> (MapGrid, trajectory, mean_range, variance_range)."""
    path = Path(path)
    if not path.is_file():
        raise ExportError(f"{path} does not exist or is not a file")
    with open(path, "rb") as fh:
        zip_file = fh.read(4) == b"PK\x03\x04"
    if zip_file:
        try:
            grid, trajectory = read_map_npz(path)
        except MapFileError as err:
            raise ExportError(str(err)) from err
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


def export_map(grid, out_dir: str | Path, trajectory=None, mean_range=None, variance_range=None,
               title: str = "map", image_format: str = "pgm",
               thresholds: tuple[float, float] = NAV2_THRESHOLDS) -> dict[str, Path]:
    """Write the nav2 map pairs of every layer, map.npz and map.png into ``out_dir``; returns name -> path.
    ``image_format`` (``pgm`` or ``png``) and ``thresholds`` (the YAMLs' free and occupied thresholds): as
    :func:`~gp_mapping.mapping.map_files.write_nav2_maps` takes them (the node's nav2 ``SaveMap`` passes its
    request's)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    trajectory = np.zeros((0, 2)) if trajectory is None else trajectory
    files = write_nav2_maps(out, grid, mean_range, variance_range, image_format, thresholds)
    files[NPZ_NAME] = write_map_npz(out / NPZ_NAME, grid, trajectory)
    files[PNG_NAME] = draw_map(out / PNG_NAME, grid, trajectory, title)
    return files


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
