"""The nodes' parameters: declared from a config schema, validated at start and on every live change.

A node's parameters are a :class:`ParameterSchema`: the dataclass fields of its settings by ROS name (type,
default, description, range), the function that builds the settings from parameter values (refusing unknown keys
and bad values by name), the one that flattens them back, and the live set. :class:`ConfigParameters` declares
them with descriptors (:func:`parameter_descriptor`), validates them at start (a bad value or an unknown key
stops the node with a message naming it, exit status 2) and on every live change (refused with the reason, the
old value stays).

The mapping node's schema (:data:`MAPPER_SCHEMA`): every key of ``config/mapper.yaml`` (``model.*``, ``sync.*``,
``batching.*``, ``grid.*``, ``node.*``), validated by :mod:`gp_mapping.config`. Only :data:`LIVE_PARAMETERS` can
change while it runs; the others are read-only because the model, the sync, the grid lattice or the
subscriptions are built from them at start. The localizer node's schema is in
:mod:`gp_mapping.ros.localizer_node`.
"""
from __future__ import annotations

import array
import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from rcl_interfaces.msg import (FloatingPointRange, IntegerRange, ParameterDescriptor, ParameterType,
                                SetParametersResult)

from gp_mapping.config import (ROS_RESERVED_KEYS, ConfigError, config_from_dict, describe_allowed,
                               field_specs, shorten, to_flat_parameters, validate_value)
from gp_mapping.mapping.grid import check_grid_config
from gp_mapping.ros.process import NodeStartError

# Parameters the running node applies when they change (the Mapper reads them at every prediction); every
# other one is declared read-only because the model, the sync, the grid lattice or the subscriptions are built
# from it at start.
LIVE_PARAMETERS = frozenset({"node.publish_period", "grid.unknown_distance", "grid.tile_size", "grid.margin",
                             "grid.window", "grid.height",
                             "grid.mean_range", "grid.variance_range", "node.initial_map", "node.new_session_on_load",
                             "node.map_directory",
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


def parameter_descriptor(name: str, spec: dataclasses.Field,
                         live: frozenset[str] = LIVE_PARAMETERS) -> ParameterDescriptor:
    """The ROS descriptor of one config field: type, description, allowed values, range, read-only (unless
    ``name`` is in ``live``)."""
    ftype = _type_name(spec)
    meta = spec.metadata
    allowed = describe_allowed(meta, ftype)
    descriptor = ParameterDescriptor(name=name, type=_PARAMETER_TYPES[ftype], description=meta["doc"],
                                     additional_constraints=allowed, read_only=name not in live)
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


def _check_grid_changes(node: Any, changes: Mapping[str, Any]) -> None:
    """The rules between grid keys (window cells, unknown_distance within the window) for a live change of
    ``grid.*`` keys, against the values accepted so far (the shared config follows on the update thread)."""
    grid_changes = {name.split(".", 1)[1]: value for name, value in changes.items() if name.startswith("grid.")}
    if not grid_changes:
        return
    current = {name.split(".", 1)[1]: validate_value(name, plain(node.get_parameter(name).value), node._specs[name])
               for name in LIVE_PARAMETERS if name.startswith("grid.")}
    check_grid_config(dataclasses.replace(node.config.grid, **{**current, **grid_changes}))


@dataclass(frozen=True)
class ParameterSchema:
    """What a node's parameters are: ``specs()`` (ROS name -> dataclass field), ``build(values)`` (the settings
    from a mapping of ROS names to values; ConfigError naming a bad or unknown key), ``flatten(settings)`` (ROS
    name -> value), the ``live`` names, and ``check(node, changes)``: rules between keys of one live change
    (ConfigError), beside each key's own validation."""

    specs: Callable[[], dict[str, dataclasses.Field]]
    build: Callable[[Mapping[str, Any]], Any]
    flatten: Callable[[Any], dict[str, Any]]
    live: frozenset[str] = frozenset()
    check: Callable[[Any, Mapping[str, Any]], None] | None = None


MAPPER_SCHEMA = ParameterSchema(field_specs, config_from_dict, to_flat_parameters, LIVE_PARAMETERS,
                                _check_grid_changes)


class ConfigParameters:
    """Mixin of an rclpy node whose parameters are a :class:`ParameterSchema` (``parameter_schema``, the mapping
    node's :data:`MAPPER_SCHEMA` unless the node names another): declares them (:meth:`_declare_parameters`),
    re-reads them (:meth:`_read_parameters`), and checks every live change before it is accepted. An accepted
    live value goes to the node's ``_apply_live_parameter(name, value)``."""

    parameter_schema: ParameterSchema = MAPPER_SCHEMA

    def _setup_parameters(self) -> None:
        """Declare and validate the parameters (a bad one raises NodeStartError) and the live-change hooks."""
        self._specs = self.parameter_schema.specs()
        self.config = self._declare_parameters()
        self.add_pre_set_parameters_callback(self._coerce_parameter_types)
        self.add_on_set_parameters_callback(self._validate_parameter_change)
        self.add_post_set_parameters_callback(self._apply_parameter_change)

    def _declare_parameters(self) -> Any:
        """Validate the overrides (params file, -p) with the schema, then declare every parameter."""
        schema = self.parameter_schema
        # rclpy offers no public accessor for the overrides it parsed; they are needed to refuse unknown keys
        # (rclpy would silently ignore them) before anything is declared.
        overrides = {name: plain(p.value) for name, p in self._parameter_overrides.items()
                     if name.split(".")[0] not in ROS_RESERVED_KEYS}
        try:
            config = schema.build(overrides)
        except ConfigError as err:
            raise NodeStartError(f"bad parameter: {err}") from err
        for name, value in schema.flatten(config).items():
            # The validated value (ints written for floats are converted) wins over the raw override.
            self.declare_parameter(name, value, parameter_descriptor(name, self._specs[name], schema.live),
                                   ignore_override=True)
        return config

    def _read_parameters(self) -> Any:
        """The config of the parameters' current values (a lifecycle node configured again after a cleanup)."""
        values = {name: plain(self.get_parameter(name).value) for name in self._specs}
        try:
            return self.parameter_schema.build(values)
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
        changes = {}
        for param in params:
            spec = self._specs.get(param.name)
            if spec is None:
                continue
            try:
                changes[param.name] = validate_value(param.name, plain(param.value), spec)
            except ConfigError as err:
                return SetParametersResult(successful=False, reason=str(err))
        check = self.parameter_schema.check
        if changes and check is not None:
            try:
                check(self, changes)
            except ConfigError as err:
                return SetParametersResult(successful=False, reason=str(err))
        return SetParametersResult(successful=True)

    def _apply_parameter_change(self, params: list) -> None:
        for param in params:
            if param.name not in self.parameter_schema.live:
                continue
            value = validate_value(param.name, plain(param.value), self._specs[param.name])
            self._apply_live_parameter(param.name, value)
            self.get_logger().info(f"parameter {param.name} = {shorten(repr(value))} applied")

    def _apply_live_parameter(self, name: str, value: Any) -> None:
        """Take an accepted value of a live parameter (the node decides when and on which thread)."""
        raise NotImplementedError
