"""hybridkv: the optimized core of KV-cache offloading for hybrid LLMs in vLLM.

Library modules never import ``spec`` (the formal model); the simulator
``hybridkv.simulator`` and the command-line layer ``hybridkv.cli`` wire spec and library
together. ``hybridkv.vllm`` (the only importer of vllm) is vLLM 0.33's ``HybridKVConnector``
over the connector core, loaded with
``kv_connector_module_path="hybridkv.vllm"`` (docs/howto/serve.md). Tested on CPU inside vLLM's
real scheduler: random traces with faults, load deadlines, preemptions and aborts, every read
content-checked and the spec's invariants evaluated each step; agreement with the spec's
reference connector; metrics; tensor parallel 2 simulated in one process. Not yet: sync loads
(refused: vLLM 0.33 cannot undo one on hybrid models), real multi-process tensor parallel, GPU
runs inside vLLM.
"""

from hybridkv.errors import HybridKVConfigError, HybridKVError

__all__ = ["HybridKVConfigError", "HybridKVError", "__version__"]

__version__ = "0.1.0"
