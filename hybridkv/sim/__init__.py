"""The pieces of ``hybridkv simulate`` that need no formal model: workloads and their trace
format (:mod:`.trace`, :mod:`.workloads`), simulated KV caches laid out as vLLM lays them out
(:mod:`.caches`) and content addressing (:mod:`.content`). The engine loop, which drives the
optimized connector with the spec scheduler, lives in ``hybridkv.simulator`` (with
``hybridkv.cli``, the one place that wires ``spec`` and the library together)."""
