"""hybridkv: the optimized core of KV-cache offloading for hybrid LLMs in vLLM.

Library modules never import ``spec`` (the formal model) and none imports vllm; the
command-line layer ``hybridkv.cli`` wires spec and library together. A vLLM connector built on
the core (the package ``hybridkv.vllm``, to be the only importer of vllm) does not exist yet.
"""

from hybridkv.errors import HybridKVConfigError, HybridKVError

__all__ = ["HybridKVConfigError", "HybridKVError", "__version__"]

__version__ = "0.1.0"
