"""Lost hits: work the host tier holds but a follow-up request cannot use.

Scenario (vLLM #56972 and the measurement in FIELD-NOTES "Measured here"): a store connector
that keeps only prompt tokens, or mamba states only at prefill boundaries, gives a conversation's
next turn no hit past the previous prompt: the previous answer is recomputed every turn. No
safety invariant is at stake (nothing wrong is read); the hit length and the recomputed tokens
are the evidence.
"""

from __future__ import annotations

from regression_script import Script, config, expected_token, full, mamba, request

from spec.connector import ReferenceConnector
from spec.connector_api import BlockTable, RequestView, TransferJob

TURN1 = (1, 2, 3, 4, 5)
# r0 samples at positions 5, 6, 7, 8 (max_tokens 4): 100 + (p + 2) % 2.
ANSWER = tuple(expected_token("r0", p) for p in range(5, 9))
TURN2 = (*TURN1, *ANSWER, 60, 61, 62)  # the next turn: history plus a new question


class PromptOnlyStores(ReferenceConnector):
    """vLLM's native default (``offload_prompt_only=True``): decode-phase units are not stored."""

    def _store_job(
        self,
        request: RequestView,
        block_ids: BlockTable,
        start: int,
        end: int,
        *,
        limit: int | None = None,
    ) -> TransferJob | None:
        # The step keeps its range (it places the mamba states, MB-8); only its stores stop
        # at the prompt (ScheduledRequest.store_limit).
        prompt = request.num_prompt_tokens
        return super()._store_job(
            request, block_ids, start, end, limit=prompt if limit is None else min(limit, prompt)
        )


def _two_turns(connector: type[ReferenceConnector] | None) -> Script:
    cfg = config((full(), mamba()), [request("r0", TURN1, 4), request("r1", TURN2, 1)])
    s = Script(cfg, connector_cls=connector)
    s.arrive("r0")
    s.run()  # turn 1: prefill [0, 4), [4, 5), then 3 decode steps; every store completes
    assert s.reset_prefix_cache()  # the GPU cache lost the turn (another tenant, say)
    s.arrive("r1")
    s.run()
    return s


def test_decode_phase_states_are_stored_so_the_next_turn_hits() -> None:
    """Scenario (#56972): turn 1 is 5 prompt tokens and 4 answer tokens. Decode steps end at
    6, 7, 8 and 9, so attention units 6 and 8 and the states after 6 and 8 are stored as well as
    the prompt's (attention 2, 4; the state after 4, where the first prefill chunk ended).
    Turn 2 (12 tokens) then claims 8, the last position with a stored state, and computes 4
    tokens. Storing the prompt only, the claim stops at 4 and the answer is recomputed."""
    s = _two_turns(None)
    assert s.broken() == set()
    assert s.tokens("r0") == ANSWER
    assert s.claims("r1")[0].accepted == 8
    # [8, 10) (the split stops at the last block boundary before the last token) and [10, 12).
    assert s.scheduled("r1") == [(8, 2), (10, 2)]
    assert s.computed_tokens("r1") == 4

    broken = _two_turns(PromptOnlyStores)
    assert broken.broken() == set()  # nothing wrong is read: hits are lost, not corrupted
    assert broken.claims("r1")[0].accepted == 4
    assert broken.computed_tokens("r1") == 8  # the previous answer is recomputed
