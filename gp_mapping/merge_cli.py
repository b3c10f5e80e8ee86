"""``gp-mapping merge A.safetensors B.safetensors ... --out DIR [--config FILE]``: merge saved maps without data.

Each argument is a map state file (``~/save_map``, checkpoints, ``gp-mapping replay --save-state``), optionally
followed by ``@x,y,yaw_deg`` (or ``@x,y,z,yaw_deg``): the rigid transform from that map's frame into the merged
frame. Writes ``DIR/merged.safetensors`` (a state file: start a node from it with ``node.initial_map``, or merge
it again), ``DIR/map.npz`` and ``DIR/map.png`` (as the replay writes them). Maps made from the same data (one
map twice, a map and a map merged or continued from it) are refused: their data would count twice. Tiled maps
merge tile by tile into a map tiled alike. Each map is a session: its constant offset to the first map (another
sensor, another day) is measured where the maps overlap and removed, and printed (``--same-level``: the maps read
alike, merge them as they are). The merge itself is gp_mapping/mapping/merge.py's, which the merger
node (gp_mapping/ros/merger_node.py) drives from model summaries instead of state files.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

STATE_NAME = "merged.safetensors"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("maps", nargs="+", metavar="MAP[@x,y,yaw_deg]",
                        help="map state files, each optionally with its transform into the merged frame")
    parser.add_argument("--out", type=Path, default=Path("out"), help="output folder (default: out)")
    parser.add_argument("--config", type=Path, default=None,
                        help="parameter YAML for the merged map (model kernel, num_inducing, grid); default: the "
                             "first map's config")
    parser.add_argument("--steps", type=int, default=None,
                        help="Adam steps on the global inducing inputs and hyperparameters (per tile for tiled maps; "
                             "0: none, the closed form). Default: for maps of one engine none when the merged "
                             "inducing points explain all the maps' (else 100), for tiled maps none")
    parser.add_argument("--num-inducing", type=int, default=None,
                        help="global inducing points (default: the sum of the maps', up to 1024 or "
                             "model.num_inducing); for tiled maps per tile (default: the largest source tile's, or "
                             "model.num_inducing if larger)")
    parser.add_argument("--same-level", action="store_true",
                        help="the maps read alike (one sensor and its calibration): do not measure and remove a "
                             "constant offset between them")


def _split(arg: str) -> tuple[Path, str | None]:
    path, sep, frame = arg.rpartition("@")
    if sep and path and not Path(arg).exists():
        return Path(path), frame
    return Path(arg), None


def run(args: argparse.Namespace) -> int:
    from gp_mapping.config import ConfigError, load_config
    from gp_mapping.gp.merging import MergeError
    from gp_mapping.mapping.grid import GridError
    from gp_mapping.mapping.mapper import Mapper
    from gp_mapping.mapping.merge import MapSource, levels_text, merge_maps, parse_transform
    from gp_mapping.mapping.state import MapStateError
    from gp_mapping.mapping.map_files import NPZ_NAME, PNG_NAME, draw_map, unwritable_folder, write_map_npz

    def fail(message: str) -> int:
        print(f"gp-mapping merge: error: {message}", file=sys.stderr)
        return 1

    if (args.steps is not None and args.steps < 0) or (args.num_inducing is not None and args.num_inducing < 1):
        return fail("--steps must be >= 0 and --num-inducing >= 1")
    problem = unwritable_folder(Path(args.out))  # before the merge, which can take minutes
    if problem:
        return fail(f"--out: {problem}")
    try:
        config = load_config(args.config) if args.config else None
        sources = []
        for arg in args.maps:
            path, frame = _split(arg)
            sources.append(MapSource.from_mapper(str(path), Mapper.load(path),
                                     parse_transform(frame) if frame is not None else None))
        steps = {} if args.steps is None else {"steps": args.steps, "tiled_steps": args.steps}
        mapper, result = merge_maps(sources, config, num_inducing=args.num_inducing, levels=not args.same_level,
                                    **steps)
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        state = out / STATE_NAME
        mapper.save(state)
        grid = mapper.grid()
        if grid is None:
            return fail("the merged map has no grid to draw")
        names = ", ".join(s.name for s in sources)
        npz = write_map_npz(out / NPZ_NAME, grid, mapper.trajectory, {"merged_from": names})
        png = draw_map(out / PNG_NAME, grid, mapper.trajectory, f"merged: {len(sources)} maps")
    except (ConfigError, MapStateError, MergeError, GridError, OSError) as err:
        return fail(str(err))
    tiles = f"{result.tiles} tiles of up to " if result.tiles else ""
    print(f"merged {len(sources)} maps ({result.num_data} samples, {tiles}{result.num_inducing} inducing points, "
          f"bound {result.bound:.1f} after {result.steps} steps, {result.seconds:.1f} s)")
    if result.levels is not None:
        print(levels_text([s.name for s in sources], result.levels, mapper.config.sync.field_unit))
    for path in (state, npz, png):
        print(f"wrote {Path(path).resolve()}")
    return 0
