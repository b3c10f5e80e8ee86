"""Write docs/parameters.md, the parameter reference, from the configuration schema.

The schema is what the nodes declare their parameters from: the dataclass fields of :mod:`gp_mapping.config`
(``field_specs()``; the ``model`` section's are in :mod:`gp_mapping.gp.config`) with the live set of
:mod:`gp_mapping.ros.parameters`, the merger node's parameter table, and the localizer's settings
(:mod:`gp_mapping.localization.config`). So the page cannot drift from the code: ``test/integration/test_docs.py`` fails
when the committed page differs from what this writes.

    python -m gp_mapping.tools.param_reference            # rewrite docs/parameters.md
    python -m gp_mapping.tools.param_reference --check    # exit 1 when docs/parameters.md is stale
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import Any, Iterable

from gp_mapping.config import describe_allowed, field_specs

PAGE = Path(__file__).resolve().parents[2] / "docs" / "parameters.md"

SECTION_TITLES = {
    "model": "the GP engine ([engines.md](engines.md))",
    "sync": "time sync, frames and input checks ([robot.md](robot.md))",
    "batching": "batches of samples",
    "grid": "the published grid ([node.md](node.md), [large_areas.md](large_areas.md))",
    "node": "the mapping node ([node.md](node.md))",
}
# The model section's keys grouped by the engine or feature they belong to: by key prefix, else by the engine
# the key's description names first.
MODEL_GROUPS = (
    ("calibration", "Calibrated variance of a reading ([calibration.md](calibration.md))", ("calibration",), ()),
    ("tile_", "Tiles: local submaps ([large_areas.md](large_areas.md))", ("tile_",), ()),
    ("continual_mogp", "continual_mogp only", (), ("continual_mogp:",)),
    ("smc_", "smc_experts only", ("smc_", "gate_on_time"), ("smc_experts",)),
    ("vargp_", "var_gp only", ("vargp_",), ()),
)


def _type_name(spec: dataclasses.Field) -> str:
    return spec.type if isinstance(spec.type, str) else spec.type.__name__


def _default(spec: dataclasses.Field) -> Any:
    return spec.default if spec.default is not dataclasses.MISSING else spec.default_factory()


def _literal(value: Any) -> str:
    """A value as it is written in the YAML."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_literal(v) for v in value) + "]"
    return repr(value)


def _cell(text: str) -> str:
    """Text for a table cell inside backticks."""
    return str(text).replace("|", "\\|").replace("\n", " ")


def _prose(text: str) -> str:
    """Text for a table cell outside backticks: ``<name>`` must not read as an HTML tag."""
    return _cell(text).replace("<", "&lt;").replace(">", "&gt;")


def _row(name: str, spec: dataclasses.Field, live: str) -> str:
    ftype = _type_name(spec)
    allowed = describe_allowed(spec.metadata, ftype)
    return (f"| `{name}` | {ftype} | `{_cell(_literal(_default(spec)))}` | {_prose(allowed)} | {live} | "
            f"{_prose(spec.metadata['doc'])} |")


HEADER = "| key | type | default | allowed | live | meaning |\n|---|---|---|---|---|---|"


def _model_group(key: str, doc: str) -> str:
    for group, _title, prefixes, doc_prefixes in MODEL_GROUPS:
        if key.startswith(prefixes) or (doc_prefixes and doc.startswith(doc_prefixes)):
            return group
    return ""


def _mapper_sections(live: Iterable[str]) -> list[str]:
    live = set(live)
    specs = field_specs()
    lines: list[str] = []
    for section, title in SECTION_TITLES.items():
        names = [n for n in specs if n.split(".")[0] == section]
        lines += [f"### `{section}`: {title}", ""]
        groups: dict[str, list[str]] = {}
        for name in names:
            key = name.split(".", 1)[1]
            group = _model_group(key, specs[name].metadata["doc"]) if section == "model" else ""
            groups.setdefault(group, []).append(name)
        order = [("", "")] + [(g, t) for g, t, _p, _d in MODEL_GROUPS]
        for group, group_title in order:
            if group not in groups:
                continue
            if group:
                lines += [f"#### {group_title}", ""]
            lines.append(HEADER)
            lines += [_row(n, specs[n], "yes" if n in live else "no") for n in groups[group]]
            lines.append("")
    return lines


def _merger_section() -> list[str]:
    from rcl_interfaces.msg import ParameterType

    from gp_mapping.ros.merger_node import _PARAMETERS

    kinds = {ParameterType.PARAMETER_STRING_ARRAY: "string array", ParameterType.PARAMETER_DOUBLE: "float",
             ParameterType.PARAMETER_INTEGER: "int", ParameterType.PARAMETER_STRING: "str",
             ParameterType.PARAMETER_BOOL: "bool"}
    lines = ["| parameter | type | default | live | meaning |", "|---|---|---|---|---|"]
    for name, (default, kind, doc) in _PARAMETERS.items():
        lines.append(f"| `{name}` | {kinds.get(kind, str(kind))} | `{_cell(_literal(default))}` | no | {_prose(doc)} |")
    return lines


def _localizer_section() -> list[str]:
    try:
        from gp_mapping.localization.config import field_specs as localizer_specs, node_field_specs
        from gp_mapping.ros.localizer_node import LIVE_PARAMETERS as LOCALIZER_LIVE
    except ImportError:  # pragma: no cover - a checkout without the localizer
        return []

    def rows(specs: dict[str, dataclasses.Field]) -> list[str]:
        return [HEADER] + [_row(name, spec, "yes" if name in LOCALIZER_LIVE else "no") for name, spec in specs.items()]
    return (["### The node (`ros2 run gp_mapping localizer`; `gp-mapping localize` skips these)", ""]
            + rows(node_field_specs())
            + ["", "### The particle filter (the node and `gp-mapping localize`)", ""] + rows(localizer_specs()))


def render() -> str:
    """The whole page, as written to docs/parameters.md."""
    from gp_mapping.ros.parameters import LIVE_PARAMETERS

    lines = [
        "# Parameter reference",
        "",
        "<!-- Generated by `python -m gp_mapping.tools.param_reference` from the configuration schema; do not edit."
        " test/integration/test_docs.py fails when this page is stale. -->",
        "",
        "Every key of `config/mapper.yaml`, the one file the mapping node (`--params-file`), the launch files, "
        "`gp-mapping replay --config` and the benchmarks read. Keys are ROS parameter names (`section.key`); in "
        "the YAML they nest under `/**: ros__parameters:`. A bad value or an unknown key is refused with a message "
        "that names the key: at start the node exits with status 2, a command with status 1.",
        "",
        "**live**: *yes* means `ros2 param set` changes it while the node runs (validated first; a refused value "
        "leaves the old one). The others are read-only parameters: the model, the sync, the grid's lattice and "
        "the subscriptions are built from them at start. Allowed ranges in `[a, b]` include both ends, `(a, b]` "
        "excludes a.",
        "",
        "## The mapping node, the replay and the benchmarks (`config/mapper.yaml`)",
        "",
    ]
    lines += _mapper_sections(LIVE_PARAMETERS)
    lines += [
        "## The merger node (`ros2 run gp_mapping merger`)",
        "",
        "Plain parameter names (no section), all read at start ([merging.md](merging.md)). A bad value stops the node "
        "with exit status 2, naming it.",
        "",
    ]
    lines += _merger_section()
    localizer = _localizer_section()
    if localizer:
        lines += [
            "",
            "## The localizer (`config/localizer.yaml`)",
            "",
            "The `localizer` section of a ROS parameter file (or of any YAML, or its keys alone), read by the localizer "
            "node (parameters `localizer.<key>`, `--params-file config/localizer.yaml`) and by `gp-mapping localize "
            "--config FILE` ([localization.md](localization.md)). **live**: as for the mapping node; the filter's keys "
            "are read at start (the command reads them once). Units: metres, radians, seconds and the map's field unit.",
            "",
        ]
        lines += localizer
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when the page differs from the schema")
    parser.add_argument("--out", type=Path, default=PAGE, help=f"the page to write (default: {PAGE})")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        current = args.out.read_text() if args.out.exists() else ""
        if current != text:
            print(f"{args.out} is stale: run python -m gp_mapping.tools.param_reference", file=sys.stderr)
            return 1
        return 0
    args.out.write_text(text)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
