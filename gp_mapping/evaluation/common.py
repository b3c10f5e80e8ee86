"""Small helpers shared by the benchmark sections: where things are (source checkout or installed package), the
machine, resident memory, JSON-safe numbers."""
from __future__ import annotations

import datetime as _dt
import math
import os
import platform
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

_CHECKOUT = Path(__file__).resolve().parents[2]
#: The source checkout holding this package (with bench/, config/ and bags/ beside gp_mapping/), or None when the
#: package is installed (pip, colcon): the harness then runs on what the package itself holds.
SOURCE_ROOT: Path | None = _CHECKOUT if (_CHECKOUT / "bench").is_dir() and (_CHECKOUT / "config").is_dir() else None


def default_results_dir() -> Path:
    """``bench/results`` of the source checkout; ``./bench-results`` when the package is installed."""
    return SOURCE_ROOT / "bench" / "results" if SOURCE_ROOT is not None else Path.cwd() / "bench-results"


def shipped_config_path() -> Path | None:
    """``config/mapper.yaml`` of the checkout, or the installed copy (``<prefix>/share/gp_mapping/config``);
    None when neither exists (its values are then the defaults of :class:`gp_mapping.config.MapperConfig`, which
    the test suite holds equal to the file)."""
    candidates = ([SOURCE_ROOT / "config" / "mapper.yaml"] if SOURCE_ROOT is not None else []) + \
        [Path(sys.prefix) / "share" / "gp_mapping" / "config" / "mapper.yaml"]
    return next((p for p in candidates if p.is_file()), None)


PAGE_SIZE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def rss_bytes() -> int:
    """Resident set size of this process, from /proc/self/statm (no psutil); 0 where /proc is absent."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * PAGE_SIZE
    except (OSError, IndexError, ValueError):
        return 0


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (platform.processor() elsewhere)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info() -> dict[str, Any]:
    """What the numbers were measured on."""
    cuda = torch.cuda.is_available()
    return {"date": _dt.datetime.now().isoformat(timespec="seconds"), "cpu": cpu_model(),
            "logical_cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
            "python": platform.python_version(), "platform": platform.platform(),
            "cuda": torch.cuda.get_device_name(0) if cuda else None,
            # Other processes on the machine inflate wall times: the 1-minute load average says how busy it was.
            "load_average_1min": os.getloadavg()[0] if hasattr(os, "getloadavg") else None}


def percentiles(seconds: list[float] | np.ndarray) -> dict[str, float]:
    """Median, 95th percentile and mean of durations given in seconds, in milliseconds."""
    a = np.asarray(seconds, dtype=np.float64) * 1e3
    if a.size == 0:
        return {"n": 0, "median_ms": math.nan, "p95_ms": math.nan, "mean_ms": math.nan}
    return {"n": int(a.size), "median_ms": float(np.median(a)), "p95_ms": float(np.percentile(a, 95)),
            "mean_ms": float(a.mean())}


def jsonable(value: Any) -> Any:
    """Numpy scalars and arrays to Python; non-finite floats to None (JSON has no NaN)."""
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, np.ndarray):
        return jsonable(value.tolist())
    if isinstance(value, (np.integer,)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        v = float(value)
        return v if math.isfinite(v) else None
    return value
