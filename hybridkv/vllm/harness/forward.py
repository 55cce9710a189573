"""The in-process engine's stand-in forward: what a model would write into the KV cache and
read from it, each read checked against the content the request's tokens imply.

The forward (:mod:`hybridkv.vllm.harness.content`): a mamba layer copies the state of block
``(c0 - 1) // block`` to ``cdiv(c1, block) - 1`` as ``preprocess_mamba`` does, checks it holds
the prefix ``[:c0]`` and writes the prefix ``[:c1]``, and, for a spec with prefill checkpoint
blocks, writes the prefix ``[:p]`` into the column vLLM's ``compute_mamba_prefill_checkpoints``
names (the backend's checkpoint export); an attention layer writes the tags of ``[c0, c1)`` and
checks the positions ``[lo, c0)`` it attends (``lo`` = 0, or the window's start). With
``EngineSettings.speculative`` only the scheduler side of speculative decoding runs: the runner
proposes no draft tokens.

:class:`StandInForward` is a part of :class:`~hybridkv.vllm.harness.inprocess.InProcessEngine`
(a base class of it), kept apart as one idea: the engine schedules and drives the connector, this
writes and checks the caches. It reads the engine's state declared on the class and changes only
the tally, the requests' prefix hashes and the mamba state index.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from hybridkv.vllm.harness.content import LayerTags, prefix_tags
from hybridkv.vllm.harness.report import Tally

__all__ = ["StandInForward"]


class StandInForward:
    """The forward of :class:`~hybridkv.vllm.harness.inprocess.InProcessEngine` (module
    docstring); every attribute below is the engine's, set in its constructor."""

    requests: dict[str, Any]
    ranks: list[Any]
    scheduler: Any
    vllm_config: Any
    hash_block_size: int
    tally: Tally
    _hashes: dict[str, list[int]]
    _state_idx: dict[str, int]
    _runner_tokens: dict[str, list[int]]
    _layers: list[tuple[int, LayerTags, Any]]
    _draft_layer: str | None
    _draft_spans: list[tuple[str, int, int]]
    _draft_tables: dict[str, Any]
    _cache_hit_alignment: int
    _drop_eagle_block: bool

    def _spans(self, output: Any) -> Iterator[tuple[str, int, int]]:
        for rid, n in output.num_scheduled_tokens.items():
            c1 = self.requests[rid].num_computed_tokens
            yield rid, c1 - n, c1

    def _tokens(self, request: Any) -> list[int]:
        """The request's tokens as the runner holds them: the scheduler's, plus the tokens the
        runner sampled that the scheduler has not applied yet (async scheduling). Sampling is a
        function of the prefix, so a token vLLM drops as stale is sampled again the same."""
        known = request.all_token_ids
        own = self._runner_tokens.get(request.request_id)
        if own is None or len(known) >= len(own):
            own = self._runner_tokens[request.request_id] = list(known)
        return own

    def _propose(self, rid: str, tokens: list[int], end: int) -> list[int]:
        """The drafter's tokens for the draft positions a step schedules up to ``end`` (under
        async scheduling the scheduler schedules placeholders and the worker's drafter fills
        them): this drafter proposes what the sampler will pick, so every draft is accepted
        and the KV of a draft position is the request's own. ``tokens`` grows by them."""
        hashes = self._hashes[rid]
        proposed = []
        while len(tokens) < end:
            tokens.append(3 + hashes[len(tokens) - 1] % 997)
            proposed.append(tokens[-1])
            prefix_tags(tokens, hashes)
        return proposed

    def _forward(self, output: Any) -> list[list[int]]:
        spans, tables, lengths, proposed = self._prepare(output)
        self._mamba_precopy(spans, tables)
        self._draft_spans, self._draft_tables = spans, tables
        for rank in self.ranks:
            w = rank.worker
            for gid, tags, spec in rank.layers:
                if tags.name == self._draft_layer:
                    continue  # the drafter writes it (_draft)
                attention = not tags.is_mamba
                if attention and w is not None:
                    w.wait_for_layer_load(tags.name)
                for rid, c0, c1 in spans:
                    if tags.is_mamba:
                        self._mamba_layer(tags, tables[rid][gid], (rid, c0, c1), spec)
                    else:
                        self._attention_layer(tags, tables[rid][gid], (rid, c0, c1), spec)
                if attention and w is not None:
                    w.save_kv_layer(tags.name, rank.kv_caches[tags.name], None)
        sampled = []
        for rid, _c0, c1 in spans:
            if c1 >= lengths[rid]:
                token = 3 + (self._hashes[rid][c1 - 1] % 997)
                self._runner_tokens[rid].append(token)
                sampled.append([*proposed.get(rid, ()), token])
            else:
                sampled.append([])
        return sampled

    def _prepare(
        self, output: Any
    ) -> tuple[list[tuple[str, int, int]], dict[str, Any], dict[str, int], dict[str, list[int]]]:
        """The step's spans, block tables, each request's token count as the runner holds it
        (drafts included) and the drafts proposed; forgets finished and preempted requests."""
        for rid in output.finished_req_ids:
            self._runner_tokens.pop(rid, None)
            self._state_idx.pop(rid, None)
        for rid in output.preempted_req_ids or ():
            self._state_idx.pop(rid, None)
        spans = list(self._spans(output))
        tables, lengths, proposed = {}, {}, {}
        drafts = output.scheduled_spec_decode_tokens or {}
        for rid, c0, c1 in spans:
            request = self.requests[rid]
            tokens = self._tokens(request)
            prefix_tags(tokens, self._hashes[rid])
            if drafts.get(rid):
                proposed[rid] = self._propose(rid, tokens, c1)
            lengths[rid] = len(tokens)
            tables[rid] = self.scheduler.kv_cache_manager.get_block_ids(rid)
            prompt = request.num_prompt_tokens
            self.tally.prefill_computed += max(0, min(c1, prompt) - c0)
        return spans, tables, lengths, proposed

    def _draft(self) -> None:
        """The stand-in drafter (``EngineSettings.speculative_hooks``): writes and checks its
        layer's KV of the step's tokens, after the target forward; nothing without one."""
        spans, tables = self._draft_spans, self._draft_tables
        self._draft_spans, self._draft_tables = [], {}
        if self._draft_layer is None:
            return
        for rank in self.ranks:
            w = rank.worker
            for gid, tags, spec in rank.layers:
                if tags.name != self._draft_layer:
                    continue
                if w is not None:
                    w.wait_for_layer_load(tags.name)
                for rid, c0, c1 in spans:
                    self._attention_layer(tags, tables[rid][gid], (rid, c0, c1), spec)
                if w is not None:
                    w.save_kv_layer(tags.name, rank.kv_caches[tags.name], None)

    def _mamba_precopy(self, spans: list[tuple[str, int, int]], tables: dict[str, Any]) -> None:
        """``preprocess_mamba``: the running state moves to the last block before the forward
        (on every rank)."""
        for rank in self.ranks:
            for gid, tags, spec in rank.layers:
                if not tags.is_mamba:
                    continue
                size = spec.block_size
                for rid, c0, c1 in spans:
                    prev = self._state_idx.get(rid, (c0 - 1) // size) if c0 > 0 else -1
                    curr = -(-c1 // size) - 1
                    if prev not in (-1, curr):
                        table = tables[rid][gid]
                        tags.copy_state(table[prev], table[curr], rank.kv_caches[tags.name])
        for rid, _c0, c1 in spans:
            size = next((s.block_size for _, t, s in self._layers if t.is_mamba), 0)
            if size:
                self._state_idx[rid] = -(-c1 // size) - 1

    def _mamba_layer(
        self, tags: LayerTags, table: Any, span: tuple[str, int, int], spec: Any
    ) -> None:
        rid, c0, c1 = span
        size = spec.block_size
        block = torch.tensor([table[-(-c1 // size) - 1]])
        slot = torch.zeros(1, dtype=torch.long)
        hashes = self._hashes[rid]
        if c0 > 0:
            self._count(rid, tags.check(block, slot, tags.expected(hashes, range(c0 - 1, c0))))
        tags.write(block, slot, tags.expected(hashes, range(c1 - 1, c1)))
        self._mamba_checkpoint(tags, table, span, spec)

    def _mamba_checkpoint(
        self, tags: LayerTags, table: Any, span: tuple[str, int, int], spec: Any
    ) -> None:
        """The backend's prefill checkpoint export: the state after ``position`` tokens into
        the column vLLM's ``compute_mamba_prefill_checkpoints`` names, where it names one (the
        null block absorbs the export when the manager reserved no block there)."""
        if not spec.num_prefill_checkpoint_blocks:
            return
        from vllm.model_executor.layers.mamba.checkpoint import compute_mamba_prefill_checkpoints

        _rid, c0, c1 = span
        (offset,), (col,) = compute_mamba_prefill_checkpoints(
            [c1],
            [c1 - c0],
            hash_block_size=self.hash_block_size,
            mamba_block_size=spec.block_size,
            checkpoint_alignment=spec.prefill_checkpoint_alignment,
            drop_eagle_block=self._drop_eagle_block,
            cache_hit_alignment_tokens=self._cache_hit_alignment,
            num_hash_lookahead_tokens=self.vllm_config.num_hash_lookahead_tokens,
        )
        if col < 0 or not table[col]:
            return
        position = c0 + offset
        block = torch.tensor([table[col]])
        slot = torch.zeros(1, dtype=torch.long)
        tags.write(block, slot, tags.expected(self._hashes[_rid], range(position - 1, position)))

    def _attention_layer(
        self, tags: LayerTags, table: Any, span: tuple[str, int, int], spec: Any
    ) -> None:
        rid, c0, c1 = span
        size = spec.block_size
        hashes = self._hashes[rid]
        ids = torch.tensor(list(table), dtype=torch.long)
        new = torch.arange(c0, c1)
        tags.write(ids[new // size], new % size, tags.expected(hashes, range(c0, c1)))
        window = getattr(spec, "sliding_window", None)
        lo = 0 if not window else max(0, c0 - (window - 1))
        if lo < c0:
            old = torch.arange(lo, c0)
            self._count(
                rid, tags.check(ids[old // size], old % size, tags.expected(hashes, range(lo, c0)))
            )

    def _count(self, rid: str, counts: Any) -> None:
        self.tally.checked += counts.checked
        self.tally.wrong += counts.wrong
        if counts.wrong:
            self.tally.wrong_by[rid] = self.tally.wrong_by.get(rid, 0) + counts.wrong
