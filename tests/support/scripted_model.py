"""A real Qwen3 checkpoint whose greedy output is scripted: chat tests that need a model which
reasons (`<think>…</think>`) and calls tools (`<tool_call>…</tool_call>`) on cue.

The model is an n-gram machine built from a Qwen3 config (`tests.support.models._config("qwen3")`:
hidden 64, 2 layers, 4 query heads over 2 KV heads, head_dim 32, untied embeddings) and the real
Qwen3 tokenizer. Its next token depends only on the last `order` tokens (1 to 4), anywhere in a
sequence of up to `max_position_embeddings` (1024) tokens, so that a script keyed on the tail
of a rendered chat prompt holds whatever came before (system prompt, tools, earlier turns).

Construction. The residual stream (64 dims) is split into a bias dim that is 1 for every token
and `order` slots of `(64 - 1) // order` dims. Each token embeds as the bias plus a random unit
vector in slot 0. In layer 0, query head `k - 1` (k = 1 … order - 1) reads only the bias dim, so
its query and key are the same for every token; after the q/k RMSNorms (weight 16), the query's
rotary phases are set so that the score peaks at relative offset -k by a margin of about 60
logits at every offset below 1024 (checked here), which puts all of the softmax on the token k
places back; the value copies that token's slot-0 vector and `o_proj` writes it into slot k.
Every other `o_proj` and every MLP `down_proj` is zero, so the layers add nothing else and the
final hidden state is RMSNorm([1, e(t), e(t-1), …]), with the final norm's weight at one. The
`lm_head` rows of the scripted next tokens are solved by least squares so that, on the hidden
states transformers itself computes for each scripted context, the scripted token's logit is
`SCALE` and every other scripted token's is 0 (exactly, up to 64 contexts); all other rows are noise of about 0.1 logit.
The builder checks the argmax and its margin over the whole vocabulary for every context.

Limits:
- A script maps contexts (the last `order` tokens, oldest first) to next tokens; a context that
  recurs with two different next tokens cannot be scripted: `script_for` and `merge_scripts`
  raise `ScriptConflict` naming it, and a larger `order` (or another text) resolves it.
- The readout is linear in the slot vectors. With 64 contexts or fewer the least-squares fit is
  exact (margin 30); up to about 100 contexts with unrelated next tokens still fit with a margin
  above 10, 150 do not (measured, orders 1, 3 and 4). Contexts that combine the same tokens in a
  "rectangle" ((a, b), (a', b), (a, b'), (a', b')) cannot take four unrelated next tokens.
  `build_scripted_model` checks every context over the whole vocabulary and raises
  `ScriptConflict` when the scripted token does not win by `MIN_MARGIN`, rather than build a
  model that strays.
- Off the script, the output is arbitrary (deterministic, but meaningless).
- The first scripted context is the rendered prompt's tail: with `add_generation_prompt=True`,
  Qwen3's template ends in `<|im_start|>assistant\\n` (ids 151644, 77091, 198), and with
  `enable_thinking=False` it appends `<think>\\n\\n</think>\\n\\n` (ends 151667, 271, 151668, 271).
  Take the tail from the actual prompt ids (`script_for(..., prompt_ids, ...)` does).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, PreTrainedTokenizerBase

from tests.support.models import _config, base_tokenizer

Context = tuple[int, ...]
Script = dict[Context, int]

SCALE = 30.0  # the scripted token's logit; every other scripted token's is 0
MIN_MARGIN = 10.0  # what the builder demands between the scripted token and the runner-up
QK_NORM_WEIGHT = 16.0  # sharpens the previous-token attention to a ~60-logit margin
MIN_ATTENTION_MARGIN = 30.0


class ScriptConflict(ValueError):
    """A script this construction cannot realise (a context with two next tokens, or too many
    contexts for the linear readout)."""


def script_for(
    tokenizer: PreTrainedTokenizerBase,
    prompt_ids: Sequence[int],
    text: str,
    eos: int,
    order: int = 3,
) -> Script:
    """The script that makes the model continue `prompt_ids` with exactly `text`'s tokens
    (`tokenizer.encode(text, add_special_tokens=False)`) and then `eos`. Only the prompt's last
    `order` tokens matter. Raises `ScriptConflict` if some context recurs with two different
    next tokens."""
    if not 1 <= order <= 4:
        raise ValueError(f"order must be 1 to 4, not {order}")
    if len(prompt_ids) < order:
        raise ValueError(f"the prompt needs at least {order} tokens")
    target = list(tokenizer.encode(text, add_special_tokens=False)) + [eos]
    sequence = list(prompt_ids[-order:]) + target
    script: Script = {}
    for i, nxt in enumerate(target):
        context = tuple(sequence[i : i + order])
        _add(script, context, nxt, tokenizer)
    return script


def merge_scripts(*scripts: Mapping[Context, int]) -> Script:
    """One script from several (for several prompts); raises `ScriptConflict` on a context that
    two of them continue differently."""
    merged: Script = {}
    for script in scripts:
        for context, nxt in script.items():
            _add(merged, context, nxt, None)
    return merged


def _add(
    script: Script, context: Context, nxt: int, tokenizer: PreTrainedTokenizerBase | None
) -> None:
    if script.setdefault(context, nxt) != nxt:
        shown = tokenizer.convert_ids_to_tokens(list(context)) if tokenizer else context
        raise ScriptConflict(
            f"context {shown} continues as both {script[context]} and {nxt}: "
            "use a larger order or a text without that repetition"
        )


def build_scripted_model(folder: Path, script: Mapping[Context, int], seed: int = 0) -> Path:
    """Save into `folder` a Qwen3 checkpoint (safetensors, config, generation config, the real
    Qwen3 tokenizer) whose greedy next token after each context of `script` is the scripted one.
    The order is the contexts' length. EOS is `<|im_end|>`."""
    if not script:
        raise ValueError("an empty script")
    order = len(next(iter(script)))
    if not 1 <= order <= 4 or any(len(c) != order for c in script):
        raise ValueError("all contexts must have the same length, 1 to 4")
    tok = base_tokenizer("qwen")
    cfg = _config("qwen3", len(tok))
    cfg.eos_token_id = tok.eos_token_id
    hidden, head_dim = cfg.hidden_size, cfg.head_dim
    assert cfg.num_attention_heads >= order - 1 and cfg.tie_word_embeddings is False
    slot = (hidden - 1) // order
    assert order == 1 or slot <= head_dim  # a head carries one slot

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        inner = model.model
        vocab = inner.embed_tokens.weight.shape[0]
        emb = torch.zeros(vocab, hidden)
        emb[:, 0] = 1.0
        vectors = torch.randn(vocab, slot, generator=generator)
        emb[:, 1 : 1 + slot] = vectors / vectors.norm(dim=1, keepdim=True)
        inner.embed_tokens.weight.copy_(emb)
        inner.norm.weight.fill_(1.0)
        for layer in inner.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        if order > 1:
            _previous_token_heads(model, order, slot)

        contexts = list(script)
        features = inner(input_ids=torch.tensor(contexts)).last_hidden_state[:, -1]
        head = torch.randn(vocab, hidden, generator=generator) * (0.1 / hidden**0.5)
        targets = sorted(set(script.values()))
        index = {t: i for i, t in enumerate(targets)}
        wanted = torch.zeros(len(contexts), len(targets))
        for row, context in enumerate(contexts):
            wanted[row, index[script[context]]] = SCALE
        # The minimum-norm solution of features @ rows.T == wanted.
        rows = torch.linalg.lstsq(features.double(), wanted.double(), driver="gelsd").solution
        head[targets] = rows.T.float()
        model.lm_head.weight.copy_(head)

        logits = features @ head.T
        best = logits.topk(2, dim=1)
        for row, context in enumerate(contexts):
            top = int(best.indices[row, 0])
            margin = float(best.values[row, 0] - best.values[row, 1])
            if top != script[context] or margin < MIN_MARGIN:
                raise ScriptConflict(
                    f"context {tok.convert_ids_to_tokens(list(context))} should give "
                    f"{script[context]} by {MIN_MARGIN} logits but gives {top} by "
                    f"{margin:.1f}: {len(contexts)} contexts are too many or too alike"
                )
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def _previous_token_heads(model: Any, order: int, slot: int) -> None:
    """Layer 0's query head k - 1 attends to the token k places back and copies its slot-0
    vector into slot k (k = 1 … order - 1)."""
    cfg = model.config
    head_dim, heads, kv_heads = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    attn = model.model.layers[0].self_attn
    model.model.layers[0].input_layernorm.weight.fill_(1.0)
    half = head_dim // 2
    theta = float(cfg.rope_parameters["rope_theta"])
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)

    # Keys: every pair at phase 0, the same for every token (read from the bias dim).
    k = torch.zeros(kv_heads * head_dim, cfg.hidden_size)
    for h in range(kv_heads):
        k[h * head_dim : h * head_dim + half, 0] = 1.0
    attn.k_proj.weight.copy_(k)
    # Query head k - 1 at phase -k * theta_i per rotary pair i (pairs are dims i and i + half):
    # its score against the key j places back is sum_i cos(theta_i * (j - k)), highest at j = k.
    q = torch.zeros(heads * head_dim, cfg.hidden_size)
    for h in range(heads):
        angle = (h + 1) * inv_freq
        q[h * head_dim : h * head_dim + half, 0] = torch.cos(angle).float()
        q[h * head_dim + half : (h + 1) * head_dim, 0] = -torch.sin(angle).float()
    attn.q_proj.weight.copy_(q)
    attn.q_norm.weight.fill_(QK_NORM_WEIGHT)
    attn.k_norm.weight.fill_(QK_NORM_WEIGHT)
    # The scores' margin, as computed above, over every offset the context length allows.
    offsets = torch.arange(cfg.max_position_embeddings, dtype=torch.float64)
    # Each normalised query and key pair has norm QK_NORM_WEIGHT * sqrt(2) (unit pairs over
    # half of the dims for keys, all of them for queries, both at rms 1 / sqrt(2) before the norm).
    amplitude = 2 * QK_NORM_WEIGHT**2 / head_dim**0.5
    for j in range(1, order):
        scores = amplitude * torch.cos(torch.outer(offsets - j, inv_freq)).sum(dim=1)
        others = torch.cat([scores[:j], scores[j + 1 :]])
        margin = float(scores[j] - others.max())
        assert margin > MIN_ATTENTION_MARGIN, margin

    # Values: slot 0 of the (normalised) input, in both KV heads; o_proj scales it back to unit
    # norm (the input norm divides by rms = sqrt(2 / hidden)) and writes head k - 1 into slot k.
    v = torch.zeros(kv_heads * head_dim, cfg.hidden_size)
    for h in range(kv_heads):
        v[h * head_dim : h * head_dim + slot, 1 : 1 + slot] = torch.eye(slot)
    attn.v_proj.weight.copy_(v)
    unscale = (2.0 / cfg.hidden_size) ** 0.5
    o = torch.zeros(cfg.hidden_size, heads * head_dim)
    for j in range(1, order):
        h = j - 1
        o[1 + j * slot : 1 + (j + 1) * slot, h * head_dim : h * head_dim + slot] = (
            torch.eye(slot) * unscale
        )
    attn.o_proj.weight.copy_(o)
