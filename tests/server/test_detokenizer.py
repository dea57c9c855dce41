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
