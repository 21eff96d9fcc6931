"""EAGLE-3 proposes: a one-layer head reads the target's own hidden states (the inputs to three
of its layers) and guesses the next tokens greedily; the target verifies them.

The head's row at position p pairs the target's hidden state at p with the token at p + 1 (as
vLLM's proposer shifts its input ids), so its output there predicts the token at p + 2: a
sequence whose target computed positions 0..n-1 (its token n just sampled) gets its first
draft from the head's row n - 1. Later drafts feed the head its own output (before its norm)
with the draft before, one position further on.

Each target step keeps, per sequence, its rows' hidden states through the head's `fc`
(`observe`); a proposal runs the head over the positions computed since the last one, which
also rewrites the head's K/V where its own drafts had put it, then drafts. The head's K/V lives
in blocks of the target's ids (one layer), so the pool's accounting covers it. Correctness never
depends on the head: only how many drafts are accepted does.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from config import EngineConfig
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.scheduler_output import SchedulerOutput
from engine.core.sequence import Sequence
from engine.errors import ModelLoadError
from engine.loading.hub import download_model, is_repo_id
from engine.loading.model_spec import ModelSpec
from engine.models.base import DecoderModel
from engine.spec_decode.beside_target import check_target, refusal
from engine.spec_decode.draft_batch import DraftRun, build_draft_batch
from engine.spec_decode.eagle3_head import Eagle3Head, Eagle3Settings, load_head, read_settings
from engine.worker.executor import LocalExecutor

log = logging.getLogger(__name__)


def _head_folder(config: EngineConfig) -> Path:
    spec = config.scheduler.speculative_config
    assert spec is not None and spec.model is not None, "eagle3 needs 'model'"
    path = Path(spec.model).expanduser()
    if not path.is_dir() and is_repo_id(spec.model):
        path = download_model(spec.model, None, config.model.download_dir, lambda _: None)
    if not (path / "config.json").is_file():
        raise refusal(config, "no EAGLE-3 head folder with a config.json there")
    return path


def head_settings(config: EngineConfig, target: ModelSpec) -> Eagle3Settings:
    """The head's settings; a ConfigError naming 'model' when it cannot serve this target (the
    checks that need no weights)."""
    check_target(config, target, "an EAGLE-3 head")
    try:
        settings = read_settings(_head_folder(config), target.info.num_layers)
    except ModelLoadError as exc:
        raise refusal(config, str(exc)) from exc
    layers, hidden = target.info.num_layers, int(target.hf_config.hidden_size)
    if any(not 0 <= i < layers for i in settings.aux_layers):
        raise refusal(
            config, f"its layers {settings.aux_layers} are not all among the target's {layers}"
        )
    if settings.target_hidden_size != hidden:
        raise refusal(
            config,
            f"it reads hidden states of {settings.target_hidden_size} values, "
            f"the target's have {hidden}",
        )
    vocab = settings.config.vocab_size
    if vocab != target.vocab_size:
        raise refusal(
            config, f"its vocabulary has {vocab} tokens, the target's {target.vocab_size}"
        )
    return settings


def eagle3_kv_bytes_per_block(config: EngineConfig, target: ModelSpec) -> int:
    """Bytes the head's K/V (one layer) adds to each block of the pool."""
    settings = head_settings(config, target)
    per_token = 2 * settings.num_kv_heads * settings.head_dim
    return per_token * target.block_size * torch.empty((), dtype=target.dtype).element_size()


@dataclass
class _HeadState:
    seq: Sequence
    start: int  # the position of `rows`' first row
    rows: torch.Tensor  # the target's hidden states through `fc`, one row per position
    # Positions below this hold the head's K/V computed from the target's hidden states; a
    # preemption frees the blocks, and with them all of it.
    head_valid: int = 0
    preemptions: int = 0

    @property
    def end(self) -> int:
        return self.start + self.rows.shape[0]

    def keep(self, start: int, rows: torch.Tensor) -> None:
        """Rows of positions from `start` on replace what was kept from there (a rejected
        draft's row, or a preempted sequence's)."""
        if not self.start <= start <= self.end:  # a gap, or the sequence started over
            self.start, self.rows = start, rows
        else:
            self.rows = torch.cat([self.rows[: start - self.start], rows])


@dataclass
class _Proposal:
    index: int
    seq: Sequence
    count: int
    table: list[int]


class Eagle3Proposer:
    def __init__(
        self,
        config: EngineConfig,
        target: ModelSpec,
        executor: LocalExecutor,
        kv: KVCacheManager,
        num_blocks: int,
    ) -> None:
        settings = head_settings(config, target)
        model = executor.runner.model
        assert isinstance(model, DecoderModel), "a generating target"
        self.embed = model.embed_tokens
        folder = _head_folder(config)
        try:
            head = load_head(folder, settings, model.embed_tokens.weight, target.dtype)
        except ModelLoadError as exc:
            raise refusal(config, f"the head cannot load: {exc}") from exc
        self.head: Eagle3Head | None = head
        head.init_rotary(target.max_model_len)
        self.executor, self.kv, self.block_size = executor, kv, target.block_size
        self.max_model_len = target.max_model_len
        self.device = model.embed_tokens.weight.device
        shape = (
            num_blocks,
            target.block_size,
            settings.num_kv_heads,
            settings.head_dim,
        )
        self.kv_cache = (
            torch.zeros(shape, dtype=target.dtype, device=self.device),
            torch.zeros(shape, dtype=target.dtype, device=self.device),
        )
        self.states: dict[str, _HeadState] = {}
        executor.capture_aux_hidden(settings.aux_layers)
        log.info(
            "EAGLE-3 head %s reads the inputs to layers %s of %s",
            folder,
            settings.aux_layers,
            target.path,
        )

    def close(self) -> None:
        self.head = None
        self.states.clear()

    @torch.inference_mode()
    def observe(self, out: SchedulerOutput) -> None:
        """Keep the rows of the step just run (before its samples are taken)."""
        assert self.head is not None, "observe() after close()"
        self.states = {k: s for k, s in self.states.items() if not s.seq.is_finished}
        fused = self.head.fc(self.executor.aux_hidden())
        row = 0
        for s in out.scheduled:
            rows = fused[row : row + s.num_new_tokens]
            row += s.num_new_tokens
            state = self.states.get(s.seq.seq_id)
            if state is None:
                self.states[s.seq.seq_id] = _HeadState(s.seq, s.start, rows)
            else:
                state.keep(s.start, rows)

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], max_drafts: list[int]) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in seqs]
        proposals, runs, hidden = [], [], []
        for i, (seq, wanted) in enumerate(zip(seqs, max_drafts, strict=True)):
            computed = seq.num_tokens - 1  # positions whose target hidden state is known
            count = min(wanted, self.max_model_len - seq.num_tokens)
            state = self.states.get(seq.seq_id)
            if count <= 0 or state is None or state.end < computed:
                continue
            valid = state.head_valid if state.preemptions == seq.num_preemptions else 0
            # Positions before the first row kept came from the prefix cache: the head's K/V
            # there is what the sequence that computed them left, if it drafted.
            first = min(max(valid, state.start), computed - 1)
            if first < state.start:
                continue
            table = self.kv.allocate_slots(seq, 1 + count)
            if table is None:
                continue
            tokens = seq.all_token_ids[first + 1 : computed + 1]
            runs.append(DraftRun(table, first, tokens, True))
            hidden.append(state.rows[first - state.start : computed - state.start])
            proposals.append(_Proposal(i, seq, count, table))
            state.head_valid, state.preemptions = computed, seq.num_preemptions
            state.start, state.rows = computed, state.rows[:0]
        if not proposals:
            return drafts
        tokens, carried = self._run(runs, torch.cat(hidden))
        for p, token in zip(proposals, tokens, strict=True):
            drafts[p.index].append(token)
        for step in range(1, max(p.count for p in proposals)):
            going = [j for j, p in enumerate(proposals) if p.count > step]
            runs = [
                DraftRun(
                    proposals[j].table,
                    proposals[j].seq.num_tokens + step - 2,
                    [drafts[proposals[j].index][-1]],
                    True,
                )
                for j in going
            ]
            tokens, carried = self._run(runs, carried[going])
            for j, token in zip(going, tokens, strict=True):
                drafts[proposals[j].index].append(token)
            proposals = [proposals[j] for j in going]
        return drafts

    def _run(self, runs: list[DraftRun], hidden: torch.Tensor) -> tuple[list[int], torch.Tensor]:
        """The head over the runs: each run's draft (a target id), and its last row's output
        before the norm, the next step's hidden state."""
        assert self.head is not None, "propose() after close()"
        backend = self.executor.runner.backend
        inp = build_draft_batch(runs, self.block_size).to_device(self.device)
        own = self.head.embed_tokens
        embeds = own(inp.input_ids) if own is not None else self.embed(inp.input_ids)
        normed, carried = self.head(embeds, hidden, inp.positions, backend, self.kv_cache, inp.attn)
        last = inp.logits_indices
        return self.head.draft_ids(normed[last]).tolist(), carried[last]
