"""examples/ is not in the wheel the `tests` session installs: it is found in the checkout,
after the installed hybridkv."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if importlib.util.find_spec("examples") is None:
    sys.path.append(str(ROOT))
