"""The test bed a connector runs in without a model: workloads, KV caches whose content can be
checked, copy timing and injected faults. Nothing here imports ``spec``.

Two engines drive a connector through it: the simulator behind ``hybridkv simulate``
(:mod:`hybridkv.simulator`, which adds the spec scheduler) and the in-process harness over
vLLM's real scheduler (:mod:`hybridkv.vllm`); ``tools/`` replay and measure with it too.

- what is served: :mod:`.trace` (the JSONL trace format), :mod:`.workloads` (the built-in
  workloads), :mod:`.aborts` (clients that cancel);
- where the KV lives: :mod:`.caches` (per-layer caches laid out as vLLM 0.33 lays them out) and
  :mod:`.content` (bytes that are a function of the prefix, so a wrong block is visible);
- how bytes move: :mod:`.copy_time` (in which step a job completes), :mod:`.timed_engine` (a
  transfer engine that completes jobs then) and :mod:`.faults` (jobs that fail);
- :mod:`.host_replay`: a recorded run's host-tier traffic replayed under any eviction policy.
"""
