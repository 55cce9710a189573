"""hybridkv inside vLLM 0.33: the only package of hybridkv that imports vllm.

- :mod:`hybridkv.vllm.planning`: vLLM's own KV-cache planning for a config.json, in-process;
- :mod:`hybridkv.vllm.inprocess`: vLLM's real ``Scheduler`` with any KV connector, the worker
  side driven in-process on CPU tensors in the model runner's hook order, content-verified;
- :mod:`hybridkv.vllm.content`: the stand-in forward's content tags;
- :mod:`hybridkv.vllm.native_cpu`: vLLM's native ``OffloadingConnector`` on CPU tensors.
"""
