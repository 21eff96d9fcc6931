"""The engine's tokenizers read once a process in the test suite, each engine given a deep copy.

Reading a tokenizer is most of a small engine's start-up (1.5 s of 1.54 for a random Llama with
Llama 3's 17 MB tokenizer.json); a deep copy of one already read takes 0.9 s and is as
independent as a fresh read, so a test that changes its engine's tokenizer (a chat template)
changes no other test's. Files are matched by path, size and modification time, so a folder
rewritten in place is read again. Production reads a tokenizer once per engine and keeps no
cache (it would hold a second copy in memory)."""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

from transformers import PreTrainedTokenizerBase

import engine.llm_engine
import engine.loading.resolve
import engine.spec_decode.draft_model

KEEP = 8  # tokenizers held; the suite's random models share a handful of folders
Loader = Callable[[Path], PreTrainedTokenizerBase]


def _stamp(path: Path) -> tuple | None:
    if not path.is_dir():
        return None
    files = sorted(p for p in path.iterdir() if p.is_file())
    return tuple((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files)


def caching(read: Loader) -> Loader:
    held: OrderedDict[tuple, PreTrainedTokenizerBase] = OrderedDict()

    def load_tokenizer(path: Path) -> PreTrainedTokenizerBase:
        stamp = _stamp(Path(path))
        if stamp is None:
            return read(path)
        key = (str(Path(path).resolve()), stamp)
        if key not in held:
            held[key] = read(path)
            if len(held) > KEEP:
                held.popitem(last=False)
        held.move_to_end(key)
        return copy.deepcopy(held[key])

    return load_tokenizer


def install() -> None:
    """Every module that took `load_tokenizer` by name gets the caching one."""
    cached = caching(engine.loading.resolve.load_tokenizer)
    for module in (engine.loading.resolve, engine.llm_engine, engine.spec_decode.draft_model):
        module.load_tokenizer = cached  # type: ignore[attr-defined]
