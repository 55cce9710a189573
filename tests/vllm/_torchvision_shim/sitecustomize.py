"""Runs at interpreter start when this folder is on PYTHONPATH (tests/vllm only).

The PyPI torchvision wheel is built for CUDA torch; beside CPU torch its compiled extension
cannot load, and ``import torchvision`` then fails registering fake kernels for two operators
that do not exist. Declaring those two schemas (never called) lets ``torchvision.transforms``
import, which vLLM's Qwen3.5 module needs through transformers' image processor. vLLM inspects
models in a subprocess, which inherits PYTHONPATH, so this file covers it too.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from typing import Any

_KEEP: list[Any] = []


def declare_torchvision_ops() -> None:
    """Declare torchvision's two fake-registered operators when its extension cannot load."""
    found = importlib.util.find_spec("torchvision")
    if "torchvision" in sys.modules or found is None or found.origin is None:
        return
    try:
        torch.ops.load_library(os.path.join(os.path.dirname(found.origin), "_C.so"))
        return  # a CPU build: the real operators exist
    except (OSError, RuntimeError):
        pass
    lib = torch.library.Library("torchvision", "DEF")
    lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    lib.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    _KEEP.append(lib)


# torch is imported only where torchvision is installed, so other interpreters start as fast.
if importlib.util.find_spec("torchvision") is not None and importlib.util.find_spec("torch"):
    import torch

    declare_torchvision_ops()
