"""IncrementalDetokenizer with SmolLM2's byte-level BPE tokenizer: multi-byte characters split across
tokens, stop strings, and agreement with a one-shot decode; every test runs on both ways of decoding (the
byte table and the tokenizer's window)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from tandem.models import detokenizer as detokenizer_module
from tandem.models.detokenizer import IncrementalDetokenizer, byte_level_table

PROMPT = "Write one sentence."


@pytest.fixture(scope="module")
def tokenizer(smollm2_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_path)


@pytest.fixture(autouse=True, params=["bytes", "window"])
def decoding(request, monkeypatch, tokenizer) -> str:
    if request.param == "window":
        monkeypatch.setattr(detokenizer_module, "byte_level_table", lambda backend, skip_special_tokens: None)
    return str(request.param)


def test_byte_level_table_is_taken_for_smollm2(tokenizer, decoding) -> None:
    detokenizer = IncrementalDetokenizer(tokenizer, [])
    assert (detokenizer._token_bytes is not None) == (decoding == "bytes")
    table = byte_level_table(tokenizer.backend_tokenizer, skip_special_tokens=False)
    assert table is not None and len(table) == len(tokenizer)
    assert table[tokenizer.convert_tokens_to_ids("Ġworld")] == b" world"
    assert table[tokenizer.eos_token_id] == tokenizer.eos_token.encode()
    assert byte_level_table(tokenizer.backend_tokenizer, skip_special_tokens=True)[tokenizer.eos_token_id] == b""


def test_a_tokenizer_that_is_not_byte_level_takes_the_window(tokenizer) -> None:
    from tokenizers import Tokenizer, decoders, models

    backend = Tokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    backend.decoder = decoders.WordPiece()
    assert byte_level_table(backend, skip_special_tokens=True) is None


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def decode(tokenizer, token_ids: list[int], skip_special_tokens: bool = True) -> str:
    return tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens,
                            clean_up_tokenization_spaces=False)


def stream(detokenizer: IncrementalDetokenizer, token_ids: list[int]) -> list[str]:
    """What a client receives: one chunk per token, then the flush."""
    return [detokenizer.push([token_id]) for token_id in token_ids] + [detokenizer.finish()]


def test_multibyte_characters_split_across_tokens_come_out_whole(tokenizer) -> None:
    text = "Hello 🙂 世界 naïve 🦀🤖 done"
    output_ids = encode(tokenizer, text)
    pieces = [tokenizer.convert_ids_to_tokens(i) for i in output_ids]
    assert len(output_ids) > len(text.split()) + 4, f"expected byte tokens, got {pieces}"
    chunks = stream(IncrementalDetokenizer(tokenizer, encode(tokenizer, PROMPT)), output_ids)
    assert "".join(chunks) == text == decode(tokenizer, output_ids)
    assert not any("\ufffd" in chunk for chunk in chunks), chunks
    assert "" in chunks, "a byte token that does not complete a character must yield nothing yet"


def test_leading_space_of_the_first_output_token_is_kept(tokenizer) -> None:
    detokenizer = IncrementalDetokenizer(tokenizer, encode(tokenizer, "Hello"))
    assert "".join(stream(detokenizer, encode(tokenizer, " world"))) == " world"


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_special_tokens_follow_skip_special_tokens(tokenizer, skip_special_tokens: bool) -> None:
    chat = [{"role": "user", "content": "Hi"}]
    prompt_ids = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True,
                                               return_dict=False)
    output_ids = encode(tokenizer, "Hi there!") + [tokenizer.eos_token_id]
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens=skip_special_tokens)
    expected = "Hi there!" if skip_special_tokens else "Hi there!<|im_end|>"
    assert "".join(stream(detokenizer, output_ids)) == expected


def _sequences(tokenizer):
    vocab = tokenizer.get_vocab()
    # Single-character tokens of the byte-level alphabet include the lone bytes of multi-byte characters:
    # drawing them often makes incomplete and invalid UTF-8 sequences common.
    byte_ids = sorted(i for token, i in vocab.items() if len(token) == 1)
    token_id = st.one_of(
        st.integers(0, len(vocab) - 1),
        st.sampled_from(byte_ids),
        st.sampled_from(tokenizer.all_special_ids),
    )
    return st.lists(token_id, max_size=40)


def test_output_equals_one_shot_decode_for_random_tokens(tokenizer, decoding) -> None:
    @settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(output_ids=_sequences(tokenizer), skip_special_tokens=st.booleans(), has_prompt=st.booleans())
    def check(output_ids: list[int], skip_special_tokens: bool, has_prompt: bool) -> None:
        prompt_ids = encode(tokenizer, PROMPT) if has_prompt else []
        detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens=skip_special_tokens)
        chunks = stream(detokenizer, output_ids)
        expected = decode(tokenizer, output_ids, skip_special_tokens)
        assert "".join(chunks) == expected
        if "\ufffd" not in expected:
            # Held back until complete, never released as a replacement character (an invalid byte is
            # U+FFFD in the one-shot decode too, and the byte table may release it at once).
            assert not any("\ufffd" in chunk for chunk in chunks), "U+FFFD released for a split character"
        if decoding == "window":  # it holds back any trailing U+FFFD until the end
            assert not any(chunk.endswith("\ufffd") for chunk in chunks[:-1]), "U+FFFD released before the end"
        assert detokenizer.num_tokens_used == len(output_ids) and not detokenizer.stopped

    check()


def test_tokens_pushed_in_groups_give_the_same_text(tokenizer) -> None:
    """The gateway pushes several tokens at once when it fell behind (and decodes them together when no
    stop string is set): the text must not depend on how the tokens were grouped."""
    @settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(output_ids=_sequences(tokenizer), cuts=st.lists(st.integers(0, 40), max_size=8))
    def check(output_ids: list[int], cuts: list[int]) -> None:
        bounds = sorted({0, len(output_ids), *(c for c in cuts if c <= len(output_ids))})
        detokenizer = IncrementalDetokenizer(tokenizer, encode(tokenizer, PROMPT))
        groups = [output_ids[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
        chunks = [detokenizer.push(group) for group in groups] + [detokenizer.finish()]
        expected = decode(tokenizer, output_ids)
        assert "".join(chunks) == expected
        if "\ufffd" not in expected:
            assert not any("\ufffd" in chunk for chunk in chunks), "U+FFFD released for a split character"
        assert detokenizer.num_tokens_used == len(output_ids)

    check()


def test_stop_string_in_random_tokens_cuts_exactly(tokenizer) -> None:
    @settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(output_ids=_sequences(tokenizer), data=st.data())
    def check(output_ids: list[int], data: st.DataObject) -> None:
        text = decode(tokenizer, output_ids)
        assume(len(text) >= 2)
        start = data.draw(st.integers(0, len(text) - 1))
        stop = text[start:data.draw(st.integers(start + 1, min(len(text), start + 6)))]
        assume("\ufffd" not in stop)
        detokenizer = IncrementalDetokenizer(tokenizer, encode(tokenizer, PROMPT), stop=[stop])
        assert "".join(stream(detokenizer, output_ids)) == text[: text.find(stop)]
        assert detokenizer.stopped
        # The stop belongs to the first token after which the settled text contains it.
        first = next(n for n in range(1, len(output_ids) + 1)
                     if stop in decode(tokenizer, output_ids[:n]).rstrip("\ufffd"))
        assert detokenizer.num_tokens_used == first

    check()


def test_stop_string_spanning_tokens_is_cut_exactly(tokenizer) -> None:
    output_ids = encode(tokenizer, "The answer is forty-two. Then more text follows.")
    stop = "forty-two."
    detokenizer = IncrementalDetokenizer(tokenizer, encode(tokenizer, PROMPT), stop=[stop])
    chunks = stream(detokenizer, output_ids)
    assert "".join(chunks) == "The answer is "
    assert detokenizer.stopped
    completing = next(n for n in range(1, len(output_ids) + 1) if stop in decode(tokenizer, output_ids[:n]))
    assert completing > 1 and stop not in decode(tokenizer, output_ids[completing - 1 : completing])
    assert detokenizer.num_tokens_used == completing
    assert all(chunk == "" for chunk in chunks[completing:]), "nothing after the stop"


def test_text_before_an_incomplete_character_is_released_with_its_token(tokenizer) -> None:
    # "Hi 🦀" is 'Hi', 'ĠðŁ', '¦', 'Ģ': the second token carries " " and the crab's first two bytes.
    output_ids = encode(tokenizer, "Hi 🦀 ok")
    assert tokenizer.convert_ids_to_tokens(output_ids[1]) == "ĠðŁ"
    assert stream(IncrementalDetokenizer(tokenizer, []), output_ids)[:4] == ["Hi", " ", "", "🦀"]
    detokenizer = IncrementalDetokenizer(tokenizer, [], stop=["Hi "])
    assert detokenizer.push(output_ids) == ""
    assert detokenizer.num_tokens_used == 2, "the stop completes on the token holding its last character"


def test_stop_at_the_very_first_token(tokenizer) -> None:
    output_ids = encode(tokenizer, "Hello world")
    for stop in ("Hello", "He"):
        detokenizer = IncrementalDetokenizer(tokenizer, encode(tokenizer, PROMPT), stop=[stop])
        assert detokenizer.push(output_ids) == ""  # all tokens in one push: the rest are not used
        assert detokenizer.stopped and detokenizer.num_tokens_used == 1
        assert detokenizer.finish() == ""


def test_earliest_stop_string_wins(tokenizer) -> None:
    output_ids = encode(tokenizer, "one two three four")
    detokenizer = IncrementalDetokenizer(tokenizer, [], stop=["four", "two th", "three"])
    assert "".join(stream(detokenizer, output_ids)) == "one "


def test_stop_string_of_multibyte_characters(tokenizer) -> None:
    output_ids = encode(tokenizer, "Say 你好世界 and leave")
    detokenizer = IncrementalDetokenizer(tokenizer, [], stop=["世界"])
    assert "".join(stream(detokenizer, output_ids)) == "Say 你好"


def test_possible_stop_start_is_held_back_then_flushed_by_finish(tokenizer) -> None:
    output_ids = encode(tokenizer, "Hello world")
    detokenizer = IncrementalDetokenizer(tokenizer, [], stop=["world peace"])
    pushed = "".join(detokenizer.push([token_id]) for token_id in output_ids)
    assert pushed == "Hello ", "'world' may begin 'world peace': held back"
    assert detokenizer.finish() == "world"
    assert not detokenizer.stopped and detokenizer.num_tokens_used == len(output_ids)


def test_held_back_text_is_released_once_it_cannot_be_a_stop(tokenizer) -> None:
    detokenizer = IncrementalDetokenizer(tokenizer, [], stop=["world peace"])
    assert detokenizer.push(encode(tokenizer, "Hello world")) == "Hello "
    assert detokenizer.push(encode(tokenizer, " war")) == "world war"
