"""The simulator: a magnetic world (Earth field plus steel dipoles), robot trajectories and a magnetometer,
deterministic by seed and ROS-free (:mod:`~gp_mapping.sim.simulation`), and the demo-bag writer that records a
simulation as a ROS 2 bag with its ground truth (:mod:`~gp_mapping.sim.demo_bag`, ``gp-mapping demo-bag``)."""
from gp_mapping.sim.simulation import (MU0, PATTERNS, SensorConfig, SimRecording, SimulationError, TrajectoryConfig,
                                       World, WorldConfig, dipole_field, earth_field, make_trajectory, simulate,
                                       truth_grid)

__all__ = ["MU0", "PATTERNS", "SimulationError", "earth_field", "dipole_field", "WorldConfig", "World",
           "TrajectoryConfig", "make_trajectory", "SensorConfig", "SimRecording", "simulate", "truth_grid"]
