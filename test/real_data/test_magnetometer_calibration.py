"""Magnetometer calibration (issue 40): the hard- and soft-iron correction of every reading (sync.hard_iron,
sync.soft_iron: corrected = soft_iron @ (raw - hard_iron)), its fit and `gp-mapping calibrate`.

Closed forms: a constant field seen in every orientation gives the offset and matrix back exactly. Real data: the
OptiTrack recording (sensor-frame readings, 6-DoF pose, a field of 41-60 uT that changes from place to place)
with a known offset and soft-iron matrix added; the recording's own small calibration is taken out by comparing
with the calibration of the unmodified recording. The simulator gives the ground robot, turning about z only.
"""
from __future__ import annotations

import numpy as np
import pytest
import yaml
from support.paths import shared_data
from scipy.spatial.transform import Rotation

from gp_mapping.config import ConfigError, MapperConfig, SyncConfig, config_from_dict, load_config
from gp_mapping.mapping.magnetometer import CalibrationError, IronCorrection, fit_iron_calibration
from gp_mapping.mapping.sync import MeasurementSync

HARD = np.array([25.0, -18.0, 12.0])                      # uT, tens of uT as a robot's motors give
SOFT_DISTORTION = np.array([[1.06, 0.04, -0.02], [0.01, 0.95, 0.05], [-0.03, 0.02, 1.0]])
SOFT_DISTORTION /= np.cbrt(np.linalg.det(SOFT_DISTORTION))  # det 1: turning cannot tell the sensor's gain


def _random_rotations(n: int, seed: int = 0) -> np.ndarray:
    return Rotation.random(n, random_state=seed).as_quat()


# ------------------------------------------------------------------------------------------- the correction


def test_defaults_change_nothing_bit_for_bit():
    iron = IronCorrection.from_sync(SyncConfig(), 1e6)
    b = np.array([[1e-5, -2e-5, 4e-5]])
    assert iron.identity and iron.apply(b) is b  # no arithmetic at the defaults


def test_sync_corrects_every_reading_before_it_is_rotated_or_measured():
    hard = [10.0, -5.0, 3.0]
    soft = [1.1, 0.1, 0.0, 0.0, 0.9, 0.0, 0.0, 0.0, 1.0]
    raw = np.array([30e-6, -10e-6, -40e-6])
    corrected = np.array(soft).reshape(3, 3) @ (raw * 1e6 - hard)
    q_body = Rotation.from_euler("z", 90, degrees=True).as_quat()
    for target, expected in (("vector", Rotation.from_quat(q_body).apply(corrected)),
                             ("magnitude", [np.linalg.norm(corrected)])):
        sync = MeasurementSync(SyncConfig(target=target, hard_iron=hard, soft_iron=soft))
        sync.add_pose(0.0, [0, 0, 0], q_body)
        sync.add_field(0.05, raw)
        sync.add_pose(0.1, [0, 0, 0], q_body)
        np.testing.assert_allclose(sync.pop_ready().y[0], expected, rtol=1e-12)


def test_config_keys_are_validated_and_saved_with_the_map():
    config = config_from_dict({"sync": {"hard_iron": [1, 2, 3], "soft_iron": [2, 0, 0, 0, 2, 0, 0, 0, 2]}})
    assert config.sync.hard_iron == [1.0, 2.0, 3.0] and config.sync.soft_iron[0] == 2.0
    singular = [1, 0, 0, 0, 1, 0, 0, 0, 0]
    with pytest.raises(ConfigError, match=r"sync\.soft_iron.*singular"):
        config_from_dict({"sync": {"soft_iron": singular}})
    with pytest.raises(ConfigError, match=r"sync\.soft_iron"):
        config_from_dict({"sync": {"soft_iron": [1, 0, 0, 0, 1, 0, 0, 0]}})
    with pytest.raises(ConfigError, match=r"sync\.hard_iron"):
        config_from_dict({"sync": {"hard_iron": [0.0, float("nan"), 0.0]}})
    with pytest.raises(ValueError, match="singular"):  # a config built in code is refused where it is used
        MeasurementSync(SyncConfig(soft_iron=singular))


def test_the_localizer_corrects_readings_with_the_maps_calibration():
    from gp_mapping.localization.field_map import MagneticMap
    from gp_mapping.localization.localizer import Localizer
    from gp_mapping.mapping.grid import GridSpec

    spec = GridSpec(0.0, 0.0, 1.0, 2, 2)
    fmap = MagneticMap.from_arrays(spec, np.full((2, 2), 50.0), np.ones((2, 2)), hard_iron=(10.0, 0.0, 0.0),
                                   soft_iron=(2.0, 0, 0, 0, 2.0, 0, 0, 0, 2.0))
    reading = Localizer(fmap)._reading_in_map_units(np.array([40e-6, 0.0, 0.0]), np.array([0, 0, 0, 1.0]))
    assert reading[0] == pytest.approx(60.0)  # 2 * (40 - 10)


# ------------------------------------------------------------------------------------------- closed forms


def test_a_constant_field_in_every_orientation_gives_the_calibration_back():
    n = 600
    q = _random_rotations(n)
    world = np.array([5.0, 20.0, -45.0])
    true_field = Rotation.from_quat(q).apply(world, inverse=True)  # sensor frame
    raw = true_field @ SOFT_DISTORTION.T + HARD
    fit = fit_iron_calibration(raw, q, None)
    assert fit.observable == "full" and fit.method == "pose"
    np.testing.assert_allclose(fit.hard_iron, HARD, atol=1e-6)
    np.testing.assert_allclose(fit.soft_iron, np.linalg.inv(SOFT_DISTORTION), atol=1e-8)
    assert fit.residual_after < 1e-6 < fit.residual_before
    # without the orientation: the ellipsoid, the same offset; the matrix up to a rotation (S^T S)
    ellipsoid = fit_iron_calibration(raw)
    assert ellipsoid.method == "ellipsoid" and "biased" in ellipsoid.report()
    np.testing.assert_allclose(ellipsoid.hard_iron, HARD, atol=1e-6)
    inv = np.linalg.inv(SOFT_DISTORTION)
    np.testing.assert_allclose(ellipsoid.soft_iron.T @ ellipsoid.soft_iron, inv.T @ inv, atol=1e-8)


def test_bad_readings_are_counted_and_left_out():
    n = 400
    q = _random_rotations(n, seed=1)
    raw = Rotation.from_quat(q).apply([0.0, 20.0, -40.0], inverse=True) + HARD
    raw[::10] = np.nan
    raw[5] = 0.0
    q[7] = np.nan
    fit = fit_iron_calibration(raw, q, None)
    assert fit.rejected == {"nonfinite_reading": 40, "zero_reading": 1, "nonfinite_pose": 1}
    assert fit.samples_used == n - 42 and "nonfinite_reading 40" in fit.report()
    np.testing.assert_allclose(fit.hard_iron, HARD, atol=1e-6)


def test_too_few_orientations_are_refused_with_the_reason():
    n = 300
    q = Rotation.from_euler("z", np.linspace(0, 20, n)[:, None], degrees=True).as_quat()  # a 20 degree turn
    raw = Rotation.from_quat(q).apply([0.0, 20.0, -40.0], inverse=True)
    with pytest.raises(CalibrationError, match="not turned enough"):
        fit_iron_calibration(raw, q, None)
    with pytest.raises(CalibrationError, match="usable readings"):
        fit_iron_calibration(np.full((100, 3), np.nan))


def test_turns_only_while_driving_on_a_loop_are_refused():
    from gp_mapping.sim.simulation import SensorConfig, TrajectoryConfig, WorldConfig, simulate

    rec = simulate(WorldConfig(area=(-3, -3, 3, 3)), TrajectoryConfig(
        patterns=("loop",), area=(-3, -3, 3, 3), duration=60, rate=10, loops=3, loop_radius=1.0),
        SensorConfig(bias=tuple(HARD * 1e-6)), seed=3)
    with pytest.raises(CalibrationError, match="turned only while moving on"):
        fit_iron_calibration(rec.field_sensor_tesla * 1e6, rec.sensor_orientation_xyzw, rec.sensor_position)


# ------------------------------------------------------------------------------------------- real data


def _osman():
    from gp_mapping.evaluation.datasets import load_osman2021

    return load_osman2021(shared_data("osman2021_optitrack"))


def test_optitrack_recovers_an_added_offset_and_matrix():
    rec = _osman()
    raw = rec.field_sensor_nT * 1e-3
    q, p = rec.orientation_xyzw, rec.position
    before = fit_iron_calibration(raw, q, p, degree=6)
    modified = raw @ SOFT_DISTORTION.T + HARD
    after = fit_iron_calibration(modified, q, p, degree=6)
    assert before.observable == after.observable == "full"
    # m' = D m + e: the calibration of m' is soft' = soft D^-1, hard' = D hard + e
    offset_error = np.abs(after.hard_iron - (SOFT_DISTORTION @ before.hard_iron + HARD)).max()
    recovered = np.linalg.inv(after.soft_iron) @ before.soft_iron
    matrix_error = np.linalg.norm(recovered - SOFT_DISTORTION) / np.linalg.norm(SOFT_DISTORTION)
    assert offset_error < 0.5 and matrix_error < 0.01, (offset_error, matrix_error)
    # the recording's own residual calibration is small, and the fit explains the world field to well below 1 uT
    assert np.abs(before.hard_iron).max() < 5.0 and np.abs(before.soft_iron - np.eye(3)).max() < 0.1
    assert before.residual_after < 0.6


@pytest.mark.slow
def test_optitrack_vector_map_from_corrected_readings_is_as_accurate():
    """Train on the first 70 %, test on the last 30 % (README protocol), every 8th training sample, dual_svgp."""
    import torch

    from gp_mapping.config import ModelConfig
    from gp_mapping.gp import build_model

    rec = _osman()
    raw = rec.field_sensor_nT * 1e-3
    q, p = rec.orientation_xyzw, rec.position
    modified = raw @ SOFT_DISTORTION.T + HARD
    fit = fit_iron_calibration(modified, q, p, degree=6)
    rotation = Rotation.from_quat(q)

    def rmse(world: np.ndarray) -> float:
        n = int(0.7 * len(p))
        # the engine pinned as it was when this test was written (hyper_points and hyper_objective too: with two
        # batches of ~320 samples its hyperparameter steps are the main source of spread between the three maps,
        # not the correction; under the streaming objective corrected / original map at 0.469 / 0.452 uT; white
        # noise alone: two unstamped batches give model.time_error nothing to learn from, and with it the maps
        # land 0.449 / 0.402 uT apart)
        config = ModelConfig(engine="dual_svgp", kernel="matern52", lengthscale=0.5, num_inducing=100,
                             noise_variance=0.05, hyper_steps=15, hyper_lr=0.05, hyper_points=256,
                             hyper_objective="memory", device="cpu", seed=0, tile_size=0.0, time_error=False)
        model = build_model(config, 3, 3)
        x, y = p[:n:8], world[:n:8]
        for batch in np.array_split(np.arange(len(x)), 2):
            model.update(x[batch], y[batch])
        mean, _ = model.predict(p[n:])
        return float(np.sqrt(((mean.numpy() - world[n:]) ** 2).mean(0)).mean())

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        original = rmse(rotation.apply(raw))
        corrected = rmse(rotation.apply((modified - fit.hard_iron) @ fit.soft_iron.T))
        uncorrected = rmse(rotation.apply(modified))
    finally:
        torch.set_num_threads(threads)
    assert corrected <= 1.03 * original, (corrected, original)
    assert uncorrected > 5 * original  # what the added offset and matrix do to the map uncorrected


# ------------------------------------------------------------------------------------------- ground robot


def test_ground_robot_turning_about_z_fits_what_is_observable():
    from gp_mapping.sim.simulation import SensorConfig, TrajectoryConfig, WorldConfig, simulate

    horizontal = np.array([[1.08, 0.05], [0.05, 0.95]])
    horizontal /= np.sqrt(np.linalg.det(horizontal))
    distortion = np.eye(3)
    distortion[:2, :2] = horizontal
    rec = simulate(WorldConfig(area=(-3, -3, 3, 3)), TrajectoryConfig(
        patterns=("random_walk",), area=(-3, -3, 3, 3), duration=120, rate=10),
        SensorConfig(bias=tuple(HARD * 1e-6), distortion=tuple(distortion.ravel())), seed=3)
    fit = fit_iron_calibration(rec.field_sensor_tesla * 1e6, rec.sensor_orientation_xyzw, rec.sensor_position,
                               degree=6)
    assert fit.observable == "planar" and abs(abs(fit.axis[2]) - 1.0) < 1e-6
    np.testing.assert_allclose(fit.hard_iron[:2], HARD[:2], atol=0.5)
    assert fit.hard_iron[2] == pytest.approx(0.0, abs=1e-9)  # not observable: kept, and said so
    truth = np.linalg.inv(horizontal)
    assert np.linalg.norm(fit.soft_iron[:2, :2] - truth) / np.linalg.norm(truth) < 0.015
    np.testing.assert_allclose(fit.soft_iron[2], [0, 0, 1], atol=1e-9)
    assert "cannot be determined" in fit.report()


# ------------------------------------------------------------------------------------------- the command


def test_calibrate_command_writes_a_file_the_replay_accepts(tmp_path, capsys):
    from gp_mapping.cli import main

    bag = tmp_path / "iron"
    assert main(["demo-bag", str(bag), "--seed", "3", "--duration", "120", "--rate", "10", "--odom-rate", "10",
                 "--area", "-3", "-3", "3", "3", "--patterns", "random_walk", "--bias", *map(str, HARD),
                 "--soft-iron", "1.05", "0.03", "0", "0.03", "0.97", "0", "0", "0", "1"]) == 0
    out = tmp_path / "calib.yaml"
    assert main(["calibrate", str(bag), "--out", str(out), "--degree", "6"]) == 0
    text = capsys.readouterr().out
    assert "planar" in text and "hard_iron [uT]" in text
    config = load_config(out)
    np.testing.assert_allclose(config.sync.hard_iron[:2], HARD[:2], atol=0.5)
    assert abs(config.sync.hard_iron[2]) < 0.05  # the demo robot wobbles 2 degrees: its turn axis is about z
    assert config.sync.soft_iron != MapperConfig().sync.soft_iron
    document = yaml.safe_load(out.read_text())
    assert set(document["/**"]["ros__parameters"]) == {"sync"}


def test_calibrate_command_refuses_a_drive_without_turns(tmp_path, capsys):
    from gp_mapping.cli import main

    bag = tmp_path / "straight"
    assert main(["demo-bag", str(bag), "--duration", "8", "--rate", "10", "--odom-rate", "10",
                 "--patterns", "lawnmower", "--roll-pitch", "0"]) == 0
    out = tmp_path / "calib.yaml"
    assert main(["calibrate", str(bag), "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert "refused: the sensor was not turned enough" in err and not out.exists()
