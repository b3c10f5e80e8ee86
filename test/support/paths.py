"""Where the checkout and the real recordings (../shared/data beside it) are."""
from __future__ import annotations

from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
SHARED_DATA = REPO_ROOT.parent / "shared" / "data"


def shared_data(*parts: str) -> Path:
    """Path under ../shared/data, or skip the test with the reason when the recording is absent."""
    path = SHARED_DATA.joinpath(*parts)
    if not path.exists():
        pytest.skip(f"real recording {path} is absent (needs ../shared/data beside the checkout)")
    return path
