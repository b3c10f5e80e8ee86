"""`gp-mapping merge`: saved maps of two simulated robots merged into one map; frames; duplicates refused."""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch
from scipy.spatial.transform import Rotation

from gp_mapping import sim
from gp_mapping.cli import main
from gp_mapping.config import config_from_dict
from gp_mapping.mapping.mapper import Mapper
from gp_mapping.mapping.merge import DuplicateSourceError, MapSource, merge_maps, parse_transform

# One engine per map here; tiled maps (merged tile by tile) have their own test below.
CONFIG = {"model": {"num_inducing": 48, "device": "cpu", "tile_size": 0.0}, "grid": {"resolution": 0.25},
          "batching": {"size": 50}}
TILED = {"model": {"num_inducing": 32, "device": "cpu", "tile_size": 5.0, "tile_overlap": 1.5},
         "grid": {"resolution": 0.25}, "batching": {"size": 50}}
TILED_SHIFT = np.array([10.0, -5.0])  # whole tiles of TILED
SHIFT = np.array([10.0, -3.0])  # robot B's own frame: map = robot + SHIFT, rotated by YAW
YAW = 90.0


def _record(world, area, seed):
    return sim.simulate(world, sim.TrajectoryConfig(area=area, duration=60, rate=20, patterns=("lawnmower",),
                                                    line_spacing=0.8, inset=0.1),
                        sim.SensorConfig(noise_std=0.1e-6), seed=seed)


def _map(rec, to_robot=None, config=None) -> Mapper:
    """A mapper fed the recording; with ``to_robot`` (a Rotation and a shift) the poses are given in the robot's
    own frame (map = R robot + shift): the magnitude does not depend on the frame."""
    mapper = Mapper(config_from_dict(config or CONFIG))
    for k, t in enumerate(rec.t):
        pos, quat = rec.position[k], rec.orientation_xyzw[k]
        if to_robot is not None:
            rot, shift = to_robot
            pos = rot.inv().apply(pos - np.array([shift[0], shift[1], 0.0]))
            quat = (rot.inv() * Rotation.from_quat(quat)).as_quat()
        mapper.add_pose(float(t), pos, quat)
        mapper.add_magnetic_field(float(t) + 1e-3, rec.field_sensor_tesla[k])
    mapper.flush()
    return mapper


@pytest.fixture(scope="module")
def saved_maps(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("maps")
    world = sim.World.from_config(sim.WorldConfig(area=(-5, -5, 5, 5), depth_range=(1.0, 2.5)),
                                  np.random.default_rng(3))
    a = _map(_record(world, (-5, -5, 0, 5), 1))
    b = _map(_record(world, (0, -5, 5, 5), 2), (Rotation.from_euler("z", YAW, degrees=True), SHIFT))
    a.save(tmp / "A.safetensors")
    b.save(tmp / "B.safetensors")
    return tmp, world, a, b


def _rmse_known(grid, world) -> float:
    c = grid.spec.cell_centres()
    mean = grid.layers["magnitude"][0].reshape(-1)
    known = np.asarray(grid.known).reshape(-1)
    inside = known & (np.abs(c[:, 0]) < 4.5) & (np.abs(c[:, 1]) < 4.5)
    truth = world.magnitude(np.column_stack([c[inside], np.zeros(int(inside.sum()))])) * 1e6
    return float(np.sqrt(np.mean((mean[inside] - truth) ** 2)))


def test_merge_command_writes_a_state_the_node_starts_from_and_a_map_of_both_halves(saved_maps, capsys):
    tmp, world, a, b = saved_maps
    out = tmp / "out"
    b_arg = f"{tmp / 'B.safetensors'}@{SHIFT[0]},{SHIFT[1]},{YAW}"
    assert main(["merge", str(tmp / "A.safetensors"), b_arg, "--out", str(out), "--steps", "30"]) == 0
    for name in ("merged.safetensors", "map.npz", "map.png"):
        assert (out / name).stat().st_size > 0
    merged = Mapper.load(out / "merged.safetensors", config=config_from_dict(CONFIG))  # what node.initial_map does
    assert set(merged.lineage) == {a.source_id, b.source_id, merged.source_id}
    assert merged.model.num_seen == a.model.num_seen + b.model.num_seen
    grid = merged.grid()
    with np.load(out / "map.npz", allow_pickle=False) as npz:
        np.testing.assert_allclose(npz["magnitude_mean"], grid.layers["magnitude"][0])
    # The merged map covers both halves (B moved into the map frame) and is far better than either half.
    c = grid.spec.cell_centres()
    assert c[:, 0].min() < -4.5 and c[:, 0].max() > 4.5 and c[:, 1].min() < -4.5
    rmse = _rmse_known(grid, world)
    b_moved = merge_maps([MapSource.from_mapper("B", b, parse_transform(f"{SHIFT[0]},{SHIFT[1]},{YAW}"))], steps=0)[0]
    print(f"merged {rmse:.3f} uT on known cells")
    for half in (a, b_moved):
        truth_grid = merged.grid()  # same cells for every map compared
        pred = half.model.predict(truth_grid.spec.cell_centres())[0][:, 0].numpy()
        known = np.asarray(truth_grid.known).reshape(-1)
        inside = known & (np.abs(c[:, 0]) < 4.5) & (np.abs(c[:, 1]) < 4.5)
        truth = world.magnitude(np.column_stack([c[inside], np.zeros(int(inside.sum()))])) * 1e6
        alone = float(np.sqrt(np.mean((pred[inside] - truth) ** 2)))
        print(f"one half alone {alone:.3f} uT")
        assert rmse < 0.5 * alone
    # A new session starts from the merged map and keeps mapping.
    before = merged.model.num_seen
    merged.model.update(np.array([[0.0, 0.0], [0.1, 0.0]]), np.array([[50.0], [50.1]]))
    assert merged.model.num_seen == before + 2


def test_a_map_merged_with_itself_or_with_a_map_derived_from_it_is_refused(saved_maps, capsys):
    tmp, _, a, b = saved_maps
    path = str(tmp / "A.safetensors")
    assert main(["merge", path, path, "--out", str(tmp / "dup")]) == 1
    err = capsys.readouterr().err
    assert "same map twice" in err and "count those data twice" in err
    assert not (tmp / "dup" / "merged.safetensors").exists()
    merged, _ = merge_maps([MapSource.from_mapper("A", a), MapSource.from_mapper("B", b)], steps=0)
    with pytest.raises(DuplicateSourceError, match="holds data of the other"):
        merge_maps([MapSource.from_mapper("merged", merged), MapSource.from_mapper("B", b)], steps=0)
    # A map that was saved and continued is still the same source.
    continued = Mapper.load(path)
    with pytest.raises(DuplicateSourceError):
        merge_maps([MapSource.from_mapper("A", a), MapSource.from_mapper("A continued", continued)], steps=0)


def test_merge_command_reports_bad_input(saved_maps, capsys, tmp_path):
    tmp, _, _, _ = saved_maps
    assert main(["merge", str(tmp_path / "missing.safetensors"), "--out", str(tmp_path)]) == 1
    assert "missing.safetensors" in capsys.readouterr().err
    not_a_map = tmp_path / "x.safetensors"
    not_a_map.write_bytes(b"\x80\x04pickle")
    assert main(["merge", str(not_a_map), "--out", str(tmp_path)]) == 1
    assert "error" in capsys.readouterr().err
    assert main(["merge", f"{tmp / 'A.safetensors'}@1,2", "--out", str(tmp_path)]) == 1
    assert "x,y,yaw_deg" in capsys.readouterr().err


def test_model_summaries_round_trip_and_bad_ones_are_refused(saved_maps):
    """What the mapper sends on ~/model: safetensors bytes that decode to the same source; anything else (too
    large, truncated, not safetensors, a pickle, non-finite or mistyped tensors) is refused with a reason."""
    import pickle

    from gp_mapping.mapping.merge import SummaryError, decode_summary, encode_summary

    _, _, a, b = saved_maps
    tf = parse_transform(f"{SHIFT[0]},{SHIFT[1]},{YAW}")
    src = MapSource.from_mapper("A", a)
    data = encode_summary(src)
    back = decode_summary(data, len(data), name="A")
    assert back.source_id == a.source_id and back.lineage == a.lineage and back.num_seen == a.model.num_seen
    np.testing.assert_array_equal(back.coverage_cells, a.coverage.cells)
    direct, _ = merge_maps([src, MapSource.from_mapper("B", b, tf)], steps=5)
    via_bytes, _ = merge_maps([back, MapSource.from_mapper("B", b, tf)], steps=5)
    xy = np.random.default_rng(0).uniform(-4, 4, (50, 2))
    for u, v in zip(direct.model.predict(xy), via_bytes.model.predict(xy)):
        torch.testing.assert_close(u, v, rtol=1e-9, atol=1e-9)
    with pytest.raises(SummaryError, match="more than the limit"):
        decode_summary(data, len(data) - 1)
    bad = [data[: len(data) // 2], b"junk", pickle.dumps({"z": 1}), b"\x00" * 64]
    for blob in bad:
        with pytest.raises(SummaryError):
            decode_summary(blob, 10**8)
    for key, value in (("site_W", src.summary["site_W"] * float("nan")), ("z", src.summary["z"].float())):
        tampered = MapSource(**{**src.__dict__, "summary": {**src.summary, key: value}})
        with pytest.raises(SummaryError, match="NaN|expected"):
            decode_summary(encode_summary(tampered), 10**8)



def test_a_merged_map_is_calibrated_on_its_sources_records_which_summaries_carry(saved_maps):
    """A summary carries its map's calibration records (its out-of-sample errors), and the merged map's
    calibration is fitted on the sources' together (Engine.pool_calibration), so the merged map does not state
    the latent variance and noise alone. Tampered records are refused with a reason; a summary without them (a
    sender before they were carried) still merges, its records missing from the fit."""
    from gp_mapping.gp.calibration import CALIBRATION_MIN_RECORDS
    from gp_mapping.mapping.merge import SummaryError, decode_summary, encode_summary

    _, _, a, b = saved_maps
    tf = parse_transform(f"{SHIFT[0]},{SHIFT[1]},{YAW}")
    src_a, src_b = MapSource.from_mapper("A", a), MapSource.from_mapper("B", b, tf)
    kept = [int(s.calibration["filled"].any(1).sum()) for s in (src_a, src_b)]
    assert min(kept) >= CALIBRATION_MIN_RECORDS
    back = decode_summary(encode_summary(src_a), 10**8, name="A")
    for k, v in src_a.calibration.items():
        torch.testing.assert_close(back.calibration[k], v)
    half = decode_summary(encode_summary(src_a, "float32"), 10**8, name="A")
    torch.testing.assert_close(half.calibration["err2"], src_a.calibration["err2"], rtol=1e-6, atol=1e-9)
    merged, _ = merge_maps([back, src_b], steps=0)
    cal = merged.model.calibration
    assert int(cal.record_count) == sum(kept)
    assert float(cal.extra) > 0.0 or float(cal.scale) > 1.0 or float(cal.widen) > 1.0  # wider than latent + noise
    one_map = merge_maps([src_a], steps=0)[0].model.calibration
    torch.testing.assert_close(one_map.extra, a.model.calibration.extra)  # the source's own records, its own fit
    xy = np.random.default_rng(0).uniform(-4, 4, (50, 2))
    merged_var = merged.model.predict_reading(xy)[1]
    latent_var = merged.model.predict(xy)[1]
    assert bool((merged_var > latent_var).all())
    without = MapSource(**{**src_a.__dict__, "calibration": None})
    old, _ = merge_maps([decode_summary(encode_summary(without), 10**8), src_b], steps=0)
    assert int(old.model.calibration.record_count) == kept[1]
    for key, value, match in (("err2", src_a.calibration["err2"] * float("nan"), "finite"),
                              ("latent_var", -src_a.calibration["latent_var"], "none negative"),
                              ("slope2", src_a.calibration["slope2"][:3], "like the others"),
                              ("filled", src_a.calibration["filled"].double(), "expected torch.bool")):
        tampered = MapSource(**{**src_a.__dict__, "calibration": {**src_a.calibration, key: value}})
        with pytest.raises(SummaryError, match=match):
            decode_summary(encode_summary(tampered), 10**8)


@pytest.fixture(scope="module")
def tiled_maps():
    """Robot A's tiled map of the left half; robot B's of the right half, in its own frame (a quarter turn and
    whole tiles from the map frame)."""
    world = sim.World.from_config(sim.WorldConfig(area=(-5, -5, 5, 5), depth_range=(1.0, 2.5)),
                                  np.random.default_rng(3))
    a = _map(_record(world, (-5, -5, 0, 5), 1), config=TILED)
    b = _map(_record(world, (0, -5, 5, 5), 2), (Rotation.from_euler("z", YAW, degrees=True), TILED_SHIFT),
             config=TILED)
    return world, a, b


def test_tiled_maps_merge_tile_by_tile_into_a_tiled_map_a_node_continues(tiled_maps, tmp_path, capsys):
    """Maps made with tiles (the shipped setting) merge tile by tile: robot B's frame is a quarter turn and whole
    tiles from the map frame, so its tiles land on tiles. The merged map is tiled alike, loads with the same
    config (what node.initial_map does), keeps mapping, and maps both halves far better than either. A frame
    that does not carry tiles onto tiles, a tiled map with a map of one engine, and a several-tile map's summary
    for ~/model are refused with the reason."""
    from gp_mapping.gp import TiledModel
    from gp_mapping.gp.merging import MergeError
    from gp_mapping.mapping.merge import SummaryError, decode_summary, encode_summary

    world, a, b = tiled_maps
    assert a.model.num_tiles > 1 and b.model.num_tiles > 1
    a.save(tmp_path / "A.safetensors")
    b.save(tmp_path / "B.safetensors")
    b_frame = f"{TILED_SHIFT[0]},{TILED_SHIFT[1]},{YAW}"
    out = tmp_path / "out"
    assert main(["merge", str(tmp_path / "A.safetensors"), f"{tmp_path / 'B.safetensors'}@{b_frame}",
                 "--out", str(out)]) == 0  # per tile the closed form by default
    assert "tiles of up to" in capsys.readouterr().out
    merged = Mapper.load(out / "merged.safetensors", config=config_from_dict(TILED))
    assert isinstance(merged.model, TiledModel) and merged.model.layout == a.model.layout
    assert merged.model.num_seen == a.model.num_seen + b.model.num_seen
    # calibrated on both sources' records, and saved so (the merged state file holds the fit)
    assert int(merged.model.calibration.record_count) == sum(
        int(m.model.calibration_records()["filled"].any(1).sum()) for m in (a, b))
    b_moved = merge_maps([MapSource.from_mapper("B", b, parse_transform(b_frame))], steps=0)[0]
    assert set(merged.model.tile_indices()) == set(a.model.tile_indices()) | set(b_moved.model.tile_indices())
    grid = merged.grid()
    rmse = _rmse_known(grid, world)
    c = grid.spec.cell_centres()
    inside = np.asarray(grid.known).reshape(-1) & (np.abs(c[:, 0]) < 4.5) & (np.abs(c[:, 1]) < 4.5)
    truth = world.magnitude(np.column_stack([c[inside], np.zeros(int(inside.sum()))])) * 1e6
    for half in (a, b_moved):
        alone = float(np.sqrt(np.mean((half.model.predict(c[inside])[0][:, 0].numpy() - truth) ** 2)))
        with capsys.disabled():
            print(f"tiled: merged {rmse:.3f} uT, one half alone {alone:.3f} uT")
        assert rmse < 0.5 * alone
    before = merged.model.num_seen
    merged.model.update(np.array([[0.0, 0.0], [0.1, 0.0]]), np.array([[50.0], [50.1]]))
    assert merged.model.num_seen == before + 2
    # Refusals, each with its reason.
    assert main(["merge", str(tmp_path / "A.safetensors"), f"{tmp_path / 'B.safetensors'}@{SHIFT[0]},{SHIFT[1]},"
                 f"{YAW}", "--out", str(tmp_path / "bad")]) == 1
    assert "carry its tiles onto tiles" in capsys.readouterr().err
    untiled = _map(_record(world, (0, -5, 5, 5), 2), config=CONFIG)
    with pytest.raises(MergeError, match="merges tile by tile, only with maps tiled alike"):
        merge_maps([MapSource.from_mapper("A", a), MapSource.from_mapper("B", untiled)], steps=0)
    # What a mapper node sends on ~/model: the tiles, decoded to the same merge; tampering is refused.
    tf = parse_transform(b_frame)
    data = encode_summary(MapSource.from_mapper("A", a))
    back = decode_summary(data, len(data), name="A")
    assert back.summary is None and sorted(back.tiles.tiles) == sorted(a.model.tile_indices())
    direct, _ = merge_maps([MapSource.from_mapper("A", a), MapSource.from_mapper("B", b, tf)])
    via_bytes, _ = merge_maps([back, MapSource.from_mapper("B", b, tf)])
    xy = np.random.default_rng(0).uniform(-4, 4, (50, 2))
    for u, v in zip(direct.model.predict(xy), via_bytes.model.predict(xy)):
        torch.testing.assert_close(u, v, rtol=1e-9, atol=1e-9)
    src = MapSource.from_mapper("A", a)
    index = next(iter(src.tiles.tiles))
    bad_tile = dict(src.tiles.tiles[index], site_W=src.tiles.tiles[index]["site_W"] * float("nan"))
    tampered = MapSource(**{**src.__dict__, "tiles": dataclasses.replace(src.tiles,
                                                                          tiles={**src.tiles.tiles, index: bad_tile})})
    with pytest.raises(SummaryError, match="NaN"):
        decode_summary(encode_summary(tampered), 10**8)
    from safetensors.torch import load, save
    metadata = json.loads(data[8:8 + int.from_bytes(data[:8], "little")])["__metadata__"]
    extra = load(data)
    extra["tile/99_99/z"] = extra[next(k for k in extra if k.endswith("/z"))].clone()
    with pytest.raises(SummaryError, match="unexpected tensor"):
        decode_summary(save(extra, metadata=metadata), 10**8)
    for change, match in (({"sizes": [5.0, 2.5]}, "no such tiled map"), ({"overlap": -1.0}, "malformed tile layout"),
                          ({"tiles": {}}, "unexpected tensor"), ({"input_dims": 1}, "no such tiled map")):
        bad = dict(metadata, tiled=json.dumps({**json.loads(metadata["tiled"]), **change}))
        with pytest.raises(SummaryError, match=match):
            decode_summary(save(load(data), metadata=bad), 10**8)


def test_a_tiled_map_too_large_for_one_message_goes_in_parts_the_merger_puts_together(tiled_maps):
    """~/model of a map whose tiles outgrow one message: parts of as many tiles as fit, changed tiles first, then
    the others in turn; the merger's assembly of the parts merges exactly as the whole summary does, refuses to
    merge while a tile is missing, drops what it holds when the parts come from another map, and a part whose
    tile list does not hold its own tiles is refused."""
    from gp_mapping.gp.merging import MergeError
    from gp_mapping.mapping.merge import (SummaryError, TileRotation, assemble_tiles, decode_summary, encode_summary,
                                          tile_summary_bytes)

    _, a, b = tiled_maps
    sizes, samples = tile_summary_bytes(a.model), a.model.tile_samples()
    assert len(sizes) >= 3 and set(sizes) == set(samples)
    budget = 2 * max(sizes.values())  # two tiles a part
    rotation, held, parts = TileRotation(), None, []
    for _ in sizes:
        part = rotation.choose(samples, sizes, budget)
        assert 1 <= len(part) <= 2 and sum(sizes[i] for i in part) <= budget
        data = encode_summary(MapSource.from_mapper("A", a, tiles=part))
        assert len(data) <= sum(sizes[i] for i in part) + 65536  # the estimate holds
        back = decode_summary(data, len(data), name="A")
        assert back.tile_index == samples and sorted(back.tiles.tiles) == sorted(part) and back.summary is None
        rotation.sent(part, samples)
        parts.append(part)
        held = assemble_tiles(held, back)
        if not held.missing_tiles:
            break
        with pytest.raises(MergeError, match="part of a tiled map: it holds"):
            merge_maps([held], steps=0)
    assert sorted(i for p in parts for i in p) == sorted(sizes)  # each tile once, none twice before all went
    assert held.tile_index is None and sorted(held.tiles.tiles) == sorted(sizes)
    tf = parse_transform(f"{TILED_SHIFT[0]},{TILED_SHIFT[1]},{YAW}")
    whole, _ = merge_maps([MapSource.from_mapper("A", a), MapSource.from_mapper("B", b, tf)])
    assembled, _ = merge_maps([held, MapSource.from_mapper("B", b, tf)])
    xy = np.random.default_rng(0).uniform(-4, 4, (50, 2))
    for u, v in zip(whole.model.predict(xy), assembled.model.predict(xy)):
        torch.testing.assert_close(u, v, rtol=1e-9, atol=1e-9)
    # The map standing still: the parts go round again, longest unsent first; a tile that took data goes first.
    assert rotation.choose(samples, sizes, budget) == parts[0]
    moved = dict(samples)
    moved[parts[-1][0]] += 5
    assert rotation.choose(moved, sizes, budget)[0] == parts[-1][0]
    assert rotation.choose(samples, sizes, min(sizes.values()) - 1) == []  # no tile fits: nothing to send
    # Parts of another map (B: another source id) replace what is held of A.
    b_tiles = sorted(b.model.tile_indices())
    other = decode_summary(encode_summary(MapSource.from_mapper("A", b, tiles=b_tiles[:1])), 10**8)
    fresh = assemble_tiles(held, other)
    assert sorted(fresh.tiles.tiles) == b_tiles[:1] and fresh.missing_tiles == b_tiles[1:]
    from safetensors.torch import load, save
    data = encode_summary(MapSource.from_mapper("A", a, tiles=parts[0]))
    metadata = json.loads(data[8:8 + int.from_bytes(data[:8], "little")])["__metadata__"]
    for index, match in (({"99_99": 1}, "does not hold its own tiles"), ({"1_2_3": 1, **{f"{i[0]}_{i[1]}": 1 for i in
                         parts[0]}}, "does not fit a layout"), ("[1, 2]", "malformed tiled summary")):
        bad = dict(metadata, index=index if isinstance(index, str) else json.dumps(index))
        with pytest.raises(SummaryError, match=match):
            decode_summary(save(load(data), metadata=bad), 10**8)


def test_the_merger_node_merges_a_map_sent_in_parts_once_it_holds_every_tile(tiled_maps):
    """The merger node (in this process, no DDS traffic) given robot A's map in parts and robot B's whole: no merge
    while A lacks a tile (`sources_incomplete`), then the merge of both, as merge_maps gives it."""
    import rclpy
    from rclpy.context import Context
    from rclpy.parameter import Parameter
    from std_msgs.msg import UInt8MultiArray

    from gp_mapping.mapping.merge import TileRotation, encode_summary, tile_summary_bytes
    from gp_mapping.ros.merger_node import MergerNode

    _, a, b = tiled_maps
    b_frame = f"{TILED_SHIFT[0]},{TILED_SHIFT[1]},{YAW}"
    context = Context()
    rclpy.init(context=context)
    try:
        node = MergerNode(context=context, parameter_overrides=[
            Parameter("sources", value=["/a/model", "/b/model"]), Parameter("transforms", value=["", b_frame])])
        try:
            node.on_summary("/b/model", UInt8MultiArray(data=encode_summary(MapSource.from_mapper("B", b))))
            sizes, samples = tile_summary_bytes(a.model), a.model.tile_samples()
            rotation = TileRotation()
            for k in range(len(sizes)):
                assert "/a/model" not in node._sources
                part = rotation.choose(samples, sizes, max(sizes.values()))
                rotation.sent(part, samples)
                node.on_summary("/a/model", UInt8MultiArray(data=encode_summary(MapSource.from_mapper("A", a,
                                                                                                    tiles=part))))
                if k == 0:
                    published = []
                    node._diag_pub.publish = published.append
                    node._publish_diagnostics()
                    values = {kv.key: kv.value for kv in published[-1].status[0].values}
                    assert values["sources_incomplete"] == "1" and values["sources"] == "1"
            assert node._counts["parts_received"] == len(sizes) and sum(node._rejected.values()) == 0
            assert "/a/model" in node._sources and node.merge_if_changed()
            expected, _ = merge_maps([MapSource.from_mapper("A", a),
                                      MapSource.from_mapper("B", b, parse_transform(b_frame))])
            xy = np.random.default_rng(1).uniform(-4, 4, (30, 2))
            for u, v in zip(expected.model.predict(xy), node.mapper.model.predict(xy)):
                torch.testing.assert_close(u, v, rtol=1e-9, atol=1e-9)
            node._publish_diagnostics()
            values = {kv.key: kv.value for kv in published[-1].status[0].values}
            assert values["sources_incomplete"] == "0" and values["sources"] == "2"
            # The map standing still, its parts go round again: held, but nothing to merge anew.
            node.on_summary("/a/model", UInt8MultiArray(data=encode_summary(MapSource.from_mapper(
                "A", a, tiles=rotation.choose(samples, sizes, max(sizes.values()))))))
            assert not node.merge_if_changed() and node._counts["parts_received"] == len(sizes) + 1
        finally:
            node.close()
    finally:
        context.try_shutdown()


def test_a_merge_with_a_tile_cache_redoes_only_the_tiles_whose_sources_changed(tiled_maps):
    """Live merges keep a cache of merged tiles (the merger node's): merging the same maps again takes every tile
    from it, a map that took data in some tiles redoes those (the merged unit stays the last merge's while the
    data have not drifted from it), and a merge from the cache equals the merge without one in that unit."""
    import copy

    _, a, b = tiled_maps
    tf = parse_transform(f"{TILED_SHIFT[0]},{TILED_SHIFT[1]},{YAW}")
    xy = np.random.default_rng(2).uniform(-4, 4, (40, 2))

    def same(u, v):
        for s, t in zip(u.model.predict(xy), v.model.predict(xy)):
            torch.testing.assert_close(s, t, rtol=0, atol=0)

    cache = {}
    first, result = merge_maps([MapSource.from_mapper("A", a), MapSource.from_mapper("B", b, tf)], tile_cache=cache)
    assert result.reused == 0 and len([k for k in cache if isinstance(k, tuple)]) == result.tiles
    again, result = merge_maps([MapSource.from_mapper("A", a), MapSource.from_mapper("B", b, tf)], tile_cache=cache)
    assert result.reused == result.tiles
    same(first, again)
    # each map's tiles alone (what its offset to the other is measured on) are kept too
    assert {k for k in cache if isinstance(k, str) and k.startswith("alone/")} == {"alone/A", "alone/B"}
    a2 = copy.deepcopy(a)
    before = a2.model.tile_samples()
    a2.model.update(np.array([[-4.0, -4.0], [-3.9, -4.0], [-3.8, -4.1]]), np.array([[50.0], [50.1], [50.2]]))
    changed = {i for i, n in a2.model.tile_samples().items() if before.get(i) != n}
    assert 0 < len(changed) < len(before)
    sources = [MapSource.from_mapper("A", a2), MapSource.from_mapper("B", b, tf)]
    unit = cache["unit"]
    cached, result = merge_maps(sources, tile_cache=cache)
    assert result.reused == result.tiles - len(changed)
    fresh = {"unit": unit}  # no tiles: every one merged anew, in the same unit
    same(cached, merge_maps(sources, tile_cache=fresh)[0])


def test_two_sensors_that_read_apart_are_levelled_before_their_maps_merge(capsys, tmp_path):
    """Two robots over overlapping ground whose magnetometers read |B| 5 uT apart: the merge measures the offset
    where both maps know the field, removes it, and holds it as the sessions' (the map at their median level, their
    spread added to a reading's variance). Levelled, the merged map is as good about its level as a merge of two
    sensors that read alike; merged as they are (``levels=False``, ``--same-level``) the middle is their average
    and the map is smeared."""
    world = sim.World.from_config(sim.WorldConfig(area=(-5, -5, 5, 5), depth_range=(1.0, 2.5)),
                                  np.random.default_rng(3))
    recs = [_record(world, area, seed) for area, seed in (((-5, -5, 1.5, 5), 1), ((-1.5, -5, 5, 5), 2))]

    def mapped(rec, offset: float) -> Mapper:
        mapper = Mapper(config_from_dict(CONFIG))
        y = np.linalg.norm(rec.field_sensor_tesla, axis=1)[:, None] * 1e6 + offset
        for i in range(0, len(y), 50):
            mapper.model.update(rec.sensor_position[i:i + 50, :2], y[i:i + 50])
        mapper.coverage.add(rec.sensor_position[:, :2])  # what the readings visited, for the map's grid
        return mapper

    grid = np.vstack([r.sensor_position[5::10, :2] for r in recs])  # beside both drives: where the maps know
    truth = world.magnitude(np.column_stack([grid, np.zeros(len(grid))])) * 1e6

    def about_level(mapper) -> float:  # RMSE once the map's constant offset to the truth is taken out
        err = mapper.model.predict(grid)[0][:, 0].numpy() - truth
        return float(np.sqrt(np.mean((err - err.mean()) ** 2)))

    alike = [MapSource.from_mapper(n, mapped(r, 0.0)) for n, r in zip("AB", recs)]
    a, b = mapped(recs[0], 0.0), mapped(recs[1], 5.0)
    apart = [MapSource.from_mapper("A", a), MapSource.from_mapper("B", b)]
    same, _ = merge_maps(alike, steps=0)
    levelled, result = merge_maps(apart, steps=0)
    smeared, unlevelled = merge_maps(apart, steps=0, levels=False)
    assert unlevelled.levels is None and result.levels.measured.all()
    assert float(result.levels.offsets[1, 0]) == pytest.approx(5.0, abs=0.3)
    sessions = levelled.model.sessions
    assert float(sessions.level()[0]) == pytest.approx(2.5, abs=0.15)  # the median of 0 and 5
    reading = levelled.model.predict_reading(grid)[1] - same.model.predict_reading(grid)[1]
    assert float(reading.median()) == pytest.approx(float(sessions.spread()[0]), rel=0.2)  # about 6.25 uT^2
    with capsys.disabled():
        print(f"about their level: alike {about_level(same):.3f} uT, levelled {about_level(levelled):.3f}, "
              f"merged as they are {about_level(smeared):.3f}")
    assert about_level(levelled) <= 1.1 * about_level(same)
    assert about_level(smeared) > 1.5 * about_level(levelled)
    # The command prints what it removed, and --same-level merges as they are.
    a.save(tmp_path / "A.safetensors")
    b.save(tmp_path / "B.safetensors")
    maps = [str(tmp_path / "A.safetensors"), str(tmp_path / "B.safetensors")]
    assert main(["merge", *maps, "--out", str(tmp_path / "out")]) == 0
    assert "B.safetensors +5." in capsys.readouterr().out
    assert main(["merge", *maps, "--out", str(tmp_path / "flat"), "--same-level"]) == 0
    assert "offsets to" not in capsys.readouterr().out
    # The merger node levels its sources as merge_maps does, unless told they read alike (same_level).
    import rclpy
    from rclpy.context import Context
    from rclpy.parameter import Parameter
    from std_msgs.msg import UInt8MultiArray

    from gp_mapping.mapping.merge import encode_summary
    from gp_mapping.ros.merger_node import MergerNode

    for same_level, expected in ((False, levelled), (True, smeared)):
        context = Context()
        rclpy.init(context=context)
        try:
            node = MergerNode(context=context, parameter_overrides=[
                Parameter("sources", value=["/a/model", "/b/model"]), Parameter("steps", value=0),
                Parameter("same_level", value=same_level)])
            try:
                for topic, source in zip(("/a/model", "/b/model"), apart):
                    node.on_summary(topic, UInt8MultiArray(data=encode_summary(source)))
                assert node.merge_if_changed()
                for u, v in zip(expected.model.predict(grid[:30]), node.mapper.model.predict(grid[:30])):
                    torch.testing.assert_close(u, v, rtol=1e-9, atol=1e-9)
                published = []  # the diagnostics say what was removed
                node._diag_pub.publish = published.append
                node._publish_diagnostics()
                said = {kv.key: kv.value for kv in published[-1].status[0].values}["source_offsets_last"]
                assert ("/b/model +5." in said) != same_level and ("same_level" in said) == same_level, said
            finally:
                node.close()
        finally:
            rclpy.shutdown(context=context)


def test_a_merged_source_keeps_its_own_sessions_in_the_merge():
    """Robot A's map holds two sessions (its second sensor reads 4 uT higher); robot B's one. Their merge holds
    three sessions: A's two at B's level measured against A's first, and B's, so the merged map states the spread
    of all three (a merge of merged maps keeps every session). Summaries carry the offsets; bad ones are refused."""
    from gp_mapping.mapping.merge import SummaryError, decode_summary, encode_summary

    world = sim.World.from_config(sim.WorldConfig(area=(-5, -5, 5, 5), depth_range=(1.0, 2.5)),
                                  np.random.default_rng(3))
    recs = [_record(world, area, seed) for area, seed in (((-5, -5, 1.5, 5), 1), ((-5, -5, 1.5, 5), 4),
                                                          ((-1.5, -5, 5, 5), 2))]

    def feed(mapper, rec, offset):
        y = np.linalg.norm(rec.field_sensor_tesla, axis=1)[:, None] * 1e6 + offset
        for i in range(0, len(y), 50):
            mapper.model.update(rec.sensor_position[i:i + 50, :2], y[i:i + 50])
        mapper.coverage.add(rec.sensor_position[:, :2])

    a = Mapper(config_from_dict(CONFIG))
    feed(a, recs[0], 0.0)
    a.model.start_session()
    feed(a, recs[1], 4.0)
    b = Mapper(config_from_dict(CONFIG))
    feed(b, recs[2], 0.0)
    own = a.model.sessions.offsets()
    assert float(own[1, 0]) == pytest.approx(4.0, abs=0.4)
    sources = [MapSource.from_mapper("A", a), MapSource.from_mapper("B", b)]
    assert sources[0].session_offsets.shape == (2, 1) and sources[1].session_offsets is None
    back = decode_summary(encode_summary(sources[0], precision="float32"), 1 << 30, "A")
    torch.testing.assert_close(back.session_offsets, sources[0].session_offsets)

    merged, result = merge_maps([back, sources[1]], steps=0)
    held = merged.model.sessions.offsets()
    assert held.shape == (3, 1)
    torch.testing.assert_close(held[:2], own.to(held), atol=1e-6, rtol=0)  # A first: its own offsets as they are
    assert float(held[2, 0]) == pytest.approx(float(result.levels.offsets[1, 0]), abs=1e-9)
    assert abs(float(held[2, 0])) < 0.5  # B reads as A's first sensor
    spread = float(merged.model.sessions.spread()[0])
    assert spread == pytest.approx(float(((held - held.median(0).values) ** 2).mean()), rel=1e-9)
    assert spread > 3.0  # about 16 / 3: B and A's first sensor at 0, A's second at 4
    # merged as they are, A's sessions are still held (B at A's first level)
    flat, _ = merge_maps([back, sources[1]], steps=0, levels=False)
    assert flat.model.sessions.offsets()[:, 0].tolist() == pytest.approx([0.0, float(own[1, 0]), 0.0])

    for bad, why in ((torch.zeros(1, 1), "expected"), (torch.tensor([[0.0], [float("nan")]]), "finite"),
                     (torch.tensor([[1.0], [4.0]]), "first session's 0"), (torch.zeros(2, 3), "expected")):
        data = encode_summary(dataclasses.replace(sources[0], session_offsets=bad))
        with pytest.raises(SummaryError, match=why):
            decode_summary(data, 1 << 30, "A")
