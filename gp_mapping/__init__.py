"""gp_mapping: online Gaussian-process maps of the magnetic field for ROS 2 robots."""

__version__ = "0.2.0"
