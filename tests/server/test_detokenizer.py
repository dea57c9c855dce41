import torch

from server.engine.detokenizer import TextStream


def _stream_all(tokenizer, text: str, stops=()):
    stream = TextStream(tokenizer, stops)
    out = []
    stopped = False
    for token in tokenizer(text, add_special_tokens=False)["input_ids"]:
        delta = stream.push(token)
        out.append(delta.text)
        if delta.stopped:
            stopped = True
            break
    out.append(stream.flush())
    return out, stopped


def test_deltas_concatenate_to_decoded_text(tokenizer):
    text = "Hello, wörld! Ünïcödé — 日本語のテキスト and emoji 🙂🚀 end."
    deltas, stopped = _stream_all(tokenizer, text)
    assert not stopped
    assert "".join(deltas) == text


def test_deltas_never_split_a_character(tokenizer):
    deltas, _ = _stream_all(tokenizer, "🙂🚀日本語")
    for delta in deltas:
        assert "\ufffd" not in delta
        delta.encode("utf-8")  # whole characters only


def test_stop_string_is_removed_and_matched_across_tokens(tokenizer):
    deltas, stopped = _stream_all(tokenizer, "one two three four five", stops=("hree fo",))
    assert stopped
    assert "".join(deltas) == "one two t"


def test_stop_prefix_is_held_back_then_released(tokenizer):
    stream = TextStream(tokenizer, ("STOPWORD",))
    sent = ""
    for token in tokenizer("abc STOP", add_special_tokens=False)["input_ids"]:
        sent += stream.push(token).text
    assert not sent.endswith("STOP")  # could still become the stop string
    assert sent + stream.flush() == "abc STOP"


def test_the_rust_decode_gives_transformers_text(tokenizer):
    """`decoder` takes the Rust tokenizer's decode for SmolLM2's (a BPE tokenizer that
    transformers does not post-process) and it gives `tokenizer.decode`'s text for every
    sequence: special tokens, spaces before punctuation, a character cut in half, random ids."""
    from server.engine.detokenizer import _rust, decoder

    fast = decoder(tokenizer, _rust(tokenizer))
    assert fast.__code__ is not decoder(object(), _rust(object())).__code__  # the direct path, not the fallback
    ids = tokenizer.encode("Hello , world ! <|im_end|> héllo 日本語 \n\n  x", add_special_tokens=False) + [0, 1, 2]
    gen = torch.Generator().manual_seed(0)
    cases = [ids, ids[:-4], ids[3:7], [], *(torch.randint(0, len(tokenizer), (n,), generator=gen).tolist() for n in (1, 5, 40))]
    cases += [ids[:i] for i in range(len(ids))]
    for case in cases:
        assert fast(case) == tokenizer.decode(case, skip_special_tokens=True), case


def _deltas(stream: TextStream, ids: list[int]) -> list[str]:
    return [stream.push(token).text for token in ids] + [stream.flush()]


def _window(tokenizer) -> TextStream:
    """A TextStream that moves its window in Python (two decodes a token), as it did before
    tokenizers' DecodeStream."""
    stream = TextStream(tokenizer)
    stream._stream = None
    return stream


def test_the_rust_stream_gives_the_windows_deltas(tokenizer):
    """For SmolLM2's tokenizer TextStream moves its window with tokenizers' DecodeStream; each
    token's delta is the Python window's: text, special tokens, characters cut in half (emoji,
    CJK), and random ids."""
    assert TextStream(tokenizer)._stream is not None
    ids = tokenizer.encode("Hello , world ! <|im_end|> héllo 日本語 🙂🚀\n\n  x", add_special_tokens=False) + [0, 1, 2]
    gen = torch.Generator().manual_seed(0)
    cases = [ids, *(torch.randint(0, len(tokenizer), (n,), generator=gen).tolist() for n in (1, 7, 300))]
    for case in cases:
        assert _deltas(TextStream(tokenizer), case) == _deltas(_window(tokenizer), case), case


def test_a_decoder_that_rewrites_across_tokens_falls_back_to_the_window():
    """A decoder whose text for more tokens does not start with its text for fewer (here "a",
    then "ab" -> "X") makes DecodeStream raise: the stream goes on with the Python window and
    its deltas are the window's."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    rust = Tokenizer(models.WordLevel({"a": 0, "b": 1, "c": 2, "[UNK]": 3}, unk_token="[UNK]"))
    rust.decoder = decoders.Sequence([decoders.Fuse(), decoders.Replace("ab", "X")])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=rust, clean_up_tokenization_spaces=False)
    stream = TextStream(tokenizer)
    assert stream._stream is not None
    ids = [0, 1, 2, 0, 1, 0, 2]
    assert _deltas(stream, ids) == _deltas(_window(tokenizer), ids)
    assert stream._stream is None  # it fell back


def test_a_long_text_keeps_only_what_a_stop_string_may_start_in(tokenizer):
    """Over a long text the stream keeps the text not sent yet and the last characters sent
    that a stop string may still start in, not all it decoded; its deltas still make the whole
    text, and a stop string that starts in text sent tokens ago still matches."""
    text = "def f(n):\n    return n + 1  # héllo 日本語\n" * 200
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    for stops in [(), ("</answer>", "STOP")]:
        stream = TextStream(tokenizer, stops)
        deltas = []
        for token in ids:
            deltas.append(stream.push(token).text)
            assert len(stream._text) <= 40, stops
        assert "".join(deltas) + stream.flush() == text, stops
    deltas, stopped = _stream_all(tokenizer, text + "the end</answer> never sent", stops=("</answer>",))
    assert stopped and "".join(deltas) == text + "the end"
