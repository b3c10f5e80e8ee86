"""Everything a magnetic-field mapper needs that is not ROS: frames, time sync, grid, the Mapper, state files, map
files, merging, health."""
from gp_mapping.mapping.frames import (FrameError, normalize_quaternion, quaternion_from_rpy, quaternion_inverse,
                                       quaternion_multiply, quaternion_to_matrix, rotate_vectors, slerp)
from gp_mapping.mapping.grid import (Coverage, GridError, GridSpec, GridTooLargeError, decode_occupancy,
                                     encode_occupancy, fixed_grid_spec, predict_grid)
from gp_mapping.mapping.drawing import MapGrid, vector_layers
from gp_mapping.mapping.mapper import Mapper
from gp_mapping.mapping.measurements import (UNIT_PER_TESLA, UNIT_SYMBOL, Measurements, SyncError, field_scale,
                                             output_dims)
from gp_mapping.mapping.state import MapState, MapStateError, read_state, write_state
from gp_mapping.mapping.sync import POSE_REJECTION_REASONS, REJECTION_REASONS, SAMPLE_REJECTION_REASONS, MeasurementSync

__all__ = [
    "Coverage", "FrameError", "GridError", "GridSpec", "GridTooLargeError", "MapGrid", "MapState", "MapStateError",
    "Mapper", "MeasurementSync", "Measurements", "POSE_REJECTION_REASONS", "REJECTION_REASONS",
    "SAMPLE_REJECTION_REASONS", "SyncError", "UNIT_PER_TESLA", "UNIT_SYMBOL",
    "decode_occupancy", "encode_occupancy", "field_scale", "fixed_grid_spec", "normalize_quaternion",
    "output_dims", "predict_grid", "quaternion_from_rpy", "quaternion_inverse", "quaternion_multiply",
    "quaternion_to_matrix", "read_state", "rotate_vectors", "slerp", "vector_layers", "write_state",
]
