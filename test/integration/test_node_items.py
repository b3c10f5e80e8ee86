"""Smaller node items of issue 19 (point 5): the reset's cleared map comes with its scale on the maps' clock, a
bad parameter is reported before the torch warm-up, the start-up line names what the node uses, the 3-D slice
height changes while running, a Ctrl-C landing in a finalizer prints nothing, and cuda:N is a device."""
from __future__ import annotations

import sys
import time

import numpy as np
import pytest

from gp_mapping.mapping.grid import GridSpec
from gp_mapping.mapping.mapper import MapGrid
from support.nodes import node_factory  # noqa: F401  (fixture)

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def _grid(stamp: float = 1234.5) -> MapGrid:
    rng = np.random.default_rng(0)
    return MapGrid(GridSpec(0.0, 0.0, 0.5, 6, 4), "map", "microtesla",
                   {"magnitude": (45.0 + rng.uniform(size=(4, 6)), rng.uniform(0.1, 1.0, size=(4, 6)))},
                   np.ones((4, 6), bool), stamp)


def _capture(node) -> list[tuple[str, object]]:
    sent: list[tuple[str, object]] = []
    mean_pub, var_pub = node._map_pubs["magnitude"]
    mean_pub.publish = lambda m: sent.append(("mean", m))
    var_pub.publish = lambda m: sent.append(("variance", m))
    node._scale_pub.publish = lambda m: sent.append(("scale", m))
    node._cloud_pub.publish = lambda m: sent.append(("cloud", m))
    return sent


def test_reset_publishes_the_cleared_map_with_its_scale_on_the_maps_clock(node_factory):  # noqa: F811
    from std_srvs.srv import Trigger

    from gp_mapping.ros import conversions

    node = node_factory(**{"grid.mean_range": [40.0, 60.0]})
    sent = _capture(node)
    node._publish_grid(_grid(stamp=1234.5))
    sent.clear()
    assert node.on_reset(Trigger.Request(), Trigger.Response()).success
    kinds = [k for k, _ in sent]
    assert kinds == ["scale", "mean", "variance", "cloud"]  # the scale first, as with every map
    scale, _ = conversions.scale_from_msg(sent[0][1])
    assert scale["magnitude"]["mean"] == (40.0, pytest.approx(0.2))  # the configured range still holds
    for kind, msg in sent[1:3]:
        assert set(np.asarray(msg.data).tolist()) == {-1}
        # Stamped on the maps' clock (data time of the last map), not the node clock.
        assert msg.header.stamp.sec == 1234 and msg.header.stamp.nanosec == 500_000_000
    assert sent[3][1].width == 0


def test_a_bad_parameter_is_reported_before_the_warm_up(monkeypatch):
    """spin() builds the node (validating the parameters) before the ~5 s torch warm-up."""
    from gp_mapping.ros import mapper_node

    calls = []
    monkeypatch.setattr(mapper_node, "warm_up_engines", lambda: calls.append("warm-up"))
    started = time.monotonic()
    status = mapper_node.spin(["mapper", "--ros-args", "-p", "model.kernel:=nope"])
    assert status == mapper_node.EXIT_BAD_CONFIG and calls == []
    assert time.monotonic() - started < 30.0


def test_start_up_line_names_topics_frames_engine_and_device(node_factory):  # noqa: F811
    from rclpy.parameter import Parameter  # noqa: F401

    node = node_factory(**{"node.pose_type": "odometry", "grid.frame_id": "world", "model.device": "cpu"})
    line = node.describe()
    for part in ("magnetometer on /mag", "odometry on /pose", "frame 'world'", "dual_svgp", "on cpu",
                 "publishing under /mapper/"):
        assert part in line, (part, line)


def test_the_3d_slice_height_changes_while_running(node_factory):  # noqa: F811
    from rclpy.parameter import Parameter

    node = node_factory(**{"sync.input_dims": 3, "grid.height": 0.0})
    assert node.set_parameters([Parameter("grid.height", value=1.5)])[0].successful
    deadline = time.monotonic() + 10.0
    while node.config.grid.height != 1.5:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert node.mapper.config.grid.height == 1.5  # the Mapper predicts the next map at the new height
    assert node.mapper.map_changed
    refused = node.set_parameters([Parameter("grid.height", value=1e9)])[0]
    assert not refused.successful and "grid.height" in refused.reason


def test_a_ctrl_c_inside_a_finalizer_prints_nothing(capsys, monkeypatch):
    from gp_mapping.ros.process import quiet_interrupts_in_finalizers

    class RaisesWhenCollected:
        def __init__(self, exc: BaseException) -> None:
            self.exc = exc

        def __del__(self) -> None:
            raise self.exc

    monkeypatch.setattr(sys, "unraisablehook", quiet_interrupts_in_finalizers)
    RaisesWhenCollected(KeyboardInterrupt())  # collected at once: the interrupt goes to the hook
    assert capsys.readouterr().err == ""
    RaisesWhenCollected(ValueError("a real problem"))
    assert "a real problem" in capsys.readouterr().err  # anything else is still reported


def test_model_device_takes_a_gpu_index():
    from gp_mapping.config import ConfigError, config_from_dict

    assert config_from_dict({"model": {"device": "cuda:1"}}).model.device == "cuda:1"
    with pytest.raises(ConfigError, match="model.device"):
        config_from_dict({"model": {"device": "cuda:x"}})
