"""Stamps from the future (issue 38, item 3): a lone reading or pose ahead of its stream, within
sync.max_stamp_jump, is held back until the stream confirms it, so the clean data after it are kept (at most 2
lost); a real gap in a stream costs one message of latency and nothing else; a non-normalised nanosec is refused
as malformed instead of read as seconds ahead."""
from __future__ import annotations

import math

import numpy as np
import pytest

from gp_mapping.config import SyncConfig
from gp_mapping.mapping.sync import MeasurementSync

Q = [0.0, 0.0, 0.0, 1.0]
B = [20e-6, -5e-6, -42e-6]
RATE = 50.0


def feed(sync, t0, n, receive_offset=0.01):
    """``n`` clean instants at 50 Hz from ``t0``: a pose at each, a reading half-way; the x position is the stamp."""
    for k in range(n):
        t = round(t0 + k / RATE, 6)
        sync.add_pose(t, [t, 0.0, 0.0], Q, receive_time=t + receive_offset)
        if k:
            s = round(t - 0.5 / RATE, 6)
            add_field = getattr(sync, "add_field", None) or sync.add_magnetic_field
            add_field(s, B, "mag", receive_time=s + receive_offset)
    return n - 1  # readings fed


@pytest.mark.parametrize("stream", ["field", "pose"])
@pytest.mark.parametrize("ahead", [0.5, 2.0, 4.3, 30.0, 59.0])
def test_a_lone_stamp_ahead_costs_at_most_two_clean_readings(stream, ahead):
    sync = MeasurementSync(SyncConfig(max_pose_gap=0.1, max_stamp_jump=60.0))
    fed = feed(sync, 100.0, 100)
    before = sync.accepted
    bad = 100.0 + 99 / RATE + ahead
    if stream == "field":  # the bad message arrives when the clean stream is at 101.98
        sync.add_field(bad, B, "mag", receive_time=101.99)
    else:
        sync.add_pose(bad, [bad, 0.0, 0.0], Q, receive_time=101.99)
    clean = feed(sync, 100.0 + 100 / RATE, 199)  # 198 readings after the bad one
    sync.finish()
    lost = fed + clean - sync.accepted
    assert lost <= 2, sync.rejected
    assert sync.rejected[f"{stream}_stamp_ahead"] == 1 and sync.reanchors == 0
    assert sync.accepted - before >= clean - 2
    m = sync.pop_ready()
    np.testing.assert_allclose(m.x[:, 0], m.t, atol=1e-9)  # no sample placed by the bad pose
    assert np.all(np.diff(m.t) > 0)


def test_beyond_max_stamp_jump_the_stamp_is_still_refused_as_a_jump():
    sync = MeasurementSync(SyncConfig(max_pose_gap=0.1, max_stamp_jump=60.0))
    feed(sync, 100.0, 100)
    sync.add_field(100.0 + 99 / RATE + 61.0, B, "mag")
    feed(sync, 102.0, 50)
    assert sync.rejected["field_stamp_jump"] == 1 and sync.rejected["field_stamp_ahead"] == 0


def test_a_real_gap_in_both_streams_loses_nothing_and_waits_one_message():
    sync = MeasurementSync(SyncConfig(max_pose_gap=0.1, max_stamp_jump=60.0))
    n = feed(sync, 100.0, 100)
    accepted = sync.accepted
    # 5 s without any message, then both streams resume at the same rate (a driver restart, a dropout).
    sync.add_pose(107.0, [107.0, 0.0, 0.0], Q)  # held: it waits for its stream
    sync.add_field(107.01, B, "mag")
    sync.add_pose(107.02, [107.02, 0.0, 0.0], Q)  # confirms both: they are accepted now
    assert sync.accepted == accepted + 1 and sum(sync.rejected.values()) == 0
    n += 1 + feed(sync, 107.04, 50)
    sync.finish()
    assert sync.accepted == n and sum(sync.rejected.values()) == 0


def test_the_other_stream_confirms_a_held_message_and_the_end_of_the_stream_releases_it():
    sync = MeasurementSync(SyncConfig(max_pose_gap=0.5, max_stamp_jump=60.0))
    feed(sync, 100.0, 50)                        # poses to 100.98, readings to 100.97
    sync.add_pose(103.0, [103.0, 0.0, 0.0], Q)   # 2 s ahead of the pose stream: held
    assert sync.poses_accepted == 50
    for k in range(1, 108):                      # the readings go on at 50 Hz and reach it: confirmed
        sync.add_field(round(100.97 + k / RATE, 6), B, "mag")
    assert sync.poses_accepted == 51 and sync.rejected["pose_stamp_ahead"] == 0
    sync.add_field(106.0, B, "mag")              # 2.9 s ahead of the readings: held at the end of the stream ...
    sync.finish()                                # ... and released by it (it waits for a pose that never comes)
    assert sync.rejected["field_stamp_ahead"] == 0 and sync.rejected["no_pose_after"] >= 1


def test_the_check_off_holds_nothing():
    sync = MeasurementSync(SyncConfig(max_pose_gap=0.1, max_stamp_jump=0.0))
    feed(sync, 100.0, 20)
    assert sync.add_pose(150.0, [150.0, 0.0, 0.0], Q)
    assert sync.last_stamp == 150.0


def test_a_non_normalised_nanosec_is_refused_as_malformed_in_the_node_and_the_bag():
    from builtin_interfaces.msg import Time

    from gp_mapping.bag.decode import _stamp
    from gp_mapping.ros.conversions import field_from_msg, stamp_to_seconds

    assert stamp_to_seconds(Time(sec=100, nanosec=999_999_999)) == pytest.approx(100.999999999)
    assert math.isnan(stamp_to_seconds(Time(sec=100, nanosec=1_000_000_000)))
    assert math.isnan(stamp_to_seconds(Time(sec=100, nanosec=4_000_000_000)))

    class Header:
        stamp = Time(sec=100, nanosec=3_000_000_000)
    assert math.isnan(_stamp(Header, 5_000_000_000))

    from sensor_msgs.msg import MagneticField
    msg = MagneticField()
    msg.header.stamp = Time(sec=101, nanosec=2_500_000_000)  # 103.5 if read as seconds ahead
    msg.magnetic_field.x = 2e-5
    stamp, field, _ = field_from_msg(msg)
    sync = MeasurementSync(SyncConfig(max_pose_gap=0.1))
    n = feed(sync, 100.0, 50)
    sync.add_field(stamp, field, "mag")
    n += feed(sync, 101.0, 50)
    sync.finish()
    assert sync.rejected["field_stamp_nonfinite"] == 1 and sync.accepted == n


def test_the_mapper_fed_as_the_node_feeds_it_keeps_the_clean_data():
    """Through the Mapper with receive times, as the node drives it: a reading 30 s ahead, then a pose 4.3 s
    ahead, each in a clean 50 Hz stream; every clean reading is mapped."""
    from gp_mapping.config import config_from_dict
    from gp_mapping.mapping.mapper import Mapper

    mapper = Mapper(config_from_dict({"model.num_inducing": 16, "model.learn_hyperparameters": False,
                                      "model.device": "cpu", "batching.size": 100, "model.tile_size": 0.0}))
    n = feed(mapper, 100.0, 100)
    mapper.add_magnetic_field(131.99, B, "mag", receive_time=101.99)
    n += feed(mapper, 102.0, 100)
    mapper.add_pose(106.3, [106.3, 0.0, 0.0], Q, receive_time=103.99)
    n += feed(mapper, 104.0, 100)
    mapper.flush()
    d = mapper.diagnostics()
    assert d["accepted"] == n and d["reanchors"] == 0, d["rejected"]
    assert d["rejected"]["field_stamp_ahead"] == 1 and d["rejected"]["pose_stamp_ahead"] == 1
    assert d["num_seen"] == n
