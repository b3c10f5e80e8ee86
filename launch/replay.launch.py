"""Replay a recorded bag through the live mapping node: `ros2 bag play BAG --clock` plus the node on sim time.

    ros2 launch gp_mapping replay.launch.py bag:=/path/to/bag mag_topic:=/imu/mag pose_topic:=/pose rate:=2.0

The node takes its stamps from the messages and its timers from /clock, so the map is the one the robot would
have built live. For an offline replay without ROS running, use `gp-mapping replay BAG` instead.
"""
from launch import LaunchDescription
from launch.actions import DeclareLaunchArgument, ExecuteProcess, IncludeLaunchDescription
from launch.launch_description_sources import PythonLaunchDescriptionSource
from launch.substitutions import LaunchConfiguration, PathJoinSubstitution
from launch_ros.substitutions import FindPackageShare


def generate_launch_description() -> LaunchDescription:
    share = FindPackageShare("gp_mapping")
    return LaunchDescription([
        DeclareLaunchArgument("bag", description="path of the bag to play (ROS 2 sqlite3 or mcap)"),
        DeclareLaunchArgument("rate", default_value="1.0", description="playback rate factor"),
        DeclareLaunchArgument("delay", default_value="2.0",
                              description="seconds before playback starts, so the node is up and discovered"),
        DeclareLaunchArgument("params_file", default_value=PathJoinSubstitution([share, "config", "mapper.yaml"]),
                              description="gp_mapping parameter file (/**: ros__parameters: form)"),
        DeclareLaunchArgument("mag_topic", default_value="/mag",
                              description="sensor_msgs/MagneticField topic in the bag"),
        DeclareLaunchArgument("pose_topic", default_value="/pose",
                              description="pose topic in the bag; its type is the parameter node.pose_type"),
        DeclareLaunchArgument("pose_source", default_value="topic",
                              description="topic: the pose topic; tf: the bag's /tf and /tf_static"),
        DeclareLaunchArgument("base_frame", default_value="base_link",
                              description="pose_source tf: the body frame (used when tf lacks the magnetometer frame)"),
        DeclareLaunchArgument("use_lifecycle", default_value="true",
                              description="true: the managed node, configured and activated; false: the plain node"),
        IncludeLaunchDescription(
            PythonLaunchDescriptionSource(PathJoinSubstitution([share, "launch", "mapper.launch.py"])),
            launch_arguments={
                "use_sim_time": "true",
                "params_file": LaunchConfiguration("params_file"),
                "mag_topic": LaunchConfiguration("mag_topic"),
                "pose_topic": LaunchConfiguration("pose_topic"),
                "pose_source": LaunchConfiguration("pose_source"),
                "base_frame": LaunchConfiguration("base_frame"),
                "use_lifecycle": LaunchConfiguration("use_lifecycle"),
            }.items(),
        ),
        ExecuteProcess(
            cmd=["ros2", "bag", "play", LaunchConfiguration("bag"), "--clock", "--rate", LaunchConfiguration("rate"),
                 "--delay", LaunchConfiguration("delay")],
            output="screen",
        ),
    ])
