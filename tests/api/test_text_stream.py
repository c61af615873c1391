"""TextStream: a generated text handed out piece by piece, never taking back what it handed out."""
from __future__ import annotations

from batchprompt.api.text_stream import TextStream


def _bytes_decode(ids: list[int]) -> str:
    """Each token one byte, as a byte-level tokenizer splits an emoji (an incomplete character: U+FFFD)."""
    return bytes(ids).decode("utf-8", errors="replace")


def test_a_stop_string_of_emoji_is_not_sent_while_its_last_character_is_half_made():
    """With stop ["🎉🎉🎉"], a stream sent "🎉" before the stop completed (the non-streamed answer
    was ""): the half-made third emoji's U+FFFD counted among the two held-back characters."""
    stream = TextStream(_bytes_decode, stop=["🎉🎉🎉"])
    made = list("🎉🎉🎉".encode())
    sent = "".join(stream.push([b]) for b in made[:-1])  # the engine cuts the output at the last byte
    assert sent == ""
    assert stream.finish("") == ""


def test_a_stop_string_longer_than_the_text_so_far_is_held_back_whole():
    """With stop ["The capital of France is Paris"], a stream sent "The capital of Fran" and the
    answer was "": a text shorter than the hold-back was sliced from its end (text[:-n])."""
    stream = TextStream(_bytes_decode, stop=["The capital of France is Paris"])
    sent = "".join(stream.push([b]) for b in "The capital of France is Pari".encode())
    assert sent == ""
    assert stream.finish("") == ""
    cjk = TextStream(_bytes_decode, stop=["日本語日本"])
    assert "".join(cjk.push([b]) for b in "日本語日".encode()) == ""


def test_text_is_sent_as_it_becomes_certain_and_the_rest_at_the_end():
    stream = TextStream(_bytes_decode, stop=["STOP"])
    pieces = [stream.push([b]) for b in "héllo 🎉 wörld".encode()]
    assert "".join(pieces) == "héllo 🎉 wö"  # the last three characters held back (a stop string may start)
    assert all("\ufffd" not in p for p in pieces)
    assert stream.finish("héllo 🎉 wörld") == "rld"
    plain = TextStream(_bytes_decode)
    assert "".join(plain.push([b]) for b in "a🎉".encode()) == "a🎉"
