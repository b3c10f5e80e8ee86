"""The tf buffer follows tf2's rules (issue 38, item 1): the latest parent of a child wins from its stamp on
(counted, one notice per change), a transform that would make the map frame a child, close a loop or name a
frame its own parent is refused and counted by reason, and the correct chain that keeps arriving is used at
once: no reset is needed and mapping resumes within one ``node.tf_timeout``. The probe's sequences, through the
matcher alone and through the node's callbacks."""
from __future__ import annotations

import math

import numpy as np
import pytest

from gp_mapping.mapping.transforms import TfPoseMatcher, TransformBuffer, TransformSample
from support.nodes import _wait_idle, node_factory  # noqa: F401  (fixture)

IDENTITY_Q = np.array([0.0, 0.0, 0.0, 1.0])
MAP_ODOM_X = 5.0  # map -> odom: a constant offset, so a reading's x in the map is 5 + its odom x
T0 = 100.0
RATE = 50.0
TIMEOUT = 0.5


def _sample(stamp, parent, child, x=0.0, q=IDENTITY_Q):
    return TransformSample(float(stamp), parent, child, np.array([float(x), 0.0, 0.0]), np.asarray(q, float))


def good_chain(stamp):
    """map -> odom (constant, published with every instant) and odom -> base_link moving 1 m/s along x."""
    return [_sample(stamp, "map", "odom", MAP_ODOM_X), _sample(stamp, "odom", "base_link", stamp - T0)]


# Each hostile transform, sent alone between two instants of the correct chain, and the reason it is refused
# under (None: accepted, as tf2 accepts a re-parenting).
HOSTILE = [
    ("stray reparent", lambda t: _sample(t, "stray_odom", "base_link", 0.0), None),
    ("map made a child (loop map -> odom -> base_link -> map)", lambda t: _sample(t, "base_link", "map"),
     "fixed_frame_child"),
    ("2-frame loop", lambda t: _sample(t, "base_link", "odom"), "loop"),
    ("3-frame loop", lambda t: _sample(t, "sensor_b", "base_link"), "loop"),
    ("self-parent", lambda t: _sample(t, "odom", "odom"), "self_parent"),
    ("NaN quaternion", lambda t: _sample(t, "odom", "base_link", 0.0, [np.nan, 0, 0, 1]), "invalid"),
    ("zero quaternion", lambda t: _sample(t, "odom", "base_link", 0.0, [0, 0, 0, 0]), "invalid"),
    ("empty parent", lambda t: _sample(t, "", "base_link"), "invalid"),
    ("empty child", lambda t: _sample(t, "odom", ""), "invalid"),
]


def _events(phase_seconds=1.0):
    """(kind, payload) in arrival order: the correct chain and a reading at 50 Hz, each hostile transform once in
    its own phase (half-way between two instants), then a final all-good phase. Returns the events and the
    stamps of the hostile transforms."""
    events, bad_stamps = [], []
    steps = int(phase_seconds * RATE)
    k = 0
    for phase in range(len(HOSTILE) + 2):  # a good phase first, one per hostile transform, a good one last
        for i in range(steps):
            t = T0 + k / RATE
            events.append(("tf", good_chain(t)))
            events.append(("mag", t))
            if 0 < phase <= len(HOSTILE) and i == steps // 2:
                bad_stamps.append(t + 0.5 / RATE)
                events.append(("tf", [HOSTILE[phase - 1][1](bad_stamps[-1])]))
            k += 1
    return events, bad_stamps


def test_the_buffer_follows_tf2s_rules_for_parents_loops_and_the_fixed_frame():
    buf = TransformBuffer(fixed_frame="map")
    for t in (0.0, 1.0, 2.0):
        for s in good_chain(T0 + t):
            assert buf.add(s)
    assert buf.add(_sample(0.0, "base_link", "sensor_a"), static=True)
    assert buf.add(_sample(0.0, "sensor_a", "sensor_b"), static=True)
    for name, make, reason in HOSTILE[1:]:
        before = dict(buf.rejected_by_reason)
        assert not buf.add(make(T0 + 2.5)), name
        assert buf.rejected_by_reason[reason] == before[reason] + 1, name
    assert buf.rejected == len(HOSTILE) - 1 and buf.reparents == 0
    # Nothing refused entered the tree: the lookup is the correct chain's.
    np.testing.assert_allclose(buf.lookup("map", "base_link", T0 + 1.5)[0], [MAP_ODOM_X + 1.5, 0, 0])
    # The latest parent wins from its stamp on; earlier times keep the old parent.
    assert buf.add(_sample(T0 + 3.0, "stray_odom", "base_link", 0.0))
    assert buf.reparents == 1
    assert not buf.connected("map", "base_link", T0 + 3.0) and buf.connected("map", "base_link", T0 + 1.5)
    np.testing.assert_allclose(buf.lookup("map", "base_link", T0 + 2.0)[0], [MAP_ODOM_X + 2.0, 0, 0])
    # Between the old parent's last transform and the change: no transform can come any more (a gap, not a wait).
    from gp_mapping.mapping.transforms import TransformGapError
    with pytest.raises(TransformGapError, match="re-parented"):
        buf.lookup("odom", "base_link", T0 + 2.5)
    # The correct parent comes back: it wins from its own stamp on, without any reset.
    for t in (3.1, 3.2):
        for s in good_chain(T0 + t):
            assert buf.add(s)
    assert buf.reparents == 2
    np.testing.assert_allclose(buf.lookup("map", "base_link", T0 + 3.15)[0], [MAP_ODOM_X + 3.15, 0, 0])
    # A change of parent at a time the current parent already covers is refused (tf2 keeps one parent per time).
    assert not buf.add(_sample(T0 + 3.15, "stray_odom", "base_link")) and buf.rejected_by_reason["late_reparent"] == 1
    # One notice per distinct change or refusal kind, however often it repeats.
    notices = buf.take_notices()
    assert sum("re-parented from odom to stray_odom" in n for n in notices) == 1
    assert sum("re-parented from stray_odom to odom" in n for n in notices) == 1
    assert any("map frame 'map' a child" in n for n in notices) and any("close a loop" in n for n in notices)
    for t in (4.0, 4.1):  # the same flap again: counted, not noticed again
        buf.add(_sample(T0 + t, "stray_odom", "base_link"))
        for s in good_chain(T0 + t + 0.05):
            buf.add(s)
    assert buf.reparents == 6 and buf.take_notices() == []


def test_probe_sequences_never_misplace_a_reading_and_mapping_resumes_within_tf_timeout():
    """The probe: one hostile transform per phase between the correct chain's instants, then an all-good phase.
    Every reading placed is placed where the correct chain says (no silently wrong pose at the stray message's
    time), readings are lost only at a re-parenting (at most 2 there), and none after a refused transform."""
    m = TfPoseMatcher("map", "base_link", (np.zeros(3), IDENTITY_Q), max_gap=0.1, timeout=TIMEOUT)
    m.add_transform(_sample(0.0, "base_link", "sensor_a"), static=True)
    m.add_transform(_sample(0.0, "sensor_a", "sensor_b"), static=True)
    events, bad_stamps = _events()
    placed, fed, pending_max = {}, [], 0
    for kind, payload in events:
        if kind == "tf":
            for s in payload:
                m.add_transform(s, static=False)
        else:
            m.add_field(payload, [2e-5, 0.0, -4e-5], "magnetometer")
            fed.append(payload)
        for stamp, position, _, _ in m.ready():
            placed[stamp] = position
        pending_max = max(pending_max, m.waiting)
    for stamp, position in placed.items():
        assert position[0] == pytest.approx(MAP_ODOM_X + stamp - T0, abs=1e-9), stamp
    lost = sorted(set(fed) - set(placed))
    stray = bad_stamps[0]
    # The only losses: readings between the old parent's last transform and the correct one's return.
    assert all(stray - 1.0 / RATE < t < stray + 1.0 / RATE for t in lost[:2]), lost
    final = [t for t in fed if t >= fed[-1] - 1.0 + 1e-9]
    decided_by_end = [t for t in final if t <= fed[-1] - TIMEOUT]
    assert len(lost) <= 2 + len([t for t in final if t not in placed and t > fed[-1] - TIMEOUT])
    assert all(t in placed for t in decided_by_end)
    # Readings never wait more than one tf_timeout of stream time (plus the instant at which they are decided).
    assert pending_max <= TIMEOUT * RATE + 2
    buf = m.buffer
    expected = {"invalid": 4, "self_parent": 1, "fixed_frame_child": 1, "loop": 2, "late_reparent": 0}
    assert buf.rejected_by_reason == expected and buf.reparents == 2


def test_the_node_counts_tf_refusals_and_reparents_and_maps_again_without_a_reset(node_factory):  # noqa: F811
    from support.nodes import mag_msg, tf_msg

    node = node_factory(**{"model.num_inducing": 32, "model.learn_hyperparameters": False, "model.device": "cpu",
                           "batching.size": 25, "grid.resolution": 0.5, "node.pose_source": "tf",
                           "node.tf_timeout": TIMEOUT, "node.publish_period": 60.0})
    node.on_tf(tf_msg(0.0, [("base_link", "sensor_a", np.zeros(3), IDENTITY_Q),
                            ("sensor_a", "sensor_b", np.zeros(3), IDENTITY_Q)]), static=True)
    events, _ = _events(phase_seconds=0.5)
    accepted_before_last_phase = None
    for n, (kind, payload) in enumerate(events):
        if kind == "tf":
            node.on_tf(tf_msg(payload[0].stamp, [(s.parent, s.child, s.translation, s.rotation) for s in payload]))
        else:
            node.on_mag(mag_msg(payload, [2e-5, 0.0, -4e-5], "magnetometer"))
        if n == len(events) - 2 * int(0.5 * RATE) - 1:
            _wait_idle(node)
            with node._lock:
                node._feed_inbox()
                accepted_before_last_phase = node.mapper.diagnostics()["accepted"]
    _wait_idle(node)
    with node._lock:
        node._feed_inbox()
        diag = node.mapper.diagnostics()
    # The all-good last phase is mapped (all but the readings still within tf_timeout of the newest).
    assert diag["accepted"] - accepted_before_last_phase >= int(0.5 * RATE) - TIMEOUT * RATE - 1
    assert diag["accepted"] >= len([e for e in events if e[0] == "mag"]) - 2 - TIMEOUT * RATE - 1
    published = []
    node._diag_pub.publish = published.append
    node._publish_diagnostics()
    values = {kv.key: kv.value for kv in published[-1].status[0].values}
    assert values["node/tf_reparents"] == "2"
    assert values["node/tf_rejected/loop"] == "2" and values["node/tf_rejected/fixed_frame_child"] == "1"
    assert values["node/tf_rejected/self_parent"] == "1" and values["node/tf_rejected/invalid"] == "4"
    assert math.isclose(float(values["node/tf_rejected_transforms"]), 8)
