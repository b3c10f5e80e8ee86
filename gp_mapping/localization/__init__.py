"""Localization on a saved magnetic map: a particle filter over (x, y, yaw) and a magnetometer offset, with the
GP map's predictive mean and reading variance as its measurement model and odometry as its motion model (in the
style of nav2's AMCL; Solin et al. 2016, "Terrain navigation in the magnetic landscape"). No ROS import here:
the node in ``ros/`` and ``gp-mapping localize`` both drive :class:`Localizer`.

* :mod:`~gp_mapping.localization.config`: :class:`LocalizerConfig` (validated settings) and the errors;
* :mod:`~gp_mapping.localization.field_map`: :class:`MagneticMap`, the lookup grid of a saved map (bilinear);
* :mod:`~gp_mapping.localization.motion`: AMCL's odometry motion model and SE(2) helpers;
* :mod:`~gp_mapping.localization.filter`: :class:`ParticleFilter` (Rao-Blackwellised offset, systematic
  resampling) and :class:`PoseEstimate`;
* :mod:`~gp_mapping.localization.localizer`: :class:`Localizer`, streams in, estimates out, bad input counted;
* :mod:`~gp_mapping.localization.cli`: ``gp-mapping localize BAG --map STATE --out DIR``.
"""
from gp_mapping.localization.config import (ConfigError, LocalizationError, LocalizerConfig, MapLoadError,
                                            config_from_dict, field_specs, load_localizer_config)
from gp_mapping.localization.field_map import MagneticMap, reading_moments
from gp_mapping.localization.filter import ParticleFilter, PoseEstimate
from gp_mapping.localization.localizer import REJECTION_REASONS, Localizer

__all__ = ["ConfigError", "LocalizationError", "Localizer", "LocalizerConfig", "MagneticMap", "MapLoadError",
           "ParticleFilter", "PoseEstimate", "REJECTION_REASONS", "config_from_dict", "field_specs",
           "load_localizer_config", "reading_moments"]
