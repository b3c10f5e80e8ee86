"""Launch the gp_mapping node with the shared parameter file.

    ros2 launch gp_mapping mapper.launch.py mag_topic:=/imu/mag pose_topic:=/robot/pose
    ros2 launch gp_mapping mapper.launch.py params_file:=/path/to/mapper.yaml use_sim_time:=true
    ros2 launch gp_mapping mapper.launch.py mag_topic:=/imu/mag pose_source:=tf base_frame:=base_link

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
        DeclareLaunchArgument("pose_source", default_value="topic",
                              description="topic: the pose topic; tf: /tf and /tf_static (grid.frame_id to the "
                                          "magnetometer frame, else to base_frame)"),
        DeclareLaunchArgument("base_frame", default_value="base_link",
                              description="pose_source tf: the body frame (used when tf lacks the magnetometer frame)"),
        Node(
            package="gp_mapping",
            executable="mapper",
            name="mapper",
            output="screen",
            emulate_tty=True,
            parameters=[
                LaunchConfiguration("params_file"),
                # After the file, so the launch argument wins over a use_sim_time written in the file.
                {"use_sim_time": ParameterValue(LaunchConfiguration("use_sim_time"), value_type=bool),
                 "node.pose_source": LaunchConfiguration("pose_source"),
                 "node.base_frame": LaunchConfiguration("base_frame")},
            ],
            remappings=[
                ("mag", LaunchConfiguration("mag_topic")),
                ("pose", LaunchConfiguration("pose_topic")),
            ],
        ),
    ])
