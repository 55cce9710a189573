"""The report of ``hybridkv simulate --engine vllm``: the spec engine's keys where vLLM lets the
figure be observed, ``None`` (shown as "not observed under vLLM") where it does not.
:mod:`hybridkv.cli.sim_vllm_report` renders it for a terminal.

- The token identity ``prompt = computed + loaded + GPU hit`` counts each prompt position the
  first time its KV is in place (:mod:`hybridkv.vllm.harness.workload`); what a preemption or a
  failed load took back and was served again is apart, as in the spec engine's report.
- Cross-check with vLLM's own counters: without preemptions and failed loads, the GPU hits
  and the loaded tokens equal vLLM's ``PrefillStats`` (local and external cached tokens) and the
  loaded tokens the ``num_external_tokens`` vLLM handed the connector; with either, vLLM's
  first-admission stats do not describe what was served, and the row says so.
- Content: every KV slot and mamba state the stand-in forward reads is checked (loaded ones
  included), so wrong loads show up as wrong reads; a separate wrong-load count is not observed.
- Failures: the failed jobs are those vLLM handed back to the scheduler side
  (``kv_connector_worker_meta``), checked against the core's own counts; each is followed to
  its recovery by the spec engine's :class:`~hybridkv.simulator.recovery.RecoveryWatch` (a load's
  positions served again by a forward with no wrong read of its request since; a store's keys
  never loaded and gone from the host), so ``failures_recovered`` counts as the spec engine's.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["NOT_OBSERVED", "build_report"]

NOT_OBSERVED = "not observed under vLLM"


def _again(run: Any, cause: str) -> dict[str, int]:
    out = {"computed": 0, "loaded": 0, "hit": 0}
    for (c, source), n in run.again.items():
        if c.value == cause:
            out[source.value] += n
    return out


def _stats_agree(run: Any, observed: Mapping[str, Any]) -> bool | None:
    """vLLM's PrefillStats and external tokens against the ledger (None: not comparable)."""
    if run.preemptions or run.failed_load_requests or observed["load_jobs_failed"]:
        return None
    first = {s.value: n for s, n in run.first.items()}
    return bool(
        first["hit"] == run.vllm_local_hits
        and first["loaded"] == run.vllm_external_hits == run.external_tokens_handed
    )


def _failed_jobs_agree(observed: Mapping[str, Any]) -> bool:
    """The failed jobs vLLM handed the scheduler (the watch's) are the ones the core counted."""
    return bool(
        observed["watched_failed_loads"] == observed["load_jobs_failed"]
        and observed["watched_failed_stores"] == observed["store_jobs_failed"]
    )


def _verdict(report: Mapping[str, Any]) -> str:
    """pass: 0 wrong reads, every read served by an observed event, the identity holds, every
    request finished, nothing leaked or left in flight, every failed job observed to recover
    (as the spec engine counts it) and every injected fault among them, every request whose
    load failed finished after recompute, and vLLM's own counters agree where comparable."""
    r, v = report, report["vllm"]
    finished = r["finished"].get("finished_length_capped", 0) == r["requests"]
    quiet = v["leaked_blocks"] == 0 and v["jobs_in_flight"] == 0 and v["held_blocks"] == 0
    failed = r["failed_loads"] + r["failed_stores"]
    healed = r["failures_recovered"] + r["failures_ended"] == failed >= r["failures_injected"]
    recovered = (
        healed
        and v["failed_jobs_agree"]
        and r["failed_load_requests_finished"] == r["failed_load_requests"]
    )
    clean = r["wrong_content_reads"] == 0 and r["unaccounted_reads"] == 0
    agree = v["prefill_stats_agree"] is not False
    passed = clean and r["identity_holds"] and finished and quiet and recovered and agree
    return "pass" if passed else "fail"


def build_report(
    options: Any,
    setup: Mapping[str, Any],
    run: Any,
    observed: Mapping[str, Any],
    seconds: float,
) -> dict[str, Any]:
    """The JSON report of one vLLM run (module docstring)."""
    from hybridkv.simulator.options import SCHEMA_VERSION

    first = {s.value: n for s, n in run.first.items()}
    total = first["computed"] + first["loaded"] + first["hit"]
    hits = first["loaded"] + first["hit"]
    report: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        "engine": "vllm",
        "setup": {
            **setup,
            "block_size": observed["block_size"],
            "chunk_size": observed["chunk_size"],
            "host_entries": observed["host_entries"],
            "host_bytes": observed["host_entries"] * observed["slot_bytes"],
            "policy": options.policy,
            "device": "cpu",
            "connector": "HybridKVConnector",
            "trace": options.trace,
            "faults": options.faults,
            "seed": options.seed,
        },
        "requests": run.requests,
        "finished": dict(sorted(run.finished.items())),
        "steps": run.steps,
        "seconds": round(seconds, 3),
        "prompt_tokens": run.prompt_tokens,
        "prefill_tokens_computed": first["computed"],
        "prefill_tokens_loaded": first["loaded"],
        "local_hit_tokens": first["hit"],
        "prompt_tokens_unserved": 0,  # no aborts under this engine (check_vllm_flags)
        "identity_holds": total == run.prompt_tokens,
        "served_again": {c: _again(run, c) for c in ("failure", "preemption", "replay")},
        "unaccounted_reads": run.unaccounted_reads,
        "hit_rate": round(hits / run.prompt_tokens, 4) if run.prompt_tokens else 0.0,
        "continuation_turns": run.continuation_turns,
        "continuation_hits": run.continuation_hits,
        "continuation_hit_tokens": run.continuation_hit_tokens,
        "load_jobs": observed["load_jobs"],
        "store_jobs": observed["store_jobs"],
        "bytes_loaded": observed["bytes_loaded"],
        "bytes_stored": observed["bytes_stored"],
        "load_gbps": None,
        "store_gbps": None,
        "failures_injected": observed["load_faults"] + observed["store_faults"],
        "failed_loads": observed["watched_failed_loads"],
        "failed_stores": observed["watched_failed_stores"],
        "failures_recovered": observed["recovered_loads"] + observed["recovered_stores"],
        "recovered_loads": observed["recovered_loads"],
        "recovered_stores": observed["recovered_stores"],
        "failures_ended": observed["failures_ended"],
        "failed_load_requests": run.failed_load_requests,
        "failed_load_requests_finished": run.failed_load_requests_finished,
        "tokens_discarded_by_recovery": run.tokens_discarded_by_recovery,
        "blocks_verified": None,  # slots instead: the forward checks each slot it reads
        "slots_verified": observed["slots_checked"],
        "wrong_content_loads": None,
        "wrong_content_reads": observed["wrong_reads"],
        "invariant_checks": None,
        "invariant_violations": None,
        "violations": [],
        "transfers": None,  # no copy-time model
        "vllm": {
            "preemptions": run.preemptions,
            "prefill_stats_local": run.vllm_local_hits,
            "prefill_stats_external": run.vllm_external_hits,
            "external_tokens_handed": run.external_tokens_handed,
            "prefill_stats_agree": _stats_agree(run, observed),
            "failed_jobs_agree": _failed_jobs_agree(observed),
            "leaked_blocks": observed["leaked_blocks"],
            "jobs_in_flight": observed["jobs_in_flight"],
            "held_blocks": observed["held_blocks"],
            "schedule_us": observed["schedule_us"],
            "connector_us": observed["connector_us"],
        },
    }
    report["verdict"] = _verdict(report)
    return report
