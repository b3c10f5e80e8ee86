"""The mapping node's parameters: declared from the config, validated at start and on every live change.

Every key of ``config/mapper.yaml`` (``model.*``, ``sync.*``, ``batching.*``, ``grid.*``, ``node.*``) is a
parameter, declared with type, description and range (:func:`parameter_descriptor`) and validated by
:mod:`gp_mapping.config` at start (a bad value or an unknown key stops the node with a message naming it, exit
status 2) and on every live change (refused with the reason, the old value stays). Only :data:`LIVE_PARAMETERS`
can change while the node runs; the others are read-only because the model, the sync, the grid lattice or the
subscriptions are built from them at start.
"""
from __future__ import annotations

import array
import dataclasses
import math
from typing import Any

from rcl_interfaces.msg import (FloatingPointRange, IntegerRange, ParameterDescriptor, ParameterType,
                                SetParametersResult)

from gp_mapping.config import (ROS_RESERVED_KEYS, ConfigError, MapperConfig, config_from_dict, describe_allowed,
                               field_specs, shorten, to_flat_parameters, validate_value)
from gp_mapping.mapping.grid import check_grid_config
from gp_mapping.ros.process import NodeStartError

# Parameters the running node applies when they change (the Mapper reads them at every prediction); every
# other one is declared read-only because the model, the sync, the grid lattice or the subscriptions are built
# from it at start.
LIVE_PARAMETERS = frozenset({"node.publish_period", "grid.unknown_distance", "grid.tile_size", "grid.margin",
                             "grid.window", "grid.height",
                             "grid.mean_range", "grid.variance_range", "node.initial_map", "node.map_directory",
                             "node.stale_after", "node.stale_level_after", "node.expected_mag_rate",
                             "node.expected_pose_rate", "node.max_refused_share", "node.diagnostics_window"})

_PARAMETER_TYPES = {"bool": ParameterType.PARAMETER_BOOL, "int": ParameterType.PARAMETER_INTEGER,
                    "float": ParameterType.PARAMETER_DOUBLE, "str": ParameterType.PARAMETER_STRING,
                    "list": ParameterType.PARAMETER_DOUBLE_ARRAY}


def plain(value: Any) -> Any:
    """A parameter value as plain Python (rclpy hands arrays as array.array)."""
    if isinstance(value, (array.array, tuple)):
        return list(value)
    return value


def _type_name(spec: dataclasses.Field) -> str:
    return spec.type if isinstance(spec.type, str) else spec.type.__name__


def parameter_descriptor(name: str, spec: dataclasses.Field) -> ParameterDescriptor:
    """The ROS descriptor of one config field: type, description, allowed values, range, read-only."""
    ftype = _type_name(spec)
    meta = spec.metadata
    allowed = describe_allowed(meta, ftype)
    descriptor = ParameterDescriptor(name=name, type=_PARAMETER_TYPES[ftype], description=meta["doc"],
                                     additional_constraints=allowed, read_only=name not in LIVE_PARAMETERS)
    if ftype == "list" and isinstance(meta.get("length"), tuple) and 0 in meta["length"]:
        # rclpy types an empty list as a byte array and would then refuse numbers; the config validation
        # checks the values instead.
        descriptor.dynamic_typing = True
    low, high = meta.get("low"), meta.get("high")
    if ftype == "float" and low is not None and high is not None:
        # ROS ranges are closed; an open lower bound (low_open) is enforced by the config validation.
        descriptor.floating_point_range = [FloatingPointRange(from_value=float(low), to_value=float(high), step=0.0)]
    elif ftype == "int" and low is not None and high is not None:
        descriptor.integer_range = [IntegerRange(from_value=int(low), to_value=int(high), step=1)]
    return descriptor


class ConfigParameters:
    """Mixin of an rclpy node whose parameters are a :class:`~gp_mapping.config.MapperConfig`: declares them
    (:meth:`_declare_parameters`), re-reads them (:meth:`_read_parameters`), and checks every live change before
    it is accepted. An accepted live value goes to the node's ``_apply_live_parameter(name, value)``."""

    def _setup_parameters(self) -> None:
        """Declare and validate the parameters (a bad one raises NodeStartError) and the live-change hooks."""
        self._specs = field_specs()
        self.config = self._declare_parameters()
        self.add_pre_set_parameters_callback(self._coerce_parameter_types)
        self.add_on_set_parameters_callback(self._validate_parameter_change)
        self.add_post_set_parameters_callback(self._apply_parameter_change)

    def _declare_parameters(self) -> MapperConfig:
        """Validate the overrides (params file, -p) with the config module, then declare every parameter."""
        # rclpy offers no public accessor for the overrides it parsed; they are needed to refuse unknown keys
        # (rclpy would silently ignore them) before anything is declared.
        overrides = {name: plain(p.value) for name, p in self._parameter_overrides.items()
                     if name.split(".")[0] not in ROS_RESERVED_KEYS}
        try:
            config = config_from_dict(overrides)
        except ConfigError as err:
            raise NodeStartError(f"bad parameter: {err}") from err
        for name, value in to_flat_parameters(config).items():
            # The validated value (ints written for floats are converted) wins over the raw override.
            self.declare_parameter(name, value, parameter_descriptor(name, self._specs[name]),
                                   ignore_override=True)
        return config

    def _read_parameters(self) -> MapperConfig:
        """The config of the parameters' current values (a lifecycle node configured again after a cleanup)."""
        values = {name: plain(self.get_parameter(name).value) for name in self._specs}
        try:
            return config_from_dict(values)
        except ConfigError as err:
            raise NodeStartError(f"bad parameter: {err}") from err

    def _coerce_parameter_types(self, params: list) -> list:
        """Before ROS checks the types of a live change: an integer for a float parameter (``3`` for 3.0) becomes
        that float, and a whole float for an integer parameter that integer, as at start (the config
        validation converts them there); anything else is left for the validation to refuse by name."""
        from rclpy.parameter import Parameter

        out = []
        for param in params:
            spec = self._specs.get(param.name)
            ftype = None if spec is None else _type_name(spec)
            value = param.value
            if ftype == "float" and param.type_ == Parameter.Type.INTEGER:
                param = Parameter(param.name, Parameter.Type.DOUBLE, float(value))
            elif ftype == "int" and param.type_ == Parameter.Type.DOUBLE and math.isfinite(value) \
                    and float(value).is_integer():
                param = Parameter(param.name, Parameter.Type.INTEGER, int(value))
            elif ftype == "list" and param.type_ == Parameter.Type.INTEGER_ARRAY:
                param = Parameter(param.name, Parameter.Type.DOUBLE_ARRAY, [float(v) for v in value])
            out.append(param)
        return out

    def _validate_parameter_change(self, params: list) -> SetParametersResult:
        grid_changes = {}
        for param in params:
            spec = self._specs.get(param.name)
            if spec is None:
                continue
            try:
                value = validate_value(param.name, plain(param.value), spec)
            except ConfigError as err:
                return SetParametersResult(successful=False, reason=str(err))
            section, _, key = param.name.partition(".")
            if section == "grid":
                grid_changes[key] = value
        if grid_changes:  # the rules between grid keys (window cells, unknown_distance within the window)
            # The parameters hold the values accepted so far (the shared config follows on the update thread).
            current = {name.split(".", 1)[1]: validate_value(name, plain(self.get_parameter(name).value),
                                                             self._specs[name])
                       for name in LIVE_PARAMETERS if name.startswith("grid.")}
            try:
                check_grid_config(dataclasses.replace(self.config.grid, **{**current, **grid_changes}))
            except ConfigError as err:
                return SetParametersResult(successful=False, reason=str(err))
        return SetParametersResult(successful=True)

    def _apply_parameter_change(self, params: list) -> None:
        for param in params:
            if param.name not in LIVE_PARAMETERS:
                continue
            value = validate_value(param.name, plain(param.value), self._specs[param.name])
            self._apply_live_parameter(param.name, value)
            self.get_logger().info(f"parameter {param.name} = {shorten(repr(value))} applied")

    def _apply_live_parameter(self, name: str, value: Any) -> None:
        """Take an accepted value of a live parameter (the node decides when and on which thread)."""
        raise NotImplementedError
