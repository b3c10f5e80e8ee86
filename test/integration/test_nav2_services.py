"""nav2's map services (issue 40, part 2): ``~/nav2/save_map`` (nav2_msgs/SaveMap) and ``~/nav2/load_map``
(nav2_msgs/LoadMap) called over DDS on localhost write the state file or the nav2 export and load a map back,
answering its mean layer; refusals come back as LoadMap's result codes and leave the map as it was. Without
nav2_msgs the node serves the Trigger services alone.

nav2_msgs comes from interfaces/nav2_msgs (`make venv` builds its Python bindings, as on a robot nav2 brings them).
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
import pytest
import yaml

from gp_mapping.mapping.map_files import UNKNOWN_PIXEL, decode_nav2_map, read_image, read_pgm
from support.nodes import served_node as serve

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

PARAMS = {"model.num_inducing": 16, "model.learn_hyperparameters": False, "model.device": "cpu",
          "batching.size": 20, "grid.resolution": 0.5, "node.publish_period": 60.0, "node.model_period": 0.0}


def _nested(flat: dict) -> dict:
    out: dict = {}
    for key, value in flat.items():
        section, name = key.split(".")
        out.setdefault(section, {})[name] = value
    return out


def _state_file(path: Path, **overrides) -> Path:
    """A map state made by a Mapper with the node's settings: a 20 s drive along a curve over a smooth field."""
    from gp_mapping.config import config_from_dict
    from gp_mapping.mapping.mapper import Mapper

    mapper = Mapper(config_from_dict(_nested({**PARAMS, **overrides})))
    stamps = np.arange(0.0, 20.0, 0.05)
    for t in stamps:
        x, y = 0.2 * t, np.sin(0.3 * t)
        mapper.add_pose(t, [x, y, 0.0], [0.0, 0.0, 0.0, 1.0])
        mapper.add_magnetic_field(t + 0.025, [(48.0 + 2.0 * np.sin(x) * np.cos(y)) * 1e-6, 0.0, 0.0])
        mapper.process()
    mapper.flush()
    path.parent.mkdir(parents=True, exist_ok=True)
    mapper.save(path)
    return path


@pytest.fixture(scope="module")
def state(tmp_path_factory) -> Path:
    return _state_file(tmp_path_factory.mktemp("nav2_state") / "drive.safetensors")


@pytest.fixture
def served_node(tmp_path):
    with serve(dict(PARAMS, **{"node.map_directory": str(tmp_path / "maps")}), "nav2_client") as pair:
        yield pair


def _call(client_node, srv_type, name: str, request, timeout: float = 120.0):
    """One call of ``name`` (relative to the node) over DDS; the response."""
    from rclpy.executors import SingleThreadedExecutor

    executor = SingleThreadedExecutor(context=client_node.context)
    executor.add_node(client_node)
    client = client_node.create_client(srv_type, name)
    try:
        deadline = time.monotonic() + 30.0
        while not client.service_is_ready():
            assert time.monotonic() < deadline, f"service {name} not found"
            executor.spin_once(timeout_sec=0.1)
        future = client.call_async(request)
        deadline = time.monotonic() + timeout
        while not future.done():
            assert time.monotonic() < deadline, f"no answer from {name}"
            executor.spin_once(timeout_sec=0.1)
        return future.result()
    finally:
        client_node.destroy_client(client)
        executor.remove_node(client_node)
        executor.shutdown()


def _save(client_node, node, **fields):
    from nav2_msgs.srv import SaveMap

    return _call(client_node, SaveMap, f"{node.get_fully_qualified_name()}/nav2/save_map", SaveMap.Request(**fields))


def _load(client_node, node, map_url: str):
    from nav2_msgs.srv import LoadMap

    return _call(client_node, LoadMap, f"{node.get_fully_qualified_name()}/nav2/load_map",
                 LoadMap.Request(map_url=map_url))


def _served(node) -> set[str]:
    """The map services the node's helper node serves (rclpy adds its own type-description service)."""
    return {service.srv_name for service in node._service_host.node.services
            if not service.srv_name.endswith("/get_type_description")}


def test_nav2_load_map_answers_the_map_and_save_map_writes_the_state_and_the_export(served_node, state, tmp_path):
    pytest.importorskip("nav2_msgs.srv", reason="nav2_msgs is not built (make venv builds interfaces/nav2_msgs)")
    from nav2_msgs.srv import LoadMap

    node, client_node = served_node
    own = node.get_fully_qualified_name()
    assert {f"{own}/save_map", f"{own}/load_map", f"{own}/reset", f"{own}/nav2/save_map",
            f"{own}/nav2/load_map"} <= _served(node)

    # LoadMap with a file:// URL: the map replaces the empty one and comes back as its mean layer.
    loaded = _load(client_node, node, state.resolve().as_uri())
    assert loaded.result == LoadMap.Response.RESULT_SUCCESS
    grid_msg = loaded.map
    assert grid_msg.header.frame_id == "map" and grid_msg.info.resolution == pytest.approx(0.5)
    cells = np.asarray(grid_msg.data, dtype=np.int8).reshape(grid_msg.info.height, grid_msg.info.width)
    assert cells.size > 0 and (cells >= 0).any() and (cells == -1).any()  # known cells along the drive only
    assert set(np.unique(cells)) <= set(range(-1, 101))
    assert node.mapper.diagnostics()["num_seen"] > 0

    # SaveMap, empty image_format: the state file <map_url>.safetensors, relative to node.map_directory.
    assert _save(client_node, node, map_url="office").result
    saved = tmp_path / "maps" / "office.safetensors"
    assert saved.is_file()

    # SaveMap, pgm: the nav2 export into the folder map_url, as `gp-mapping export` writes it.
    folder = tmp_path / "export"
    assert _save(client_node, node, map_url=str(folder), image_format="pgm", map_mode="raw", free_thresh=0.2,
                 occupied_thresh=0.7).result
    assert {p.name for p in folder.iterdir()} == {"magnitude_mean.pgm", "magnitude_mean.yaml", "magnitude_variance.pgm",
                                                  "magnitude_variance.yaml", "map.npz", "map.png"}
    meta = yaml.safe_load((folder / "magnitude_mean.yaml").read_text())
    assert meta["mode"] == "raw" and meta["image"] == "magnitude_mean.pgm"
    assert (meta["free_thresh"], meta["occupied_thresh"]) == (0.2, 0.7)
    # LoadMap's map is the export's mean image: the same cells, 255 there for -1 here, row 0 at the top there.
    pixels = read_pgm(folder / "magnitude_mean.pgm")[::-1]
    assert pixels.shape == cells.shape
    np.testing.assert_array_equal(np.where(cells < 0, UNKNOWN_PIXEL, cells.astype(np.int16)), pixels)
    assert (grid_msg.info.origin.position.x, grid_msg.info.origin.position.y) == pytest.approx(meta["origin"][:2])
    values = decode_nav2_map(folder / "magnitude_mean.yaml")
    assert np.all((values[cells >= 0] > 40.0) & (values[cells >= 0] < 56.0))  # microtesla near the 48 uT field

    # png: the same images as PNG, and the map_saver thresholds when the request leaves them 0.
    png = tmp_path / "export_png"
    assert _save(client_node, node, map_url=png.as_uri(), image_format="png").result
    meta = yaml.safe_load((png / "magnitude_mean.yaml").read_text())
    assert meta["image"] == "magnitude_mean.png" and (meta["free_thresh"], meta["occupied_thresh"]) == (0.25, 0.65)
    np.testing.assert_array_equal(read_image(png / "magnitude_mean.png")[::-1], pixels)

    # The state SaveMap wrote loads back (the stem is enough) to the same map.
    again = _load(client_node, node, str(tmp_path / "maps" / "office"))
    assert again.result == LoadMap.Response.RESULT_SUCCESS
    np.testing.assert_array_equal(np.asarray(again.map.data, dtype=np.int8).reshape(cells.shape), cells)

    # An empty map_url: the Trigger save's timestamped name in node.map_directory.
    assert _save(client_node, node).result
    assert len(list((tmp_path / "maps").glob(f"{node.get_name()}_*.safetensors"))) == 1

    # Another reader takes the PNG as written (last: it skips where Pillow, which matplotlib brings, is absent).
    image = pytest.importorskip("PIL.Image", reason="Pillow (matplotlib's) checks the PNG as other tools read it")
    with image.open(png / "magnitude_mean.png") as opened:
        assert opened.mode == "L"
        np.testing.assert_array_equal(np.asarray(opened)[::-1], pixels)


def test_nav2_refusals_are_result_codes_and_leave_the_map(served_node, state, tmp_path):
    pytest.importorskip("nav2_msgs.srv", reason="nav2_msgs is not built (make venv builds interfaces/nav2_msgs)")
    from nav2_msgs.srv import LoadMap

    node, client_node = served_node
    assert _load(client_node, node, str(state)).result == LoadMap.Response.RESULT_SUCCESS
    mapper = node.mapper
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"not a map state")
    (tmp_path / "nav2").mkdir()
    (tmp_path / "nav2" / "map.yaml").write_text("image: map.pgm\n")
    other_frame = _state_file(tmp_path / "odom.safetensors", **{"grid.frame_id": "odom"})
    codes = LoadMap.Response
    for url, code in ((str(tmp_path / "missing.safetensors"), codes.RESULT_MAP_DOES_NOT_EXIST),
                      ("", codes.RESULT_MAP_DOES_NOT_EXIST),
                      (str(junk), codes.RESULT_INVALID_MAP_DATA),
                      (str(tmp_path / "nav2" / "map.yaml"), codes.RESULT_INVALID_MAP_DATA),
                      (str(other_frame), codes.RESULT_INVALID_MAP_METADATA),
                      ("http://example.com/map.safetensors", codes.RESULT_UNDEFINED_FAILURE),
                      ("file://otherhost/tmp/map.safetensors", codes.RESULT_UNDEFINED_FAILURE)):
        answer = _load(client_node, node, url)
        assert answer.result == code, url
        assert answer.map.info.width == 0 and len(answer.map.data) == 0
        assert node.mapper is mapper, url  # the map stays
    for fields in ({"image_format": "jpg"}, {"image_format": "pgm", "map_mode": "trinary"},
                   {"image_format": "pgm", "free_thresh": 0.8, "occupied_thresh": 0.3},
                   {"map_url": "ftp://host/map"}):
        assert not _save(client_node, node, **fields).result, fields
    assert not (tmp_path / "maps").exists()  # nothing written
    assert node.mapper is mapper


def test_save_map_with_no_data_yet_fails_cleanly(served_node, tmp_path):
    pytest.importorskip("nav2_msgs.srv", reason="nav2_msgs is not built (make venv builds interfaces/nav2_msgs)")
    node, client_node = served_node
    assert not _save(client_node, node, map_url=str(tmp_path / "empty"), image_format="pgm").result
    assert not (tmp_path / "empty").exists()
    assert _save(client_node, node, map_url=str(tmp_path / "empty_state")).result  # an empty map's state is a file
    assert (tmp_path / "empty_state.safetensors").is_file()


def test_without_nav2_msgs_the_trigger_services_are_served_alone(monkeypatch, tmp_path):
    """A robot without nav2: importing nav2_msgs fails, the node starts and serves the Trigger services."""
    import rclpy
    from rclpy.context import Context
    from rclpy.parameter import Parameter
    from std_srvs.srv import Trigger

    from gp_mapping.ros.mapper_node import MapperNode
    from gp_mapping.ros.services import nav2_service_types

    monkeypatch.setitem(sys.modules, "nav2_msgs", None)  # `import nav2_msgs...` raises ImportError
    monkeypatch.setitem(sys.modules, "nav2_msgs.srv", None)
    assert nav2_service_types() is None
    context = Context()
    rclpy.init(context=context)
    params = {**PARAMS, "node.map_directory": str(tmp_path / "maps")}
    node = MapperNode(context=context, parameter_overrides=[Parameter(k, value=v) for k, v in params.items()])
    client_node = rclpy.create_node("trigger_client", context=context)
    try:
        own = node.get_fully_qualified_name()
        assert _served(node) == {f"{own}/save_map", f"{own}/load_map", f"{own}/reset",
                                  f"{own}/start_session"}
        answer = _call(client_node, Trigger, f"{own}/save_map", Trigger.Request())
        assert answer.success and Path(answer.message).is_file()
    finally:
        client_node.destroy_node()
        node.close()
        context.try_shutdown()


@pytest.mark.parametrize("url, expected", [("file:///tmp/a%20b/map", "/tmp/a b/map"), ("rel/map", "/base/rel/map"),
                                           ("/abs/map", "/abs/map"), ("file://localhost/x", "/x"),
                                           ("office:2", "/base/office:2")])
def test_map_url_paths(url, expected):
    from gp_mapping.ros.services import map_url_path

    assert map_url_path(url, Path("/base")) == Path(expected)
