"""The formal model of hybridkv: plain-Python reference models and their invariants.

Standard library only. It never imports ``hybridkv`` (nor torch or vllm): it is the oracle the
optimized library is tested against, written from vLLM 0.33's contracts and ours.
"""

__all__ = ["__version__"]

__version__ = "0.1.0"
