"""tandem's transformers-free Tokenizer and config reading, checked against transformers itself.

Small tokenizers built here cover the config shapes (added tokens, extra and model-specific special tokens,
templates as lists, clean-up); SmolLM2's real tokenizer (slow) covers encode/decode/chat on varied text.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer as RustTokenizer
from tokenizers import decoders, models, normalizers, pre_tokenizers, trainers

from tandem.common.config import ConfigError, ModelConfig, RopeConfig
from tandem.models import Tokenizer, apply_chat_template, load_model_config, load_tokenizer
from tandem.models.detokenizer import IncrementalDetokenizer
from tandem.models.loader import config_from_hf_folder

TEXTS = [
    "Hello, world!",
    "The capital of France is Paris. Isn't it? I'm sure it's true, they've said so.",
    "naïve café — 世界 こんにちは Здравствуйте",
    "emoji 🙂🦀🤖👩‍👩‍👧‍👦 and flags 🇫🇷🇯🇵",
    "  leading spaces, double  spaces,\ttabs\t\tand\n\nnewlines   \n  ",
    "   ",
    "",
    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more text<|im_end|>",
    "not quite special: <|im_start |> <im_end|> <|endoftext",
    "code: def f(x):\n    return x ** 2  # comment\n",
    "numbers 1234567890 3.14159 1e-5 0x1F",
    "\u200b zero width \u00a0nbsp \ufeff bom",
    "don 't , spaced . punctuation ! ?",
]

CHATS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi!"}],
    [
        {"role": "system", "content": "You are a poet."},
        {"role": "user", "content": "Write a haiku about GPUs."},
        {"role": "assistant", "content": "Silicon rivers\nthousands of tiny minds hum\nheat rises like dawn"},
        {"role": "user", "content": "Now one about 🦀 and 世界."},
    ],
    [{"role": "user", "content": "  spaces  \n\n and <|im_end|> inside  "}],
    [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": ""}],
]


# --- small tokenizers built here ---------------------------------------------------------------

CORPUS = ["the quick brown fox jumps over the lazy dog", "hello world, hello there!", "don't stop . ok ?",
          "tokenizers are fun", "naïve café 世界 🙂"] * 20


def _byte_level_bpe() -> RustTokenizer:
    tok = RustTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<eos>", "<bos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    return tok


def _wordpiece() -> RustTokenizer:
    tok = RustTokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    trainer = trainers.WordPieceTrainer(vocab_size=300, special_tokens=["[UNK]", "[CLS]", "[SEP]", "[PAD]"],
                                        show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    return tok


TEMPLATE = textwrap.dedent("""\
    {{ bos_token }}{% set ns = namespace(n=0) %}
    {% for message in messages %}
        {% if message['role'] == 'tool' %}{{ raise_exception('no tools here') }}{% endif %}
        {% if loop.index > 3 %}{% break %}{% endif %}
        {% set ns.n = ns.n + 1 %}
        {{ '<|' + message['role'] + '|>' }}{% generation %}{{ message['content'] | trim }}{% endgeneration %}
        {{ eos_token }}
    {% endfor %}
    {{ {'n': ns.n, 'text': 'é<&>'} | tojson }}{{ dict(a=1) | tojson(sort_keys=True) }}
    {% if image_token is defined %}{{ image_token }}{% endif %}
    {% if add_generation_prompt %}<|assistant|>{% endif %}""")

CONFIGS: dict[str, dict[str, Any]] = {
    "plain": {"bos_token": "<bos>", "eos_token": "<eos>", "chat_template": TEMPLATE},
    # Named tokens the vocabulary lacks are added as special; an added_tokens_decoder re-adds its tokens
    # with its own properties (here: <eos> made non-special, a new non-special token).
    "added-tokens": {
        "bos_token": {"__type": "AddedToken", "content": "<bos>", "lstrip": False, "rstrip": False,
                      "normalized": False, "single_word": False, "special": True},
        "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>",
        "added_tokens_decoder": {
            "0": {"content": "<eos>", "lstrip": False, "rstrip": True, "normalized": False,
                  "single_word": False, "special": False},
            "1": {"content": "<bos>", "lstrip": False, "rstrip": False, "normalized": False,
                  "single_word": False, "special": True},
            "400": {"content": "<tool>", "lstrip": True, "rstrip": False, "normalized": False,
                    "single_word": False, "special": False},
        },
        "chat_template": [{"name": "default", "template": TEMPLATE}, {"name": "tool_use", "template": "x"}],
    },
    "extra-special": {
        "bos_token": "<bos>", "eos_token": "<eos>", "additional_special_tokens": ["<a>", "<b>"],
        "image_token": "<image>", "chat_template": TEMPLATE,
    },
    "extra-special-dict": {
        "eos_token": "<eos>", "extra_special_tokens": {"audio_token": "<audio>"}, "split_special_tokens": True,
    },
    "clean-up": {"bos_token": "<bos>", "eos_token": "<eos>", "clean_up_tokenization_spaces": True},
    "clean-up-forced": {"eos_token": "<eos>", "clean_up_tokenization_spaces": True,
                        "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output": True},
}


def _save(folder: Path, backend: RustTokenizer, config: dict[str, Any]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    backend.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def _hf_fast(folder: Path) -> Any:
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(str(folder))


def _assert_same_tokenizer(ours: Tokenizer, hf: Any, texts: list[str]) -> None:
    assert json.loads(ours.backend_tokenizer.to_str()) == json.loads(hf.backend_tokenizer.to_str())
    assert ours.special_tokens_map == hf.special_tokens_map
    assert ours.all_special_tokens == hf.all_special_tokens
    assert ours.all_special_ids == hf.all_special_ids
    for name in ("bos_token", "eos_token", "pad_token", "unk_token",
                 "bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id", "vocab_size"):
        assert getattr(ours, name) == getattr(hf, name), name
    assert len(ours) == len(hf)
    assert ours.get_vocab() == hf.get_vocab()
    if hf.chat_template is None:
        assert ours.chat_template is None
    else:
        assert ours.chat_template == hf.get_chat_template()
    for text in texts:
        ids = ours.encode(text)
        assert ids == hf.encode(text, add_special_tokens=False), text
        assert ours.encode(text, add_special_tokens=True) == hf.encode(text, add_special_tokens=True), text
        assert ours.convert_ids_to_tokens(ids) == hf.convert_ids_to_tokens(ids)
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip), text
            for clean_up in (False, True):
                assert ours.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=clean_up) == \
                    hf.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=clean_up), text


@pytest.mark.parametrize("model", ["bpe", "wordpiece"])
@pytest.mark.parametrize("config_name", list(CONFIGS))
def test_small_tokenizers_match_transformers(tmp_path: Path, model: str, config_name: str) -> None:
    backend = _byte_level_bpe() if model == "bpe" else _wordpiece()
    config = json.loads(json.dumps(CONFIGS[config_name]))
    if model == "wordpiece" and "added_tokens_decoder" in config:
        config["added_tokens_decoder"]["300"] = config["added_tokens_decoder"].pop("400")
    folder = _save(tmp_path / "tok", backend, config)
    ours, hf = Tokenizer.from_folder(folder), _hf_fast(folder)
    texts = [*TEXTS, "<bos>a <eos> b <tool> c<pad><unk>", "<a><b> <image><audio>", "hello world . ok ? don 't"]
    _assert_same_tokenizer(ours, hf, texts)
    random_ids = [random.Random(0).randrange(len(hf)) for _ in range(200)]
    for skip in (False, True):
        assert ours.decode(random_ids, skip_special_tokens=skip) == hf.decode(random_ids, skip_special_tokens=skip)
    if ours.chat_template is not None:
        chats = [*CHATS, [{"role": "user", "content": "x", "reasoning": "hmm", "name": None}]]
        for chat in chats:
            for add_generation_prompt in (False, True):
                kwargs = dict(add_generation_prompt=add_generation_prompt)
                assert ours.apply_chat_template(chat, tokenize=False, **kwargs) == \
                    hf.apply_chat_template(chat, tokenize=False, **kwargs)
                assert ours.apply_chat_template(chat, **kwargs) == \
                    hf.apply_chat_template(chat, tokenize=True, return_dict=False, **kwargs)
        with pytest.raises(Exception, match="no tools here"):
            ours.apply_chat_template([{"role": "tool", "content": "x"}])


def test_chat_template_file_wins_over_the_config(tmp_path: Path) -> None:
    folder = _save(tmp_path / "tok", _byte_level_bpe(), {"eos_token": "<eos>", "chat_template": "config"})
    assert Tokenizer.from_folder(folder).chat_template == "config"
    (folder / "chat_template.jinja").write_text("{{ messages[0]['content'] }}!")
    tokenizer = Tokenizer.from_folder(folder)
    assert tokenizer.chat_template == _hf_fast(folder).chat_template == "{{ messages[0]['content'] }}!"
    assert tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == "hi!"


def test_template_sandbox_refuses_underscore_attributes(tmp_path: Path) -> None:
    folder = _save(tmp_path / "tok", _byte_level_bpe(), {"eos_token": "<eos>"})
    tokenizer = Tokenizer.from_folder(folder)
    with pytest.raises(Exception, match="underscore"):
        tokenizer.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False,
                                      chat_template="{% set ns = namespace(_x=1) %}")
    with pytest.raises(Exception, match="unsafe|access"):
        tokenizer.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False,
                                      chat_template="{{ messages.__class__.__mro__ }}")


def test_missing_tokenizer_json_is_a_config_error(tmp_path: Path) -> None:
    (tmp_path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(ConfigError, match="not a fast tokenizer.*tokenizer.json"):
        Tokenizer.from_folder(tmp_path)


def test_no_chat_template_is_a_config_error(tmp_path: Path) -> None:
    folder = _save(tmp_path / "tok", _byte_level_bpe(), {"eos_token": "<eos>"})
    with pytest.raises(ConfigError, match="no chat template"):
        apply_chat_template(Tokenizer.from_folder(folder), [{"role": "user", "content": "x"}])


# --- config.json without AutoConfig ----------------------------------------------------------------


def reference_config(path: Path, name: str | None = None) -> ModelConfig:
    """What config_from_hf_folder computed with transformers' AutoConfig and AutoTokenizer."""
    from transformers import AutoConfig, AutoTokenizer

    hf = AutoConfig.from_pretrained(str(path))
    params = getattr(hf, "rope_parameters", None)
    if not params:
        params = dict(getattr(hf, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(hf, "rope_theta", 10000.0))
    rope_type = params.get("rope_type") or params.get("type") or "default"
    theta = float(params["rope_theta"])
    rope = RopeConfig(theta=theta) if rope_type == "default" else RopeConfig(
        theta=theta, rope_type=rope_type, factor=float(params["factor"]),
        low_freq_factor=float(params["low_freq_factor"]), high_freq_factor=float(params["high_freq_factor"]),
        original_max_position_embeddings=int(params["original_max_position_embeddings"]))

    def ids(value: Any) -> set[int]:
        return set() if value is None else {value} if isinstance(value, int) else set(value)

    eos = ids(hf.eos_token_id)
    if (path / "generation_config.json").is_file():
        eos |= ids(json.loads((path / "generation_config.json").read_text()).get("eos_token_id"))
    has_tokenizer = (path / "tokenizer.json").is_file() or (path / "tokenizer_config.json").is_file()
    if has_tokenizer:
        eos |= ids(AutoTokenizer.from_pretrained(str(path)).eos_token_id)
    heads = hf.num_attention_heads
    return ModelConfig(
        name=name or path.resolve().name, vocab_size=hf.vocab_size, hidden_size=hf.hidden_size,
        intermediate_size=hf.intermediate_size, num_hidden_layers=hf.num_hidden_layers, num_attention_heads=heads,
        num_key_value_heads=getattr(hf, "num_key_value_heads", None) or heads,
        head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // heads,
        max_position_embeddings=hf.max_position_embeddings, rms_norm_eps=hf.rms_norm_eps, rope=rope,
        tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
        attention_bias=bool(getattr(hf, "attention_bias", False)), mlp_bias=bool(getattr(hf, "mlp_bias", False)),
        eos_token_ids=tuple(sorted(eos)), bos_token_id=getattr(hf, "bos_token_id", None), weights_path=str(path),
        tokenizer_path=str(path) if has_tokenizer else None)


LLAMA3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
MINIMAL = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 96,
           "num_hidden_layers": 2}
RAW_CONFIGS: dict[str, dict[str, Any]] = {
    "minimal": MINIMAL,  # every other key from LlamaConfig's defaults
    "nulls": MINIMAL | {"head_dim": None, "num_key_value_heads": None, "bos_token_id": None, "eos_token_id": None},
    "v4-rope-scaling-type": MINIMAL | {"rope_theta": 500000.0, "tie_word_embeddings": True, "eos_token_id": [9, 8],
                                       "rope_scaling": {"type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                                        "high_freq_factor": 4.0,
                                                        "original_max_position_embeddings": 8192}},
    "v4-rope-theta-only": MINIMAL | {"rope_theta": 12345.0, "rms_norm_eps": 1e-5, "attention_bias": True},
    "v4-llama3-no-original-max": MINIMAL | {
        "rope_theta": 500000.0, "max_position_embeddings": 4096, "mlp_bias": True,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}},
    "v5-rope-parameters": MINIMAL | {"rope_parameters": dict(LLAMA3), "num_key_value_heads": 2, "head_dim": 32},
    "v5-theta-outside": MINIMAL | {"rope_parameters": {"rope_type": "default"}, "rope_theta": 2000.0},
    "v5-default": MINIMAL | {"rope_parameters": {"rope_type": "default", "rope_theta": 100000.0}},
}


@pytest.mark.parametrize("variant", list(RAW_CONFIGS))
def test_config_json_read_as_autoconfig_does(tmp_path: Path, variant: str) -> None:
    folder = tmp_path / variant
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(RAW_CONFIGS[variant]))
    if variant == "v5-default":
        (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [3, 5]}))
    assert config_from_hf_folder(folder) == reference_config(folder)
    assert config_from_hf_folder(folder, name="x") == reference_config(folder, name="x")


@pytest.mark.parametrize("rope", ["default", "llama3"])
def test_random_hf_models_read_as_autoconfig_does(tmp_path: Path, rope: str) -> None:
    from tests.factories import save_random_hf_model

    overrides: dict[str, object] = {"rope_parameters": dict(LLAMA3)} if rope == "llama3" else {}
    save_random_hf_model(tmp_path, **overrides)
    assert config_from_hf_folder(tmp_path) == reference_config(tmp_path)


def test_transformers_saved_configs_read_as_autoconfig_does(tmp_path: Path) -> None:
    from transformers import LlamaConfig

    for i, kwargs in enumerate([{}, {"rope_parameters": dict(LLAMA3), "tie_word_embeddings": True},
                                {"num_key_value_heads": 8, "head_dim": 256, "bos_token_id": None,
                                 "eos_token_id": [4, 2]}]):
        folder = tmp_path / str(i)
        LlamaConfig(**kwargs).save_pretrained(folder)
        assert config_from_hf_folder(folder) == reference_config(folder)


def test_folder_tokenizer_eos_joins_the_config_eos(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(MINIMAL | {"eos_token_id": 7}))
    _save(tmp_path, _byte_level_bpe(), {"eos_token": "<eos>", "tokenizer_class": "PreTrainedTokenizerFast"})
    config = config_from_hf_folder(tmp_path)
    assert config == reference_config(tmp_path)
    assert config.eos_token_ids == (0, 7)
    assert load_tokenizer(config).eos_token_id == 0


# --- the real SmolLM2 --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2(smollm2_path: Path) -> tuple[Tokenizer, Any]:
    from transformers import AutoTokenizer

    return Tokenizer.from_folder(smollm2_path), AutoTokenizer.from_pretrained(smollm2_path)


@pytest.mark.slow
def test_smollm2_matches_transformers(smollm2: tuple[Tokenizer, Any]) -> None:
    ours, hf = smollm2
    _assert_same_tokenizer(ours, hf, TEXTS)
    assert (ours.eos_token_id, ours.bos_token_id) == (2, 1)
    assert (ours.eos_token, ours.bos_token) == ("<|im_end|>", "<|im_start|>")
    assert ours.is_fast and ours.vocab_size == 49152
    assert ours.convert_tokens_to_ids("<|im_start|>") == hf.convert_tokens_to_ids("<|im_start|>") == 1
    assert ours.convert_tokens_to_ids("not-a-token") == hf.convert_tokens_to_ids("not-a-token")
    assert ours.convert_ids_to_tokens(1) == hf.convert_ids_to_tokens(1)


@pytest.mark.slow
def test_smollm2_decode_of_random_ids(smollm2: tuple[Tokenizer, Any]) -> None:
    ours, hf = smollm2
    rng = random.Random(0)
    for _ in range(50):
        ids = [rng.randrange(len(hf)) for _ in range(rng.randrange(1, 40))] + rng.sample(range(17), 3)
        rng.shuffle(ids)
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)
        assert ours.convert_ids_to_tokens(ids, skip_special_tokens=True) == \
            hf.convert_ids_to_tokens(ids, skip_special_tokens=True)


@pytest.mark.slow
@pytest.mark.parametrize("add_generation_prompt", [False, True])
@pytest.mark.parametrize("chat", CHATS, ids=[f"chat{i}" for i in range(len(CHATS))])
def test_smollm2_chat_template_matches_transformers(smollm2: tuple[Tokenizer, Any], chat: list[dict[str, Any]],
                                                    add_generation_prompt: bool) -> None:
    ours, hf = smollm2
    kwargs = dict(add_generation_prompt=add_generation_prompt)
    text = ours.apply_chat_template(chat, tokenize=False, **kwargs)
    assert text == hf.apply_chat_template(chat, tokenize=False, **kwargs)
    ids = ours.apply_chat_template(chat, **kwargs)
    assert ids == hf.apply_chat_template(chat, tokenize=True, return_dict=False, **kwargs)
    assert ids == hf.encode(text, add_special_tokens=False)
    if add_generation_prompt:
        assert apply_chat_template(ours, chat) == apply_chat_template(hf, chat) == ids


@pytest.mark.slow
def test_smollm2_load_tokenizer_and_config(smollm2_path: Path) -> None:
    cache = smollm2_path.parent.parent
    config = load_model_config("smollm2-135m", cache_dir=cache, fetch=False)
    assert config == reference_config(smollm2_path, name="smollm2-135m")
    assert config_from_hf_folder(smollm2_path) == reference_config(smollm2_path)
    tokenizer = load_tokenizer(config)
    assert isinstance(tokenizer, Tokenizer) and tokenizer.is_fast
    assert set(config.eos_token_ids) == {0, 2}


@pytest.mark.slow
def test_smollm2_detokenizer_agrees_with_transformers(smollm2: tuple[Tokenizer, Any]) -> None:
    ours, hf = smollm2
    prompt = ours.apply_chat_template(CHATS[2])
    output = ours.encode("Hello 🙂 世界 naïve 🦀🤖 done. Isn't it?") + [ours.eos_token_id]
    for skip in (False, True):
        streams = []
        for tokenizer in (ours, hf):
            detok = IncrementalDetokenizer(tokenizer, prompt, stop=["🤖"], skip_special_tokens=skip)
            streams.append([detok.push([t]) for t in output] + [detok.finish()])
        assert streams[0] == streams[1]


@pytest.mark.slow
def test_gateway_path_loads_no_torch_or_transformers(smollm2_path: Path) -> None:
    code = textwrap.dedent(f"""
        import sys
        from pathlib import Path
        from tandem.models import apply_chat_template, load_model_config, load_tokenizer
        from tandem.models.detokenizer import IncrementalDetokenizer

        config = load_model_config("smollm2-135m", cache_dir=Path({str(smollm2_path.parent.parent)!r}), fetch=False)
        tokenizer = load_tokenizer(config)
        ids = apply_chat_template(tokenizer, [{{"role": "user", "content": "Hi!"}}])
        detok = IncrementalDetokenizer(tokenizer, ids, stop=["."])
        text = detok.push(tokenizer.encode("Hello there. Bye")) + detok.finish()
        assert text == "Hello there", text
        loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "transformers"))
        assert not loaded, loaded
    """)
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)

