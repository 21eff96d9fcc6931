"""A draft model proposes: a smaller model of the same vocabulary guesses the next tokens
greedily, and the target verifies them in one forward pass.

The draft runs through its own executor with its own K/V tensors of the pool's `num_blocks`
blocks, addressed through the target's block tables: a block id holds the target's and the
draft's K/V of the same positions, so the draft needs no allocator of its own and the pool's
accounting (`draft_kv_bytes_per_block`) covers both.

Drafts are the draft's argmax: the engine verifies such one-hot drafts by sampling the target
and matching, which is rejection sampling for a point-mass draft distribution. Correctness never
depends on the draft's K/V, only how many drafts are accepted does.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from config import ConfigError, EngineConfig, LoRAConfig
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.sequence import Sequence
from engine.errors import ModelLoadError
from engine.loading.model_spec import ModelSpec, resolve_model_spec
from engine.loading.resolve import load_tokenizer
from engine.spec_decode.beside_target import check_target, refusal
from engine.spec_decode.draft_batch import DraftRun, build_draft_batch
from engine.worker.executor import LocalExecutor

log = logging.getLogger(__name__)

# What a failed draft start-up may raise: the config's refusals and the loader's.
_LOAD_ERRORS = (ConfigError, ModelLoadError, OSError, ValueError)


def draft_engine_config(config: EngineConfig, target: ModelSpec) -> EngineConfig:
    """The engine's settings with the draft as the model: the target's device, dtype, block
    size and context limit (its positions are the target's), one rank, no adapters, and none
    of the target's own quantization, tokenizer or revision."""
    spec = config.scheduler.speculative_config
    assert spec is not None and spec.model is not None, "a draft model needs 'model'"
    return config.model_copy(
        update={
            "model": config.model.model_copy(
                update={
                    "model": spec.model,
                    "tokenizer": None,
                    "revision": None,
                    "device": target.device,
                    "dtype": str(target.dtype).removeprefix("torch."),
                    "quantization": None,
                    "quantize_activations": None,
                    "runner": "generate",
                }
            ),
            "cache": config.cache.model_copy(
                update={"block_size": target.block_size, "kv_events_config": None}
            ),
            "scheduler": config.scheduler.model_copy(
                update={"max_model_len": target.max_model_len, "speculative_config": None}
            ),
            "parallel": config.parallel.model_copy(update={"tensor_parallel_size": 1}),
            "lora": LoRAConfig(),
        }
    )


def resolve_draft_spec(config: EngineConfig, target: ModelSpec) -> ModelSpec:
    """The draft's spec; a ConfigError naming 'model' for a draft that cannot serve this
    target, before any weights load."""
    check_target(config, target, "a draft model")
    try:
        draft = resolve_model_spec(draft_engine_config(config, target))
    except _LOAD_ERRORS as exc:
        raise refusal(config, f"the draft cannot load: {exc}") from exc
    if draft.vocab_size != target.vocab_size:
        raise refusal(
            config,
            f"its vocabulary has {draft.vocab_size} tokens, the target's {target.vocab_size}: "
            "a draft must share the target's tokenizer",
        )
    check_same_vocabulary(config, draft, target)
    return draft


def check_same_vocabulary(config: EngineConfig, draft: ModelSpec, target: ModelSpec) -> None:
    """Every token id the models share means the same text to both tokenizers."""
    if draft.tokenizer_path.resolve() == target.tokenizer_path.resolve():
        return
    try:
        draft_vocab = load_tokenizer(draft.tokenizer_path).get_vocab()
    except ModelLoadError as exc:
        raise refusal(config, f"its tokenizer does not load: {exc}") from exc
    target_vocab = load_tokenizer(target.tokenizer_path).get_vocab()
    size = target.vocab_size
    ours = {token: i for token, i in draft_vocab.items() if i < size}
    theirs = {token: i for token, i in target_vocab.items() if i < size}
    if ours != theirs:
        differ = sorted(set(ours.items()) ^ set(theirs.items()), key=lambda item: item[1])
        raise refusal(
            config,
            f"its tokenizer differs from the target's ({len(differ)} token ids map to other "
            f"text, e.g. id {differ[0][1]}): a draft must share the target's tokenizer",
        )


def draft_kv_bytes_per_block(config: EngineConfig, target: ModelSpec) -> int:
    """Bytes the draft's K/V adds to each block of the pool."""
    return resolve_draft_spec(config, target).kv_bytes_per_block


@dataclass
class _DraftState:
    computed: int  # leading positions whose draft K/V is written from the sequence's tokens
    preemptions: int  # the sequence's count when it was computed: a preemption frees its blocks
    # The drafts whose K/V follows `computed` (all but the last, which was never run): valid
    # as far as the sequence took them, which verification does for a prefix of them.
    fed: list[int]

    def valid_positions(self, seq: Sequence) -> int:
        """Leading positions whose draft K/V was computed from the sequence's tokens."""
        if self.preemptions != seq.num_preemptions:  # its blocks were freed: all is gone
            return 0
        taken = seq.all_token_ids[self.computed : self.computed + len(self.fed)]
        matched = 0
        while matched < len(taken) and taken[matched] == self.fed[matched]:
            matched += 1
        return self.computed + matched


@dataclass
class _Proposal:
    """A sequence drafting this call: `index` into the call's lists, up to `count` drafts."""

    index: int
    seq: Sequence
    count: int
    table: list[int]
    next_position: int  # the first position the draft has not computed this call


class DraftModelProposer:
    def __init__(
        self, config: EngineConfig, target: ModelSpec, kv: KVCacheManager, num_blocks: int
    ) -> None:
        spec = resolve_draft_spec(config, target)
        self.kv = kv
        self.block_size = target.block_size
        self.max_model_len = target.max_model_len
        self.max_batch_tokens = config.scheduler.max_num_batched_tokens
        self.max_batch_seqs = config.scheduler.max_num_seqs
        try:
            self.executor: LocalExecutor | None = LocalExecutor(
                draft_engine_config(config, target), spec
            )
        except _LOAD_ERRORS as exc:
            raise refusal(config, f"the draft cannot load: {exc}") from exc
        self.executor.allocate_kv(num_blocks)
        self.states: dict[str, _DraftState] = {}
        log.info(
            "draft model %s (%s, %d layers) proposes for %s",
            spec.path,
            spec.architecture,
            spec.info.num_layers,
            target.path,
        )

    def close(self) -> None:
        self.executor = None  # its weights and K/V tensors go with it
        self.states.clear()

    def propose(self, seqs: list[Sequence], max_drafts: list[int]) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in seqs]
        seen = {seq.seq_id for seq in seqs}
        self.states = {k: v for k, v in self.states.items() if k in seen}
        proposals = []
        for i, (seq, wanted) in enumerate(zip(seqs, max_drafts, strict=True)):
            # The verify step computes `count` positions after the last token: all inside the
            # context limit, which also bounds the draft's rotary table.
            count = min(wanted, self.max_model_len - seq.num_tokens)
            if count <= 0:
                continue
            # The positions the verify step computes (the draft's among them); None: the pool
            # is short, and this sequence goes without drafts.
            table = self.kv.allocate_slots(seq, 1 + count)
            if table is None:
                continue
            # A sequence new here runs from its start: blocks it took from the prefix cache may
            # come from steps that did not speculate, with no draft K/V in them.
            state = self.states.get(seq.seq_id)
            valid = 0 if state is None else state.valid_positions(seq)
            # At least the last token is run: its logits give the first draft.
            proposals.append(_Proposal(i, seq, count, table, min(valid, seq.num_tokens - 1)))
        if not proposals:
            return drafts
        for p, token in zip(proposals, self._catch_up(proposals), strict=True):
            drafts[p.index].append(token)
        for step in range(1, max(p.count for p in proposals)):
            going = [p for p in proposals if p.count > step]
            runs = [
                DraftRun(p.table, p.seq.num_tokens + step - 1, [drafts[p.index][-1]], True)
                for p in going
            ]
            for p, token in zip(going, self._argmax(runs), strict=True):
                drafts[p.index].append(token)
        for p in proposals:
            fed = drafts[p.index][:-1]
            self.states[p.seq.seq_id] = _DraftState(p.seq.num_tokens, p.seq.num_preemptions, fed)
        return drafts

    def _catch_up(self, proposals: list[_Proposal]) -> list[int]:
        """Run each sequence's tokens the draft has not seen, in batches within the step's
        token and sequence budgets (a long prompt over several); the first draft of each."""
        first = [0] * len(proposals)
        left = list(range(len(proposals)))
        while left:
            budget = self.max_batch_tokens
            runs, owners = [], []
            for j in left[: self.max_batch_seqs]:
                if budget == 0:
                    break
                p = proposals[j]
                end = min(p.seq.num_tokens, p.next_position + budget)
                ids = p.seq.all_token_ids[p.next_position : end]
                runs.append(DraftRun(p.table, p.next_position, ids, end == p.seq.num_tokens))
                budget -= end - p.next_position
                p.next_position = end
                owners.append(j)
            tokens = iter(self._argmax(runs))
            for j, run in zip(owners, runs, strict=True):
                if run.wants_logits:
                    first[j] = next(tokens)
            left = [j for j in left if proposals[j].next_position < proposals[j].seq.num_tokens]
        return first

    def _argmax(self, runs: list[DraftRun]) -> list[int]:
        """The draft's most likely next token after each run that wants logits."""
        assert self.executor is not None, "propose() after close()"
        logits = self.executor.execute(build_draft_batch(runs, self.block_size))
        return torch.argmax(logits, dim=-1).tolist()
