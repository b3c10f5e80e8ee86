"""The bench's command line (gp_mapping/evaluation/harness.py): what --set accepts and what it refuses, and the
calibration section's selections of recordings, engines and candidates."""
from __future__ import annotations

import json

import pytest

from gp_mapping.evaluation import calibration, harness


def _bench(tmp_path, *args: str) -> int:
    parser = harness.argparse.ArgumentParser()
    harness.add_arguments(parser)
    empty = tmp_path / "no_data"
    empty.mkdir(exist_ok=True)
    return harness.main_with_args(parser.parse_args(["--only", "calibration", "--data", str(empty),
                                                     "--out", str(tmp_path / "out"), *args]))


def test_a_json_list_selects_the_calibration_sections_candidates_and_is_saved_with_the_plan(tmp_path):
    # no recordings in --data: the section is recorded as skipped, and the plan it would have run is saved
    assert _bench(tmp_path, "--jobs", "3", "--set", 'calibration_candidates=["shipped", "M = 128"]',
                  "calibration_batch_factors=[0.9, 1.1]", "solin_sequences=[1, 5]") == 0
    plan = json.loads((tmp_path / "out" / "calibration.json").read_text())["plan"]
    assert plan["calibration_candidates"] == ["shipped", "M = 128"]
    assert plan["calibration_batch_factors"] == [0.9, 1.1] and plan["solin_sequences"] == [1, 5]
    assert plan["calibration_recordings"] is None and plan["jobs"] == 3  # None: every recording


@pytest.mark.parametrize("args, says", [
    (("--set", "calibration_candidates=shipped"), "takes a JSON list"),
    (("--set", 'calibration_candidates=[{"a": 1}]'), "takes a JSON list"),
    (("--set", "calibration_candidates=[true]"), "takes a JSON list"),
    (("--set", "p1_batches=[1, 2]"), "is not a int"),
    (("--set", "no_such_key=1"), "expected KEY=VALUE"),
    (("--set", "p1_batches=-3"), "must be positive"),
    (("--jobs", "0"), "must be at least 1"),
])
def test_bad_bench_options_are_refused_with_what_to_give(tmp_path, capsys, args, says):
    assert _bench(tmp_path, *args) == 2
    assert says in capsys.readouterr().err
    assert not (tmp_path / "out").exists()  # nothing ran, nothing written


def test_an_unknown_name_in_a_calibration_selection_says_what_there_is_to_choose_from():
    for key, bad in (("calibration_candidates", ("shipped", "M = 1000")), ("calibration_recordings", ("kitchen",)),
                     ("calibration_engines", ("gpytorch",)), ("calibration_parts", ("everything",)),
                     ("calibration_batch_factors", (0.9, -1.0))):
        with pytest.raises(ValueError, match=key):  # before any recording is loaded or streamed
            calibration.run({key: bad}, None, lambda message: None)
    with pytest.raises(ValueError, match="M = 512"):
        calibration.run({"calibration_candidates": ("M = 1000",)}, None, lambda message: None)
    # an empty selection is no error: nothing to stream, an empty table
    assert calibration.run({"calibration_recordings": ()}, None, lambda message: None) == {"recordings": {},
                                                                                         "defaults": {}}


def test_a_failing_task_fails_the_section_with_its_error(monkeypatch):
    # a task that raises in a worker: its error comes back to the caller (the harness records it as the section's
    # error; the queued tasks are cancelled); in one process, the tasks after it are not run
    tasks = [("candidate", "sim_revisit", "no such candidate")] + [("peers", "sim_revisit", None)] * 3
    with pytest.raises(KeyError, match="no such candidate"):
        calibration.run_tasks(tasks[:1], {"calibration_exact_points": 50, "calibration_offline_iterations": 5}, None,
                              2, lambda message: None)
    started = []
    monkeypatch.setattr(calibration, "run_task", lambda task: started.append(task) or 1 / 0)
    with pytest.raises(ZeroDivisionError):
        calibration.run_tasks(tasks, {}, None, 1, lambda message: None)
    assert started == tasks[:1]
