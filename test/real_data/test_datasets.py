"""Loaders of the real recordings and the simple baselines, checked together against the data README.

The README's nearest-neighbour and constant-mean numbers were computed independently of this code, so
reproducing them checks the file parsing, the units, the quaternion convention of the Osman recording and
the baselines at once.
"""
from __future__ import annotations

import numpy as np
import pytest
from support.paths import shared_data

from gp_mapping.evaluation.baselines import BaselineError, ConstantMean, NearestNeighbour, rmse
from gp_mapping.evaluation.datasets import (DatasetError, DatasetNotFoundError, load_osman2021, load_solin2018,
                                 shared_data_root)


def _vector_error_rmse(pred: np.ndarray, truth: np.ndarray) -> float:
    """sqrt(mean |B_pred - B|^2): RMSE of the error vector's length (the convention of the README's Solin numbers)."""
    return float(np.sqrt(np.mean(np.sum((pred - truth) ** 2, axis=1))))


@pytest.fixture(scope="module")
def solin():
    root = shared_data("solin2018_invensense")
    return {s: load_solin2018(root, s) for s in range(1, 6)}


@pytest.fixture(scope="module")
def osman():
    return load_osman2021(shared_data("osman2021_optitrack", "measurements_aligned_simple_trajectory.mat"))


# ------------------------------------------------------------------------------------------------ Solin 2018

def test_solin_shapes_units_and_extent(solin):
    lengths = {s: len(seq) for s, seq in solin.items()}
    assert lengths == {1: 8875, 2: 9105, 3: 9404, 4: 7332, 5: 8313}
    for seq in solin.values():
        n = len(seq)
        assert seq.t.shape == (n,) and seq.xy.shape == (n, 2) and seq.field_uT.shape == (n, 3)
        assert 16.0 <= seq.t[0] <= 21.0
        np.testing.assert_allclose(np.diff(seq.t), 0.02, atol=1e-6)  # 50 Hz
        assert seq.xy[:, 0].min() >= -1.2 and seq.xy[:, 0].max() <= 4.7
        assert seq.xy[:, 1].min() >= -3.5 and seq.xy[:, 1].max() <= 1.2
        magnitude = seq.magnitude_uT
        # microtesla, not tesla or nanotesla: the typical indoor field strength is 42-52 uT
        assert 42.0 <= np.median(magnitude) <= 52.0
        assert 5.0 < magnitude.min() and magnitude.max() < 100.0


def test_solin_nearest_neighbour_matches_readme(solin):
    train = [solin[s] for s in (1, 2, 3, 4)]
    x = np.vstack([s.xy for s in train])
    b = np.vstack([s.field_uT for s in train])
    test = solin[5]
    nn_vec = NearestNeighbour(x, b).predict(test.xy)
    const_vec = ConstantMean(b).predict(test.xy)
    # README: "nearest neighbour trained on 1-4, tested on 5: RMSE 5.6 uT (constant mean 13.7 uT)"; these are
    # the RMSE of the 3-D error vector's length.
    assert _vector_error_rmse(nn_vec, test.field_uT) == pytest.approx(5.65, abs=0.05)  # 5.652
    assert _vector_error_rmse(const_vec, test.field_uT) == pytest.approx(13.7, abs=0.05)  # 13.741
    # The same split on the magnitude |B| (the target of the map): measured 2.85 and 8.37 uT.
    mag = np.concatenate([s.magnitude_uT for s in train])
    nn_mag = NearestNeighbour(x, mag).predict(test.xy)
    assert rmse(nn_mag, test.magnitude_uT) == pytest.approx(2.85, abs=0.02)
    assert rmse(ConstantMean(mag).predict(test.xy), test.magnitude_uT) == pytest.approx(8.37, abs=0.02)


def test_solin_root_may_be_data_root_or_dataset_folder(solin):
    seq = load_solin2018(shared_data(), 4)
    np.testing.assert_array_equal(seq.field_uT, solin[4].field_uT)


# ------------------------------------------------------------------------------------------------ Osman 2021

def test_osman_shapes_units_and_frames(osman):
    n = 20770
    assert len(osman) == n
    assert osman.position.shape == (n, 3) and osman.orientation_xyzw.shape == (n, 4)
    assert osman.field_sensor_nT.shape == (n, 3) and osman.field_world_uT.shape == (n, 3)
    np.testing.assert_allclose(osman.t[:3], [0.0, 0.005, 0.010])
    assert osman.t[-1] == pytest.approx(103.845)
    np.testing.assert_allclose(np.linalg.norm(osman.orientation_xyzw, axis=1), 1.0, atol=1e-12)
    # A rotation keeps the length; nT -> uT divides by 1000.
    np.testing.assert_allclose(np.linalg.norm(osman.field_world_uT, axis=1),
                               np.linalg.norm(osman.field_sensor_nT, axis=1) * 1e-3, rtol=1e-9)
    magnitude = osman.magnitude_uT
    assert magnitude.min() >= 41.0 and magnitude.max() <= 60.0
    extent = osman.position.max(axis=0) - osman.position.min(axis=0)
    np.testing.assert_allclose(extent, [2.4, 2.1, 0.7], atol=0.15)


def test_osman_nearest_neighbour_matches_readme(osman):
    n = len(osman)
    k = int(0.7 * n)
    x_tr, x_te = osman.position[:k], osman.position[k:]
    b_tr, b_te = osman.field_world_uT[:k], osman.field_world_uT[k:]
    nn = NearestNeighbour(x_tr, b_tr)
    assert rmse(nn.predict(x_te), b_te) == pytest.approx(0.65, abs=0.01)
    assert rmse(ConstantMean(b_tr).predict(x_te), b_te) == pytest.approx(3.15, abs=0.01)
    # The per-axis check pins the quaternion convention: the inverse rotation (R^T, i.e. the file read as
    # world-to-body) maps the same readings to a field that nearest neighbour cannot predict.
    from gp_mapping.mapping.frames import quaternion_inverse, rotate_vectors

    wrong = rotate_vectors(quaternion_inverse(osman.orientation_xyzw), osman.field_sensor_nT) * 1e-3
    assert rmse(NearestNeighbour(x_tr, wrong[:k]).predict(x_te), wrong[k:]) > 5.0
    m_tr, m_te = osman.magnitude_uT[:k], osman.magnitude_uT[k:]
    assert rmse(NearestNeighbour(x_tr, m_tr).predict(x_te), m_te) == pytest.approx(0.62, abs=0.01)
    assert rmse(ConstantMean(m_tr).predict(x_te), m_te) == pytest.approx(4.66, abs=0.01)


# ------------------------------------------------------------------------------------------- errors and roots

def _write_solin(folder, n=5, mag_rows=None, mag_text=None):
    folder.mkdir(parents=True, exist_ok=True)
    t = 20.0 + 0.02 * np.arange(n)
    np.savetxt(folder / "1-time.csv", t, delimiter=",")
    np.savetxt(folder / "1-loc.csv", np.c_[np.linspace(0, 1, n), np.zeros(n)], delimiter=",")
    if mag_text is not None:
        (folder / "1-mag.csv").write_text(mag_text)
    else:
        np.savetxt(folder / "1-mag.csv", np.tile([1.0, 2.0, 40.0], (mag_rows or n, 1)), delimiter=",")


def test_solin_loader_reads_a_small_synthetic_copy(tmp_path):
    _write_solin(tmp_path / "solin2018_invensense")
    seq = load_solin2018(tmp_path, 1)
    assert len(seq) == 5 and seq.sequence == 1
    np.testing.assert_allclose(seq.magnitude_uT, np.sqrt(1 + 4 + 1600))


@pytest.mark.parametrize("case, message", [
    ("rows", "row counts differ"),
    ("nan", "non-finite"),
    ("text", "not a numeric"),
    ("columns", "columns, expected 3"),
])
def test_solin_loader_refuses_corrupt_files(tmp_path, case, message):
    if case == "rows":
        _write_solin(tmp_path, mag_rows=4)
    elif case == "nan":
        _write_solin(tmp_path, mag_text="1,2,3\n1,nan,3\n1,2,3\n1,2,3\n1,2,3\n")
    elif case == "text":
        _write_solin(tmp_path, mag_text="Bx,By,Bz\n1,2,3\n")
    else:
        _write_solin(tmp_path, mag_text="1,2\n1,2\n1,2\n1,2\n1,2\n")
    with pytest.raises(DatasetError, match=message):
        load_solin2018(tmp_path, 1)


def test_solin_loader_refuses_missing_files_and_bad_sequence(tmp_path):
    with pytest.raises(DatasetNotFoundError, match="1-time.csv"):
        load_solin2018(tmp_path, 1)
    with pytest.raises(DatasetNotFoundError, match="does not exist"):
        load_solin2018(tmp_path / "absent", 1)
    with pytest.raises(DatasetError, match="sequence must be one of"):
        load_solin2018(tmp_path, 6)
    (tmp_path / "1-time.csv").write_text("20.0\n20.0\n")
    np.savetxt(tmp_path / "1-loc.csv", np.zeros((2, 2)), delimiter=",")
    np.savetxt(tmp_path / "1-mag.csv", np.ones((2, 3)), delimiter=",")
    with pytest.raises(DatasetError, match="not strictly increasing"):
        load_solin2018(tmp_path, 1)


def test_osman_loader_refuses_corrupt_files(tmp_path):
    from scipy.io import savemat

    n = 4
    q = np.tile([[1.0], [0.0], [0.0], [0.0]], (1, n))
    good = {"T": np.array([[0.005]]), "N": np.array([[n]]), "u": np.ones((9, n)), "p_opti": np.zeros((3, n)),
            "q_opti": q}
    path = tmp_path / "rec.mat"
    savemat(path, good)
    rec = load_osman2021(path)
    np.testing.assert_allclose(rec.orientation_xyzw, np.tile([0.0, 0.0, 0.0, 1.0], (n, 1)))  # identity, reordered
    np.testing.assert_allclose(rec.field_world_uT, 1e-3)

    # 90 degrees about z, scalar first: sensor x -> world y.
    half = np.sqrt(0.5)
    savemat(path, dict(good, q_opti=np.tile([[half], [0.0], [0.0], [half]], (1, n)),
                       u=np.vstack([np.zeros((6, n)), np.tile([[1000.0], [0.0], [0.0]], (1, n))])))
    np.testing.assert_allclose(load_osman2021(path).field_world_uT, np.tile([0.0, 1.0, 0.0], (n, 1)), atol=1e-12)

    for bad, message in [({"q_opti": 2 * q}, "not unit length"), ({"p_opti": np.zeros((3, n + 1))}, "counts differ"),
                         ({"u": np.full((9, n), np.nan)}, "non-finite"),
                         ({"u": np.ones((8, n))}, "expected \\(9, N\\)")]:
        savemat(path, dict(good, **bad))
        with pytest.raises(DatasetError, match=message):
            load_osman2021(path)
    savemat(path, {k: v for k, v in good.items() if k != "q_opti"})
    with pytest.raises(DatasetError, match="lacks the variable 'q_opti'"):
        load_osman2021(path)
    path.write_bytes(b"not a mat file at all" * 10)
    with pytest.raises(DatasetError, match="not a readable MATLAB"):
        load_osman2021(path)
    with pytest.raises(DatasetNotFoundError):
        load_osman2021(tmp_path / "missing.mat")


def test_shared_data_root_from_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("GP_MAPPING_DATA", str(tmp_path))
    assert shared_data_root() == tmp_path
    _write_solin(tmp_path / "solin2018_invensense")
    assert len(load_solin2018(None, 1)) == 5
    monkeypatch.setenv("GP_MAPPING_DATA", str(tmp_path / "nowhere"))
    with pytest.raises(DatasetNotFoundError, match="GP_MAPPING_DATA"):
        shared_data_root()


def test_simple_baselines_refuse_bad_input():
    nn = NearestNeighbour(np.array([[0.0, 0.0], [1.0, 0.0]]), np.array([1.0, 2.0]))
    np.testing.assert_allclose(nn.predict([[0.9, 0.1], [0.1, -0.2]]), [[2.0], [1.0]])
    with pytest.raises(BaselineError, match="columns, expected 2"):
        nn.predict(np.zeros((3, 3)))
    with pytest.raises(BaselineError, match="rows"):
        NearestNeighbour(np.zeros((3, 2)), np.zeros(2))
    with pytest.raises(BaselineError, match="non-finite"):
        ConstantMean(np.array([1.0, np.nan]))
    with pytest.raises(BaselineError, match="shape"):
        rmse(np.zeros(3), np.zeros(4))
