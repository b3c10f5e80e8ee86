"""Map state files: the whole mapper in one safetensors file that cannot execute code when loaded.

Layout. Tensors ``model/<name>`` hold the model's ``state_dict``; tensors ``mapper/<name>`` the mapper's arrays
(coverage cells, trajectory, samples waiting for an update, recent update times). The safetensors metadata
(strings) holds ``format``, ``schema_version``, ``config`` (the MapperConfig as JSON), ``info`` (counters and
scalars as JSON) and ``checksum`` (SHA-256 over every tensor's name, dtype, shape and bytes), so truncation and
corruption are caught on load. Writes are atomic: a temporary file in the same folder, fsync, ``os.replace``.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import stat
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

FORMAT = "gp_mapping.map_state"
SCHEMA_VERSION = 2  # 2: engines keep running target statistics and Adam moments
MODEL_PREFIX = "model/"
MAPPER_PREFIX = "mapper/"


#: Why a state file is refused (``MapStateError.reason``): each refusal names one.
STATE_ERROR_REASONS = (
    "unreadable",          # cannot be opened or read, or changed while read
    "not_regular_file",    # a device, FIFO, socket or folder
    "too_large",           # larger than any map state can be
    "truncated",           # shorter than its header says
    "corrupt_header",      # the header is not JSON, or a tensor entry is malformed
    "header_too_deep",     # JSON nested deeper than any map state's (a hostile file)
    "bad_offsets",         # tensor offsets that are not byte positions in the file (huge, negative, non-integer)
    "not_map_state",       # a safetensors file of something else
    "schema",              # another schema version
    "checksum",            # the contents do not match the checksum
    "metadata",            # missing metadata or metadata of the wrong type
    "non_finite",          # a tensor holds NaN (or an infinity where none belongs)
    "shape",               # a tensor's shape or type does not fit the config
    "frame_mismatch",      # made in another map frame (grid.frame_id) than the node's
    "unit_mismatch",       # made in another field unit (sync.field_unit) than the node's
    "config_mismatch",     # made with another state-defining config key
    "model_mismatch",      # the model built from the config does not take the tensors
    "model_fails",         # the loaded model does not predict finite values
    "write_failed",        # (writing) the file cannot be written
)


class MapStateError(RuntimeError):
    """A map state file cannot be written, or is missing, truncated, corrupt or from another schema/config.
    ``reason`` names the kind of problem (one of :data:`STATE_ERROR_REASONS`); the message says the rest."""

    def __init__(self, message: str, reason: str = "unreadable") -> None:
        super().__init__(message)
        self.reason = reason


@dataclass
class MapState:
    """Everything a state file holds, in memory."""

    config: dict[str, Any]
    model_state: dict[str, torch.Tensor]
    arrays: dict[str, np.ndarray] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)


def _checksum(tensors: dict[str, torch.Tensor]) -> str:
    digest = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        digest.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        flat = t.reshape(-1)
        if flat.dtype == torch.bfloat16:  # numpy has no bfloat16; hash the same bits as int16
            flat = flat.view(torch.int16)
        digest.update(flat.numpy().tobytes())
    return digest.hexdigest()


def _to_cpu_tensor(name: str, value: Any) -> torch.Tensor:
    if isinstance(value, np.ndarray):
        value = torch.from_numpy(np.ascontiguousarray(value))
    if not isinstance(value, torch.Tensor):
        raise MapStateError(f"cannot save '{name}': only tensors and arrays can be stored, got {type(value).__name__}",
                            "write_failed")
    # A private contiguous CPU copy: safetensors refuses tensors that share storage.
    return value.detach().to("cpu").contiguous().clone()


def write_state(path: str | os.PathLike, state: MapState) -> None:
    """Write ``state`` to ``path`` atomically (the old file, if any, stays intact until the new one is complete)."""
    from safetensors.torch import save

    path = Path(path)
    tensors = {MODEL_PREFIX + k: _to_cpu_tensor(MODEL_PREFIX + k, v) for k, v in state.model_state.items()}
    tensors.update({MAPPER_PREFIX + k: _to_cpu_tensor(MAPPER_PREFIX + k, v) for k, v in state.arrays.items()})
    try:
        metadata = {
            "format": FORMAT,
            "schema_version": str(SCHEMA_VERSION),
            "config": json.dumps(state.config, sort_keys=True),
            "info": json.dumps(state.info, sort_keys=True, allow_nan=False),
            "checksum": _checksum(tensors),
        }
    except (TypeError, ValueError) as err:
        raise MapStateError(f"cannot save map state to {path}: config or counters are not plain JSON: {err}",
                            "write_failed") from err
    payload = save(tensors, metadata=metadata)
    directory = path.parent if str(path.parent) else Path(".")
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=directory)
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(payload)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
        # Make the rename itself durable (not possible on every platform; the data is already synced).
        try:
            dir_fd = os.open(directory, os.O_RDONLY)
        except OSError:
            return
        try:
            os.fsync(dir_fd)
        except OSError:
            pass
        finally:
            os.close(dir_fd)
    except OSError as err:
        raise MapStateError(f"cannot write map state to {path}: {err}", "write_failed") from err


# Bounds checked before a byte of the payload is read (a map state is megabytes: a model of a few thousand
# inducing points, the coverage cells, a bounded pending queue and trajectory).
MAX_STATE_FILE_BYTES = 4 * 1024**3
MAX_HEADER_BYTES = 100 * 1024**2  # safetensors' own limit on the JSON header


def _json(text: str | bytes, path: Path, what: str) -> Any:
    """JSON of a header or metadata string, refused by name when it is not JSON, not a string, or nested deeper
    than the parser's recursion allows (a hostile file of a million brackets)."""
    if not isinstance(text, (str, bytes)):
        raise MapStateError(f"map state file {path} has a corrupt {what}: {type(text).__name__}, not a string",
                            "metadata")
    try:
        return json.loads(text)
    except RecursionError:
        raise MapStateError(f"map state file {path} has a {what} nested deeper than any map state's; refused",
                            "header_too_deep") from None
    except (ValueError, UnicodeDecodeError) as err:  # JSONDecodeError, digits beyond Python's int limit
        raise MapStateError(f"map state file {path} has a corrupt {what}: {str(err)[:200]}",
                            "corrupt_header" if what == "header" else "metadata") from None


def _offsets(entry: Any, name: str, path: Path) -> tuple[int, int]:
    """A header entry's ``data_offsets``: two integers 0 <= begin <= end (never floats, huge values or bools)."""
    if not isinstance(entry, dict):
        raise MapStateError(f"map state file {path} has a corrupt header: tensor entry {name[:80]!r} is not a "
                            "mapping", "corrupt_header")
    offsets = entry.get("data_offsets")
    ok = (isinstance(offsets, list) and len(offsets) == 2
          and all(isinstance(v, int) and not isinstance(v, bool) for v in offsets))
    if not ok or not 0 <= offsets[0] <= offsets[1] < 2**63:
        shown = repr(offsets)[:80]
        raise MapStateError(f"map state file {path} has impossible tensor offsets {shown} for {name[:80]!r} "
                            f"(two integers within the file are expected)", "bad_offsets")
    return offsets[0], offsets[1]


def _read_checked(path: Path) -> tuple[dict[str, Any], bytes]:
    """The metadata and the whole file, after checking (in this order, each refusal naming the problem) that
    ``path`` is a regular file no larger than MAX_STATE_FILE_BYTES, that its header length fits the file and
    MAX_HEADER_BYTES, that the header is JSON with gp_mapping metadata of this schema, and that the tensors it
    declares (integer offsets) fill the rest of the file exactly. Only then is the payload read."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))  # a FIFO must not block the open
    except (OSError, ValueError) as err:  # ValueError: a path with a NUL byte
        raise MapStateError(f"cannot read map state file {path}: {err}", "unreadable") from err
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise MapStateError(f"map state file {path} is not a regular file (a device, FIFO, socket or folder); "
                            f"refused without reading it", "not_regular_file")
    with os.fdopen(fd, "rb") as fh:
        size = st.st_size
        if size > MAX_STATE_FILE_BYTES:
            raise MapStateError(f"map state file {path} is {size / 1024**3:.1f} GiB, larger than the "
                                f"{MAX_STATE_FILE_BYTES / 1024**3:.0f} GiB any map state can be; refused without "
                                f"reading it", "too_large")
        if size < 8:
            raise MapStateError(f"map state file {path} is truncated: {size} bytes, not even a header length",
                                "truncated")
        n = int.from_bytes(fh.read(8), "little")
        if n <= 0 or 8 + n > size or n > MAX_HEADER_BYTES:
            why = "header length 0" if n == 0 else f"header of {n} bytes"
            raise MapStateError(f"map state file {path} is truncated or not a safetensors file ({why}, file of "
                                f"{size} bytes)", "truncated")
        header = _json(fh.read(n), path, "header")
        meta = header.get("__metadata__") if isinstance(header, dict) else None
        if not isinstance(meta, dict):
            raise MapStateError(f"{path} is a safetensors file without gp_mapping metadata; not a map state file",
                                "not_map_state")
        if meta.get("format") != FORMAT:
            raise MapStateError(f"{path} is not a gp_mapping map state file (format {str(meta.get('format'))[:80]!r})",
                                "not_map_state")
        if meta.get("schema_version") != str(SCHEMA_VERSION):
            raise MapStateError(f"{path} has map state schema version {str(meta.get('schema_version'))[:80]!r}; "
                                f"this gp_mapping reads version {SCHEMA_VERSION}", "schema")
        payload = size - 8 - n
        declared = max((_offsets(v, k, path)[1] for k, v in header.items() if k != "__metadata__"), default=0)
        if declared != payload:
            raise MapStateError(f"map state file {path} is truncated or corrupt: its header declares {declared} "
                                f"bytes of tensors, the file holds {payload}", "truncated")
        fh.seek(0)
        data = fh.read(size + 1)
    if len(data) != size:
        raise MapStateError(f"map state file {path} changed while it was read ({len(data)} bytes, {size} expected)",
                            "unreadable")
    return meta, data


def read_state(path: str | os.PathLike) -> MapState:
    """Read and verify a state file (header, checksum, metadata types); raises MapStateError naming the problem.
    What the contents mean is checked by :func:`check_state` against the config they are used with."""
    from safetensors.torch import load

    path = Path(path)
    meta, data = _read_checked(path)
    try:
        tensors = load(data)
    except Exception as err:  # safetensors raises its own error type for every malformed payload
        raise MapStateError(f"map state file {path} is truncated or corrupt: {err}", "truncated") from err
    if _checksum(tensors) != meta.get("checksum"):
        raise MapStateError(f"map state file {path} is corrupt: its checksum does not match its contents",
                            "checksum")
    if "config" not in meta or "info" not in meta:
        raise MapStateError(f"map state file {path} has missing metadata: "
                            f"{', '.join(k for k in ('config', 'info') if k not in meta)}", "metadata")
    config = _json(meta["config"], path, "config")
    info = _json(meta["info"], path, "info")
    for name, value in (("config", config), ("info", info)):
        if not isinstance(value, dict):
            raise MapStateError(f"map state file {path} has malformed metadata: {name} is a "
                                f"{type(value).__name__}, not a mapping", "metadata")
    model_section = config.get("model")
    if isinstance(model_section, dict):
        # written before these keys existed: its model is what it was then, whatever the defaults are now (one
        # kernel; white noise alone)
        config["model"] = {"kernel_scales": 1, "time_error": False, **model_section}
    model_state = {k[len(MODEL_PREFIX):]: v for k, v in tensors.items() if k.startswith(MODEL_PREFIX)}
    arrays = {k[len(MAPPER_PREFIX):]: v.numpy() for k, v in tensors.items() if k.startswith(MAPPER_PREFIX)}
    other = [k for k in tensors if not k.startswith((MODEL_PREFIX, MAPPER_PREFIX))]
    if other:
        raise MapStateError(f"map state file {path} holds tensors outside model/ and mapper/: "
                            f"{', '.join(repr(k[:80]) for k in other[:5])}", "shape")
    return MapState(config=config, model_state=model_state, arrays=arrays, info=info)


# --------------------------------------------------------------------------------- what the contents mean

_COUNTERS = ("accepted", "poses_accepted", "dropped", "dropped_overflow", "dropped_failed_update", "dropped_spikes",
             "teleports", "reanchors", "pauses", "frame_relatches", "updates", "failed_updates", "jitter_escalations",
             "checkpoints", "catch_up_updates", "catch_up_samples", "largest_batch")
_REQUIRED_INFO = ("accepted", "poses_accepted", "dropped", "updates", "rejected", "last_stamp",
                  "coverage_resolution", "trajectory_spacing")
_OTHER_INFO = ("last_position", "source_id", "lineage", "sync")
MAX_COUNT = 2**63 - 1
# mapper/<name>: (dtype kind, trailing shape with "D" / "P" for the input / output dimensions, rows group). Arrays of
# one group have as many rows.
_ARRAYS = {
    "coverage_cells": ("i", (2,), "cells"), "trajectory": ("f", (2,), "trajectory"),
    "update_seconds": ("f", (), "times"),
    "pending_x": ("f", ("D",), "pending"), "pending_y": ("f", ("P",), "pending"), "pending_t": ("f", (), "pending"),
    "pending_position": ("f", (3,), "pending"),
    "sync_pose_t": ("f", (), "poses"), "sync_pose_p": ("f", (3,), "poses"), "sync_pose_q": ("f", (4,), "poses"),
    "sync_pose_jump": ("b", (), "poses"), "sync_waiting_t": ("f", (), "waiting"),
    "sync_waiting_b": ("f", (3,), "waiting"),
}
_REQUIRED_ARRAYS = ("coverage_cells", "trajectory", "update_seconds", "pending_x", "pending_y", "pending_t",
                    "pending_position")


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_COUNT


def _is_number(value: Any, positive: bool = False) -> bool:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    return ok and (not positive or value > 0)


def _check_info(info: dict[str, Any], path: Path) -> None:
    def bad(key: str, what: str) -> MapStateError:
        shown = repr(info.get(key))
        shown = shown if len(shown) <= 80 else shown[:80] + "..."
        return MapStateError(f"map state file {path} has malformed metadata: info.{key} = {shown}, expected "
                             f"{what}", "metadata")

    missing = [k for k in _REQUIRED_INFO if k not in info]
    if missing:
        raise MapStateError(f"map state file {path} has missing metadata: info.{', info.'.join(missing)}",
                            "metadata")
    unknown = [k for k in info if k not in _COUNTERS + _REQUIRED_INFO + _OTHER_INFO]
    if unknown:
        raise MapStateError(f"map state file {path} has unexpected metadata: info."
                            f"{', info.'.join(str(k)[:80] for k in unknown[:5])}", "metadata")
    for key in _COUNTERS:
        if key in info and not _is_count(info[key]):
            raise bad(key, "a count (an integer >= 0)")
    rejected = info["rejected"]
    if not isinstance(rejected, dict) or not all(isinstance(k, str) and _is_count(v) for k, v in rejected.items()):
        raise bad("rejected", "a mapping of reasons to counts")
    if info["last_stamp"] is not None and not _is_number(info["last_stamp"]):
        raise bad("last_stamp", "null or a finite number")
    for key in ("coverage_resolution", "trajectory_spacing"):
        if not _is_number(info[key], positive=True):
            raise bad(key, "a finite number > 0")
    last = info.get("last_position")
    if last is not None and not (isinstance(last, list) and len(last) == 2 and all(_is_number(v) for v in last)):
        raise bad("last_position", "null or two finite numbers")
    if "source_id" in info and not (isinstance(info["source_id"], str) and 0 < len(info["source_id"]) <= 256):
        raise bad("source_id", "a string of 1 to 256 characters")
    lineage = info.get("lineage", [])
    if not (isinstance(lineage, list) and all(isinstance(i, str) and len(i) <= 256 for i in lineage)):
        raise bad("lineage", "a list of source ids")
    sync = info.get("sync")
    if sync is not None:
        ok = isinstance(sync, dict) and isinstance(sync.get("field_frame", ""), str)
        ok = ok and all(sync.get(k) is None or _is_number(sync.get(k)) for k in ("last_field_stamp", "last_pose_stamp"))
        anchor = sync.get("anchor") if isinstance(sync, dict) else None
        ok = ok and (anchor is None or (isinstance(anchor, list) and len(anchor) == 2
                                        and all(_is_number(v) for v in anchor)))
        if not ok or not {"last_field_stamp", "last_pose_stamp", "field_frame"} <= set(sync):
            raise bad("sync", "the sync's stamps (null or finite), field frame (a string) and anchor")


def _finite(name: str, t: torch.Tensor, path: Path, infinities_allowed: bool = False) -> None:
    if not (t.is_floating_point() or t.is_complex()):
        return
    if bool(torch.isnan(t).any()) or (not infinities_allowed and not bool(torch.isfinite(t).all())):
        raise MapStateError(f"map state file {path}: tensor {name} holds non-finite values (NaN or infinity); a "
                            "map state never does; refused", "non_finite")


def _template_key(key: str, template: dict[str, torch.Tensor]) -> str | None:
    """The fresh model's tensor that ``key`` must resemble: the same name, or for a tile of a tiled map
    (``tiles.<index>.engine.<name>``) the tiled model's tile-less engine (``prior.<name>``)."""
    if key in template:
        return key
    head, sep, rest = key.partition(".engine.")
    if sep and head.startswith("tiles.") and "prior." + rest in template:
        return "prior." + rest
    return None


def check_state(state: MapState, path: str | os.PathLike, *, template: dict[str, torch.Tensor], input_dims: int,
                output_dims: int, saved: Any, reference: Any = None) -> None:
    """Check what a state file read by :func:`read_state` holds before anything uses it; MapStateError naming
    the problem (``reason``) otherwise. The one check of every loader (Mapper.load: the node's
    ``node.initial_map``, ``~/load_map`` and checkpoints, ``gp-mapping export`` and ``merge``, the reload of
    ``replay --save-state``).

    - ``reference`` (the config of the node that loads it, if any): the map frame (``grid.frame_id``) and field
      unit (``sync.field_unit``) of ``saved`` (the state's own config) must equal its, as merge requires.
    - metadata: every counter an integer >= 0, stamps finite or null, resolutions > 0, ids strings; no unknown
      key.
    - tensors: every floating tensor finite (an infinity only where the fresh model, ``template``, holds one);
      each model tensor of the dtype and rank of the fresh model's, with the same size on every axis where the
      fresh model's is not empty (empty axes grow with the data: inducing points, memory); a missing tensor is
      the engine's load_state_dict's to refuse (engines read older files); the mapper's arrays of their kind,
      with ``input_dims`` / ``output_dims`` columns and matching rows.
    """
    path = Path(path)
    if reference is not None:
        for (section, key), reason in ((("grid", "frame_id"), "frame_mismatch"),
                                       (("sync", "field_unit"), "unit_mismatch")):
            mine, theirs = getattr(getattr(reference, section), key), getattr(getattr(saved, section), key)
            if mine != theirs:
                raise MapStateError(f"map state file {path} was made with {section}.{key} = {str(theirs)[:80]!r}, "
                                    f"but this node has {str(mine)[:80]!r}; they must agree to reuse the map", reason)
    _check_info(state.info, path)
    for key, t in state.model_state.items():
        tkey = _template_key(key, template)
        fresh = template.get(tkey) if tkey is not None else None
        _finite(f"model/{key}", t, path,
                infinities_allowed=fresh is not None and fresh.is_floating_point()
                and not bool(torch.isfinite(fresh).all()))
        if fresh is None:
            continue
        ok = t.dtype == fresh.dtype and t.dim() == fresh.dim() and all(
            a == 0 or a == b for a, b in zip(fresh.shape, t.shape))
        if not ok:
            raise MapStateError(f"map state file {path}: tensor model/{key} is {t.dtype} {tuple(t.shape)}, but the "
                                f"model of its config holds {fresh.dtype} of shape {tuple(fresh.shape)} (0: any "
                                "size); refused", "shape")
    dims = {"D": input_dims, "P": output_dims}
    rows: dict[str, tuple[str, int]] = {}
    for name, a in state.arrays.items():
        spec = _ARRAYS.get(name)
        if spec is None:
            raise MapStateError(f"map state file {path} holds an unexpected array mapper/{name[:80]}", "shape")
        kind, tail, group = spec
        tail = tuple(dims.get(v, v) for v in tail)
        kind_ok = a.dtype.kind == kind or (kind == "f" and a.dtype.kind in "iu") or (kind == "i" and a.dtype.kind == "u")
        if not kind_ok or a.ndim != 1 + len(tail) or tuple(a.shape[1:]) != tail:
            raise MapStateError(f"map state file {path}: array mapper/{name} is {a.dtype} {a.shape}, expected rows "
                                f"of shape {tail} ({'floats' if kind == 'f' else 'integers' if kind == 'i' else 'booleans'})",
                                "shape")
        _finite(f"mapper/{name}", torch.from_numpy(np.ascontiguousarray(a)) if a.dtype.kind == "f" else
                torch.zeros(0), path)
        if group in rows and rows[group][1] != a.shape[0]:
            raise MapStateError(f"map state file {path}: arrays mapper/{rows[group][0]} and mapper/{name} have "
                                f"{rows[group][1]} and {a.shape[0]} rows; they go together", "shape")
        rows.setdefault(group, (name, a.shape[0]))
    missing = [k for k in _REQUIRED_ARRAYS if k not in state.arrays]
    if missing:
        raise MapStateError(f"map state file {path} lacks the arrays mapper/{', mapper/'.join(missing)}", "shape")


def check_model(model: Any, path: str | os.PathLike, points: np.ndarray, output_dims: int) -> None:
    """After the state is loaded into ``model``: its prediction at ``points`` (a few visited places, (G, D)) must
    be finite with a variance >= 0, else MapStateError ``model_fails`` (a posterior that cannot be used, e.g. a
    factor that is no longer positive definite). Numerical failures are part of the message, not a traceback. A
    model without data is its prior (not every engine predicts before its first update): not probed."""
    try:
        if int(model.num_seen) == 0:
            return
    except (TypeError, ValueError, RuntimeError):
        pass
    x = np.asarray(points, dtype=np.float64)
    try:
        with torch.no_grad():
            mean, var = model.predict(x)
        mean, var = torch.as_tensor(mean).cpu(), torch.as_tensor(var).cpu()
        ok = (tuple(mean.shape) == (x.shape[0], output_dims) and tuple(var.shape) == (x.shape[0], output_dims)
              and bool(torch.isfinite(mean).all()) and bool(torch.isfinite(var).all()) and bool((var >= 0).all()))
        why = "" if ok else "non-finite or negative values, or the wrong shape"
    except Exception as err:  # the engine's own numerical errors, whatever their type
        ok, why = False, f"{type(err).__name__}: {str(err)[:300]}"
    if not ok:
        raise MapStateError(f"map state file {path}: the model it holds cannot predict ({why}); refused",
                            "model_fails")
