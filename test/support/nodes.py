"""MapperNode objects in the test process (the node's callbacks without DDS traffic), and the messages fed to them."""
from __future__ import annotations

import contextlib
import time
from typing import Iterator

import pytest


@pytest.fixture
def node_factory():
    """MapperNode objects in this process on their own rclpy context (no DDS traffic is needed)."""
    import rclpy
    from rclpy.context import Context
    from rclpy.parameter import Parameter

    from gp_mapping.ros.mapper_node import MapperNode

    made = []
    context = Context()
    rclpy.init(context=context)

    def make(**params):
        overrides = [Parameter(k, value=v) for k, v in params.items()]
        node = MapperNode(context=context, parameter_overrides=overrides)
        made.append(node)
        return node

    yield make
    for node in made:
        node.close()
    context.try_shutdown()


def _wait_idle(node, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with node._lock:
            if node.backlog == 0 and node.mapper.num_pending < node.config.batching.size:
                return
        time.sleep(0.02)
    raise AssertionError("the node's update thread did not catch up")


def tf_msg(stamp: float, edges) -> object:
    from geometry_msgs.msg import TransformStamped
    from tf2_msgs.msg import TFMessage

    from gp_mapping.ros.conversions import seconds_to_stamp

    msg = TFMessage()
    for parent, child, t, q in edges:
        ts = TransformStamped()
        ts.header.stamp, ts.header.frame_id, ts.child_frame_id = seconds_to_stamp(stamp), parent, child
        ts.transform.translation.x, ts.transform.translation.y, ts.transform.translation.z = (float(v) for v in t)
        (ts.transform.rotation.x, ts.transform.rotation.y, ts.transform.rotation.z,
         ts.transform.rotation.w) = (float(v) for v in q)
        msg.transforms.append(ts)
    return msg


def mag_msg(stamp: float, field, frame: str):
    from sensor_msgs.msg import MagneticField

    from gp_mapping.ros.conversions import seconds_to_stamp

    msg = MagneticField()
    msg.header.stamp, msg.header.frame_id = seconds_to_stamp(stamp), frame
    msg.magnetic_field.x, msg.magnetic_field.y, msg.magnetic_field.z = (float(v) for v in field)
    return msg


@contextlib.contextmanager
def served_node(params: dict, client_name: str) -> Iterator[tuple]:
    """A mapping node in this process (its services on their own executor thread, as always) and a client node
    in the same context, talking over DDS; yields (node, client node)."""
    import rclpy
    from rclpy.context import Context
    from rclpy.parameter import Parameter

    from gp_mapping.ros.mapper_node import MapperNode

    context = Context()
    rclpy.init(context=context)
    node = MapperNode(context=context, parameter_overrides=[Parameter(k, value=v) for k, v in params.items()])
    client_node = rclpy.create_node(client_name, context=context)
    try:
        yield node, client_node
    finally:
        client_node.destroy_node()
        node.close()
        context.try_shutdown()
