"""Fixed colour range (grid.mean_range / grid.variance_range): a published cell value means the same field value
in every map of a run, in the node and in the replay's maps.mcap; empty keeps each map's own min..max."""
from __future__ import annotations

import math

import numpy as np
import pytest

from gp_mapping.config import ConfigError, config_from_dict
from gp_mapping.mapping.grid import GridError, GridSpec, decode_occupancy, encode_occupancy
from gp_mapping.mapping.mapper import MapGrid
from support.nodes import node_factory  # noqa: F401  (fixture)

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def _grid(mean: np.ndarray, var: np.ndarray) -> MapGrid:
    h, w = mean.shape
    return MapGrid(GridSpec(0.0, 0.0, 0.5, w, h), "map", "microtesla", {"magnitude": (mean, var)},
                   np.ones((h, w), bool), 12.5)


def test_fixed_range_encodes_the_same_value_as_the_same_cell_in_every_map():
    rng = np.random.default_rng(0)
    known = np.ones((6, 7), bool)
    small = 48.0 + rng.uniform(size=known.shape)          # spans ~1 uT
    large = 40.0 + 20.0 * rng.uniform(size=known.shape)   # spans ~20 uT
    small[0, 0] = large[0, 0] = 50.0
    a, off_a, scale_a = encode_occupancy(small, known, [40.0, 60.0])
    b, off_b, scale_b = encode_occupancy(large, known, [40.0, 60.0])
    assert (off_a, scale_a) == (off_b, scale_b) == (40.0, pytest.approx(0.2))
    assert a[0] == b[0] == 50  # 50 uT is cell 50 in both maps
    for data, values in ((a, small), (b, large)):
        back = decode_occupancy(data, known.shape, off_a, scale_a)
        assert np.all(np.abs(back - values) <= scale_a / 2 + 1e-9)
    # Outside the range: clipped to the ends, still known.
    data, _, _ = encode_occupancy(np.array([[30.0, 70.0, np.nan]]), np.ones((1, 3), bool), [40.0, 60.0])
    assert data.tolist() == [0, 100, -1]
    # Automatic (empty or None): the map's own min..max, as before.
    auto, off, scale = encode_occupancy(small, known, [])
    assert off == small.min() and auto.min() == 0 and auto.max() == 100
    assert encode_occupancy(small, known, None)[0].tolist() == auto.tolist()
    # A constant map keeps the fixed scale; an empty one too.
    data, off, scale = encode_occupancy(np.full((2, 2), 45.0), np.ones((2, 2), bool), [40.0, 60.0])
    assert data.tolist() == [25] * 4 and (off, scale) == (40.0, pytest.approx(0.2))
    data, off, scale = encode_occupancy(np.zeros((2, 2)), np.zeros((2, 2), bool), [40.0, 60.0])
    assert data.tolist() == [-1] * 4 and (off, scale) == (40.0, pytest.approx(0.2))
    with pytest.raises(GridError, match="lo < hi"):
        encode_occupancy(small, known, [60.0, 40.0])


@pytest.mark.parametrize("value, ok", [([], True), (None, True), ([40, 60.5], True), ([60.0, 40.0], False),
                                       ([1.0, 1.0], False), ([1.0], False), ([1.0, math.nan], False),
                                       ([1.0, 2.0, 3.0], False), ("auto", False)])
def test_ranges_are_validated(value, ok):
    for key in ("mean_range", "variance_range"):
        if ok:
            config = config_from_dict({"grid": {key: value}})
            assert getattr(config.grid, key) == [float(v) for v in (value or [])]
        else:
            with pytest.raises(ConfigError, match=f"grid.{key}"):
                config_from_dict({"grid": {key: value}})


def test_node_publishes_with_the_fixed_range_and_takes_a_live_change(node_factory):  # noqa: F811
    from rclpy.parameter import Parameter

    from gp_mapping.ros import conversions

    node = node_factory(**{"grid.mean_range": [40.0, 60.0], "grid.variance_range": [0.0, 4.0]})
    assert node.config.grid.mean_range == [40.0, 60.0]
    scales = []
    node._scale_pub.publish = lambda msg: scales.append(conversions.scale_from_msg(msg)[0]["magnitude"])
    rng = np.random.default_rng(1)
    for spread in (1.0, 15.0):  # two maps with very different value spans
        node._publish_grid(_grid(45.0 + spread * rng.uniform(size=(5, 5)), rng.uniform(0.1, 1.0, size=(5, 5))))
    assert [s["mean"] for s in scales] == [(40.0, pytest.approx(0.2))] * 2
    assert [s["variance"] for s in scales] == [(0.0, pytest.approx(0.04))] * 2
    # Refused live (the old value stays), then a good change applied by the update thread.
    result = node.set_parameters([Parameter("grid.mean_range", value=[60.0, 40.0])])[0]
    assert not result.successful and "grid.mean_range" in result.reason
    result = node.set_parameters([Parameter("grid.mean_range", value="auto")])[0]
    assert not result.successful and "grid.mean_range" in result.reason
    assert node.set_parameters([Parameter("grid.mean_range", value=[30.0, 70.0])])[0].successful
    for _ in range(200):
        if node.config.grid.mean_range == [30.0, 70.0]:
            break
        import time
        time.sleep(0.02)
    node._publish_grid(_grid(np.full((5, 5), 50.0), np.ones((5, 5))))
    assert scales[-1]["mean"] == (30.0, pytest.approx(0.4))


def test_node_without_ranges_declares_them_unset_and_encodes_automatically(node_factory):  # noqa: F811
    from gp_mapping.ros import conversions

    node = node_factory()
    assert node.config.grid.mean_range == [] and list(node.get_parameter("grid.mean_range").value) == []
    scales = []
    node._scale_pub.publish = lambda msg: scales.append(conversions.scale_from_msg(msg)[0]["magnitude"])
    mean = np.linspace(44.0, 46.0, 25).reshape(5, 5)
    node._publish_grid(_grid(mean, np.ones((5, 5))))
    assert scales[-1]["mean"] == (44.0, pytest.approx(0.02))


def test_replay_bag_writer_uses_the_ranges(tmp_path):
    from rosbags.highlevel import AnyReader

    from gp_mapping.bag import MapBagWriter

    rng = np.random.default_rng(2)
    with MapBagWriter(tmp_path / "maps.mcap", "microtesla", mean_range=[40.0, 60.0], variance_range=[0.0, 2.0]) as w:
        for t, spread in ((1.0, 1.0), (2.0, 10.0)):
            w.write(_grid(45.0 + spread * rng.uniform(size=(4, 4)), rng.uniform(size=(4, 4))), t)
    with AnyReader([tmp_path / "maps.mcap"]) as reader:
        conns = [c for c in reader.connections if c.topic.endswith("/scale")]
        rows = [list(reader.deserialize(raw, c.msgtype).data) for c, _, raw in reader.messages(connections=conns)]
    assert len(rows) == 2
    for row in rows:
        np.testing.assert_allclose(row, [40.0, 0.2, 0.0, 0.02])
