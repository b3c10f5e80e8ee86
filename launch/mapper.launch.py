"""Launch the gp_mapping node with the shared parameter file.

    ros2 launch gp_mapping mapper.launch.py mag_topic:=/imu/mag pose_topic:=/robot/pose
    ros2 launch gp_mapping mapper.launch.py params_file:=/path/to/mapper.yaml use_sim_time:=true

The node publishes /mapper/mean, /mapper/variance (nav_msgs/OccupancyGrid, latched), /mapper/cloud
(sensor_msgs/PointCloud2) and /mapper/scale; `rviz2 -d <share>/gp_mapping/config/gp_mapping.rviz` shows them.
"""
from launch import LaunchDescription
from launch.actions import DeclareLaunchArgument
from launch.substitutions import LaunchConfiguration, PathJoinSubstitution
from launch_ros.actions import Node
from launch_ros.parameter_descriptions import ParameterValue
from launch_ros.substitutions import FindPackageShare


def generate_launch_description() -> LaunchDescription:
    default_params = PathJoinSubstitution([FindPackageShare("gp_mapping"), "config", "mapper.yaml"])
    return LaunchDescription([
        DeclareLaunchArgument("use_sim_time", default_value="false",
                              description="use /clock (true when replaying a bag with `ros2 bag play --clock`)"),
        DeclareLaunchArgument("params_file", default_value=default_params,
                              description="gp_mapping parameter file (/**: ros__parameters: form)"),
        DeclareLaunchArgument("mag_topic", default_value="mag",
                              description="sensor_msgs/MagneticField input topic"),
        DeclareLaunchArgument("pose_topic", default_value="pose",
                              description="pose input topic; its type is the parameter node.pose_type"),
        Node(
            package="gp_mapping",
            executable="mapper",
            name="mapper",
            output="screen",
            emulate_tty=True,
            parameters=[
                LaunchConfiguration("params_file"),
                # After the file, so the launch argument wins over a use_sim_time written in the file.
                {"use_sim_time": ParameterValue(LaunchConfiguration("use_sim_time"), value_type=bool)},
            ],
            remappings=[
                ("mag", LaunchConfiguration("mag_topic")),
                ("pose", LaunchConfiguration("pose_topic")),
            ],
        ),
    ])
