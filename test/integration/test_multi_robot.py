"""Two mapping nodes and a merger node over real DDS (localhost): the merger merges the mappers' ~/model
summaries (no data) and publishes the merged map like a mapper; malformed and oversized summaries are refused
and counted, and the merger keeps going. The mappers map in small tiles with a small node.model_max_bytes, so
their summaries outgrow one message and go in parts, which the merger puts together."""
from __future__ import annotations

import os
import uuid

import numpy as np
import pytest
import yaml

from support.mapper_process import (MapperProcess, MapView, decode, diagnostic_values, map_qos, node_env,
                                    publish_recording, subscribe_map, truth_on_grid, wait_for_node, write_params)
from support.ros import PYTHON, ChildProcess, RosHarness

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

AREA = (-2.0, -2.0, 2.0, 2.0)
MAX_BYTES = 1_000_000
MAPPER_MAX_BYTES = 60_000  # a robot's half in 1.5 m tiles (about 105 kB whole) outgrows it: it goes in parts


def _recordings():
    from gp_mapping import sim

    world = sim.World.from_config(sim.WorldConfig(area=AREA, n_dipoles=4, depth_range=(0.8, 1.5),
                                                  anomaly_range=(2e-6, 8e-6)), np.random.default_rng(5))

    def drive(area, seed):
        path = sim.TrajectoryConfig(patterns=("lawnmower",), area=area, inset=0.1, speed=1.0, rate=10.0,
                                    duration=30.0, line_spacing=0.5)
        return sim.simulate(world, path, sim.SensorConfig(noise_std=0.05e-6), seed=seed)

    return drive((-2.0, -2.0, 0.0, 2.0), 1), drive((0.0, -2.0, 2.0, 2.0), 2)


class MergerProcess(ChildProcess):
    def __init__(self, tmp, env, sources, entry: str = "module") -> None:
        self.name = f"merger_{uuid.uuid4().hex[:8]}"
        params = tmp / "merger.yaml"
        params.write_text(yaml.safe_dump({"/**": {"ros__parameters": {
            "sources": sources, "merge_period": 0.5, "steps": 20, "max_summary_bytes": MAX_BYTES}}}))
        ros = ["--ros-args", "--params-file", str(params), "-r", f"__node:={self.name}"]
        args = ([PYTHON, "-m", "gp_mapping.ros.merger_node", *ros] if entry == "module"
                else [PYTHON, "-m", "gp_mapping.cli", "merge-node", *ros])
        super().__init__(args, env, tmp / "merger.log")

    def topic(self, name: str) -> str:
        return f"/{self.name}/{name}"

    def check_alive(self) -> None:
        if self.poll() is not None:
            pytest.fail(f"the merger exited with {self.poll()}:\n{self.output[-3000:]}")


def test_two_mappers_and_a_merger_over_dds(tmp_path):
    from std_msgs.msg import UInt8MultiArray

    env = node_env(dict(os.environ, ROS_AUTOMATIC_DISCOVERY_RANGE="LOCALHOST"), tmp_path)
    params = write_params(tmp_path / "params.yaml", node={"publish_period": 0.5, "model_period": 0.5,
                                                          "queue_depth": 1000, "model_max_bytes": MAPPER_MAX_BYTES},
                          model={"tile_size": 1.5, "tile_overlap": 0.3})
    rec_a, rec_b = _recordings()
    junk_topic = f"/junk_{uuid.uuid4().hex[:8]}/model"
    with RosHarness("multi_robot_test") as harness:
        procs = [MapperProcess(tmp_path, env, params, log=f"mapper{i}.log") for i in range(2)]
        merger = MergerProcess(tmp_path, env, [procs[0].topic("model"), procs[1].topic("model"), junk_topic],
                               entry="cli")
        try:
            views = [subscribe_map(harness, p) for p in procs]
            merged = subscribe_map(harness, merger)
            merged.diagnostics.clear()
            from diagnostic_msgs.msg import DiagnosticArray
            harness.node.create_subscription(
                DiagnosticArray, "/diagnostics",
                lambda m: merged.diagnostics.extend(s for s in m.status if s.name.startswith(merger.name + ":")), 10)
            for p, v in zip(procs, views):
                wait_for_node(harness, v, p)
            harness.spin_until(lambda: merger.check_alive() or bool(merged.diagnostics), 60.0, "the merger's diagnostics")
            # Bad summaries first: a malformed one and an oversized one, on a source topic the merger listens to.
            junk = harness.node.create_publisher(UInt8MultiArray, junk_topic, map_qos())
            harness.spin_until(lambda: junk.get_subscription_count() > 0, 30.0, "the merger's junk subscription")
            junk.publish(UInt8MultiArray(data=b"\x80\x04 not a summary"))
            harness.spin_for(0.5)
            junk.publish(UInt8MultiArray(data=bytes(MAX_BYTES + 10)))
            for p, rec in zip(procs, (rec_a, rec_b)):
                publish_recording(harness, p, rec, "pose_stamped")

            def merged_both() -> bool:
                merger.check_alive()
                values = diagnostic_values(merged)
                return bool(merged.mean) and values.get("sources") == "2" and int(values.get("merges", 0)) >= 1
            harness.spin_until(merged_both, 120.0, "a merged map of both mappers")
            # Let the last summaries (all data mapped) reach the merger, and its map go out.
            harness.spin_for(4.0)
            values = diagnostic_values(merged)
            assert int(values["rejected/malformed"]) >= 1 and int(values["rejected/oversized"]) >= 1, values
            assert int(values["parts_received"]) >= 2 and values["sources_incomplete"] == "0", values
            for v in views:
                assert int(diagnostic_values(v)["node/model_summaries_parts"]) >= 1
            mean, var, _, unit = decode(merged)
            assert unit == "microtesla"
            known = np.isfinite(mean)
            info = merged.mean[-1].info
            xs = info.origin.position.x + (np.arange(info.width) + 0.5) * info.resolution
            left, right = np.broadcast_to(xs < 0, known.shape), np.broadcast_to(xs > 0, known.shape)
            assert (known & left).sum() > 20 and (known & right).sum() > 20  # both robots' halves
            truth = truth_on_grid(rec_a, merged.mean[-1])  # one world: either recording's truth
            rmse = float(np.sqrt(np.mean((mean[known] - truth[known]) ** 2)))
            spread = float(np.std(truth[known]))
            print(f"merged map RMSE {rmse:.3f} uT over {known.sum()} known cells (field spread {spread:.2f} uT)")
            assert rmse < 0.3 * spread
            for p in procs:
                p.check_alive()
            merger.check_alive()
        finally:
            merger.stop()
            for p in procs:
                p.stop()


@pytest.mark.parametrize("args, names", [
    ([], ["sources"]),
    (["-p", "sources:=['/a/model', '/b/model']", "-p", "transforms:=['1,2']"], ["transforms"]),
    (["-p", "sources:=['/a/model']", "-p", "merge_period:=0.0"], ["merge_period"]),
])
def test_bad_merger_parameters_stop_it_naming_the_parameter(tmp_path, args, names):
    import subprocess

    env = node_env(dict(os.environ, ROS_AUTOMATIC_DISCOVERY_RANGE="LOCALHOST"), tmp_path)
    proc = subprocess.run([PYTHON, "-m", "gp_mapping.ros.merger_node", "--ros-args", *args], env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    for name in names:
        assert name in proc.stderr + proc.stdout
