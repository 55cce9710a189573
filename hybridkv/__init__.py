"""hybridkv: the optimized core of KV-cache offloading for hybrid LLMs in vLLM.

Library modules never import ``spec`` (the formal model); the command-line layer
``hybridkv.cli`` wires spec and library together. ``hybridkv.vllm`` (the only importer of
vllm) is vLLM 0.33's ``HybridKVConnector`` over the connector core, loaded with
``kv_connector_module_path="hybridkv.vllm"`` (docs/howto/serve.md). Tested on CPU inside vLLM's
real scheduler: construction through vLLM's factory, config validation, and a byte-checked
store-then-load. Not yet: fault-injected trace runs inside vLLM, load deadlines, sync loads,
tensor parallelism, Prometheus metrics, KV events, GPU runs.
"""

from hybridkv.errors import HybridKVConfigError, HybridKVError

__all__ = ["HybridKVConfigError", "HybridKVError", "__version__"]

__version__ = "0.1.0"
