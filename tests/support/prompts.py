"""Prompts for the correctness tests: real text, cut to token counts from 1 to 300+."""

from __future__ import annotations

TEXT = (
    "The lighthouse keeper had kept a logbook for forty-one years, and every entry began the same way: "
    "the date, the wind, the colour of the sea at dawn. In the spring of the year the station was automated, "
    "a young engineer arrived with crates of batteries, a laptop and a list of questions nobody had asked "
    "before. How often did the lamp fail? Which storms had cracked the glass? Why were there two clocks in "
    "the kitchen, one of them always eleven minutes fast? The keeper answered slowly, turning pages, reading "
    "aloud the names of ships that had passed and never come back, the winter the harbour froze, the summer "
    "a whale slept for three days in the bay. The engineer typed everything into a spreadsheet with columns "
    "for date, event, cause and outcome, and discovered that the old handwriting held a pattern: the lamp "
    "failed most often in the week after the equinox, when the damp crept into the wiring. She wrote a small "
    "program that would warn the mainland office when the humidity sensor crossed a threshold, and she named "
    "it after the keeper's dog. On her last evening they climbed the stairs together, one hundred and "
    "twelve steps, and watched the new lamp turn without anyone to tend it. The keeper said that a light "
    "which needs no one is a strange kind of light. The engineer said that the logbook would be scanned "
    "and kept in the archive, and that people would read it long after the tower had been sold. Then she "
    "asked about the two clocks, and he laughed, and told her that the fast one had belonged to his wife, "
    "who liked to be early for everything, even for the tide. Recipes, train timetables and chess problems "
    "filled the back pages: a stew of mussels and fennel, the Sunday service to the city at 07:42, and a "
    "mate in three that he had never managed to solve."
)

PROMPT_LENGTHS = [1, 5, 17, 33, 64, 100, 200, 320]


def cut_prompts(tokenizer, lengths: list[int] = PROMPT_LENGTHS) -> list[list[int]]:
    """Token-id prompts of the given lengths, each starting at a different point of the text."""
    ids = tokenizer(TEXT * 2, add_special_tokens=False).input_ids
    assert len(ids) >= max(lengths) + 8 * len(lengths), "TEXT too short for the requested lengths"
    return [ids[7 * i : 7 * i + n] for i, n in enumerate(lengths)]


def shared_prefix_prompts(tokenizer, prefix_len: int = 150) -> list[list[int]]:
    """Eight prompts that share their first `prefix_len` tokens, then diverge (lengths differ)."""
    ids = tokenizer(TEXT * 2, add_special_tokens=False).input_ids
    prefix = ids[:prefix_len]
    tails = [ids[prefix_len + 13 * i : prefix_len + 13 * i + 3 + 9 * i] for i in range(8)]
    return [prefix + tail for tail in tails]
