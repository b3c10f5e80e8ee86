"""ament_python build of gp_mapping; also `pip install -e .` in a user's own environment."""
from glob import glob

from setuptools import find_packages, setup

PACKAGE = "gp_mapping"

setup(
    name=PACKAGE,
    version="0.2.0",
    packages=find_packages(include=[PACKAGE, f"{PACKAGE}.*"]),
    data_files=[
        ("share/ament_index/resource_index/packages", [f"resource/{PACKAGE}"]),
        (f"share/{PACKAGE}", ["package.xml"]),
        (f"share/{PACKAGE}/launch", sorted(glob("launch/*.launch.py"))),
        (f"share/{PACKAGE}/config", sorted(glob("config/*.yaml") + glob("config/*.rviz"))),
        (f"share/{PACKAGE}/rosdep", ["rosdep/gp_mapping.yaml"]),
    ],
    # rclpy and the ROS message packages come from ROS (rosdep / apt, or the ros-* wheels), not from here.
    install_requires=[
        "numpy>=1.23",
        "scipy>=1.9",
        "pyyaml>=6.0",
        "matplotlib>=3.6",
        "tqdm>=4.64",
        "rosbags>=0.10",
        "safetensors>=0.4",
        "torch>=2.2",
    ],
    extras_require={"test": ["pytest>=7", "gpytorch>=1.11"], "bench": ["gpytorch>=1.11"]},
    zip_safe=True,
    maintainer="gp_mapping team",
    maintainer_email="team@gp-mapping.dev",
    description=(
        "Online Gaussian-process mapping of the magnetic field from a magnetometer and the robot's pose, "
        "with offline bag replay."
    ),
    license="Apache-2.0",
    python_requires=">=3.10",
    entry_points={
        "console_scripts": [
            "gp-mapping = gp_mapping.cli:main",
            "mapper = gp_mapping.ros.mapper_node:main",
            "lifecycle_mapper = gp_mapping.ros.mapper_node:lifecycle_main",
            "merger = gp_mapping.ros.merger_node:main",
            "localizer = gp_mapping.ros.localizer_node:main",
            "lifecycle_localizer = gp_mapping.ros.localizer_node:lifecycle_main",
        ],
    },
)
