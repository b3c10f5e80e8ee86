"""Issue 20: no permanent lockouts, bounded memory under every parameter and trajectory, maps that keep coming.

State files checked before their payload is read; the magnetometer frame latch; pauses told from bad stamps;
the published window (a teleport of 50 km keeps publishing, the known-cell mask bounded by the window); the
node's small items (publish_period lower bound, an integer for a float parameter, a clean stop mid-publish)."""
from __future__ import annotations

import json
import math
import os
import time

import numpy as np
import pytest
import torch

from gp_mapping.config import ConfigError, config_from_dict
from gp_mapping.mapping.grid import tile_cells
from gp_mapping.mapping.mapper import Mapper
from gp_mapping.mapping.state import FORMAT, SCHEMA_VERSION, MapStateError, read_state

torch.set_num_threads(1)
Q = [0.0, 0.0, 0.0, 1.0]
B = [20e-6, -5e-6, -42e-6]


def small_config(**sections):
    base = {"model": {"num_inducing": 16, "memory_size": 50, "hyper_steps": 2, "device": "cpu"},
            "batching": {"size": 20}, "grid": {"resolution": 0.5, "tile_size": 4096}}
    for name, values in sections.items():
        base.setdefault(name, {}).update(values)
    return config_from_dict(base)


# ------------------------------------------------------------------------------------------- state files


def _timed_refusal(path, match):
    start = time.perf_counter()
    with pytest.raises(MapStateError, match=match) as err:
        read_state(path)
    seconds = time.perf_counter() - start
    assert str(path) in str(err.value)
    return seconds


def test_dev_zero_is_refused_at_once_as_not_a_regular_file():
    if not os.path.exists("/dev/zero"):
        pytest.skip("no /dev/zero on this system")
    assert _timed_refusal("/dev/zero", r"not a regular file") < 1.0


def test_a_10_gb_sparse_file_is_refused_at_once_for_its_size(tmp_path):
    path = tmp_path / "sparse.safetensors"
    with open(path, "wb") as fh:
        fh.truncate(10 * 1024**3)
    assert _timed_refusal(path, r"10\.0 GiB.*larger than") < 1.0


def test_header_length_and_header_are_checked_before_the_payload(tmp_path):
    # A plausible size but a header length of zero (the start of a sparse or zeroed file).
    zeros = tmp_path / "zeros.safetensors"
    zeros.write_bytes(bytes(4096))
    assert _timed_refusal(zeros, r"header length 0") < 1.0
    # A header length larger than the file.
    long = tmp_path / "long.safetensors"
    long.write_bytes((10**6).to_bytes(8, "little") + b"{}")
    _timed_refusal(long, r"header of 1000000 bytes")
    # A header that is JSON but declares tensors beyond the end of the file.
    header = json.dumps({"__metadata__": {"format": FORMAT, "schema_version": str(SCHEMA_VERSION)},
                         "model/a": {"dtype": "F64", "shape": [1000000000], "data_offsets": [0, 8000000000]}}).encode()
    lying = tmp_path / "lying.safetensors"
    lying.write_bytes(len(header).to_bytes(8, "little") + header + bytes(64))
    assert _timed_refusal(lying, r"declares 8000000000 bytes of tensors.*holds 64") < 1.0


def test_a_directory_and_a_missing_file_are_refused_by_name(tmp_path):
    _timed_refusal(tmp_path, r"not a regular file")
    _timed_refusal(tmp_path / "absent.safetensors", r"cannot read")


def test_a_good_state_file_still_loads(tmp_path):
    mapper = Mapper(small_config())
    for k in range(60):
        t = 0.1 * k
        mapper.add_pose(t, [0.1 * k, 0.0, 0.0], Q)
        mapper.add_magnetic_field(t, B, "mag")
    mapper.flush()
    path = tmp_path / "good.safetensors"
    mapper.save(path)
    loaded = Mapper.load(path)
    assert loaded.diagnostics()["num_seen"] == mapper.diagnostics()["num_seen"] == 60


# ------------------------------------------------------------------------------------ magnetometer frame


def feed_line(mapper, t0, n, frame="mag", dt=0.1, receive_offset=None, x0=None, y=0.0):
    """``n`` poses and readings (same stamps) along x at 1 m/s from ``t0`` (x = t, or from ``x0``), at ``y``;
    ``receive_offset``: receive time = stamp + offset (None: no receive time)."""
    for k in range(n):
        t = round(t0 + dt * k, 6)
        recv = None if receive_offset is None else t + receive_offset
        x = (t if x0 is None else x0 + dt * k)
        mapper.add_pose(t, [x, y, 0.0], Q, receive_time=recv)
        mapper.add_magnetic_field(t, [(50 + math.sin(x)) * 1e-6, 0.0, 0.0], frame, receive_time=recv)
    mapper.process()


def test_a_stray_frame_then_the_real_sensor_maps():
    from gp_mapping.mapping.stream_checks import FRAME_RELATCH_AFTER

    mapper = Mapper(small_config())
    mapper.add_magnetic_field(0.0, B, "x" * 1_000_000)  # a 1 MB frame_id: refused, never latched
    mapper.add_magnetic_field(0.05, B, "bogus")         # one stray reading before the real sensor
    assert mapper.diagnostics()["field_frame"] == "bogus"
    feed_line(mapper, 0.1, 200)
    d = mapper.diagnostics()
    assert d["rejected"]["field_frame_invalid"] == 1
    assert d["rejected"]["field_frame_mismatch"] == FRAME_RELATCH_AFTER - 1
    assert d["field_frame"] == "mag" and d["field_frame_relatches"] == 1
    assert d["updates"] >= 8 and mapper.grid() is not None


def test_two_frames_taking_turns_never_relatch_and_a_configured_frame_is_never_learned():
    mapper = Mapper(small_config())
    for k in range(100):  # the held frame keeps talking: the other one is refused every time
        t = 0.1 * k
        mapper.add_pose(t, [t, 0.0, 0.0], Q)
        mapper.add_magnetic_field(t, B, "mag")
        mapper.add_magnetic_field(t + 0.01, B, "imu")
    d = mapper.diagnostics()
    assert d["field_frame"] == "mag" and d["field_frame_relatches"] == 0
    assert d["rejected"]["field_frame_mismatch"] == 100
    fixed = Mapper(small_config(sync={"field_frame": "mag"}))
    assert fixed.diagnostics()["field_frame"] == "mag"
    for k in range(100):
        fixed.add_magnetic_field(0.1 * k, B, "bogus")
    feed_line(fixed, 10.0, 50)
    d = fixed.diagnostics()
    assert d["rejected"]["field_frame_mismatch"] == 100 and d["field_frame"] == "mag" and d["accepted"] == 50


def test_frame_id_length_is_bounded_in_the_config():
    with pytest.raises(ConfigError, match="sync.field_frame"):
        small_config(sync={"field_frame": "f" * 1000})


def test_a_restart_keeps_the_held_frame_and_still_relatches(tmp_path):
    from gp_mapping.mapping.stream_checks import FRAME_RELATCH_AFTER

    mapper = Mapper(small_config())
    mapper.add_magnetic_field(0.0, B, "bogus")
    path = tmp_path / "cp.safetensors"
    mapper.checkpoint(path)
    resumed = Mapper.load(path)
    assert resumed.diagnostics()["field_frame"] == "bogus"
    feed_line(resumed, 1.0, 100)
    d = resumed.diagnostics()
    assert d["field_frame"] == "mag" and d["rejected"]["field_frame_mismatch"] == FRAME_RELATCH_AFTER - 1
    # A configured frame wins over the one saved in the file.
    configured = Mapper.load(path, config=small_config(sync={"field_frame": "mag"}))
    assert configured.diagnostics()["field_frame"] == "mag"


# ----------------------------------------------------------------------------------------------- pauses


def test_a_61_s_pause_loses_no_data_and_is_counted():
    mapper = Mapper(small_config())
    feed_line(mapper, 100.0, 100, receive_offset=0.02, x0=0.0)
    feed_line(mapper, 100.0 + 9.9 + 61.0, 100, receive_offset=0.02, x0=10.0)  # stamps and receive times jump
    mapper.flush()
    d = mapper.diagnostics()
    assert d["pauses"] == 1 and d["reanchors"] == 0
    assert d["rejected_total"] == 0 and d["accepted"] == 200 and d["num_seen"] == 200


def test_a_stamp_that_jumps_alone_is_still_refused():
    mapper = Mapper(small_config())
    feed_line(mapper, 100.0, 50, receive_offset=0.02, x0=0.0)
    mapper.add_magnetic_field(100.0 + 4.9 + 61.0, B, "mag", receive_time=100.0 + 5.0)  # the receive time did not
    mapper.add_pose(100.0 + 4.95 + 61.0, [5.0, 0.0, 0.0], Q, receive_time=100.0 + 5.0)
    feed_line(mapper, 105.0, 50, receive_offset=0.02, x0=5.0)
    mapper.flush()
    d = mapper.diagnostics()
    assert d["pauses"] == 0
    assert d["rejected"]["field_stamp_jump"] == 1 and d["rejected"]["pose_stamp_jump"] == 1
    assert d["num_seen"] == 100


# ------------------------------------------------------------------------------------- node, small items

from support.nodes import _wait_idle, node_factory  # noqa: E402,F401  (the in-process node fixture)


def _feed_node(node, n, t0=100.0, x0=0.0, y0=0.0):
    from geometry_msgs.msg import PoseStamped
    from sensor_msgs.msg import MagneticField

    from gp_mapping.ros.conversions import seconds_to_stamp

    for k in range(n):
        t = t0 + 0.1 * k
        pose = PoseStamped()
        pose.header.stamp, pose.header.frame_id = seconds_to_stamp(t), "map"
        pose.pose.position.x, pose.pose.position.y, pose.pose.orientation.w = x0 + 0.1 * k, y0, 1.0
        mag = MagneticField()
        mag.header.stamp, mag.header.frame_id = seconds_to_stamp(t), "magnetometer"
        mag.magnetic_field.x = 50e-6 + 1e-7 * k
        node.on_pose(pose)
        node.on_mag(mag)


NODE_PARAMS = {"batching.size": 20, "model.num_inducing": 16, "model.hyper_steps": 2, "model.device": "cpu",
               "grid.resolution": 0.5}


def test_publish_period_has_a_lower_bound_at_start_and_live(node_factory):
    from rclpy.parameter import Parameter

    from gp_mapping.ros.mapper_node import NodeStartError

    with pytest.raises(ConfigError, match="node.publish_period"):
        config_from_dict({"node": {"publish_period": 1e-9}})
    with pytest.raises(NodeStartError, match="node.publish_period"):
        node_factory(**{"node.publish_period": 1e-9})
    node = node_factory(**NODE_PARAMS)
    result = node.set_parameters([Parameter("node.publish_period", value=1e-9)])[0]
    assert not result.successful and "publish_period" in result.reason
    assert node.get_parameter("node.publish_period").value == 1.0


def test_an_integer_for_a_float_parameter_is_accepted_on_a_live_change(node_factory):
    from rclpy.parameter import Parameter

    node = node_factory(**NODE_PARAMS)
    result = node.set_parameters([Parameter("grid.unknown_distance", value=3)])[0]
    assert result.successful, result.reason
    value = node.get_parameter("grid.unknown_distance").value
    assert value == 3.0 and isinstance(value, float)
    deadline = time.monotonic() + 10.0
    while node.config.grid.unknown_distance != 3.0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert node.config.grid.unknown_distance == 3.0
    result = node.set_parameters([Parameter("grid.tile_size", value=2.0)])[0]  # a whole float for an integer
    assert result.successful and node.get_parameter("grid.tile_size").value == 2
    result = node.set_parameters([Parameter("grid.tile_size", value=2.5)])[0]
    assert not result.successful


def test_a_shutdown_during_a_publication_stops_the_update_thread_cleanly(monkeypatch):
    """SIGTERM shuts the context down while the update thread predicts a map: the publication that follows
    must not raise out of the thread (it printed an RCLError traceback)."""
    import threading

    import rclpy
    from rclpy.context import Context
    from rclpy.parameter import Parameter

    from gp_mapping.ros.mapper_node import MapperNode

    uncaught = []
    monkeypatch.setattr(threading, "excepthook", lambda args: uncaught.append(args.exc_value))
    context = Context()
    rclpy.init(context=context)
    node = MapperNode(context=context, parameter_overrides=[Parameter(k, value=v) for k, v in NODE_PARAMS.items()])
    try:
        _feed_node(node, 41)
        _wait_idle(node)
        real_grid = node.mapper.grid

        def slow_grid(*args, **kwargs):
            grid = real_grid(*args, **kwargs)
            context.shutdown()  # what rclpy's SIGTERM handler does while the prediction runs
            return grid

        monkeypatch.setattr(node.mapper, "grid", slow_grid)
        node._publish_due = True
        node.mapper.mark_changed()
        _feed_node(node, 1, t0=200.0)  # wakes the update thread, which publishes after its step
        deadline = time.monotonic() + 20.0
        while context.ok() and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.5)
        assert not context.ok()
        assert node._worker.is_alive() and not uncaught, uncaught
    finally:
        node.close()
        context.try_shutdown()
    assert not uncaught, uncaught
    assert not node._worker.is_alive()


# -------------------------------------------------------------------------- the published window, coverage


def test_coverage_in_tiles_holds_exactly_the_visited_cells_with_negative_indices():
    from gp_mapping.mapping.grid import Coverage

    rng = np.random.default_rng(0)
    pts = np.concatenate([rng.uniform(-30, 30, size=(5000, 2)), rng.normal(0, 0.3, size=(2000, 2)),
                          [[-1e6, 3.0], [2e6, -5e5]]])
    cov = Coverage(0.25)
    for chunk in np.array_split(pts, 7):
        cov.add(chunk)
    expected = np.unique(np.floor(pts / 0.25).astype(np.int64), axis=0)  # sorted by ix, then iy
    np.testing.assert_array_equal(cov.cells, expected)
    assert len(cov) == expected.shape[0]
    copy = Coverage(0.25)
    copy.set_cells(cov.cells)
    np.testing.assert_array_equal(copy.cells, expected)
    copy.clear()
    assert len(copy) == 0 and copy.cells.shape == (0, 2)


def _window_config(**grid):
    return small_config(grid={"resolution": 0.5, "window": [20.0, 20.0], "unknown_distance": 1.0, **grid})


class CountingModel:
    """Wraps a model and records how many inputs each predict call got."""

    def __init__(self, model):
        self.model, self.calls = model, []

    def __getattr__(self, name):
        return getattr(self.model, name)

    def predict(self, x):
        self.calls.append(int(x.shape[0]))
        return self.model.predict(x)


def test_a_50_km_teleport_keeps_publishing_a_window_around_the_robot():
    from gp_mapping.mapping.grid import GridTooLargeError

    mapper = Mapper(_window_config())
    feed_line(mapper, 0.0, 100, x0=0.0)                  # 10 m along x near the origin
    far = 50_000.0 / math.sqrt(2.0)
    feed_line(mapper, 20.0, 100, x0=far, y=far)          # a teleport of 50 km, well inside sync.max_position
    mapper.flush()
    assert mapper.diagnostics()["teleports"] == 1
    grid = mapper.grid()                                 # was GridTooLargeError for every publish
    spec = grid.spec
    assert spec.width <= 40 and spec.height <= 40 and grid.extent == "window"
    assert spec.origin_x <= far + 9.9 <= spec.origin_x + spec.width * spec.resolution  # around the robot
    assert spec.origin_y <= far <= spec.origin_y + spec.height * spec.resolution
    assert grid.known.sum() > 0 and np.all(np.isfinite(grid.layers["magnitude"][0][grid.known]))
    with pytest.raises(GridTooLargeError):
        mapper.grid(full=True)                           # the whole 50 km is more than grid.max_cells
    exported = mapper.export_grid()                      # the file export falls back to the window, saying so
    assert exported.extent == "window" and exported.spec == spec


def test_publication_cost_is_bounded_by_the_window_not_the_explored_area():
    mapper = Mapper(_window_config())
    for leg in range(8):                                 # 1.6 km of lawnmower legs over 200 m x 200 m
        feed_line(mapper, 200.0 * leg, 400, dt=0.5, x0=-100.0, y=-100.0 + 200.0 / 7 * leg)
    mapper.flush()
    counting = CountingModel(mapper.model)
    mapper.model = counting
    grid = mapper.grid()
    assert sum(counting.calls) == grid.spec.num_cells <= 40 * 40
    counting.calls.clear()
    published = mapper.grid(predict_unknown=False)         # what the node publishes: the known cells alone
    assert sum(counting.calls) == int(published.known.sum()) < grid.spec.num_cells
    known = published.known
    for name, (mean, var) in grid.layers.items():
        np.testing.assert_allclose(published.layers[name][0][known], mean[known], rtol=1e-9, atol=1e-9)
        assert np.all(np.isnan(published.layers[name][0][~known]))
    # The full map is still there for saving and export: the visited extent, predicted in bounded tiles.
    full = mapper.grid(full=True)
    assert full.extent == "full" and full.spec.num_cells > grid.spec.num_cells
    assert max(counting.calls) <= tile_cells(mapper.config.grid.tile_size, mapper.model.device,
                                             mapper.config.model.num_inducing)


def test_small_maps_are_unchanged_by_the_window():
    mapper = Mapper(_window_config(window=[1000.0, 1000.0], max_cells=4_000_000))
    feed_line(mapper, 0.0, 60, x0=0.0)
    mapper.flush()
    assert mapper.grid().spec == mapper.coverage.grow_spec(mapper.config.grid) == mapper.grid(full=True).spec


def test_unknown_distance_and_window_are_validated_against_each_other_and_max_cells():
    with pytest.raises(ConfigError, match="grid.unknown_distance"):
        Mapper(_window_config(unknown_distance=300.0))
    with pytest.raises(ConfigError, match="grid.window"):
        Mapper(_window_config(window=[1000.0, 1000.0], max_cells=1_000_000))
    with pytest.raises(ConfigError, match="grid.window"):
        config_from_dict({"grid": {"window": [0.0, 10.0]}})


def _median_grid_seconds(mapper, runs=3):
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        mapper.grid()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def test_the_largest_unknown_distance_allowed_keeps_publication_time_within_2x():
    mapper = Mapper(_window_config(resolution=0.25))
    feed_line(mapper, 0.0, 400, x0=-20.0)
    mapper.flush()
    default = _median_grid_seconds(mapper)
    mapper.config.grid.unknown_distance = 20.0           # the window's side: the most it allows
    largest = _median_grid_seconds(mapper)
    assert mapper.grid().known.all()
    assert largest < 2.0 * default + 0.05, (largest, default)


def test_node_refuses_an_unknown_distance_beyond_the_window_live_and_keeps_publishing(node_factory):
    from rclpy.parameter import Parameter

    node = node_factory(**NODE_PARAMS, **{"grid.window": [20.0, 20.0]})
    result = node.set_parameters([Parameter("grid.unknown_distance", value=300.0)])[0]
    assert not result.successful and "grid.unknown_distance" in result.reason and "grid.window" in result.reason
    assert node.set_parameters([Parameter("grid.unknown_distance", value=20.0)])[0].successful
    result = node.set_parameters([Parameter("grid.window", value=[5.0, 5.0])])[0]
    assert not result.successful and "grid.unknown_distance" in result.reason
    _feed_node(node, 41)
    _wait_idle(node)
    node.publish_map()
    assert node._counts["maps_published"] == 1 and node._last_error == ""


def test_node_diagnostics_show_the_held_magnetometer_frame_and_the_new_counters(node_factory):
    node = node_factory(**NODE_PARAMS)
    _feed_node(node, 41)
    _wait_idle(node)
    diag = node._mapper_diagnostics
    assert diag["field_frame"] == "magnetometer"
    assert diag["pauses"] == 0 and diag["field_frame_relatches"] == 0
    assert diag["rejected"]["field_frame_invalid"] == 0


def test_node_keeps_publishing_after_a_50_km_teleport(node_factory):
    node = node_factory(**NODE_PARAMS, **{"grid.window": [20.0, 20.0]})
    _feed_node(node, 41)
    _wait_idle(node)
    node.publish_map()
    far = 50_000.0 / math.sqrt(2.0)
    _feed_node(node, 41, t0=110.0, x0=far, y0=far)
    _wait_idle(node)
    node.publish_map()
    assert node._counts["maps_published"] == 2 and node._last_error == "", node._last_error
    spec = node._last_grid.spec
    assert spec.num_cells <= 40 * 40 and spec.origin_x <= far + 4.0 <= spec.origin_x + spec.width * spec.resolution


def test_a_tiled_map_sends_its_tiles_on_model_in_parts_once_they_outgrow_the_limit(node_factory):
    """~/model carries a tiled map tile by tile (as it merges); its size grows with the map, so once it would pass
    node.model_max_bytes the node sends it in parts, each under the limit, one per call, also while the map stands
    still, which put together hold every tile (`parts` counted). A tile too large for a float64 part goes in float32
    parts (`reduced`), never stopped for good (issue 38); a limit that no form fits is counted (`too_large`) and
    tried again at the next period, without an error, and a limit raised again sends again."""
    from gp_mapping.mapping.merge import (MapSource, assemble_tiles, decode_summary, encode_summary,
                                          summary_overhead_bytes, tile_summary_bytes)

    node = node_factory(**NODE_PARAMS, **{"model.tile_size": 4.0, "model.tile_overlap": 0.5})
    sent = []
    node._model_pub.publish = sent.append
    _feed_node(node, 21, x0=-1.0)  # x -1..1 m: in tile 0's core [-1.75, 1.75]
    _wait_idle(node)
    assert node.mapper.model.num_tiles == 1 and node.publish_model()
    _feed_node(node, 41, t0=110.0, x0=3.0)  # x 3..7 m: on into tiles 1 and 2
    _wait_idle(node)
    assert node.mapper.model.num_tiles > 1 and node.publish_model()
    source = decode_summary(bytes(sent[-1].data), 10**8)
    assert sorted(source.tiles.tiles) == sorted(node.mapper.model.tile_indices())
    assert source.num_seen == node.mapper.model.num_seen and node._model["sent"] == 2
    sizes = tile_summary_bytes(node.mapper.model)
    overhead = len(encode_summary(MapSource.from_mapper("overhead", node.mapper, tiles=[])))
    assert overhead <= summary_overhead_bytes(node.mapper)  # the old estimate, an upper bound (2.5 x over)
    limit = overhead + max(sizes.values()) + 100  # about a tile a part
    node.config.node.model_max_bytes = limit
    held = None
    for k in range(len(sizes)):
        assert node.publish_model()  # the map stands still: the parts go on
        assert len(sent[-1].data) <= limit
        part = decode_summary(bytes(sent[-1].data), limit)
        assert part.tile_index == node.mapper.model.tile_samples() and len(part.tiles.tiles) < len(sizes)
        held = assemble_tiles(held, part)
    assert not held.missing_tiles and sorted(held.tiles.tiles) == sorted(sizes)
    assert node._model["parts"] == len(sizes) and node._model["sent"] == 2 + len(sizes)
    assert node._model["reduced"] == len(sizes)  # parts are a reduced form
    # Below the largest tile in float64: float32 parts carry it, read back as float64 within float32's rounding.
    node.config.node.model_max_bytes = limit - 101
    exact = MapSource.from_mapper("exact", node.mapper)
    held = None
    for k in range(len(sizes)):
        assert node.publish_model()
        assert len(sent[-1].data) <= limit - 101
        held = assemble_tiles(held, decode_summary(bytes(sent[-1].data), limit))
    assert not held.missing_tiles and node._model["too_large"] == 0
    for index, tile in exact.tiles.tiles.items():
        scale = float(tile["site_W"].abs().max())
        np.testing.assert_allclose(held.tiles.tiles[index]["site_W"], tile["site_W"], rtol=1e-6, atol=1e-6 * scale)
    node.config.node.model_max_bytes = 1024  # below any form (the config alone is larger)
    _feed_node(node, 21, t0=120.0, x0=7.0)
    _wait_idle(node)
    count = len(sent)
    assert not node.publish_model() and not node.publish_model()  # counted each period, tried again
    assert node._model["too_large"] == 2 and node._model["failed"] == 0 and node._last_error == ""
    published = []
    node._diag_pub.publish = published.append
    node._publish_diagnostics()
    status = published[-1].status[0]
    values = {kv.key: kv.value for kv in status.values}
    assert values["node/model_summaries_too_large"] == "2"
    assert values["node/model_summaries_parts"] == values["node/model_summaries_reduced"] == str(2 * len(sizes))
    assert values["node/model_summaries_sent"] == str(2 + 2 * len(sizes))
    assert status.message == "mapping"
    node.config.node.model_max_bytes = 10**8  # room again: the whole map goes at once, with the new data
    assert node.publish_model() and len(sent) == count + 1
    assert decode_summary(bytes(sent[-1].data), 10**8).num_seen == node.mapper.model.num_seen


def test_a_single_engines_summary_over_the_limit_goes_in_float32_then_with_coarser_cells(node_factory):
    """A map of one engine cannot go in parts: over node.model_max_bytes its summary goes in float32 (read back as
    float64: a merge of it predicts as the float64 one within float32's rounding), then with its visited cells at
    a coarser resolution and fewer trajectory points; never stopped for good while the map changes (issue 38)."""
    from gp_mapping.mapping.merge import MapSource, decode_summary, encode_summary, merge_maps

    node = node_factory(**{**NODE_PARAMS, "model.tile_size": 0.0, "model.num_inducing": 48, "grid.resolution": 0.05})
    sent = []
    node._model_pub.publish = sent.append
    _feed_node(node, 81, x0=-4.0)
    _wait_idle(node)
    # encoded as the node encodes its own: under its name and with the limit in the config it carries (the
    # name's and the limit's digits move the header's 8-byte padding); the limit is one byte under the size of
    # the summary that holds it
    name = node.get_fully_qualified_name()
    for _ in range(4):  # settles at once unless the limit's digits change
        whole = encode_summary(MapSource.from_mapper(name, node.mapper))
        if node.config.node.model_max_bytes == len(whole) - 1:
            break
        node.config.node.model_max_bytes = len(whole) - 1
    else:
        pytest.fail("the summary's size does not settle with the limit it carries")
    reduced = encode_summary(MapSource.from_mapper(name, node.mapper), "float32")
    assert len(reduced) < 0.75 * len(whole)
    assert node.publish_model() and len(sent[-1].data) < len(whole) and node._model["reduced"] == 1
    got = decode_summary(bytes(sent[-1].data), len(whole))
    exact = decode_summary(whole, len(whole))
    assert got.summary["site_W"].dtype == exact.summary["site_W"].dtype
    assert got.coverage_resolution == exact.coverage_resolution
    xy = np.random.default_rng(0).uniform(-4.0, 4.0, (20, 2))
    mean32 = merge_maps([got])[0].model.predict(xy)[0]
    mean64 = merge_maps([exact])[0].model.predict(xy)[0]
    np.testing.assert_allclose(mean32.numpy(), mean64.numpy(), rtol=0, atol=1e-3)  # uT
    assert not node.publish_model()  # nothing new to send
    from safetensors.torch import load, save

    from gp_mapping.mapping.merge import SummaryError

    metadata = json.loads(bytes(sent[-1].data)[8:8 + int.from_bytes(bytes(sent[-1].data)[:8], "little")])
    for precision in ("float16", "float64"):  # an unknown precision; float32 tensors in a float64 summary
        bad = save(load(bytes(sent[-1].data)), metadata={**metadata["__metadata__"], "precision": precision})
        with pytest.raises(SummaryError, match="precision|expected torch.float64"):
            decode_summary(bad, len(whole))
    # Smaller still: the visited cells go at a coarser resolution (and fewer trajectory points) until it fits.
    _feed_node(node, 21, t0=120.0, x0=4.0)
    _wait_idle(node)
    cells = len(node.mapper.coverage.cells)
    limit = len(encode_summary(MapSource.from_mapper(name, node.mapper), "float32")) - 8 * cells
    node.config.node.model_max_bytes = limit
    assert node.publish_model() and len(sent[-1].data) <= limit
    coarse = decode_summary(bytes(sent[-1].data), len(whole))
    assert coarse.coverage_resolution > exact.coverage_resolution and len(coarse.coverage_cells) < cells
    assert coarse.num_seen == node.mapper.model.num_seen and node._model["too_large"] == 0
