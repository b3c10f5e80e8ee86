"""Launch the gp_mapping node with the shared parameter file.

    ros2 launch gp_mapping mapper.launch.py mag_topic:=/imu/mag pose_topic:=/robot/pose
    ros2 launch gp_mapping mapper.launch.py params_file:=/path/to/mapper.yaml use_sim_time:=true
    ros2 launch gp_mapping mapper.launch.py mag_topic:=/imu/mag pose_source:=tf base_frame:=base_link
    ros2 launch gp_mapping mapper.launch.py use_lifecycle:=false    # the plain node instead of the managed one

By default the managed node (`lifecycle_mapper`) is started and brought up as nav2's lifecycle manager does:
configure, then activate once it is inactive. With `autostart:=false` it waits in 'unconfigured' for a manager
(nav2's lifecycle_manager with node_names [mapper], or `ros2 lifecycle set /mapper configure`).

The node publishes /mapper/mean, /mapper/variance (nav_msgs/OccupancyGrid, latched), /mapper/cloud
(sensor_msgs/PointCloud2) and /mapper/scale; `rviz2 -d <share>/gp_mapping/config/gp_mapping.rviz` shows them.
"""
from launch import LaunchDescription
from launch.actions import DeclareLaunchArgument, EmitEvent, RegisterEventHandler
from launch.conditions import IfCondition, UnlessCondition
from launch.events import matches_action
from launch.substitutions import LaunchConfiguration, PathJoinSubstitution, PythonExpression
from launch_ros.actions import LifecycleNode, Node
from launch_ros.event_handlers import OnStateTransition
from launch_ros.events.lifecycle import ChangeState
from launch_ros.parameter_descriptions import ParameterValue
from launch_ros.substitutions import FindPackageShare
from lifecycle_msgs.msg import Transition


def generate_launch_description() -> LaunchDescription:
    default_params = PathJoinSubstitution([FindPackageShare("gp_mapping"), "config", "mapper.yaml"])
    parameters = [
        LaunchConfiguration("params_file"),
        # After the file, so the launch arguments win over values written in the file.
        {"use_sim_time": ParameterValue(LaunchConfiguration("use_sim_time"), value_type=bool),
         "node.pose_source": LaunchConfiguration("pose_source"),
         "node.base_frame": LaunchConfiguration("base_frame")},
    ]
    remappings = [
        ("mag", LaunchConfiguration("mag_topic")),
        ("pose", LaunchConfiguration("pose_topic")),
    ]
    lifecycle = LaunchConfiguration("use_lifecycle")
    managed = LifecycleNode(package="gp_mapping", executable="lifecycle_mapper", name="mapper", namespace="",
                            output="screen", emulate_tty=True, parameters=parameters, remappings=remappings,
                            condition=IfCondition(lifecycle))
    autostart = PythonExpression(["'", lifecycle, "'.lower() == 'true' and '", LaunchConfiguration("autostart"),
                                  "'.lower() == 'true'"])
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
        DeclareLaunchArgument("use_lifecycle", default_value="true",
                              description="true: the managed node (lifecycle_mapper); false: the plain node (mapper)"),
        DeclareLaunchArgument("autostart", default_value="true",
                              description="with use_lifecycle: configure and activate it (as nav2's lifecycle "
                                          "manager does); false: leave that to a manager"),
        managed,
        Node(package="gp_mapping", executable="mapper", name="mapper", output="screen", emulate_tty=True,
             parameters=parameters, remappings=remappings, condition=UnlessCondition(lifecycle)),
        # Configure at start; activate when that configure has reached 'inactive' (not after a later deactivate;
        # a failed configure stays unconfigured and says why in its log).
        RegisterEventHandler(OnStateTransition(
            target_lifecycle_node=managed, start_state="configuring", goal_state="inactive",
            entities=[EmitEvent(event=ChangeState(lifecycle_node_matcher=matches_action(managed),
                                                  transition_id=Transition.TRANSITION_ACTIVATE))]),
            condition=IfCondition(autostart)),
        EmitEvent(event=ChangeState(lifecycle_node_matcher=matches_action(managed),
                                    transition_id=Transition.TRANSITION_CONFIGURE),
                  condition=IfCondition(autostart)),
    ])
