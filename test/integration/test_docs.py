"""Docs that stay true: the generated parameter reference is current and holds every key of config/mapper.yaml,
every relative link in README.md and docs/ points to a file, and every command the pages name exists and
answers --help."""
from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from support.paths import REPO_ROOT

PAGES = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def _text() -> str:
    return "\n".join(page.read_text() for page in PAGES)


def test_parameter_reference_is_generated_from_the_schema():
    from gp_mapping.tools.param_reference import PAGE, render

    assert PAGE == REPO_ROOT / "docs" / "parameters.md"
    assert PAGE.read_text() == render(), \
        "docs/parameters.md is stale: run python -m gp_mapping.tools.param_reference"


def _flat_keys(mapping, prefix=""):
    for key, value in mapping.items():
        if isinstance(value, dict):
            yield from _flat_keys(value, f"{prefix}{key}.")
        else:
            yield prefix + key


def test_every_key_of_the_shipped_yaml_is_in_the_parameter_reference():
    document = yaml.safe_load((REPO_ROOT / "config" / "mapper.yaml").read_text())
    keys = list(_flat_keys(document["/**"]["ros__parameters"]))
    assert len(keys) > 50
    page = (REPO_ROOT / "docs" / "parameters.md").read_text()
    missing = [key for key in keys if f"| `{key}` |" not in page]
    assert not missing, f"keys of config/mapper.yaml missing from docs/parameters.md: {missing}"


def test_live_column_follows_the_node():
    from gp_mapping.ros.parameters import LIVE_PARAMETERS

    page = (REPO_ROOT / "docs" / "parameters.md").read_text()
    for line in page.splitlines():
        match = re.match(r"\| `((?:model|sync|batching|grid|node)\.[a-z_]+)` \|", line)
        if match:
            live = line.split(" | ")[4]
            assert live == ("yes" if match.group(1) in LIVE_PARAMETERS else "no"), line


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_relative_links_point_to_existing_files(page):
    broken = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # an address (https:, mailto:) or an anchor on the same page
        path = (page.parent / target.split("#")[0]).resolve()
        if not path.exists():
            broken.append(target)
    assert not broken, f"{page.relative_to(REPO_ROOT)} links to missing files: {broken}"


def test_every_page_is_linked_from_the_readme_or_another_page():
    text = "\n".join(p.read_text() for p in PAGES)
    for page in PAGES[1:]:
        assert f"{page.name})" in text, f"docs/{page.name} is linked from no page"


def test_gp_mapping_commands_named_in_the_docs_exist_and_answer_help(capsys):
    from gp_mapping.cli import SUBCOMMANDS, main

    named = set(re.findall(r"gp-mapping ([a-z][a-z-]*)", _text()))
    assert {"replay", "bench", "merge", "export", "localize"} <= named
    unknown = named - set(SUBCOMMANDS)
    assert not unknown, f"the docs name gp-mapping commands that do not exist: {sorted(unknown)}"
    for name in sorted(named):
        with pytest.raises(SystemExit) as done:
            main([name, "--help"])
        assert done.value.code == 0, name
        assert f"usage: gp-mapping {name}" in capsys.readouterr().out


def test_the_installed_command_answers_help():
    script = Path(sys.executable).with_name("gp-mapping")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "gp_mapping.cli"]
    out = subprocess.run([*command, "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "replay" in out.stdout, out.stderr


def test_ros_executables_launch_files_modules_and_make_targets_named_exist():
    text = _text()
    setup = (REPO_ROOT / "setup.py").read_text()
    for name in set(re.findall(r"ros2 run gp_mapping ([A-Za-z_-]+)", text)):
        assert f'"{name} = ' in setup, f"ros2 run gp_mapping {name}: no such console script in setup.py"
    for name in set(re.findall(r"ros2 launch gp_mapping ([a-z_]+\.launch\.py)", text)):
        assert (REPO_ROOT / "launch" / name).is_file(), name
    for module in set(re.findall(r"python -m (gp_mapping[a-z_.]*[a-z_])", text)):
        assert importlib.util.find_spec(module) is not None, f"python -m {module}: no such module"
    makefile = (REPO_ROOT / "Makefile").read_text()
    for target in set(re.findall(r"(?:^|`)make ([a-z][a-z-]*)", text, re.M)):
        assert re.search(rf"^{re.escape(target)}:", makefile, re.M), f"make {target}: no such target"
