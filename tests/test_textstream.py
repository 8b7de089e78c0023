"""Stop strings and UTF-8 assembly: a stream, cut anywhere, must give exactly the non-streamed text."""

import random

import pytest

from app.runtime.textstream import StopFilter, TextStream


def run_stream(pieces: list[bytes], stops: list[str]) -> tuple[str, str | None]:
    ts = TextStream(stops)
    out = []
    for p in pieces:
        out.append(ts.push(p))
        if ts.stopped:
            break
    if not ts.stopped:
        out.append(ts.finish())
    return "".join(out), ts.stopped.word if ts.stopped else None


def reference(text: str, stops: list[str]) -> tuple[str, str | None]:
    hits = [(text.find(s), s) for s in stops if s and text.find(s) >= 0]
    if not hits:
        return text, None
    pos, word = min(hits)
    return text[:pos], word


@pytest.mark.parametrize("seed", range(40))
def test_random_splits_match_reference(seed):
    rng = random.Random(seed)
    alphabet = ["a", "b", "c", " ", "é", "日", "\n", "</", "s>", "ab"]
    text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 60)))
    stops = [rng.choice(["</s>", "ab c", "\n\n", "日日", "x"]) for _ in range(rng.randrange(0, 3))]
    data = text.encode()
    cuts = sorted(rng.sample(range(len(data) + 1), k=min(len(data), rng.randrange(0, 12))))
    pieces = [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)])]
    assert run_stream(pieces, stops) == reference(text, stops)


def test_partial_stop_is_held_then_released():
    f = StopFilter(["STOP"])
    assert f.push("abc ST") == "abc "
    assert f.push("O") == ""
    assert f.push("p") == "STOp"
    assert f.flush() == ""


def test_stop_at_earliest_position_wins():
    text, word = run_stream([b"xx END yy HALT"], ["HALT", "END"])
    assert (text, word) == ("xx ", "END")


def test_split_multibyte_character():
    data = "héllo 日本".encode()
    pieces = [data[i : i + 1] for i in range(len(data))]
    assert run_stream(pieces, []) == ("héllo 日本", None)
