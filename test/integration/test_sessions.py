"""Sessions as a user declares them (issue 37, point 4: "a session is what the user says it is: a bag, a node run,
a merge source"): a bag replayed on the map of an earlier one (``gp-mapping replay --initial-map``), a node started
from a saved map or loading one, and the node's ``~/start_session``. The offset model itself is tested in
test/unit/test_calibration.py; here, that each way in starts a session and that a bag read with a constant offset
is mapped without it.
"""
from __future__ import annotations

import argparse
import dataclasses

import numpy as np
import pytest
import torch

from gp_mapping.config import config_from_dict
from gp_mapping.mapping.mapper import Mapper
from support.state import fed_mapper, small_config

torch.set_num_threads(1)

OFFSET_UT = 5.0
AREA = (-3.0, -3.0, 3.0, 3.0)


def _replay_config(**node):
    return config_from_dict({"model": {"num_inducing": 64, "memory_size": 200, "device": "cpu"},
                             "batching": {"mode": "count", "size": 50}, "grid": {"resolution": 0.25},
                             "node": node})


@pytest.fixture(scope="module")
def two_bags(tmp_path_factory):
    """One simulated room driven twice: a lawnmower, then (1000 s later) a loop over the same ground whose sensor
    reads |B| exactly OFFSET_UT higher (every reading scaled along itself)."""
    from gp_mapping import sim
    from gp_mapping.sim.demo_bag import DEFAULT_START_TIME, write_demo_bag

    folder = tmp_path_factory.mktemp("sessions")
    world = sim.World.from_config(sim.WorldConfig(area=AREA, n_dipoles=6), np.random.default_rng(4))
    first = sim.simulate(world, sim.TrajectoryConfig(patterns=("lawnmower",), area=AREA, speed=0.6, rate=10.0,
                                                     duration=60.0), sim.SensorConfig(), seed=1)
    second = sim.simulate(world, sim.TrajectoryConfig(patterns=("loop",), area=AREA, speed=0.6, rate=10.0,
                                                      duration=40.0), sim.SensorConfig(), seed=2)
    reading = second.field_sensor_tesla
    norm = np.linalg.norm(reading, axis=1, keepdims=True)
    second = dataclasses.replace(second, field_sensor_tesla=reading * (norm + OFFSET_UT * 1e-6) / norm)
    write_demo_bag(folder / "first", first, ground_truth=False)
    write_demo_bag(folder / "second", second, ground_truth=False, start_time=DEFAULT_START_TIME + 1000.0)
    truth = [(rec.sensor_position[:, :2], np.linalg.norm(rec.field_map_tesla_true, axis=1) * 1e6)
             for rec in (first, second)]
    return folder, truth


def _shape_error(mapper: Mapper, truth) -> float:
    """RMSE of the map's |B| along both drives about its mean error (the level of a map of several sessions is
    theirs, not the first one's)."""
    x = np.vstack([xy for xy, _ in truth])
    y = np.concatenate([b for _, b in truth])
    mean, _ = mapper.model.predict(x)
    err = mean.numpy()[:, 0] - y
    return float(np.sqrt(np.mean((err - err.mean()) ** 2)))


def test_a_bag_replayed_on_an_earlier_map_is_a_session_whose_offset_is_learned(two_bags, tmp_path):
    from gp_mapping.replay import replay_bag

    folder, truth = two_bags
    first = replay_bag(folder / "first", _replay_config())
    state = tmp_path / "first.safetensors"
    first.mapper.save(state)
    assert first.mapper.session == 0

    sessions = replay_bag(folder / "second", _replay_config(), initial_map=state)
    one = replay_bag(folder / "second", _replay_config(new_session_on_load=False), initial_map=state)
    diag = sessions.counts["mapper"]
    assert diag["session"] == 1 and one.counts["mapper"]["session"] == 0
    before = first.counts["mapper"]
    assert diag["num_seen"] == before["num_seen"] + diag["accepted"] - before["accepted"]  # the map went on
    assert diag["session_offset"][0] == pytest.approx(OFFSET_UT, abs=0.5)
    assert any("session 1" in note for note in sessions.notes)
    with_sessions, without = _shape_error(sessions.mapper, truth), _shape_error(one.mapper, truth)
    print(f"learned offset {diag['session_offset'][0]:.3f} uT; map error about its level: sessions "
          f"{with_sessions:.3f} uT, one session {without:.3f} uT")
    assert with_sessions < 0.5 * without


def test_replay_cli_names_the_session_and_refuses_same_session_alone(two_bags, tmp_path, capsys):
    from gp_mapping.replay import add_arguments, run

    folder, _ = two_bags
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    state = tmp_path / "first.safetensors"
    assert run(parser.parse_args([str(folder / "first"), "--out", str(tmp_path / "a"), "--save-state", str(state),
                                  "--no-progress"])) == 0
    assert run(parser.parse_args([str(folder / "second"), "--out", str(tmp_path / "b"), "--initial-map", str(state),
                                  "--no-progress"])) == 0
    out = capsys.readouterr().out
    assert "session 1: constant offset to the loaded map +" in out
    assert run(parser.parse_args([str(folder / "second"), "--same-session", "--no-progress"])) == 1
    assert "--same-session goes with --initial-map" in capsys.readouterr().err
    assert run(parser.parse_args([str(folder / "second"), "--out", str(tmp_path / "c"),
                                  "--initial-map", str(tmp_path / "absent.safetensors"), "--no-progress"])) == 1
    assert "--initial-map" in capsys.readouterr().err


def test_a_map_loaded_for_new_readings_starts_a_session_unless_told_otherwise(tmp_path):
    path = tmp_path / "map.safetensors"
    fed_mapper(small_config()).save(path)
    assert Mapper.load(path).session == 0  # a plain load (export, merge, resume) continues
    assert Mapper.load(path, new_session=True).session == 1
    empty = tmp_path / "empty.safetensors"
    Mapper(small_config()).save(empty)
    assert Mapper.load(empty, new_session=True).session == 0  # nothing to be offset from


def test_the_node_starts_a_session_from_a_saved_map_on_load_and_on_request(tmp_path):
    import rclpy
    from rclpy.context import Context
    from rclpy.parameter import Parameter
    from std_srvs.srv import Trigger

    from gp_mapping.ros.mapper_node import MapperNode

    path = tmp_path / "map.safetensors"
    fed_mapper(small_config()).save(path)
    params = {"model.num_inducing": 16, "model.memory_size": 30, "model.hyper_steps": 2, "model.device": "cpu",
              "batching.size": 20, "grid.resolution": 0.25, "node.initial_map": str(path)}
    context = Context()
    rclpy.init(context=context)
    try:
        def make(**extra):
            return MapperNode(context=context, parameter_overrides=[Parameter(k, value=v) for k, v in
                                                                    {**params, **extra}.items()])

        node = make(**{"node.new_session_on_load": False})
        try:
            assert node.mapper.session == 0  # the same sensor and day: the loaded session goes on
        finally:
            node.close()
        node = make()
        try:
            assert node.mapper.session == 1 and node.mapper.diagnostics()["session"] == 1
            answer = node.on_start_session(Trigger.Request(), Trigger.Response())
            assert answer.success and "session 2 started" in answer.message, answer.message
            assert node.mapper.session == 2
            assert node.on_load_map(Trigger.Request(), Trigger.Response()).success
            assert node.mapper.session == 1  # the reloaded map, this run's readings a session on it
        finally:
            node.close()
    finally:
        context.try_shutdown()
