"""package.xml and setup.py describe the same package and install what the launch files and README need."""
from __future__ import annotations

import configparser
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from support.paths import REPO_ROOT

ROS_MESSAGE_PACKAGES = {"rclpy", "sensor_msgs", "geometry_msgs", "nav_msgs", "std_msgs", "std_srvs",
                        "diagnostic_msgs"}
# Python imports of the package -> the rosdep key that installs them (rosdistro's rosdep/python.yaml, or the
# package's own rosdep/gp_mapping.yaml for keys rosdistro lacks).
PYTHON_KEYS = {"numpy": "python3-numpy", "scipy": "python3-scipy", "yaml": "python3-yaml",
               "matplotlib": "python3-matplotlib", "tqdm": "python3-tqdm", "torch": "python3-torch",
               "safetensors": "python3-safetensors-pip", "rosbags": "python3-rosbags-pip"}
# Keys that rosdistro's rosdep/python.yaml defines (August 2026); python3-pytorch-pip is end-of-life there.
ROSDISTRO_PYTHON_KEYS = {"python3-numpy", "python3-scipy", "python3-yaml", "python3-matplotlib", "python3-tqdm",
                         "python3-torch", "python3-rosbags-pip", "python3-pytest"}
# Optional imports (benchmark baselines; `pip install .[test]`), not run-time dependencies of the node.
OPTIONAL_IMPORTS = {"gpytorch", "bench"}
# Used without an import: the replay launch file runs `ros2 bag play`.
COMMAND_PACKAGES = {"ros2bag"}


def _setup_call() -> dict:
    """The keyword arguments setup.py passes to setup(), captured by running it with setup() replaced."""
    import os

    import setuptools
    captured: dict = {}
    original, cwd = setuptools.setup, os.getcwd()
    setuptools.setup = lambda **kw: captured.update(kw)
    try:
        os.chdir(REPO_ROOT)
        exec(compile((REPO_ROOT / "setup.py").read_text(), "setup.py", "exec"), {"__name__": "__main__"})
    finally:
        os.chdir(cwd)
        setuptools.setup = original
    return captured


@pytest.fixture(scope="module")
def package_xml() -> ET.Element:
    return ET.parse(REPO_ROOT / "package.xml").getroot()


def test_package_xml_is_format_3_ament_python(package_xml):
    assert package_xml.get("format") == "3"
    assert package_xml.find("export/build_type").text == "ament_python"
    depends = {e.text for e in package_xml.findall("exec_depend")}
    assert ROS_MESSAGE_PACKAGES <= depends


def test_name_and_version_agree(package_xml):
    setup = _setup_call()
    import gp_mapping
    assert package_xml.find("name").text == setup["name"] == "gp_mapping"
    assert package_xml.find("version").text == setup["version"] == gp_mapping.__version__
    assert package_xml.find("license").text == setup["license"]


def test_installed_files_exist_and_cover_launch_and_config():
    """data_files installs the ament marker, package.xml, every launch file and every config file."""
    captured = _setup_call()
    installed = {dest: files for dest, files in captured["data_files"]}
    assert installed["share/ament_index/resource_index/packages"] == ["resource/gp_mapping"]
    assert installed["share/gp_mapping"] == ["package.xml"]
    for dest, files in installed.items():
        for f in files:
            assert (REPO_ROOT / f).is_file(), f"setup.py installs missing file {f}"
    launch_files = sorted(str(p.relative_to(REPO_ROOT)) for p in (REPO_ROOT / "launch").glob("*.launch.py"))
    config_files = sorted(str(p.relative_to(REPO_ROOT)) for p in (REPO_ROOT / "config").iterdir()
                          if p.suffix in (".yaml", ".rviz"))
    assert installed["share/gp_mapping/launch"] == launch_files
    assert installed["share/gp_mapping/config"] == config_files
    assert "config/mapper.yaml" in config_files


def test_console_scripts_point_to_real_functions():
    import importlib
    scripts = _setup_call()["entry_points"]["console_scripts"]
    names = {}
    for spec in scripts:
        name, target = (s.strip() for s in spec.split("="))
        module_name, func = target.split(":")
        module = importlib.import_module(module_name)
        assert callable(getattr(module, func)), spec
        names[name] = target
    # `ros2 run gp_mapping mapper` / `lifecycle_mapper` / `merger` / `localizer` / `lifecycle_localizer` and the
    # `gp-mapping` command
    assert set(names) == {"gp-mapping", "mapper", "lifecycle_mapper", "merger", "localizer", "lifecycle_localizer"}


def test_setup_cfg_installs_scripts_where_ros2_run_looks():
    cfg = configparser.ConfigParser()
    cfg.read(REPO_ROOT / "setup.cfg")
    assert cfg["develop"]["script_dir"] == "$base/lib/gp_mapping"
    assert cfg["install"]["install_scripts"] == "$base/lib/gp_mapping"


def test_user_requirements_name_unpinned_torch():
    """Users install into their own environment: torch>=2.2, never an exact pin that would fight theirs."""
    requires = _setup_call()["install_requires"]
    assert "torch>=2.2" in requires
    assert not any(r.startswith("torch==") for r in requires)


def test_dev_install_pins_torch_first():
    makefile = (REPO_ROOT / "Makefile").read_text()
    assert "torch==2.13.0" in makefile
    assert (REPO_ROOT / "constraints.txt").read_text().count("torch==2.13.0") == 1
    # torch installed before the requirements, which are installed under the constraints file
    assert makefile.index("$(TORCH)") < makefile.index("-c constraints.txt -r requirements-dev.txt")
    assert "bash" in (REPO_ROOT / ".ci/run").read_text() and "make test" in (REPO_ROOT / ".ci/run").read_text()


def _top_level_imports(paths) -> set[str]:
    import ast
    import sys
    names: set[str] = set()
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    return {n for n in names if n not in sys.stdlib_module_names and n != "gp_mapping"}


def test_exec_depends_are_exactly_what_the_code_imports(package_xml):
    """Every import of gp_mapping/ and launch/ has an exec_depend that rosdep resolves, and every exec_depend is
    used (an unused one makes rosdep install a package for nothing; a missing one gives a node that fails with
    ModuleNotFoundError on a robot)."""
    depends = {e.text for e in package_xml.findall("exec_depend")}
    files = list((REPO_ROOT / "gp_mapping").rglob("*.py")) + list((REPO_ROOT / "launch").glob("*.launch.py"))
    imports = _top_level_imports(files) - OPTIONAL_IMPORTS
    unknown = imports - set(PYTHON_KEYS) - {d for d in depends if not d.startswith("python3-")}
    assert not unknown, f"imported but not declared in package.xml: {sorted(unknown)}"
    expected = {PYTHON_KEYS.get(name, name) for name in imports} | COMMAND_PACKAGES
    assert depends == expected, (f"unused: {sorted(depends - expected)}; missing: {sorted(expected - depends)}")
    assert "python3-pytorch-pip" not in depends  # end-of-life key in rosdistro


def test_python_keys_resolve_from_rosdistro_or_the_package_rosdep_file(package_xml):
    """A python3-* key is one rosdistro defines or one the package's rosdep file defines as a pip package."""
    import yaml
    own = yaml.safe_load((REPO_ROOT / "rosdep" / "gp_mapping.yaml").read_text())
    keys = {e.text for e in package_xml.findall("*") if e.tag.endswith("depend") and e.text.startswith("python3-")}
    for key in keys - ROSDISTRO_PYTHON_KEYS:
        assert key in own, f"{key} is in neither rosdistro nor rosdep/gp_mapping.yaml"
        assert own[key]["*"]["pip"]["packages"], key
    assert set(own) <= keys, "rosdep/gp_mapping.yaml defines keys the package does not use"


def test_setup_has_python_requires_and_no_deprecated_options():
    setup = _setup_call()
    assert setup["python_requires"] == ">=3.10"
    for deprecated in ("tests_require", "setup_requires", "test_suite"):
        assert deprecated not in setup, deprecated
    # the rosdep file travels with the package
    installed = {dest: files for dest, files in setup["data_files"]}
    assert installed[f"share/gp_mapping/rosdep"] == ["rosdep/gp_mapping.yaml"]


def test_nav2_msgs_is_an_optional_dependency_behind_a_condition():
    """nav2_msgs (the nav2 map services) is declared with a REP 149 condition that holds only where
    GP_MAPPING_WITH_NAV2=1 is set, so rosdep installs it on request and never by default; the node runs without it
    (test_nav2_services.py)."""
    package = pytest.importorskip("catkin_pkg.package", reason="catkin_pkg comes with colcon-ros")
    for environment, expected in (({}, False), ({"GP_MAPPING_WITH_NAV2": "1"}, True)):
        parsed = package.parse_package(str(REPO_ROOT / "package.xml"))
        parsed.evaluate_conditions(environment)
        conditional = {d.name: d.evaluated_condition for d in parsed.exec_depends if d.condition}
        assert conditional == {"nav2_msgs": expected}
