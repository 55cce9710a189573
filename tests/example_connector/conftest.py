"""examples/ is not in the wheel the `tests` session installs: it is found in the checkout,
after the installed hybridkv."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # appended: a regular package there wins over a namespace one
    sys.path.append(str(ROOT))
