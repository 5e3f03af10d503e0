"""IncrementalDetokenizer against the real SmolLM2 tokenizer's full decode."""

import random

import pytest

from jaxllm.engine.output_processor import IncrementalDetokenizer, decode_logprob_token

TEXTS = [
    "Hello world! The capital of France is Paris.",
    "  two leading spaces,  double  spaces and a trailing one ",
    "héllo wörld, café naïve façade — “quotes” … ",
    "你好，世界。日本語のテキストと한국어",
    "emoji 🙂🎉👍🏽 family 👨‍👩‍👧 flags 🇫🇷🇯🇵",
    "Ελληνικά, русский, עברית, 한국어",
    "\n\nnew lines\tand\ttabs\n",
]


@pytest.fixture(scope="module")
def fast_tok():
    from smollm2_oracle import hf_tokenizer

    return hf_tokenizer()  # transformers' reading of the default model's GGUF


class WindowOnly:
    """The tokenizer with its Rust backend out of sight, as a slow one: the detokenizer decodes
    windows through `decode`."""

    def __init__(self, tok):
        self._tok = tok

    def __getattr__(self, name):
        if name == "_tokenizer":
            raise AttributeError(name)
        return getattr(self._tok, name)


@pytest.fixture(scope="module", params=["stream", "window"])
def tok(request, fast_tok):
    """Both paths: tokenizers' DecodeStream (a fast tokenizer) and the decoded window."""
    t = fast_tok if request.param == "stream" else WindowOnly(fast_tok)
    assert IncrementalDetokenizer(t, [1, 2]).streams == (request.param == "stream")
    return t


def stream(tok, ids, prompt=(), chunks=None, **kw):
    """Feed ids in chunks (default one at a time) -> (deltas, stop string, detokenizer)."""
    d = IncrementalDetokenizer(tok, list(prompt), **kw)
    deltas, sizes, i = [], chunks or [1] * len(ids), 0
    for n in sizes:
        delta, stop = d.add_tokens(ids[i:i + n])
        deltas.append(delta)
        i += n
        if stop:
            return deltas, stop, d
    deltas.append(d.flush())
    return deltas, None, d


@pytest.mark.parametrize("text", TEXTS)
def test_deltas_concatenate_to_the_full_decode(tok, text):
    ids = tok.encode(text)
    prompt = tok.encode("Say something:")
    deltas, stop, d = stream(tok, ids, prompt)
    assert "".join(deltas) == d.text == tok.decode(ids, skip_special_tokens=True) == text
    assert stop is None and not any("\ufffd" in x for x in deltas)
    rng = random.Random(text)
    sizes = []
    while sum(sizes) < len(ids):
        sizes.append(rng.randint(1, 3))
    deltas, _, _ = stream(tok, ids, prompt, chunks=sizes)
    assert "".join(deltas) == text and not any("\ufffd" in x for x in deltas)


def test_split_characters_are_held_until_complete(tok):
    ids = tok.encode("你好")
    assert "\ufffd" in tok.decode(ids[:1])  # the first token is half a character
    deltas, _, _ = stream(tok, ids)
    assert deltas[0] == "" and "".join(deltas) == "你好"


def test_leading_space_after_the_prompt(tok):
    prompt = tok.encode("The capital of France is")
    ids = tok.encode(" Paris. It is")
    deltas, _, _ = stream(tok, ids, prompt)
    assert deltas[0] == " Paris" and "".join(deltas) == " Paris. It is"


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens_skipped_or_kept(tok, skip):
    ids = tok.encode("<|im_start|>assistant\nHi there<|im_end|>\n<|im_start|>user")
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>")
    deltas, _, d = stream(tok, ids, tok.encode("prompt"), skip_special_tokens=skip)
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=skip)
    assert ("<|im_end|>" in d.text) is not skip


def test_stop_string_across_tokens_is_excluded(tok):
    ids = tok.encode("Hello world, this is it.")
    assert "lo wor" not in [tok.decode([i]) for i in ids]  # spans "Hello" and " world"
    deltas, stop, d = stream(tok, ids, stop=["lo wor"])
    assert stop == "lo wor" and d.text == "".join(deltas) == "Hel"


def test_stop_string_included_when_asked(tok):
    ids = tok.encode("Hello world, this is it.")
    deltas, stop, d = stream(tok, ids, stop=["lo wor"], include_stop_str_in_output=True)
    assert stop == "lo wor" and d.text == "".join(deltas) == "Hello wor"
    assert deltas[0] == "Hello"  # nothing held back when the stop string is kept


def test_partial_match_is_held_then_released(tok):
    ids = tok.encode("Hello world, friend")
    assert [tok.decode([i]) for i in ids][:3] == ["Hello", " world", ","]
    deltas, stop, d = stream(tok, ids, stop=["world peace", "xyz"])
    assert deltas[:3] == ["Hello", " ", "world,"]  # "world" could start "world peace"
    assert stop is None and "".join(deltas) == d.text == "Hello world, friend"
    d = IncrementalDetokenizer(tok, [], stop=["world peace"])
    d.add_tokens(ids[:2])
    assert (d.text, d.released_text) == ("Hello world", "Hello ")
    d.add_tokens(ids[2:3])
    assert d.text == d.released_text == "Hello world,"


def test_held_text_released_by_flush_at_the_end(tok):
    ids = tok.encode("Hello world")
    deltas, stop, _ = stream(tok, ids, stop=["world peace"])
    assert deltas == ["Hello", " ", "world"] and stop is None  # the last one from flush()


def test_earliest_stop_string_wins(tok):
    ids = tok.encode("one two three four")
    _, stop, d = stream(tok, ids, chunks=[len(ids)], stop=["four", "two"])
    assert stop == "two" and d.text == "one "


def test_stop_terminated_token_text_left_out(tok):
    eos = tok.eos_token_id
    ids = tok.encode("Done") + [eos]
    for include, expected in ((False, "Done"), (True, "Done<|im_end|>")):
        d = IncrementalDetokenizer(tok, [1], skip_special_tokens=False,
                                   include_stop_str_in_output=include)
        delta, stop = d.add_tokens(ids, stop_terminated=True)
        assert (delta, stop, d.text) == (expected, None, expected)


def test_no_stop_strings_within_min_tokens(tok):
    ids = tok.encode("stop here, stop there")
    deltas, stop, d = stream(tok, ids, stop=["stop"], min_tokens=2)
    assert stop == "stop" and d.text == "".join(deltas) == "stop here, "


def test_each_token_decodes_a_short_window(fast_tok):
    """Cheap per token: the windows passed to decode stay short however long the output."""
    tok = fast_tok
    class Counting:
        def __init__(self):
            self.longest = 0

        def decode(self, ids, **kw):
            self.longest = max(self.longest, len(ids))
            return tok.decode(ids, **kw)

    ids = tok.encode(" ".join(TEXTS) * 10)
    counting = Counting()
    deltas, _, _ = stream(counting, ids, tok.encode("a long prompt " * 50))
    assert "".join(deltas) == tok.decode(ids) and len(ids) > 500
    assert counting.longest <= 12


def test_decode_logprob_token(fast_tok):
    tok = fast_tok
    ids = tok.encode("Hi 你")
    assert [decode_logprob_token(tok, i) for i in ids] == [tok.decode([i]) for i in ids]
    assert decode_logprob_token(tok, tok.eos_token_id) == "<|im_end|>"
    assert decode_logprob_token(tok, ids[-1]) == "\ufffd"


def test_a_decode_stream_that_cannot_be_primed_leaves_the_window(fast_tok, monkeypatch):
    """An older tokenizers whose DecodeStream takes no ids: the window decodes, as correctly."""
    import jaxllm.engine.output_processor as detok

    def unprimed(*, skip_special_tokens=False, **kw):
        if kw:
            raise TypeError(f"unexpected keyword argument {next(iter(kw))!r}")
        return object()

    monkeypatch.setattr(detok, "DecodeStream", unprimed)
    ids = fast_tok.encode(TEXTS[2])
    deltas, _, d = stream(fast_tok, ids, fast_tok.encode("prompt"))
    assert not d.streams
    assert "".join(deltas) == fast_tok.decode(ids)
