"""Static checks of the launch files and the RViz config (launch, launch_ros and RViz are not on this machine).

The launch files are parsed with ``ast``: they must define ``generate_launch_description``, every ``Node`` they
start must be a console script that setup.py installs, every parameter they pass must be one the node declares,
every ``LaunchConfiguration`` must be declared, every file they reference under the package share must exist
in the repository and be installed by setup.py, and the replay must play the bag with ``--clock`` into a node
on sim time. The RViz file must be YAML whose map topics are the ones the node publishes, with the QoS that
lets a late RViz receive the latched maps.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest
import yaml

from support.paths import REPO_ROOT
from gp_mapping.config import MapperConfig, field_specs

LAUNCH_FILES = sorted((REPO_ROOT / "launch").glob("*.launch.py"))
RVIZ_FILE = REPO_ROOT / "config" / "gp_mapping.rviz"
NODE_NAME = "mapper"


def _call_name(node: ast.AST) -> str:
    func = node.func if isinstance(node, ast.Call) else node
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute):
        return func.attr
    return ""


def _calls(tree: ast.AST, name: str) -> list[ast.Call]:
    return [n for n in ast.walk(tree) if isinstance(n, ast.Call) and _call_name(n) == name]


def _kw(call: ast.Call, key: str) -> ast.AST | None:
    return next((k.value for k in call.keywords if k.arg == key), None)


def _literal(node: ast.AST | None):
    return ast.literal_eval(node) if node is not None else None


def _arg_or_kw(call: ast.Call, index: int, key: str) -> ast.AST | None:
    return call.args[index] if len(call.args) > index else _kw(call, key)


def _console_scripts() -> dict[str, str]:
    """console_scripts name -> module:function, read from setup.py's AST."""
    tree = ast.parse((REPO_ROOT / "setup.py").read_text())
    setup = _calls(tree, "setup")[0]
    entry_points = _literal(_kw(setup, "entry_points"))
    return dict(item.replace(" ", "").split("=", 1) for item in entry_points["console_scripts"])


def _installed_share_files() -> set[str]:
    """Repository paths that setup.py's data_files install under share/gp_mapping, evaluated like setup.py does."""
    tree = ast.parse((REPO_ROOT / "setup.py").read_text())
    setup = _calls(tree, "setup")[0]
    namespace = {"glob": lambda pattern: [str(p.relative_to(REPO_ROOT)) for p in REPO_ROOT.glob(pattern)],
                 "PACKAGE": "gp_mapping"}
    data_files = eval(compile(ast.Expression(_kw(setup, "data_files")), "setup.py", "eval"), namespace)  # noqa: S307
    return {f for dest, files in data_files if dest.startswith("share/gp_mapping") for f in files}


def _share_paths(tree: ast.AST) -> list[str]:
    """Files named as PathJoinSubstitution([FindPackageShare("gp_mapping") or a name bound to it, "dir", "file"])."""
    share_names = {t.id for a in ast.walk(tree) if isinstance(a, ast.Assign)
                   and isinstance(a.value, ast.Call) and _call_name(a.value) == "FindPackageShare"
                   for t in a.targets if isinstance(t, ast.Name)}
    paths = []
    for call in _calls(tree, "PathJoinSubstitution"):
        parts = call.args[0].elts
        head = parts[0]
        is_share = (isinstance(head, ast.Call) and _call_name(head) == "FindPackageShare"
                    and _literal(head.args[0]) == "gp_mapping") \
            or (isinstance(head, ast.Name) and head.id in share_names)
        assert is_share, f"PathJoinSubstitution not rooted at FindPackageShare('gp_mapping'): {ast.unparse(call)}"
        paths.append("/".join(_literal(p) for p in parts[1:]))
    return paths


def _parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def test_both_launch_files_are_shipped():
    assert {p.name for p in LAUNCH_FILES} == {"mapper.launch.py", "replay.launch.py", "multi_robot.launch.py",
                                              "localizer.launch.py"}
    installed = _installed_share_files()
    for path in LAUNCH_FILES:
        assert str(path.relative_to(REPO_ROOT)) in installed, f"{path.name} is not installed by setup.py"


@pytest.mark.parametrize("path", LAUNCH_FILES, ids=lambda p: p.name)
def test_launch_file_structure(path):
    tree = _parse(path)
    functions = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
    assert "generate_launch_description" in functions
    # Every LaunchConfiguration refers to an argument declared in the same file.
    declared = {_literal(_arg_or_kw(c, 0, "name")) for c in _calls(tree, "DeclareLaunchArgument")}
    used = {_literal(c.args[0]) for c in _calls(tree, "LaunchConfiguration")}
    assert used <= declared, f"undeclared launch arguments: {used - declared}"
    # Every file under the package share exists in the repository and is installed.
    installed = _installed_share_files()
    for rel in _share_paths(tree):
        assert (REPO_ROOT / rel).is_file(), f"{path.name} references {rel}, absent from the repository"
        assert rel in installed, f"{path.name} references {rel}, which setup.py does not install"


def _resolve(tree: ast.AST, node: ast.AST | None) -> ast.AST | None:
    """A name bound earlier in the file (``parameters = [...]``) -> the expression bound to it."""
    if isinstance(node, ast.Name):
        return next(a.value for a in ast.walk(tree) if isinstance(a, ast.Assign)
                    and any(isinstance(t, ast.Name) and t.id == node.id for t in a.targets))
    return node


def _localizer_parameters() -> set[str]:
    from gp_mapping.localization.config import field_specs as filter_specs, node_field_specs

    return set(filter_specs()) | set(node_field_specs())


# executable -> (its entry point, the node name, the parameters it declares, the input topics a launch remaps)
NODES = {
    "mapper": ("gp_mapping.ros.mapper_node:main", NODE_NAME, lambda: set(field_specs()), {"mag", "pose"}),
    "lifecycle_mapper": ("gp_mapping.ros.mapper_node:lifecycle_main", NODE_NAME, lambda: set(field_specs()),
                         {"mag", "pose"}),
    "localizer": ("gp_mapping.ros.localizer_node:main", "localizer", _localizer_parameters, {"mag", "odom"}),
    "lifecycle_localizer": ("gp_mapping.ros.localizer_node:lifecycle_main", "localizer", _localizer_parameters,
                            {"mag", "odom"}),
}


@pytest.mark.parametrize("path", LAUNCH_FILES, ids=lambda p: p.name)
def test_launched_nodes_exist_and_take_declared_parameters(path):
    tree = _parse(path)
    scripts = _console_scripts()
    for call in _calls(tree, "Node") + _calls(tree, "LifecycleNode"):
        assert _literal(_kw(call, "package")) == "gp_mapping"
        executable = _literal(_kw(call, "executable"))
        assert executable in scripts, f"{path.name} starts '{executable}', not a console script of setup.py"
        if executable == "merger":  # the merger node (multi_robot.launch.py): its own parameters, no inputs
            from gp_mapping.ros.merger_node import _PARAMETERS, MERGER_NAME

            assert scripts[executable] == "gp_mapping.ros.merger_node:main"
            assert _literal(_kw(call, "name")) == MERGER_NAME
            for item in _resolve(tree, _kw(call, "parameters")).elts:
                names = {_literal(k) for k in item.keys}
                assert names <= set(_PARAMETERS) | {"use_sim_time"}, f"undeclared merger parameters {names}"
            continue
        target, name, declared, inputs = NODES[executable]
        assert scripts[executable] == target
        assert _call_name(call) == "Node" or executable.startswith("lifecycle_")
        assert _literal(_kw(call, "name")) == name
        known_parameters = declared() | {"use_sim_time"}
        for item in _resolve(tree, _kw(call, "parameters")).elts:
            if isinstance(item, ast.Dict):
                names = {_literal(k) for k in item.keys}
                assert names <= known_parameters, f"{path.name} passes undeclared parameters {names - known_parameters}"
        remapped = {_literal(pair.elts[0]) for pair in _resolve(tree, _kw(call, "remappings")).elts}
        assert remapped == inputs, "the remappings must target the node's input topics"


def test_mapper_launch_brings_the_managed_node_up_like_a_lifecycle_manager():
    """use_lifecycle (default true) starts lifecycle_mapper, the plain node otherwise (one of the two); with
    autostart a configure is emitted, and activate only on the configure's own configuring -> inactive
    transition (a later deactivate by a manager must not be undone)."""
    tree = _parse(REPO_ROOT / "launch" / "mapper.launch.py")
    args = {_literal(_arg_or_kw(c, 0, "name")): c for c in _calls(tree, "DeclareLaunchArgument")}
    assert _literal(_kw(args["use_lifecycle"], "default_value")) == "true"
    assert _literal(_kw(args["autostart"], "default_value")) == "true"
    (managed,), (plain,) = _calls(tree, "LifecycleNode"), _calls(tree, "Node")
    assert _call_name(_kw(managed, "condition")) == "IfCondition"
    assert _call_name(_kw(plain, "condition")) == "UnlessCondition"
    transitions = [ast.unparse(_kw(c, "transition_id")) for c in _calls(tree, "ChangeState")]
    assert sorted(transitions) == ["Transition.TRANSITION_ACTIVATE", "Transition.TRANSITION_CONFIGURE"]
    (handler,) = _calls(tree, "OnStateTransition")
    assert _literal(_kw(handler, "start_state")) == "configuring" and _literal(_kw(handler, "goal_state")) == "inactive"
    replay = _parse(REPO_ROOT / "launch" / "replay.launch.py")
    assert "use_lifecycle" in {_literal(_arg_or_kw(c, 0, "name")) for c in _calls(replay, "DeclareLaunchArgument")}


def test_mapper_launch_defaults():
    tree = _parse(REPO_ROOT / "launch" / "mapper.launch.py")
    args = {_literal(_arg_or_kw(c, 0, "name")): c for c in _calls(tree, "DeclareLaunchArgument")}
    assert {"use_sim_time", "params_file", "mag_topic", "pose_topic"} <= set(args)
    assert _literal(_kw(args["use_sim_time"], "default_value")) == "false"
    default = _kw(args["params_file"], "default_value")
    if isinstance(default, ast.Name):  # bound to a variable earlier in the function
        default = next(a.value for a in ast.walk(tree) if isinstance(a, ast.Assign)
                       and any(isinstance(t, ast.Name) and t.id == default.id for t in a.targets))
    assert _share_paths(ast.Module(body=[ast.Expr(default)], type_ignores=[])) == ["config/mapper.yaml"]


def test_replay_launch_plays_the_bag_with_clock_into_a_sim_time_node():
    tree = _parse(REPO_ROOT / "launch" / "replay.launch.py")
    (process,) = _calls(tree, "ExecuteProcess")
    cmd = _kw(process, "cmd").elts
    words = [_literal(w) if isinstance(w, ast.Constant) else ast.unparse(w) for w in cmd]
    assert words[:3] == ["ros2", "bag", "play"] and "--clock" in words
    assert words[3] == "LaunchConfiguration('bag')"
    (include,) = _calls(tree, "IncludeLaunchDescription")
    assert "mapper.launch.py" in ast.unparse(include)
    launch_args = _kw(include, "launch_arguments").func.value  # {...}.items()
    passed = {_literal(k): v for k, v in zip(launch_args.keys, launch_args.values)}
    assert _literal(passed["use_sim_time"]) == "true"
    # What the replay passes on must be declared by the included mapper launch file.
    mapper_args = {_literal(_arg_or_kw(c, 0, "name"))
                   for c in _calls(_parse(REPO_ROOT / "launch" / "mapper.launch.py"), "DeclareLaunchArgument")}
    assert set(passed) <= mapper_args


def _displays(document) -> list[dict]:
    return document["Visualization Manager"]["Displays"]


def _shown_topics(path: Path, fixed_frame: str, published: dict[str, str], rviz_types: dict[str, str]) -> list:
    """The RViz config at ``path``: installed, with ``fixed_frame``; every display of a class in ``rviz_types``
    shows a topic the node publishes (``published``: topic -> type) with that type. Returns ``(class, topic)``."""
    document = yaml.safe_load(path.read_text())
    assert str(path.relative_to(REPO_ROOT)) in _installed_share_files()
    assert document["Visualization Manager"]["Global Options"]["Fixed Frame"] == fixed_frame
    shown = []
    for display in _displays(document):
        kind = rviz_types.get(display["Class"])
        if kind is None:
            continue
        topic = display["Topic"]
        assert published.get(topic["Value"]) == kind, f"RViz shows {topic['Value']}, which the node does not publish"
        shown.append((display["Class"], topic))
    return shown


def test_rviz_config_matches_the_node():
    from gp_mapping.ros.publishers import published_topics

    document = yaml.safe_load(RVIZ_FILE.read_text())
    config = MapperConfig()
    published = {t.replace("~", f"/{NODE_NAME}"): kind for t, kind in published_topics(config).items()}
    rviz_types = {"rviz_default_plugins/Map": "nav_msgs/msg/OccupancyGrid",
                  "rviz_default_plugins/PointCloud2": "sensor_msgs/msg/PointCloud2"}
    map_topics = set()
    for _kind, topic in _shown_topics(RVIZ_FILE, config.grid.frame_id, published, rviz_types):
        # Latched maps reach a late RViz only with matching QoS.
        assert topic["Durability Policy"] == "Transient Local" and topic["Reliability Policy"] == "Reliable"
        map_topics.add(topic["Value"])
    assert {f"/{NODE_NAME}/mean", f"/{NODE_NAME}/variance", f"/{NODE_NAME}/cloud"} <= map_topics
    clouds = [d for d in _displays(document) if d["Class"] == "rviz_default_plugins/PointCloud2"]
    assert all(d["Channel Name"] == "mean" for d in clouds)  # a field of the published cloud
    poses = [d for d in _displays(document) if d["Class"] in ("rviz_default_plugins/Pose",
                                                               "rviz_default_plugins/Path")]
    assert poses, "the RViz config should show the robot's pose or path"


def test_localizer_launch_takes_the_map_and_brings_the_managed_node_up():
    """localizer.launch.py: `map` is required (no default), the parameter file defaults to config/localizer.yaml,
    the managed node (default) configures and activates itself with --autostart <autostart>, the plain node
    otherwise (one of the two)."""
    tree = _parse(REPO_ROOT / "launch" / "localizer.launch.py")
    args = {_literal(_arg_or_kw(c, 0, "name")): c for c in _calls(tree, "DeclareLaunchArgument")}
    assert _kw(args["map"], "default_value") is None
    assert _literal(_kw(args["use_lifecycle"], "default_value")) == "true"
    assert _literal(_kw(args["autostart"], "default_value")) == "true"
    default = _kw(args["params_file"], "default_value")
    default = _resolve(tree, default)
    assert _share_paths(ast.Module(body=[ast.Expr(default)], type_ignores=[])) == ["config/localizer.yaml"]
    nodes = {_literal(_kw(c, "executable")): c for c in _calls(tree, "Node")}
    assert set(nodes) == {"localizer", "lifecycle_localizer"}
    assert _call_name(_kw(nodes["lifecycle_localizer"], "condition")) == "IfCondition"
    assert _call_name(_kw(nodes["localizer"], "condition")) == "UnlessCondition"
    words = [ast.unparse(w) for w in _kw(nodes["lifecycle_localizer"], "arguments").elts]
    assert words == ["'--autostart'", "LaunchConfiguration('autostart')"]
    from gp_mapping.ros.process import node_command

    assert node_command(["lifecycle_localizer", "--autostart", "true"], "x", "", lifecycle=True)[1]
    assert not node_command(["lifecycle_localizer", "--autostart", "false"], "x", "", lifecycle=True)[1]


def test_localizer_rviz_config_shows_the_map_particles_and_pose():
    from gp_mapping.localization.config import LocalizerNodeConfig
    from gp_mapping.ros.localizer_node import LOCALIZER_NAME, published_topics

    path = REPO_ROOT / "config" / "localizer.rviz"
    document = yaml.safe_load(path.read_text())
    published = {t.replace("~", f"/{LOCALIZER_NAME}"): kind for t, kind in published_topics().items()}
    rviz_types = {"rviz_default_plugins/Map": "nav_msgs/msg/OccupancyGrid",
                  "rviz_default_plugins/PoseArray": "geometry_msgs/msg/PoseArray",
                  "rviz_default_plugins/PoseWithCovariance": "geometry_msgs/msg/PoseWithCovarianceStamped"}
    shown = {kind.split("/")[1]: topic for kind, topic in _shown_topics(path, LocalizerNodeConfig().global_frame,
                                                                         published, rviz_types)}
    assert set(shown) == {"Map", "PoseArray", "PoseWithCovariance"}
    assert all(topic["Reliability Policy"] == "Reliable" for topic in shown.values())
    # The map and the pose are latched (a late RViz gets them); the particles are not.
    assert shown["Map"]["Durability Policy"] == shown["PoseWithCovariance"]["Durability Policy"] == "Transient Local"
    assert "rviz_default_plugins/TF" in {d["Class"] for d in _displays(document)}
    tools = {t["Class"]: t for t in document["Visualization Manager"]["Tools"]}
    assert tools["rviz_default_plugins/SetInitialPose"]["Topic"]["Value"] == "/initialpose"

