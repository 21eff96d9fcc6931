"""Incremental detokenization with real byte-level BPE tokenizers: streamed text never shows a
broken character and always adds up to what the tokenizer itself decodes."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.processing.detokenizer import IncrementalDetokenizer
from engine.processing.tokenization import flat_decoder
from engine.sampling_params import SamplingParams
from tests.support.models import tokenizer_dir

REPLACEMENT = "\ufffd"

TEXTS = [
    "Hello 👋 world",
    "Flags: 🇯🇵🇫🇷🇧🇷 and 🏳️‍🌈",
    "A family 👨‍👩‍👧‍👦, a thumbs up 👍🏽 and a technologist 🧑🏿‍💻.",
    "日本語のテキスト、中文文本和한국어 텍스트。",
    "café naïve résumé Ångström Øre façade, e\u0301 combined, ñ",
    "Mixed: 東京 🗼 — “quotes” ½ € 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ok\n\tend 🤷‍♀️",  # noqa: RUF001 - on purpose
]


def _gpt2_byte_symbols() -> dict[int, str]:
    """The printable character byte-level BPE vocabularies use for each byte value: printable
    Latin-1 bytes stand for themselves, the others are shifted past 255 in order."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    symbols = {b: chr(b) for b in printable}
    shifted = 0
    for b in range(256):
        if b not in symbols:
            symbols[b] = chr(256 + shifted)
            shifted += 1
    return symbols


def _byte_token_ids(tokenizer, data: bytes) -> list[int]:
    """One single-byte token per byte, as a byte-level BPE emits for rare characters."""
    symbols = _gpt2_byte_symbols()
    ids = [tokenizer.convert_tokens_to_ids(symbols[b]) for b in data]
    assert tokenizer.decode(ids) == data.decode("utf-8", errors="replace"), (
        "not a byte-level vocabulary"
    )
    return ids


@pytest.fixture(scope="module", params=["qwen", "llama", "smollm2"])
def tokenizer(request):
    if request.param == "smollm2":
        folder: Path = request.getfixturevalue("default_model_dir")
    else:
        folder = tokenizer_dir(request.param)
    return AutoTokenizer.from_pretrained(folder)


def _prompt(tokenizer) -> list[int]:
    return list(tokenizer("Repeat after me:").input_ids)


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_text_matches_decode(tokenizer, text: str) -> None:
    ids = list(tokenizer(text, add_special_tokens=False).input_ids)
    # (Some tokenizers normalize, e.g. NFC: the decoded ids are the reference, not `text`.)
    assert REPLACEMENT not in tokenizer.decode(ids)
    detok = IncrementalDetokenizer(tokenizer, _prompt(tokenizer))
    streamed = ""
    for i, token in enumerate(ids):
        delta = detok.add(token)
        assert REPLACEMENT not in delta, (i, delta)
        streamed += delta
        so_far = tokenizer.decode(ids[: i + 1])
        # Text is held back only while it would end in an incomplete character.
        assert so_far.startswith(streamed)
        if not so_far.endswith(REPLACEMENT):
            assert streamed == so_far
    streamed += detok.flush()
    assert streamed == tokenizer.decode(ids)


def test_split_characters_are_held_until_complete(tokenizer) -> None:
    # 2-, 3- and 4-byte characters, each fed one byte token at a time.
    text = "é中🎉x"
    ids = _byte_token_ids(tokenizer, text.encode())
    detok = IncrementalDetokenizer(tokenizer, _prompt(tokenizer))
    deltas = [detok.add(t) for t in ids]
    expected: list[str] = []
    for ch in text:
        expected += [""] * (len(ch.encode()) - 1) + [ch]
    assert deltas == expected
    assert detok.flush() == ""


def test_flush_releases_an_incomplete_character(tokenizer) -> None:
    ids = _byte_token_ids(tokenizer, "ok🎉".encode()[:-1])  # the emoji's last byte never comes
    detok = IncrementalDetokenizer(tokenizer, _prompt(tokenizer))
    streamed = "".join(detok.add(t) for t in ids)
    assert streamed == "ok"
    assert detok.flush() == tokenizer.decode(ids)[len("ok") :]
    assert detok.flush() == ""  # nothing is released twice


def test_prompt_ending_mid_character(tokenizer) -> None:
    # The prompt carries the first two bytes of an emoji, the output the rest: the output text
    # shows the completed character and never a replacement character.
    data = "ab🎉".encode()
    prompt = _byte_token_ids(tokenizer, data[:4])
    rest = _byte_token_ids(tokenizer, data[4:] + b"x")
    detok = IncrementalDetokenizer(tokenizer, prompt)
    assert [detok.add(t) for t in rest] == ["", "🎉", "x"]
    # Also when the sequence ends right after the character completes.
    detok = IncrementalDetokenizer(tokenizer, prompt)
    assert [detok.add(t) for t in rest[:-1]] + [detok.flush()] == ["", "🎉", ""]


def test_special_tokens_skipped_or_kept(tokenizer) -> None:
    eos = tokenizer.eos_token_id
    ids = list(tokenizer("one", add_special_tokens=False).input_ids) + [eos]
    ids += list(tokenizer(" two", add_special_tokens=False).input_ids)
    for skip in (True, False):
        detok = IncrementalDetokenizer(tokenizer, _prompt(tokenizer), skip_special_tokens=skip)
        streamed = "".join(detok.add(t) for t in ids) + detok.flush()
        assert streamed == tokenizer.decode(ids, skip_special_tokens=skip)
    assert tokenizer.eos_token in tokenizer.decode(ids, skip_special_tokens=False)


def _sentencepiece_style_tokenizer():
    """A tiny tokenizer decoding like Llama-2's SentencePiece one: "▁" marks a space, the first
    leading space of a decode is dropped, and rare characters fall back to <0xNN> byte tokens."""
    from tokenizers import Tokenizer, decoders, models

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    for word in ("▁Hello", "▁world", "▁the", "▁end"):
        vocab[word] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    backend.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


def test_leading_space_kept_with_sentencepiece_style_decoding() -> None:
    tokenizer = _sentencepiece_style_tokenizer()
    ids = tokenizer.convert_tokens_to_ids
    # Decoded alone, "▁world" loses its space: the prompt's last tokens must serve as context.
    assert tokenizer.decode(ids(["▁world"])) == "world"
    detok = IncrementalDetokenizer(tokenizer, ids(["<s>", "▁Hello"]))
    emoji = ids([f"<0x{b:02X}>" for b in "🎉".encode()])
    deltas = [detok.add(t) for t in ids(["▁world", "▁the"]) + emoji + ids(["▁end"])]
    assert deltas == [" world", " the", "", "", "", "🎉", " end"]
    assert detok.flush() == ""


def test_engine_stream_deltas_add_up(llama_dir: Path) -> None:
    """Random weights sample arbitrary tokens, byte fragments included: the streamed deltas of
    every sample concatenate to its final text, which is the tokenizer's decode of its tokens."""
    engine = LLMEngine(
        EngineConfig.from_kwargs(model=str(llama_dir), num_kv_blocks=64, max_model_len=256)
    )
    params = SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=24, ignore_eos=True)
    request_id = engine.add_request("Streaming 🎉 test: 日本", params)
    text_deltas = {0: "", 1: ""}
    token_deltas: dict[int, list[int]] = {0: [], 1: []}
    final = None
    while engine.has_unfinished_requests():
        for output in engine.step():
            assert output.request_id == request_id
            for completion in output.outputs:
                text_deltas[completion.index] += completion.text_delta
                token_deltas[completion.index] += completion.token_ids_delta
            if output.finished:
                final = output
    assert final is not None
    for completion in final.outputs:
        assert completion.finish_reason == "length" and len(completion.token_ids) == 24
        assert token_deltas[completion.index] == completion.token_ids
        assert text_deltas[completion.index] == completion.text
        assert completion.text == engine.tokenizer.decode(
            completion.token_ids, skip_special_tokens=True
        )


def _wordpiece_tokenizer_that_cleans_up() -> PreTrainedTokenizerFast:
    """WordPiece, where transformers' decode removes the space before punctuation afterwards."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {"[UNK]": 0, "hello": 1, ",": 2, "world": 3, ".": 4, "##s": 5}
    backend = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    backend.decoder = decoders.WordPiece()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="[UNK]", clean_up_tokenization_spaces=True
    )


def test_flat_decoder_is_decode(tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    """The stream's decoder gives what the tokenizer's decode gives, specials skipped or kept, on
    random windows of the vocabulary (byte fragments and special tokens included); on these
    byte-level BPE tokenizers it goes to the Rust tokenizer without transformers' wrapper."""
    rng = random.Random(0)
    specials = tokenizer.all_special_ids
    windows = [
        [rng.randrange(len(tokenizer)) for _ in range(rng.randrange(1, 12))] + specials[:2]
        for _ in range(200)
    ]
    for skip in (True, False):
        fast = flat_decoder(tokenizer, skip)
        want = [tokenizer.decode(w, skip_special_tokens=skip) for w in windows]
        with monkeypatch.context() as m:
            m.setattr(tokenizer, "decode", lambda *a, **k: pytest.fail("the wrapper was called"))
            assert [fast(w) for w in windows] == want


def test_flat_decoder_keeps_transformers_clean_up_where_it_applies() -> None:
    tokenizer = _wordpiece_tokenizer_that_cleans_up()
    ids = tokenizer.convert_tokens_to_ids(["hello", ",", "world", "##s", "."])
    assert tokenizer.decode(ids) == "hello, worlds."  # the clean-up removed two spaces
    assert flat_decoder(tokenizer, True)(ids) == "hello, worlds."
    sentencepiece = _sentencepiece_style_tokenizer()
    pieces = sentencepiece.convert_tokens_to_ids(["<s>", "▁Hello", "▁world"])
    assert flat_decoder(sentencepiece, True)(pieces) == sentencepiece.decode(
        pieces, skip_special_tokens=True
    )
