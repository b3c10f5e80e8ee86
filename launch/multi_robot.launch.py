"""Two robots mapping in their own namespaces and one merger node that merges their maps without their data.

    ros2 launch gp_mapping multi_robot.launch.py
    ros2 launch gp_mapping multi_robot.launch.py robot2_transform:="12.0,-3.0,90.0"

Each mapper (/robot1/mapper, /robot2/mapper) maps its robot's mag and pose topics and sends its model summary on
~/model every node.model_period seconds; the merger (/merger) merges the summaries as they arrive and publishes
/merger/mean, /merger/variance, /merger/cloud and /merger/scale exactly as a mapper publishes its map. A robot
whose map frame is not the merged frame gets a transform "x,y,yaw_deg" (its frame into the merged one).

    ros2 launch gp_mapping multi_robot.launch.py tile_size:=12.0

maps with tiles (the mappers' shipped default, better in a building), merged tile by tile; the transforms must
then carry tiles onto tiles (quarter turns, shifts by whole tiles) and a map's summary grows with its tiles (past
node.model_max_bytes it goes in parts, which the merger puts together). The launch default, 0, gives each robot
one engine: any transform, a summary of fixed size.
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
        DeclareLaunchArgument("use_sim_time", default_value="false", description="use /clock"),
        DeclareLaunchArgument("params_file", default_value=default_params,
                              description="gp_mapping parameter file for both mappers (/**: ros__parameters: form)"),
        DeclareLaunchArgument("merge_period", default_value="2.0", description="seconds between merges"),
        DeclareLaunchArgument("tile_size", default_value="0.0",
                              description="model.tile_size of both mappers: 0 one engine each (any transform); "
                                          "12.0 tiles as shipped (transforms by quarter turns and whole tiles)"),
        DeclareLaunchArgument("robot1_mag_topic", default_value="/robot1/mag",
                              description="robot1's sensor_msgs/MagneticField topic"),
        DeclareLaunchArgument("robot1_pose_topic", default_value="/robot1/pose",
                              description="robot1's pose topic (type: node.pose_type)"),
        DeclareLaunchArgument("robot1_transform", default_value="",
                              description="robot1's map frame into the merged frame: x,y,yaw_deg ('' = the same frame)"),
        DeclareLaunchArgument("robot2_mag_topic", default_value="/robot2/mag",
                              description="robot2's sensor_msgs/MagneticField topic"),
        DeclareLaunchArgument("robot2_pose_topic", default_value="/robot2/pose",
                              description="robot2's pose topic (type: node.pose_type)"),
        DeclareLaunchArgument("robot2_transform", default_value="",
                              description="robot2's map frame into the merged frame: x,y,yaw_deg ('' = the same frame)"),
        Node(
            package="gp_mapping",
            executable="mapper",
            name="mapper",
            namespace="robot1",
            output="screen",
            parameters=[
                LaunchConfiguration("params_file"),
                {"use_sim_time": ParameterValue(LaunchConfiguration("use_sim_time"), value_type=bool),
                 "model.tile_size": ParameterValue(LaunchConfiguration("tile_size"), value_type=float)},
            ],
            remappings=[
                ("mag", LaunchConfiguration("robot1_mag_topic")),
                ("pose", LaunchConfiguration("robot1_pose_topic")),
            ],
        ),
        Node(
            package="gp_mapping",
            executable="mapper",
            name="mapper",
            namespace="robot2",
            output="screen",
            parameters=[
                LaunchConfiguration("params_file"),
                {"use_sim_time": ParameterValue(LaunchConfiguration("use_sim_time"), value_type=bool),
                 "model.tile_size": ParameterValue(LaunchConfiguration("tile_size"), value_type=float)},
            ],
            remappings=[
                ("mag", LaunchConfiguration("robot2_mag_topic")),
                ("pose", LaunchConfiguration("robot2_pose_topic")),
            ],
        ),
        Node(
            package="gp_mapping",
            executable="merger",
            name="merger",
            output="screen",
            parameters=[{
                "use_sim_time": ParameterValue(LaunchConfiguration("use_sim_time"), value_type=bool),
                "sources": ["/robot1/mapper/model", "/robot2/mapper/model"],
                "transforms": [LaunchConfiguration("robot1_transform"), LaunchConfiguration("robot2_transform")],
                "merge_period": ParameterValue(LaunchConfiguration("merge_period"), value_type=float),
            }],
        ),
    ])
