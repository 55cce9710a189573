"""vLLM's own prefix-cache counters beside the connector's, from either metrics source.

Names are vLLM's Prometheus names without the ``_total`` suffix (as ``LLM.get_metrics``
gives them), summed over label sets: ``vllm:external_prefix_cache_hits`` is vLLM's count of
prompt tokens a connector supplied, ``vllm:hybridkv_hit_tokens`` the connector's count of the
tokens vLLM accepted from it (``num_external_tokens``).

The two differ by exactly one thing (docs/howto/serve.md, ``hit_tokens``): vLLM records the
hits of a request resumed after a preemption apart (``PrefixCacheStats.preempted_hits``, not
exported), while the connector counts every token vLLM accepted. So they are equal when
nothing was preempted, and the connector's count can only be larger otherwise. With no load
failing, every load job the scheduler side built is one the worker side reported done.
"""

from __future__ import annotations

import re

EXTERNAL_HITS = "vllm:external_prefix_cache_hits"
PREEMPTIONS = "vllm:num_preemptions"
HIT_TOKENS = "vllm:hybridkv_hit_tokens"
LOADS_DONE = "vllm:hybridkv_loads_done"
LOAD_JOBS = "vllm:hybridkv_load_jobs"
LOAD_FAILED = "vllm:hybridkv_load_jobs_failed"

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)$")


def parse_prometheus(text: str) -> dict[str, float]:
    """vLLM's counter samples of a ``/metrics`` page, ``_total`` dropped, summed over label
    sets. The process's own counters (``process_cpu_seconds``, ``python_gc_*``) are left out:
    they move while the server idles, and nothing here reads them."""
    found: dict[str, float] = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match is None or not match.group(1).endswith("_total"):
            continue
        if not match.group(1).startswith("vllm:"):
            continue
        name = match.group(1)[: -len("_total")]
        found[name] = found.get(name, 0.0) + float(match.group(3))
    return found


def disagreement(counters: dict[str, float]) -> str | None:
    """Why the connector's hit tokens and vLLM's external hits disagree, or None."""
    for name in (EXTERNAL_HITS, PREEMPTIONS, HIT_TOKENS, LOAD_JOBS, LOADS_DONE, LOAD_FAILED):
        if name not in counters:
            return f"{name} was not exported"
    hits, vllm_hits = counters[HIT_TOKENS], counters[EXTERNAL_HITS]
    if counters[LOAD_FAILED]:
        return f"{counters[LOAD_FAILED]:.0f} load jobs failed in a run without faults"
    if counters[LOAD_JOBS] != counters[LOADS_DONE]:
        return (
            f"{counters[LOAD_JOBS]:.0f} load jobs built, {counters[LOADS_DONE]:.0f} reported done"
        )
    if counters[PREEMPTIONS] == 0 and hits != vllm_hits:
        return f"no preemption, yet hybridkv hit_tokens {hits:.0f} != vLLM's {vllm_hits:.0f}"
    if hits < vllm_hits:
        return f"hybridkv hit_tokens {hits:.0f} < vLLM's external hits {vllm_hits:.0f}"
    return None
