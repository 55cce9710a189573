"""The in-process vLLM engine that tests, benchmarks and ``hybridkv simulate --engine vllm``
run, and its adapters: nothing here ships into a server.

``vllm serve`` loads :mod:`hybridkv.vllm` (the connector and what it imports); that package
never imports this one (an import-linter contract in pyproject.toml, and
``tests/vllm/test_server_imports.py`` on a fresh interpreter). This package imports the
connector, never the reverse. It lives under :mod:`hybridkv.vllm` because it imports vLLM.

Importing the package imports none of its modules:

- :mod:`~hybridkv.vllm.harness.planning`: vLLM's own KV-cache planning for a config.json,
  in-process (a stand-in executor, tensor parallel simulated in one process);
- :mod:`~hybridkv.vllm.harness.engine_config`:
  :class:`~hybridkv.vllm.harness.engine_config.EngineSettings` and the ``VllmConfig`` built from
  them;
- :mod:`~hybridkv.vllm.harness.inprocess`: vLLM's real ``Scheduler`` with any KV connector,
  the worker side driven in-process on CPU tensors in the model runner's hook order;
- :mod:`~hybridkv.vllm.harness.forward`: the stand-in forward, which writes and checks every
  KV slot and mamba state (:mod:`~hybridkv.vllm.harness.content`: its content tags);
- :mod:`~hybridkv.vllm.harness.report`: what a run observed, and the scheduler-side clock;
- :mod:`~hybridkv.vllm.harness.chat`: the multi-turn chat trace and its closed-loop driver;
- :mod:`~hybridkv.vllm.harness.cpu_worker` / :mod:`~hybridkv.vllm.harness.delayed`:
  ``HybridKVConnector``'s worker on CPU tensors with seeded faults and simulated copy latency;
- :mod:`~hybridkv.vllm.harness.native_cpu`: vLLM's native ``OffloadingConnector`` on CPU
  tensors;
- :mod:`~hybridkv.vllm.harness.multi_cpu`: ``WeightedMultiConnector``'s adapter;
- :mod:`~hybridkv.vllm.harness.workload`: ``hybridkv simulate --engine vllm``'s workload under
  vLLM.
"""
