"""Launch the gp_mapping localizer on a saved magnetic map, with the shared parameter file.

    ros2 launch gp_mapping localizer.launch.py map:=/path/to/map.safetensors mag_topic:=/imu/mag odom_topic:=/odom
    ros2 launch gp_mapping localizer.launch.py map:=map.safetensors odom_source:=tf    # odometry from /tf
    ros2 launch gp_mapping localizer.launch.py map:=map.safetensors use_lifecycle:=false  # the plain node

By default the managed node (`lifecycle_localizer`) is started and brings itself up (`--autostart`: configure,
which loads the map, then activate; a missing map or one of another frame ends it with the reason). With
`autostart:=false` it waits in 'unconfigured' for a manager (nav2's lifecycle_manager with node_names
[localizer], or `ros2 lifecycle set /localizer configure`).

The node waits for a start: RViz's "2D Pose Estimate" (/initialpose), or `localizer.initial_pose` /
`localizer.global_start` in the parameter file. It publishes /localizer/pose, /localizer/particles, map -> odom
on /tf and the map it looks up (/localizer/mean ...); `rviz2 -d <share>/gp_mapping/config/localizer.rviz`
shows them.
"""
from launch import LaunchDescription
from launch.actions import DeclareLaunchArgument
from launch.conditions import IfCondition, UnlessCondition
from launch.substitutions import LaunchConfiguration, PathJoinSubstitution
from launch_ros.actions import Node
from launch_ros.parameter_descriptions import ParameterValue
from launch_ros.substitutions import FindPackageShare


def generate_launch_description() -> LaunchDescription:
    default_params = PathJoinSubstitution([FindPackageShare("gp_mapping"), "config", "localizer.yaml"])
    parameters = [
        LaunchConfiguration("params_file"),
        # After the file, so the launch arguments win over values written in the file.
        {"use_sim_time": ParameterValue(LaunchConfiguration("use_sim_time"), value_type=bool),
         "localizer.map": LaunchConfiguration("map"),
         "localizer.odom_source": LaunchConfiguration("odom_source"),
         "localizer.tf_broadcast": ParameterValue(LaunchConfiguration("tf_broadcast"), value_type=bool)},
    ]
    remappings = [
        ("mag", LaunchConfiguration("mag_topic")),
        ("odom", LaunchConfiguration("odom_topic")),
    ]
    lifecycle = LaunchConfiguration("use_lifecycle")
    return LaunchDescription([
        DeclareLaunchArgument("map", description="the map state file (.safetensors: the mapper's ~/save_map, "
                                                 "gp-mapping replay --save-state); required"),
        DeclareLaunchArgument("use_sim_time", default_value="false",
                              description="use /clock (true when replaying a bag with `ros2 bag play --clock`)"),
        DeclareLaunchArgument("params_file", default_value=default_params,
                              description="localizer parameter file (/**: ros__parameters: localizer: ...)"),
        DeclareLaunchArgument("mag_topic", default_value="mag", description="sensor_msgs/MagneticField input topic"),
        DeclareLaunchArgument("odom_topic", default_value="odom",
                              description="nav_msgs/Odometry input topic (odom_source topic)"),
        DeclareLaunchArgument("odom_source", default_value="topic",
                              description="topic: the odometry topic; tf: odom -> base_link from /tf"),
        DeclareLaunchArgument("tf_broadcast", default_value="true",
                              description="publish map -> odom on /tf (false where another node publishes it)"),
        DeclareLaunchArgument("use_lifecycle", default_value="true",
                              description="true: the managed node (lifecycle_localizer); false: the plain node"),
        DeclareLaunchArgument("autostart", default_value="true",
                              description="with use_lifecycle: the node configures and activates itself; false: "
                                          "it waits for a lifecycle manager"),
        Node(package="gp_mapping", executable="lifecycle_localizer", name="localizer", output="screen",
             emulate_tty=True, arguments=["--autostart", LaunchConfiguration("autostart")], parameters=parameters,
             remappings=remappings, condition=IfCondition(lifecycle)),
        Node(package="gp_mapping", executable="localizer", name="localizer", output="screen", emulate_tty=True,
             parameters=parameters, remappings=remappings, condition=UnlessCondition(lifecycle)),
    ])
