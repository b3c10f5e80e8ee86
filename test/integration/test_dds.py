"""Foundation: two real processes exchange sensor_msgs/MagneticField over DDS on this machine.

The helpers (an in-process rclpy harness on its own context, and child processes that are always stopped) are in
test/support/ros.py, shared by the node end-to-end tests. Every process runs with
ROS_AUTOMATIC_DISCOVERY_RANGE=LOCALHOST and this run's ROS_DOMAIN_ID (test/conftest.py), so no traffic leaves the
machine.
"""
from __future__ import annotations

import textwrap

from support.ros import PYTHON, ChildProcess, RosHarness

# A publisher of MagneticField messages with known values; it waits for a subscriber (bounded) before sending.
PUBLISHER = textwrap.dedent("""
    import sys, time
    import rclpy
    from sensor_msgs.msg import MagneticField

    count = int(sys.argv[1])
    rclpy.init()
    node = rclpy.create_node("dds_test_publisher")
    pub = node.create_publisher(MagneticField, "dds_test/mag", 10)
    deadline = time.monotonic() + float(sys.argv[2])
    while pub.get_subscription_count() == 0 and time.monotonic() < deadline:
        rclpy.spin_once(node, timeout_sec=0.05)
    for i in range(count):
        msg = MagneticField()
        msg.header.frame_id = "magnetometer"
        msg.header.stamp.sec = 1000 + i
        msg.header.stamp.nanosec = 250_000_000
        msg.magnetic_field.x = 20e-6 + 1e-9 * i
        msg.magnetic_field.y = -3.5e-6
        msg.magnetic_field.z = -41.25e-6 * (i + 1)
        msg.magnetic_field_covariance = [float(i)] * 9
        pub.publish(msg)
        rclpy.spin_once(node, timeout_sec=0.05)
    time.sleep(0.5)  # let the reliable writer deliver before the process goes away
    print("published", count, flush=True)
    node.destroy_node()
    rclpy.shutdown()
""")


def _receive(harness: RosHarness, received: list) -> None:
    from rclpy.qos import QoSProfile, ReliabilityPolicy
    from sensor_msgs.msg import MagneticField

    harness.node.create_subscription(MagneticField, "dds_test/mag", received.append,
                                     QoSProfile(depth=10, reliability=ReliabilityPolicy.RELIABLE))


# -------------------------------------------------------------------------------------------------- tests


def test_environment_keeps_dds_on_loopback(ros_env):
    assert ros_env["ROS_AUTOMATIC_DISCOVERY_RANGE"] == "LOCALHOST"
    assert 1 <= int(ros_env["ROS_DOMAIN_ID"]) <= 101


def test_magnetic_field_crosses_processes(tmp_path, ros_env):
    count = 5
    received: list = []
    with RosHarness("dds_test_subscriber") as harness:
        _receive(harness, received)
        with ChildProcess([PYTHON, "-c", PUBLISHER, str(count), "20"], ros_env, tmp_path / "pub.log") as child:
            harness.spin_until(lambda: len(received) >= count, timeout=30.0,
                               what=f"{count} MagneticField messages from the child process")
            assert child.wait(timeout=20.0) == 0, child.output
            assert f"published {count}" in child.output
    assert len(received) == count
    for i, msg in enumerate(received):  # reliable + in order: values arrive bit-exact
        assert msg.header.frame_id == "magnetometer"
        assert (msg.header.stamp.sec, msg.header.stamp.nanosec) == (1000 + i, 250_000_000)
        assert msg.magnetic_field.x == 20e-6 + 1e-9 * i
        assert msg.magnetic_field.y == -3.5e-6
        assert msg.magnetic_field.z == -41.25e-6 * (i + 1)
        assert list(msg.magnetic_field_covariance) == [float(i)] * 9


def test_other_domain_is_not_heard(tmp_path, ros_env):
    """The per-run domain id isolates runs: a publisher on another domain never reaches this one."""
    env = dict(ros_env, ROS_DOMAIN_ID=str((int(ros_env["ROS_DOMAIN_ID"]) % 101) + 1))
    received: list = []
    with RosHarness("dds_test_subscriber") as harness:
        _receive(harness, received)
        # The child waits 4 s for a subscriber it cannot see, then publishes anyway.
        with ChildProcess([PYTHON, "-c", PUBLISHER, "3", "4"], env, tmp_path / "pub.log") as child:
            assert child.wait(timeout=30.0) == 0, child.output
            harness.spin_for(0.5)
    assert received == []
