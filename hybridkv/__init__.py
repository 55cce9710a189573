"""hybridkv: the optimized core of KV-cache offloading for hybrid LLMs in vLLM.

Library modules never import ``spec`` (the formal model) and only ``hybridkv.vllm`` imports
vllm; the command-line layer ``hybridkv.cli`` wires spec and library together.
"""

from hybridkv.errors import HybridKVConfigError, HybridKVError

__all__ = ["HybridKVConfigError", "HybridKVError", "__version__"]

__version__ = "0.1.0"
