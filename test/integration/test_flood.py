"""Load: a publisher floods the node with 1 kHz magnetometer and 1 kHz pose messages for 30 s. The node stays
responsive (maps and diagnostics keep coming), its queues stay within their bounds, the backlog it drops is
counted in the diagnostics, and its resident memory levels off."""
from __future__ import annotations

import itertools
import textwrap
import time

import pytest

from support.mapper_process import (MapperProcess, diagnostic_values, node_env, subscribe_map, wait_for_node,
                                    write_params)
from support.ros import PYTHON, ChildProcess, RosHarness

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::DeprecationWarning")]

RATE = 1000.0    # messages per second on each topic
DURATION = 30.0  # seconds
MAX_PENDING = 1000
BATCH = 10  # small batches of full updates: the mapper cannot keep up with what arrives, so backlog is dropped

FLOOD = textwrap.dedent("""
    import math, sys, time
    import rclpy
    from rclpy.qos import QoSProfile, ReliabilityPolicy
    from geometry_msgs.msg import PoseStamped
    from sensor_msgs.msg import MagneticField

    mag_topic, pose_topic, rate, duration = sys.argv[1], sys.argv[2], float(sys.argv[3]), float(sys.argv[4])
    rclpy.init()
    node = rclpy.create_node("flood_publisher")
    qos = QoSProfile(depth=100, reliability=ReliabilityPolicy.BEST_EFFORT)
    mag_pub = node.create_publisher(MagneticField, mag_topic, qos)
    pose_pub = node.create_publisher(PoseStamped, pose_topic, qos)
    deadline = time.monotonic() + 30.0
    while (mag_pub.get_subscription_count() == 0 or pose_pub.get_subscription_count() == 0) \\
            and time.monotonic() < deadline:
        rclpy.spin_once(node, timeout_sec=0.05)
    mag, pose = MagneticField(), PoseStamped()
    mag.header.frame_id, pose.header.frame_id = "magnetometer", "map"
    pose.pose.orientation.w = 1.0
    start = time.monotonic()
    sent = 0
    print("flood start", flush=True)
    while True:
        now = time.monotonic() - start
        if now >= duration:
            break
        due = int(now * rate) + 1
        while sent < due:  # catch up after a late wake-up: the rate holds on average
            t = now + 1000.0
            stamp = node.get_clock().now().to_msg()
            angle = 0.25 * t
            pose.header.stamp = stamp
            pose.pose.position.x, pose.pose.position.y = 2.0 * math.cos(angle), 2.0 * math.sin(angle)
            pose_pub.publish(pose)
            mag.header.stamp = stamp
            mag.magnetic_field.x = 50e-6 + 2e-6 * math.sin(3.0 * pose.pose.position.x)
            mag.magnetic_field.y, mag.magnetic_field.z = 1e-6, -3e-6
            mag_pub.publish(mag)
            sent += 1
        time.sleep(0.0005)
    print(f"flood sent {sent} per topic in {time.monotonic() - start:.1f} s", flush=True)
    node.destroy_node()
    rclpy.shutdown()
""")


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    raise RuntimeError("no VmRSS")


def test_flood_keeps_the_node_responsive_with_bounded_queues_and_memory(tmp_path, ros_env):
    params = write_params(tmp_path / "params.yaml",
                          # Every batch is a full update (full_update_samples 1) with its 20 hyperparameter steps
                          # (no hyper_batch budget after a warm-up), and a batch (10 ms of a 0.5 m/s circle: 2.5 mm
                          # from its centroid) spans more than 3 % of the 0.05 m lengthscale, so it teaches hyperparameters: the mapper must
                          # fall behind (with the shipped budget it keeps up with the flood: no drops to count).
                          model={"num_inducing": 64, "memory_size": 300, "hyper_steps": 20,
                                 "hyper_warmup": 10_000_000, "lengthscale": 0.05, "full_update_samples": 1},
                          # catch-up off: with it the node absorbs this flood (test_catch_up.py); here the mapper
                          # must stay behind, to show the queues bounded and the drops counted
                          batching={"size": BATCH, "max_pending": MAX_PENDING, "catch_up_after": 0},
                          grid={"mode": "grow", "resolution": 0.25, "unknown_distance": 0.5},
                          node={"publish_period": 0.5, "queue_depth": 100})
    env = node_env(ros_env, tmp_path)
    with RosHarness("flood_test") as harness:
        with MapperProcess(tmp_path, env, params, batch=BATCH) as proc:
            view = subscribe_map(harness, proc)
            wait_for_node(harness, view, proc)
            harness.spin_for(1.0)
            rss_idle = rss_mib(proc.proc.pid)
            with ChildProcess([PYTHON, "-c", FLOOD, proc.mag_topic, proc.pose_topic, str(RATE), str(DURATION)],
                              env, tmp_path / "flood.log") as flood:
                harness.spin_until(lambda: "flood start" in flood.output, 60.0, "the flood to start")
                started = time.monotonic()
                maps_before, diags_before = len(view.mean), len(view.diagnostics)
                rss = []
                while flood.poll() is None and time.monotonic() - started < DURATION + 30.0:
                    harness.spin_for(1.0)
                    proc.check_alive()
                    rss.append((time.monotonic() - started, rss_mib(proc.proc.pid)))
                assert flood.wait(timeout=30.0) == 0, flood.output
                flood_seconds = time.monotonic() - started
                maps_during = len(view.mean) - maps_before
                diags_during = len(view.diagnostics) - diags_before
                during = [{kv.key: kv.value for kv in s.values} for s in view.diagnostics[diags_before:]]
                sent = int(flood.output.split("flood sent ")[1].split()[0])
            harness.spin_for(3.0)
            proc.check_alive()
            final = diagnostic_values(view)
            rss_end = rss_mib(proc.proc.pid)
    received = int(final["node/mag_messages"])
    dropped = {"inbox_overflow": int(final["node/rejected/inbox_overflow"]),
               "dropped_overflow": int(final["dropped_overflow"]),
               "sync_overflow": int(final["rejected/sync_overflow"]),
               "transport_lost_mag": int(final["node/rejected/transport_lost_mag"])}
    rss_mid = [r for t, r in rss if t >= DURATION / 3]
    # The longest stretch of the flood without a new map, counted in diagnostics (one a second).
    published = [int(d["node/maps_published"]) for d in during]
    longest_gap = max(len(list(run)) for _, run in itertools.groupby(published)) if published else 0
    print(f"flood: {sent} per topic sent in {flood_seconds:.1f} s; node received {received} magnetometer and "
          f"{final['node/pose_messages']} pose messages; {final['updates']} updates; {maps_during} maps and "
          f"{diags_during} diagnostics published during the flood, longest stretch without a new map "
          f"{longest_gap} s; dropped {dropped}; RSS idle {rss_idle:.0f} MiB,"
          f" at 1/3 {rss_mid[0]:.0f} MiB, max {max(r for _, r in rss):.0f} MiB, end {rss_end:.0f} MiB")
    assert sent >= 0.5 * RATE * DURATION, "the publisher could not flood on this machine"
    # Responsive: diagnostics (1 s) kept coming while the flood ran, and so did maps: each update's map went out
    # right after it, and no stretch of the flood went long without one. On two cores shared with the Python
    # publisher, an update (0.15 s alone) took 1-3 s: measured 14-19 maps, longest stretch 3-4 s; 62 maps and 1 s
    # once the sync decided samples only when a batch could be full. Before the engines were warmed up at start,
    # the first update stalled 10 s importing torch._dynamo. On a loaded CI machine the executor took every message
    # only to drop it from the full inbox and starved the update thread of the GIL: 5 maps, a 12 s stretch; since a
    # full inbox holds the callback back (update_worker.INBOX_FULL_WAIT) 47-60 maps and 1 s, here also beside a
    # second busy test process.
    assert diags_during >= DURATION / 2  # measured 31
    assert longest_gap <= 8, published
    assert maps_during >= DURATION / 4
    assert int(final["updates"]) >= 10
    # Bounded queues: the inbox never held more than its bound, the mapper never more than max_pending.
    assert all(int(d["node/inbox"]) <= 2 * MAX_PENDING for d in during)
    assert all(int(d["pending"]) <= MAX_PENDING + BATCH for d in during)
    # The mapper fell behind (that is the point of the test) and counted what it dropped.
    assert dropped["dropped_overflow"] > 0
    # Every reading sent was received or counted as lost in transport (bar the few sent before the node first
    # heard from the publisher). With rclpy's MultiThreadedExecutor the node took ~400 of 30000 and never knew.
    assert received + dropped["transport_lost_mag"] >= 0.99 * sent
    # Every received reading is accounted for (mapped, pending, refused or dropped by a named counter).
    assert int(final["accepted"]) + int(final["samples_rejected"]) + int(final["waiting"]) \
        + dropped["inbox_overflow"] // 2 <= received + int(final["node/pose_messages"])
    assert int(final["accepted"]) == int(final["num_seen"]) + int(final["pending"]) + int(final["dropped"])
    # Memory levels off: after the first third of the flood the resident set grows by less than 100 MiB.
    assert max(rss_mid) - rss_mid[0] < 100.0, rss
