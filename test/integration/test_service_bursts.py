"""Services answer bursts (issue 38, item 6): 50 concurrent calls of each of ~/reset, ~/save_map and ~/load_map
(150 in flight at once), over DDS on localhost, are all answered; a burst of one service alone too."""
from __future__ import annotations

import time

import pytest

from gp_mapping.ros.services import SERVICE_QUEUE_DEPTH
from support.nodes import served_node as serve

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

PARAMS = {"model.num_inducing": 16, "model.learn_hyperparameters": False, "model.device": "cpu",
          "batching.size": 20, "grid.resolution": 0.5, "node.publish_period": 60.0, "node.model_period": 0.0}


@pytest.fixture
def served_node(tmp_path):
    with serve(dict(PARAMS, **{"node.map_directory": str(tmp_path / "maps")}), "burst_client") as pair:
        yield pair


def _burst(client_node, prefix: str, calls: dict[str, int], timeout: float = 120.0):
    """``calls``: service name -> how many concurrent calls; returns the responses (None where none came)."""
    from rclpy.executors import SingleThreadedExecutor
    from rclpy.qos import QoSProfile
    from std_srvs.srv import Trigger

    qos = QoSProfile(depth=SERVICE_QUEUE_DEPTH)  # the caller keeps every answer too
    executor = SingleThreadedExecutor(context=client_node.context)
    executor.add_node(client_node)
    futures = []
    clients = []
    try:
        for name, count in calls.items():
            client = client_node.create_client(Trigger, f"{prefix}/{name}", qos_profile=qos)
            clients.append(client)
            deadline = time.monotonic() + 30.0
            while not client.service_is_ready():
                assert time.monotonic() < deadline, f"service {name} not found"
                executor.spin_once(timeout_sec=0.1)
            futures += [(name, client.call_async(Trigger.Request())) for _ in range(count)]
        deadline = time.monotonic() + timeout
        while not all(f.done() for _, f in futures) and time.monotonic() < deadline:
            executor.spin_once(timeout_sec=0.1)
        return [(name, f.result() if f.done() else None) for name, f in futures]
    finally:
        for client in clients:
            client_node.destroy_client(client)
        executor.remove_node(client_node)
        executor.shutdown()


def test_50_concurrent_calls_of_each_service_are_all_answered(served_node, tmp_path):
    from rclpy.parameter import Parameter

    node, client_node = served_node
    answers = _burst(client_node, node.get_fully_qualified_name(), {"save_map": 1})
    assert answers[0][1] is not None and answers[0][1].success
    saved = answers[0][1].message
    node.set_parameters([Parameter("node.initial_map", value=saved)])
    start = time.monotonic()
    answers = _burst(client_node, node.get_fully_qualified_name(), {"reset": 50, "save_map": 50, "load_map": 50})
    seconds = time.monotonic() - start
    missing = [name for name, response in answers if response is None]
    assert not missing, f"{len(missing)} of {len(answers)} calls never answered ({seconds:.1f} s)"
    assert all(response.success for _, response in answers), [r.message for _, r in answers if not r.success][:3]
    assert len({r.message for name, r in answers if name == "save_map"}) == 50  # 50 files, none overwritten


def test_a_burst_of_one_service_alone_is_answered(served_node):
    node, client_node = served_node
    answers = _burst(client_node, node.get_fully_qualified_name(), {"reset": 50})
    assert sum(r is not None and r.success for _, r in answers) == 50
