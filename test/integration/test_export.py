"""Maps leave the node and come back: ~/save_map (timestamped files), ~/load_map while running, `gp-mapping
replay --save-state`, and `gp-mapping export` to nav2 map_server files that decode back to the field."""
from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import yaml

from gp_mapping.mapping.map_files import NAV2_KEYS, UNKNOWN_PIXEL, decode_nav2_map, read_pgm
from support.nodes import node_factory  # noqa: F401  (fixture)

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

# Hyperparameters fixed, so the short replay takes seconds (as test_replay's FAST).
PARAMS = {"model": {"learn_hyperparameters": False, "lengthscale": 1.0, "device": "cpu", "num_inducing": 64},
          "batching": {"size": 100}, "grid": {"resolution": 0.2}, "node": {"publish_period": 5.0}}


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gp_mapping.cli", *args], capture_output=True, text=True,
                          timeout=300)


@pytest.fixture(scope="module")
def replayed(tmp_path_factory):
    """A 12 s simulated bag replayed by the CLI with --save-state."""
    from gp_mapping import sim
    from gp_mapping.sim.demo_bag import write_demo_bag

    tmp = tmp_path_factory.mktemp("export")
    area = (-2.0, -2.0, 2.0, 2.0)
    rec = sim.simulate(sim.WorldConfig(area=area, n_dipoles=4),
                       sim.TrajectoryConfig(patterns=("lawnmower",), area=area, speed=1.0, rate=20.0, duration=12.0),
                       sim.SensorConfig(), seed=5)
    bag = tmp / "bag"
    write_demo_bag(bag, rec, ground_truth=False)
    config = tmp / "params.yaml"
    config.write_text(yaml.safe_dump({"/**": {"ros__parameters": PARAMS}}))
    state = tmp / "state" / "replayed.safetensors"
    proc = _cli("replay", str(bag), "--config", str(config), "--out", str(tmp / "out"), "--save-state", str(state),
                "--no-progress")
    assert proc.returncode == 0, proc.stderr
    assert f"wrote {state.resolve()}" in proc.stdout and state.is_file()
    with np.load(tmp / "out" / "map.npz", allow_pickle=False) as npz:
        arrays = {k: npz[k] for k in npz.files}
    return tmp, state, arrays


@pytest.mark.parametrize("source", ["state", "npz"])
def test_export_writes_nav2_maps_that_decode_to_the_field_within_one_grey_level(replayed, source):
    tmp, state, npz = replayed
    src = state if source == "state" else tmp / "out" / "map.npz"
    out = tmp / f"nav2_{source}"
    proc = _cli("export", str(src), "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    height, width = npz["known"].shape
    known = npz["known"]
    for statistic in ("mean", "variance"):
        meta_path = out / f"magnitude_{statistic}.yaml"
        assert f"wrote {meta_path.resolve()}" in proc.stdout
        meta = yaml.safe_load(meta_path.read_text())
        assert set(NAV2_KEYS) <= set(meta)  # what nav2's map_server requires
        assert meta["mode"] == "raw" and meta["negate"] == 0 and meta["image"] == f"magnitude_{statistic}.pgm"
        assert meta["resolution"] == pytest.approx(float(npz["resolution"]))
        assert meta["origin"] == pytest.approx([*npz["origin"], 0.0])
        assert meta["field_unit"] == ("microtesla" if statistic == "mean" else "microtesla^2")
        pixels = read_pgm(out / meta["image"])
        assert pixels.shape == (height, width)
        assert set(np.unique(pixels)) <= set(range(101)) | {UNKNOWN_PIXEL}
        # Row 0 of the image is the top of the map: the map's last row.
        assert np.array_equal(pixels[::-1] == UNKNOWN_PIXEL, ~known)
        values = decode_nav2_map(meta_path)
        truth = npz[f"magnitude_{statistic}"]
        step = meta["value_scale"]
        assert np.all(np.abs(values[known] - truth[known]) <= step)  # within one grey level
        assert np.all(np.isnan(values[~known]))
        lo, hi = meta["value_range"]
        assert lo == pytest.approx(truth[known].min()) and hi == pytest.approx(truth[known].max())
    assert (out / "map.png").is_file()
    with np.load(out / "map.npz", allow_pickle=False) as again:
        np.testing.assert_array_equal(again["magnitude_mean"], npz["magnitude_mean"])


def test_export_refuses_what_is_not_a_map(tmp_path):
    (tmp_path / "junk.safetensors").write_bytes(b"not a state file")
    for path, words in ((tmp_path / "junk.safetensors", "neither a map.npz nor a readable map state"),
                        (tmp_path / "missing.npz", "does not exist")):
        proc = _cli("export", str(path), "--out", str(tmp_path / "x"))
        assert proc.returncode == 1 and words in proc.stderr and "Traceback" not in proc.stderr


def _node_params(**extra):
    flat = {f"{s}.{k}": v for s, values in PARAMS.items() for k, v in values.items()}
    flat.update(extra)
    return flat


def _published(node) -> dict[str, object]:
    """Capture what publish_map sends (mean grid, scale) instead of sending it."""
    got: dict[str, object] = {}
    mean_pub, _ = node._map_pubs["magnitude"]
    mean_pub.publish = lambda msg: got.__setitem__("mean", msg)
    node._scale_pub.publish = lambda msg: got.__setitem__("scale", msg)
    return got


def test_a_replayed_state_starts_a_node_that_publishes_the_same_map(replayed, node_factory):  # noqa: F811
    from gp_mapping.ros import conversions

    _, state, npz = replayed
    node = node_factory(**_node_params(**{"node.initial_map": str(state)}))
    got = _published(node)
    node.publish_map()
    scale, _ = conversions.scale_from_msg(got["scale"])
    offset, step = scale["magnitude"]["mean"]
    decoded = conversions.decode_occupancy_msg(got["mean"], offset, step)
    known = npz["known"]
    assert decoded.shape == known.shape
    assert (got["mean"].info.origin.position.x, got["mean"].info.origin.position.y) == tuple(npz["origin"])
    assert np.array_equal(~np.isnan(decoded), known)
    assert np.all(np.abs(decoded[known] - npz["magnitude_mean"][known]) <= step / 2 + 1e-9)
    assert np.array_equal(np.asarray(got["mean"].data).reshape(known.shape) >= 0, known)


def _call(node, handler):
    from std_srvs.srv import Trigger

    return handler(Trigger.Request(), Trigger.Response())


def test_save_map_writes_a_new_timestamped_file_each_call_and_load_map_restores_it(replayed, node_factory,  # noqa
                                                                                    tmp_path):
    from rclpy.parameter import Parameter

    _, state, npz = replayed
    maps = tmp_path / "maps"
    node = node_factory(**_node_params(**{"node.initial_map": str(state), "node.map_directory": str(maps)}))
    first = _call(node, node.on_save_map)
    second = _call(node, node.on_save_map)
    assert first.success and second.success, (first.message, second.message)
    a, b = Path(first.message), Path(second.message)
    assert a != b and a.parent == b.parent == maps.resolve() and a.is_file() and b.is_file()
    pattern = rf"{node.get_name()}_\d{{8}}T\d{{6}}\.\d{{3}}Z(_\d+)?\.safetensors"
    assert re.fullmatch(pattern, a.name) and re.fullmatch(pattern, b.name)
    before = node.mapper.grid()

    reset = _call(node, node.on_reset)
    assert reset.success and node.mapper.grid() is None
    # A bad file is refused with the reason; the (empty) map stays.
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"garbage")
    assert node.set_parameters([Parameter("node.initial_map", value=str(bad))])[0].successful
    _wait(lambda: node.config.node.initial_map == str(bad))
    refused = _call(node, node.on_load_map)
    assert not refused.success and "load_map failed" in refused.message and node.mapper.grid() is None
    # An incompatible one (another kernel) too, naming the key.
    # The state records its config: the same state under another kernel is an incompatible file.
    from gp_mapping.mapping.state import read_state, write_state
    st = read_state(a)
    st.config["model"]["kernel"] = "rbf"
    incompatible = tmp_path / "rbf.safetensors"
    write_state(incompatible, st)
    assert node.set_parameters([Parameter("node.initial_map", value=str(incompatible))])[0].successful
    _wait(lambda: node.config.node.initial_map == str(incompatible))
    refused = _call(node, node.on_load_map)
    assert not refused.success and "kernel" in refused.message and node.mapper.grid() is None
    # The saved map loads back while running and publishes the same map.
    assert node.set_parameters([Parameter("node.initial_map", value=str(b))])[0].successful
    _wait(lambda: node.config.node.initial_map == str(b))
    loaded = _call(node, node.on_load_map)
    assert loaded.success and str(b) in loaded.message, loaded.message
    after = node.mapper.grid()
    np.testing.assert_array_equal(after.layers["magnitude"][0], before.layers["magnitude"][0])
    np.testing.assert_array_equal(after.known, before.known)


def _wait(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)
