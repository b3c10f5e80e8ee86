"""Pose/field matching against closed forms, the sensor extrinsic, units and every rejection reason."""
import math

import numpy as np
import pytest
from scipy.spatial.transform import Rotation

from gp_mapping.config import SyncConfig
from gp_mapping.mapping.frames import quaternion_from_rpy
from gp_mapping.mapping.sync import REJECTION_REASONS, UNIT_PER_TESLA, Measurements, MeasurementSync, SyncError

V = np.array([0.5, -0.2, 0.05])   # m/s, straight line
P0 = np.array([1.0, 2.0, 0.3])
YAW_RATE = 0.4                    # rad/s about z
B_MAP = np.array([20e-6, -5e-6, -42e-6])  # tesla, constant in the map frame


def pose_at(t):
    return P0 + V * t, quaternion_from_rpy(0.0, 0.0, YAW_RATE * t)


def field_in_sensor(t, sensor_rotation):
    """Reading of the constant map-frame field by a sensor rotated by yaw(t) * sensor_rotation."""
    r = Rotation.from_euler("z", YAW_RATE * t) * Rotation.from_quat(sensor_rotation)
    return r.inv().apply(B_MAP)


def run_stream(sync, pose_stamps, field_stamps, sensor_rotation=(0, 0, 0, 1)):
    """Feed both streams merged by stamp, each field arriving just before the pose that follows it."""
    events = [(t, 1, "pose") for t in pose_stamps] + [(t, 0, "field") for t in field_stamps]
    for t, _, kind in sorted(events):
        if kind == "pose":
            assert sync.add_pose(t, *pose_at(t))
        else:
            sync.add_field(t, field_in_sensor(t, sensor_rotation))
    return sync.pop_ready()


def test_interpolation_straight_line_constant_yaw_rate_with_extrinsic():
    t_s = [0.3, -0.1, 0.2]
    q_s = list(Rotation.from_euler("xyz", [0.3, -0.2, 1.1]).as_quat())
    sync = MeasurementSync(SyncConfig(target="vector", input_dims=3, sensor_translation=t_s, sensor_rotation=q_s))
    poses = np.arange(0.0, 3.0001, 0.1)
    fields = np.arange(0.013, 2.99, 0.02)
    m = run_stream(sync, poses, fields, q_s)
    assert len(m) == fields.size and sync.accepted == fields.size
    np.testing.assert_allclose(m.t, fields)
    # closed form: body at P0 + V t with yaw w t; sensor at p + Rz(w t) t_s
    expect = P0 + V * fields[:, None] + Rotation.from_euler("z", YAW_RATE * fields[:, None]).apply(t_s)
    np.testing.assert_allclose(m.x, expect, atol=1e-12)
    np.testing.assert_allclose(m.position, expect, atol=1e-12)
    # the reading rotated back into the map frame is the constant field, in microtesla by default
    np.testing.assert_allclose(m.y, np.tile(B_MAP * 1e6, (fields.size, 1)), atol=1e-9)
    assert sum(sync.rejected.values()) == 0


def test_magnitude_target_and_2d_inputs():
    sync = MeasurementSync(SyncConfig(target="magnitude", input_dims=2, sensor_translation=[0.5, 0, 0]))
    fields = np.array([0.05, 0.55, 1.25])
    m = run_stream(sync, np.arange(0, 1.5, 0.1), fields)
    assert m.x.shape == (3, 2) and m.y.shape == (3, 1)
    expect = P0[:2] + V[:2] * fields[:, None] + 0.5 * np.stack(
        [np.cos(YAW_RATE * fields), np.sin(YAW_RATE * fields)], axis=1)
    np.testing.assert_allclose(m.x, expect, atol=1e-12)
    np.testing.assert_allclose(m.y[:, 0], np.linalg.norm(B_MAP) * 1e6, rtol=1e-12)


@pytest.mark.parametrize("unit", list(UNIT_PER_TESLA))
def test_units(unit):
    sync = MeasurementSync(SyncConfig(field_unit=unit))
    sync.add_pose(0.0, [0, 0, 0], [0, 0, 0, 1])
    sync.add_field(0.0, [3e-6, 4e-6, 0.0])
    m = sync.pop_ready()
    assert m.y[0, 0] == pytest.approx(5e-6 * UNIT_PER_TESLA[unit])
    assert UNIT_PER_TESLA["gauss"] == 1e4 and UNIT_PER_TESLA["nanotesla"] == 1e9


def test_slerp_midpoint_between_two_poses():
    sync = MeasurementSync(SyncConfig(target="vector", max_pose_gap=1.0))
    sync.add_field(0.5, [1e-6, 0, 0])  # arrives before both poses: waits
    assert sync.num_waiting == 1
    sync.add_pose(0.0, [0, 0, 0], quaternion_from_rpy(0, 0, 0.0))
    assert sync.num_waiting == 1
    sync.add_pose(1.0, [2, 0, 0], quaternion_from_rpy(0, 0, math.pi / 2))
    m = sync.pop_ready()
    np.testing.assert_allclose(m.x, [[1.0, 0.0]])
    # halfway: yaw pi/4, the sensor x axis points to (1, 1)/sqrt 2 in the map frame
    np.testing.assert_allclose(m.y, [[math.sqrt(0.5), math.sqrt(0.5), 0.0]], atol=1e-12)


def test_exact_pose_stamp_and_late_sample_within_buffer():
    sync = MeasurementSync(SyncConfig(max_pose_gap=0.1, pose_buffer_seconds=5.0))
    for t in np.arange(0.0, 4.01, 0.1):
        sync.add_pose(t, [t, 0, 0], [0, 0, 0, 1])
    sync.add_field(0.3, [1e-6, 0, 0])   # 3.7 s late, still in the buffer, exactly a pose stamp (up to float)
    sync.add_field(1.25, [1e-6, 0, 0])
    m = sync.pop_ready()
    np.testing.assert_allclose(m.x[:, 0], [0.3, 1.25], atol=1e-12)


def test_rejection_reasons_each_counted():
    cfg = SyncConfig(max_pose_gap=0.1, pose_buffer_seconds=2.0)
    sync = MeasurementSync(cfg)
    ok = [0, 0, 0, 1]
    # poses
    assert sync.add_pose(1.0, [0, 0, 0], ok)
    assert not sync.add_pose(float("nan"), [0, 0, 0], ok)
    assert not sync.add_pose(1.1, [np.nan, 0, 0], ok)
    assert not sync.add_pose(1.1, [0, 0, 0], [0, 0, 0, np.inf])
    assert not sync.add_pose(1.1, [0, 0, 0], [0, 0, 0, 0])
    assert not sync.add_pose(0.5, [0, 0, 0], ok)
    assert not sync.add_pose(1.0, [0, 0, 0], ok)
    assert sync.add_pose(1.05, [0, 0, 0], ok)
    # fields
    sync.add_field(0.9, [1e-6, 0, 0])             # before the first pose
    sync.add_field(1.02, [np.nan, 0, 0])           # NaN component
    sync.add_field(float("inf"), [1e-6, 0, 0])     # bad stamp
    sync.add_field(1.03, [1e-6, 0, 0])             # accepted
    sync.add_field(1.01, [1e-6, 0, 0])             # older than the previous field sample
    sync.add_field(1.3, [1e-6, 0, 0])              # waits; next pose is 0.5 s later: pose gap
    assert sync.add_pose(1.8, [0, 0, 0], ok)
    sync.add_field(1.9, [1e-6, 0, 0])              # waits for a pose that never comes ...
    sync.add_field(4.5, [1e-6, 0, 0])              # ... and 2.6 s of field time later it times out
    # (4.5 is 2.6 s ahead of a stream ~0.3 s apart: held back until confirmed; finish() releases it)
    assert sync.num_waiting == 2
    sync.finish()                                   # the 4.5 s sample never gets its following pose
    expected = {"pose_stamp_nonfinite": 1, "pose_nonfinite": 2, "pose_bad_quaternion": 1,
                "pose_stamp_backwards": 1, "pose_stamp_duplicate": 1, "no_pose_before": 1, "field_nonfinite": 1,
                "field_stamp_nonfinite": 1, "field_stamp_backwards": 1, "pose_gap": 1, "pose_timeout": 1,
                "no_pose_after": 1, "sync_overflow": 0}
    assert set(sync.rejected) == set(REJECTION_REASONS)
    assert {k: v for k, v in sync.rejected.items() if v or k in expected} == expected
    assert sync.accepted == 1 and sync.poses_accepted == 3
    assert len(sync.pop_ready()) == 1
    c = sync.counters()
    assert c["accepted"] == 1 and c["rejected"] == sync.rejected and c["waiting"] == 0


def test_pose_gap_on_the_near_side():
    sync = MeasurementSync(SyncConfig(max_pose_gap=0.1))
    sync.add_pose(0.0, [0, 0, 0], [0, 0, 0, 1])
    sync.add_pose(1.0, [1, 0, 0], [0, 0, 0, 1])
    sync.add_field(0.05, [1e-6, 0, 0])   # 0.05 after a pose but 0.95 before the next: rejected
    sync.add_field(0.95, [1e-6, 0, 0])
    assert sync.rejected["pose_gap"] == 2 and sync.accepted == 0


def test_buffer_bound_and_old_samples():
    sync = MeasurementSync(SyncConfig(max_pose_gap=0.2, pose_buffer_seconds=1.0))
    for t in np.arange(0.0, 10.01, 0.1):
        sync.add_pose(t, [t, 0, 0], [0, 0, 0, 1])
    assert len(sync._poses) <= 12   # 1 s of 10 Hz poses plus the one at the cutoff
    sync.add_field(5.0, [1e-6, 0, 0])  # its poses were dropped from the buffer
    assert sync.rejected["no_pose_before"] == 1


def test_overflow_drops_oldest_and_accounting_balances():
    sync = MeasurementSync(SyncConfig(max_pose_gap=0.5), max_pending=5)
    sync.add_pose(0.0, [0, 0, 0], [0, 0, 0, 1])
    sync.add_pose(0.1, [0, 0, 0], [0, 0, 0, 1])
    for k in range(8):
        sync.add_field(0.01 * k, [1e-6, 0, 0])  # accepted but not popped
    for k in range(3):
        sync.add_field(0.15 + 0.01 * k, [1e-6, 0, 0])  # waiting for a following pose
    assert sync.rejected["sync_overflow"] == 6
    assert sync.num_ready + sync.num_waiting == 5
    m = sync.pop_ready()
    np.testing.assert_allclose(m.t, [0.06, 0.07])
    sync.add_pose(0.3, [0, 0, 0], [0, 0, 0, 1])
    assert len(sync.pop_ready()) == 3
    assert sync.accepted + sum(sync.rejected.values()) == 11


def test_wrong_shapes_raise():
    sync = MeasurementSync()
    with pytest.raises(SyncError, match="shape"):
        sync.add_field(0.0, [1.0, 2.0])
    with pytest.raises(SyncError, match="orientation"):
        sync.add_pose(0.0, [0, 0, 0], [0, 0, 1])


def test_bad_extrinsic_refused():
    with pytest.raises(SyncError, match="sensor_rotation"):
        MeasurementSync(SyncConfig(sensor_rotation=[0.0, 0.0, 0.0, 0.0]))


def test_every_field_sample_is_accounted_for_in_a_messy_stream():
    """A random stream with bad values, late samples, repeated poses and pose stalls:
    accepted + sample rejections + waiting = samples given, and poses likewise."""
    rng = np.random.default_rng(11)
    sync = MeasurementSync(SyncConfig(max_pose_gap=0.08, pose_buffer_seconds=1.0), max_pending=300)
    n_fields = n_poses = 0
    last_pose = 0.0
    popped = []
    for step in range(4000):
        clock = 0.01 * step
        stalled = 1500 <= step < 1560  # 0.6 s without poses
        if rng.uniform() < 0.3 and not stalled:
            stamp = last_pose if rng.uniform() < 0.05 else clock  # some repeated stamps
            q = [0, 0, 0, 0] if rng.uniform() < 0.02 else quaternion_from_rpy(0, 0, clock)
            sync.add_pose(stamp, [clock, 0, 0], q)
            last_pose, n_poses = stamp, n_poses + 1
        if rng.uniform() < 0.5:
            delay = rng.choice([0.0, 0.0, 0.0, 0.03])  # some late samples arrive out of order
            b = [np.nan, 0, 0] if rng.uniform() < 0.02 else [1e-6, 2e-6, 0]
            sync.add_field(clock - delay, b)
            n_fields += 1
        if step % 100 == 0:
            popped.append(sync.pop_ready())
    popped.append(sync.pop_ready())
    got = np.concatenate([m.t for m in popped])
    c = sync.counters()
    assert c["accepted"] == got.size and np.all(np.diff(got) >= 0)
    assert c["accepted"] + c["samples_rejected"] + c["waiting"] == n_fields
    assert c["poses_accepted"] + c["poses_rejected"] == n_poses
    sync.finish()
    c = sync.counters()
    assert c["accepted"] + c["samples_rejected"] == n_fields
    for reason in ("field_nonfinite", "field_stamp_backwards", "pose_gap", "pose_stamp_duplicate",
                   "pose_bad_quaternion"):
        assert sync.rejected[reason] > 0, reason
    assert c["accepted"] > 0.6 * n_fields  # most of the stream is clean


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_batched_decisions_equal_deciding_each_sample_on_arrival(seed):
    """Samples are decided in batches (module docstring, "Cost"); reading a counter after every call forces the
    one-by-one decisions of an eager sync. On a stream with gaps, teleports, late and bad samples, stalls past
    the pose buffer, stamp jumps with a re-anchor, and a small bound, both give the same samples, bit for bit,
    and the same counters."""
    rng = np.random.default_rng(seed)
    config = SyncConfig(max_pose_gap=0.08, pose_buffer_seconds=0.5, max_speed=5.0, max_stamp_jump=2.0)
    events = []
    clock = 0.0
    for step in range(6000):
        clock += 0.01
        if step == 3333:
            clock += 100.0  # a real clock jump: refused until the streams re-anchor
        stalled = 1500 <= step < 1600  # 1 s without poses: samples time out of the pose buffer
        if rng.uniform() < 0.3 and not stalled:
            x = clock + (20.0 if rng.uniform() < 0.01 else 0.0)  # a few teleports
            q = [0, 0, 0, 0] if rng.uniform() < 0.02 else quaternion_from_rpy(0, 0, clock)
            events.append(("pose", clock, [x, 0.5 * x, 0], q))
        if rng.uniform() < 0.6:
            delay = rng.choice([0.0, 0.0, 0.0, 0.03])
            b = [np.nan, 0, 0] if rng.uniform() < 0.02 else [1e-6 * (1 + np.sin(clock)), 2e-6, 3e-7]
            events.append(("field", clock - delay, b))
        if step % 1000 == 0:  # ~600 samples between pops: the bound of 400 drops some
            events.append(("pop",))

    def run(eager: bool):
        sync = MeasurementSync(config, max_pending=400)
        out = []
        for event in events:
            if event[0] == "pose":
                sync.add_pose(*event[1:])
            elif event[0] == "field":
                sync.add_field(*event[1:])
            else:
                out.append(sync.pop_ready())
            if eager:
                assert sync.num_waiting >= 0  # decides what is decidable now, as an eager sync would have
        out.append(sync.pop_ready())
        sync.finish()
        return Measurements.concatenate(out), sync.counters()

    (lazy, lazy_counts), (eager, eager_counts) = run(False), run(True)
    assert lazy_counts == eager_counts
    for name in ("x", "y", "t", "position"):
        np.testing.assert_array_equal(getattr(lazy, name), getattr(eager, name))
    rejected = lazy_counts["rejected"]
    for reason in ("pose_gap", "pose_jump", "pose_timeout", "sync_overflow", "field_nonfinite"):
        assert rejected[reason] > 0, (reason, rejected)
    assert lazy_counts["reanchors"] >= 1 and len(lazy) > 1000
