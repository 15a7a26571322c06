"""Stop strings found incrementally agree with the whole-text definition, and cost what the new
text costs, not what the output's length costs."""

from __future__ import annotations

import random
import time

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from specagent.decoding.stopping import (
    MAX_STOP_CHARS,
    MAX_STOPS,
    IncrementalText,
    StopStrings,
    check_stops,
)
from tests.conftest import CORPUS, make_tokenizer

TEXTS = [*CORPUS, "Café crème — naïve façade, 東京 and 🙂 emoji.", "  leading   spaces\n\nend"]


def _metaspace_tokenizer() -> PreTrainedTokenizerFast:
    """A SentencePiece-style tokenizer (Metaspace): a word's leading space is part of its
    token and the first one is dropped, the case that a window decode must get right."""
    backend = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    alphabet = [f"<0x{b:02X}>" for b in range(256)]
    trainer = trainers.BpeTrainer(
        vocab_size=600, special_tokens=["<unk>", *alphabet], show_progress=False
    )
    backend.train_from_iterator(TEXTS * 20, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>")


TOKENIZERS = {"byte-level": make_tokenizer, "metaspace": _metaspace_tokenizer}


@pytest.fixture(scope="module", params=sorted(TOKENIZERS))
def decode(request: pytest.FixtureRequest):
    tok = TOKENIZERS[request.param]()

    def run(ids):
        return tok.decode(list(ids), skip_special_tokens=True)

    run.encode = lambda text: tok.encode(text, add_special_tokens=False)  # type: ignore[attr-defined]
    return run


def _steps(ids: list[int], rng: random.Random) -> list[list[int]]:
    """The ids cut into steps of 1 to 5 tokens, as a speculative loop emits them."""
    out, i = [], 0
    while i < len(ids):
        n = rng.randint(1, 5)
        out.append(ids[i : i + n])
        i += n
    return out


def test_incremental_text_is_the_whole_decode(decode) -> None:
    rng = random.Random(0)
    for text in TEXTS:
        ids = decode.encode(text)
        inc = IncrementalText(decode)
        streamed = "".join(inc.extend(step) for step in _steps(ids, rng))
        whole = decode(ids)
        assert streamed == inc.text
        assert whole.startswith(streamed)
        assert len(whole) - len(streamed) <= 1  # at most a held incomplete character


def _reference_keep(decode, output: list[int], stops: list[str]) -> int | None:
    """The definition: the earliest stop in the whole text; the most tokens wholly before it."""
    text = decode(output)
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    if not hits:
        return None
    cut = min(hits)
    keep = len(output)
    while keep > 0 and len(decode(output[:keep])) > cut:
        keep -= 1
    return keep


def test_tokens_to_keep_matches_the_whole_text_definition(decode) -> None:
    rng = random.Random(1)
    checked = 0
    for text in TEXTS:
        ids = decode.encode(text)
        whole = decode(ids)
        for _ in range(12):
            a = rng.randrange(len(whole) - 2)
            stops = [whole[a : a + rng.randint(1, 4)]]
            if rng.random() < 0.5:
                stops.append("never appears")
            if not all(stops) or "\ufffd" in stops[0]:
                continue
            matcher = StopStrings(stops, decode)
            output: list[int] = []
            got = None
            for step in _steps(ids, rng):
                output.extend(step)
                got = matcher.tokens_to_keep(output)
                if got is not None:
                    break
            assert got == _reference_keep(decode, output, stops), (text, stops)
            checked += 1
    assert checked > 40


def test_safe_length_holds_back_only_what_can_grow_into_a_stop(decode) -> None:
    ids = decode.encode("Hello world, hello there!")
    matcher = StopStrings(["there!", "xyz"], decode)
    emitted = ""
    for step in _steps(ids, random.Random(2)):
        matcher.feed(step)
        safe = matcher.safe_length()
        text = matcher.text.text
        assert safe >= len(emitted)  # never retracts
        emitted = text[:safe]
        assert "there!" not in emitted
        # What is held back is a proper prefix of a stop string (or nothing).
        held = text[safe:]
        assert (
            held == "" or matcher.cut is not None or any(s.startswith(held) for s in matcher.stops)
        )
    assert emitted == "Hello world, hello "


def test_a_step_costs_its_new_text_not_the_whole_output() -> None:
    """With the maximum stops, each of maximum length, a late step costs about what an early
    one does: the check never re-decodes or re-searches the whole output."""
    calls: list[int] = []

    def decode(ids):
        calls.append(len(ids))
        return "".join(chr(97 + i % 26) for i in ids)

    stops = [("z" * (MAX_STOP_CHARS - 1)) + str(i % 10) for i in range(MAX_STOPS)]
    matcher = StopStrings(stops, decode)
    output: list[int] = []
    timings = []
    for step in range(4000):
        output.extend([step % 25, (step + 1) % 25])
        calls.clear()
        t = time.perf_counter()
        assert matcher.tokens_to_keep(output) is None
        matcher.safe_length()
        timings.append(time.perf_counter() - t)
        assert max(calls) <= 4  # a window of this step and the one before, never the output
    assert sum(timings[-500:]) < 3 * sum(timings[:500]) + 0.05


def test_stop_limits_name_the_field() -> None:
    with pytest.raises(ValueError, match=rf"at most {MAX_STOPS}"):
        check_stops(["x"] * (MAX_STOPS + 1))
    with pytest.raises(ValueError, match=r"stop\[1\]: .*at most"):
        check_stops(["ok", "y" * (MAX_STOP_CHARS + 1)])
    with pytest.raises(ValueError, match=r"stop\[0\]: .*non-empty"):
        check_stops([""])
    check_stops(["x" * MAX_STOP_CHARS] * MAX_STOPS)
