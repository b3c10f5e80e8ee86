"""One map layout (gp_mapping/mapping/publication.py): the node's messages and the replay's map-bag messages for the
same map are built from it, on the same topics, in the same order, with equal contents."""
from __future__ import annotations

import numpy as np
import pytest

from gp_mapping.bag import MapBagWriter
from gp_mapping.mapping import publication
from gp_mapping.mapping.grid import GridSpec
from gp_mapping.mapping.mapper import MapGrid, vector_layers
from support.nodes import node_factory  # noqa: F401  (the fixture: MapperNode objects in this process)
from support.replay import _plain

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def _grid(target: str) -> MapGrid:
    rng = np.random.default_rng(11)
    spec = GridSpec(-1.2, 0.4, 0.25, 7, 5)
    known = rng.random((5, 7)) > 0.3
    if target == "vector":
        layers = vector_layers(rng.normal(20.0, 5.0, (5, 7, 3)), rng.uniform(0.01, 0.5, (5, 7, 3)))
        height = 0.7
    else:
        mean, var = rng.normal(48.0, 3.0, (5, 7)), rng.uniform(0.01, 0.5, (5, 7))
        mean[2, 3] = np.nan  # a cell the prediction lost: published as unknown, left out of the cloud
        layers = {"magnitude": (mean, var)}
        height = 0.0
    return MapGrid(spec=spec, frame_id="map", field_unit="microtesla", layers=layers, known=known, stamp=1234.5,
                   height=height)


class _Recorder:
    """Stands in for an rclpy publisher: keeps what the node publishes, in order, under the resolved topic."""

    def __init__(self, topic: str, sink: list) -> None:
        self.topic, self.sink = topic, sink

    def publish(self, msg) -> None:
        self.sink.append((self.topic, msg))


def _node_messages(node, grid) -> list:
    sink: list = []
    node._scale_pub = _Recorder(node._scale_pub.topic_name, sink)
    node._cloud_pub = _Recorder(node._cloud_pub.topic_name, sink)
    node._map_pubs = {layer: (_Recorder(mean.topic_name, sink), _Recorder(var.topic_name, sink))
                      for layer, (mean, var) in node._map_pubs.items()}
    node._publish_grid(grid)
    return sink


def _bag_messages(tmp_path, grid) -> list:
    from rosbags.highlevel import AnyReader

    path = tmp_path / "maps.mcap"
    with MapBagWriter(path, grid.field_unit) as writer:
        writer.write(grid, 1240.0)
    with AnyReader([path]) as reader:
        return [(conn.topic, conn.msgtype, bytes(data)) for conn, _, data in reader.messages()]


@pytest.mark.parametrize("target", ["magnitude", "vector"])
def test_node_and_map_bag_render_the_one_layout_identically(node_factory, tmp_path, target):
    from rclpy.serialization import serialize_message
    from rosbags.typesys import Stores, get_typestore

    from gp_mapping.ros.publishers import published_topics

    grid = _grid(target)
    node = node_factory(**{"sync.target": target, "model.device": "cpu"})
    ours = _node_messages(node, grid)
    bag = _bag_messages(tmp_path, grid)

    layers = publication.layer_names(target)
    layout = publication.map_topic_types(layers, publication.MAP_NAMESPACE)  # publishing order
    assert [t for t, _ in ours] == [t for t, _, _ in bag] == list(layout)
    assert [m for _, m, _ in bag] == list(layout.values())
    node_layout = {t: m for t, m in published_topics(node.config).items() if t.startswith("~/")}
    assert list(node_layout) == [t.replace(publication.MAP_NAMESPACE, "~", 1) for t in layout]

    ts = get_typestore(Stores.ROS2_KILTED)
    for (topic, msg), (_, msgtype, raw) in zip(ours, bag):
        # Compared field by field (CDR padding bytes are unspecified, so raw bytes may differ there).
        assert _plain(ts.deserialize_cdr(raw, msgtype)) == \
            _plain(ts.deserialize_cdr(bytes(serialize_message(msg)), msgtype)), topic

    # And both hold the layout's content: the scale rows, the grids' cells and the cloud's columns.
    expected = publication.publication(grid)
    scale = ts.deserialize_cdr(bag[0][2], bag[0][1])
    assert [d.label for d in scale.layout.dim] == list(expected.scale_labels)
    np.testing.assert_array_equal(scale.data, expected.scale_data)
    for k, layer in enumerate(expected.layers):
        mean_msg = ts.deserialize_cdr(bag[1 + 2 * k][2], bag[1 + 2 * k][1])
        np.testing.assert_array_equal(mean_msg.data, layer.mean_data)
    cloud = ts.deserialize_cdr(bag[-1][2], bag[-1][1])
    assert [f.name for f in cloud.fields] == expected.cloud_fields
    assert cloud.width == int(publication.publishable_known(grid).sum()) == expected.cloud.shape[0]
    np.testing.assert_array_equal(np.frombuffer(bytes(cloud.data), "<f4").reshape(expected.cloud.shape),
                                  expected.cloud)
    if target == "magnitude":
        assert expected.layers[0].mean_data.reshape(5, 7)[2, 3] == -1  # the NaN cell
