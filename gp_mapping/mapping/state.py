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
import os
import stat
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

FORMAT = "gp_mapping.map_state"
SCHEMA_VERSION = 2  # 2: engines keep running target statistics and Adam moments (issue 13)
MODEL_PREFIX = "model/"
MAPPER_PREFIX = "mapper/"


class MapStateError(RuntimeError):
    """A map state file cannot be written, or is missing, truncated, corrupt or from another schema/config."""


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
        raise MapStateError(f"cannot save '{name}': only tensors and arrays can be stored, got {type(value).__name__}")
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
        raise MapStateError(f"cannot save map state to {path}: config or counters are not plain JSON: {err}") from err
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
        raise MapStateError(f"cannot write map state to {path}: {err}") from err


# Bounds checked before a byte of the payload is read (a map state is megabytes: a model of a few thousand
# inducing points, the coverage cells, a bounded pending queue and trajectory).
MAX_STATE_FILE_BYTES = 4 * 1024**3
MAX_HEADER_BYTES = 100 * 1024**2  # safetensors' own limit on the JSON header


def _read_checked(path: Path) -> tuple[dict[str, Any], bytes]:
    """The metadata and the whole file, after checking (in this order, each refusal naming the problem) that
    ``path`` is a regular file no larger than MAX_STATE_FILE_BYTES, that its header length fits the file and
    MAX_HEADER_BYTES, that the header is JSON with gp_mapping metadata of this schema, and that the tensors it
    declares fill the rest of the file exactly. Only then is the payload read."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))  # a FIFO must not block the open
    except OSError as err:
        raise MapStateError(f"cannot read map state file {path}: {err}") from err
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise MapStateError(f"map state file {path} is not a regular file (a device, FIFO, socket or folder); "
                            f"refused without reading it")
    with os.fdopen(fd, "rb") as fh:
        size = st.st_size
        if size > MAX_STATE_FILE_BYTES:
            raise MapStateError(f"map state file {path} is {size / 1024**3:.1f} GiB, larger than the "
                                f"{MAX_STATE_FILE_BYTES / 1024**3:.0f} GiB any map state can be; refused without "
                                f"reading it")
        if size < 8:
            raise MapStateError(f"map state file {path} is truncated: {size} bytes, not even a header length")
        n = int.from_bytes(fh.read(8), "little")
        if n <= 0 or 8 + n > size or n > MAX_HEADER_BYTES:
            why = "header length 0" if n == 0 else f"header of {n} bytes"
            raise MapStateError(f"map state file {path} is truncated or not a safetensors file ({why}, file of "
                                f"{size} bytes)")
        try:
            header = json.loads(fh.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise MapStateError(f"map state file {path} has a corrupt header: {err}") from err
        meta = header.get("__metadata__") if isinstance(header, dict) else None
        if not isinstance(meta, dict):
            raise MapStateError(f"{path} is a safetensors file without gp_mapping metadata; not a map state file")
        if meta.get("format") != FORMAT:
            raise MapStateError(f"{path} is not a gp_mapping map state file (format {meta.get('format')!r})")
        if meta.get("schema_version") != str(SCHEMA_VERSION):
            raise MapStateError(f"{path} has map state schema version {meta.get('schema_version')!r}; this "
                                f"gp_mapping reads version {SCHEMA_VERSION}")
        payload = size - 8 - n
        try:
            declared = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"),
                           default=0)
        except (TypeError, KeyError, IndexError, ValueError) as err:
            raise MapStateError(f"map state file {path} has a corrupt header: bad tensor entry ({err})") from err
        if declared != payload:
            raise MapStateError(f"map state file {path} is truncated or corrupt: its header declares {declared} "
                                f"bytes of tensors, the file holds {payload}")
        fh.seek(0)
        data = fh.read(size + 1)
    if len(data) != size:
        raise MapStateError(f"map state file {path} changed while it was read ({len(data)} bytes, {size} expected)")
    return meta, data


def read_state(path: str | os.PathLike) -> MapState:
    """Read and verify a state file; raises MapStateError naming the problem."""
    from safetensors.torch import load

    path = Path(path)
    meta, data = _read_checked(path)
    try:
        tensors = load(data)
    except Exception as err:  # safetensors raises its own error type for every malformed payload
        raise MapStateError(f"map state file {path} is truncated or corrupt: {err}") from err
    if _checksum(tensors) != meta.get("checksum"):
        raise MapStateError(f"map state file {path} is corrupt: its checksum does not match its contents")
    try:
        config = json.loads(meta["config"])
        info = json.loads(meta["info"])
    except (KeyError, json.JSONDecodeError) as err:
        raise MapStateError(f"map state file {path} has missing or corrupt metadata: {err}") from err
    model_state = {k[len(MODEL_PREFIX):]: v for k, v in tensors.items() if k.startswith(MODEL_PREFIX)}
    arrays = {k[len(MAPPER_PREFIX):]: v.numpy() for k, v in tensors.items() if k.startswith(MAPPER_PREFIX)}
    return MapState(config=config, model_state=model_state, arrays=arrays, info=info)
