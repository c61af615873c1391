"""Prompt tokens against `transformers` on the same tokenizer files: a raw prompt gets what the
tokenizer adds by default (the BOS of Llama-family models); a chat-rendered prompt gets exactly
what its template writes."""
from __future__ import annotations

import json
import shutil

import pytest

from batchprompt.models import ModelSource, Tokenizer, resolve_model
from batchprompt.models.tokenizer import NoChatTemplate

LLAMA2_TEMPLATE = "{{ bos_token }}{% for m in messages %}[INST] {{ m['content'] }} [/INST]{% endfor %}"
CHATML_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                   "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TEXTS = ["hello world", "the quick brown fox jumps", "<s> hello"]
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello world"}]


def _llama_style_dir(path, chat_template):
    """A tiny BPE tokenizer whose post-processor puts <s> before every text, as Llama's does
    (ids below the tiny test model's vocabulary of 97; <s> is 1, as in its config)."""
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import decoders, models, pre_tokenizers, processors, trainers

    tk = RustTokenizer(models.BPE(unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Metaspace()
    tk.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=90, special_tokens=["<unk>", "<s>", "</s>"])
    tk.train_from_iterator(["hello world, the quick brown fox jumps [INST] be brief [/INST]"] * 20, trainer)
    tk.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                      special_tokens=[("<s>", tk.token_to_id("<s>"))])
    tk.save(str(path / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
              "unk_token": "<unk>", "add_bos_token": True}
    if chat_template is not None:
        config["chat_template"] = chat_template
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


def _template_ids(hf, messages):
    out = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


@pytest.mark.parametrize("template", [LLAMA2_TEMPLATE, CHATML_TEMPLATE, None],
                         ids=["template-writes-bos", "template-without-bos", "no-template"])
def test_local_llama_style_tokenizer_matches_transformers(tmp_path, template):
    from transformers import AutoTokenizer

    path = _llama_style_dir(tmp_path, template)
    hf = AutoTokenizer.from_pretrained(str(path))
    ours = Tokenizer.load(ModelSource("hf_dir", path, "tiny"))  # tokenizer files only, no weights
    bos = hf.bos_token_id
    for text in TEXTS:
        expected = hf(text)["input_ids"]
        assert expected[0] == bos  # the tokenizer made here does add a BOS
        assert ours.encode(text) == expected
        assert ours.encode(text, add_special_tokens=False) == hf(text, add_special_tokens=False)["input_ids"]
    if template is None:
        # One user message is its text as written, a raw prompt; a system prompt or a conversation
        # is refused (they were joined with "\n", their roles lost, where vLLM refuses them).
        assert ours.encode_prompt(MESSAGES[1]["content"]) == hf(MESSAGES[1]["content"])["input_ids"]
        for asked in ({"system": MESSAGES[0]["content"]}, {}):
            given = MESSAGES[1]["content"] if asked else MESSAGES
            with pytest.raises(NoChatTemplate, match="no chat template, so a system prompt cannot be rendered"):
                ours.encode_prompt(given, **asked)
        with pytest.raises(NoChatTemplate, match="a conversation of 2 messages"):
            ours.encode_prompt([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}])
        with pytest.raises(NoChatTemplate, match="an 'assistant' message"):
            ours.encode_prompt([{"role": "assistant", "content": "b"}])
        with pytest.raises(NoChatTemplate, match="the tools cannot be shown to it"):  # they were dropped unsaid
            ours.encode_prompt("a", template_kwargs={"tools": [{"type": "function", "function": {"name": "f"}}]})
    else:
        ids = ours.encode_prompt(MESSAGES[1]["content"], system=MESSAGES[0]["content"])
        assert ids == _template_ids(hf, MESSAGES)
        assert ids.count(bos) == (1 if template == LLAMA2_TEMPLATE else 0)


@pytest.mark.slow
def test_embedded_gguf_tokenizer_matches_transformers(tmp_path, monkeypatch):
    """The embedded GGUF, converted by us (then read back from our cache) and by transformers."""
    from transformers import AutoTokenizer

    monkeypatch.setenv("BATCHPROMPT_CACHE", str(tmp_path))
    source = resolve_model(None)
    hf = AutoTokenizer.from_pretrained(str(source.path.parent), gguf_file=source.path.name)
    converted, cached = Tokenizer.load(source), Tokenizer.load(source)
    assert any((tmp_path / "tokenizers").iterdir())
    for ours in (converted, cached):
        for text in TEXTS:
            assert ours.encode(text) == hf(text)["input_ids"]
        assert ours.encode_prompt(MESSAGES[1]["content"], system=MESSAGES[0]["content"]) == \
            _template_ids(hf, MESSAGES)


def test_engine_runs_a_raw_text_prompt_with_the_bos(tiny_model_dir, tmp_path):
    """`add_request("text")`, as `/v1/completions` rows and vLLM run it: the tokenizer's BOS first."""
    from transformers import AutoTokenizer

    from batchprompt import LLMEngine, SamplingParams

    path = tmp_path / "model"
    shutil.copytree(tiny_model_dir, path)
    hf = AutoTokenizer.from_pretrained(str(_llama_style_dir(path, LLAMA2_TEMPLATE)))
    engine = LLMEngine.from_pretrained(str(path), dtype="float32", device="cpu", kv_cache_memory=1 << 22)
    out = engine.generate(["hello world"], SamplingParams(max_tokens=1))[0]
    assert out.error is None
    assert out.prompt_token_ids == hf("hello world")["input_ids"] and out.prompt_token_ids[0] == hf.bos_token_id


def test_a_lone_surrogate_is_named_not_the_tokenizers_type_error():
    """JSON's "\\ud800" without its pair reaches Python as a lone surrogate, which no tokenizer
    encodes: one ValueError saying so, for a raw prompt and for chat messages."""
    tok = Tokenizer.load(resolve_model(None))
    for encode in (lambda: tok.encode("lone \udc00 surrogate"),
                   lambda: tok.encode_prompt([{"role": "user", "content": "hi \ud800"}])):
        with pytest.raises(ValueError, match=r"lone surrogate '\\ud[c8]00', which is not valid Unicode"):
            encode()
    assert tok.encode("a pair \U0001F600 is fine")


def test_token_bytes_rebuild_a_character_split_across_tokens():
    """OpenAI's log-prob `bytes`: the embedded (byte-level BPE) tokenizer splits an emoji into
    tokens whose text is U+FFFD each; their bytes join back into the text. A special token's
    bytes are its own text's, as vLLM gives them (they were none, as decoding leaves it out)."""
    from batchprompt.remote.tokenizer import load_tokenizer

    tok = load_tokenizer("smollm2-135m")[0]
    text = "🎉🌟 hi é"
    ids = tok.encode(text, add_special_tokens=False)
    assert "\ufffd" in tok.decode(ids[:1])  # the emoji's first token is part of a character
    assert b"".join(tok.token_bytes(t) for t in ids) == text.encode()
    assert tok.token_bytes(tok.hf.convert_tokens_to_ids("<|im_end|>")) == b"<|im_end|>"


@pytest.mark.parametrize("name", ["embedded", "llama"])
def test_a_text_too_long_by_its_length_is_refused_without_encoding(name, tmp_path, monkeypatch):
    """A prompt of megabytes held the tokenizer (which every caller waits for) for seconds only
    to be refused as too long. Its length alone now tells: no token covers more bytes than
    `max_token_bytes`, so the bound never refuses a text that would fit."""
    if name == "embedded":
        tok = Tokenizer.load(resolve_model(None))
    else:
        tok = Tokenizer.load(ModelSource("hf_dir", _llama_style_dir(tmp_path, None), "tiny"))
    texts = ["hello world " * 50, "\n" + " " * 300 + "x", "é🎉 " * 40, "<|im_start|>" * 30, "a" * 500]
    for text in texts:  # the bound holds: bytes / max_token_bytes never exceeds the true count
        n = len(tok.encode(text, add_special_tokens=False))
        assert n >= len(text.encode()) / tok.max_token_bytes, (text[:20], n, tok.max_token_bytes)
        assert tok.encode(text, add_special_tokens=False, limit=n) == tok.encode(text, add_special_tokens=False)
    huge = "word " * (1000 * tok.max_token_bytes)

    def no_encode(*a, **k):
        raise AssertionError("the huge text was encoded")

    monkeypatch.setattr(tok.hf, "encode", no_encode)
    with pytest.raises(ValueError, match=r"at least \d+ tokens long, more than 1000") as e:
        tok.encode_prompt([{"role": "user", "content": huge}], limit=1000)
    assert e.value.at_least > 1000


def _converted_as_transformers_5_17_did(tmp_path):
    """The embedded model's tokenizer as transformers 5.17 converts it from the GGUF file: a
    SentencePiece decoder chain and byte fallback over the byte-level vocabulary, and
    <|im_start|> for EOS. (Built from the right conversion, edited; 5.17 is not installed here.)"""
    from transformers import AutoTokenizer

    good = Tokenizer.load(resolve_model(None))
    path = tmp_path / "as-5.17"
    good.hf.save_pretrained(path)
    spec = json.loads((path / "tokenizer.json").read_text())
    spec["decoder"] = {"type": "Sequence", "decoders": [
        {"type": "ByteFallback"}, {"type": "Fuse"}, {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
        {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True}]}
    spec["model"].update(byte_fallback=True, fuse_unk=True)
    (path / "tokenizer.json").write_text(json.dumps(spec))
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["eos_token"] = "<|im_start|>"
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return AutoTokenizer.from_pretrained(path)


def test_a_gguf_tokenizer_that_transformers_converts_wrongly_is_put_right_by_the_file(tmp_path, monkeypatch):
    """On a machine with transformers 5.17, every regex and JSON-schema answer of the embedded
    model failed or held control characters: the grammar engine read the converted tokenizer's
    byte fallback as SentencePiece's and took 'Ġ' (a space) for two bytes. Its EOS was
    <|im_start|> too, and <|im_end|> showed in log-prob bytes. The file's metadata says what
    the tokenizer is, and the load puts it right."""
    import transformers

    from batchprompt.structured import Grammar
    from batchprompt.structured.compiler import GrammarCompiler

    broken = _converted_as_transformers_5_17_did(tmp_path)
    real = transformers.AutoTokenizer.from_pretrained

    def as_5_17(name, *args, **kwargs):
        return broken if kwargs.get("gguf_file") else real(name, *args, **kwargs)

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", as_5_17)
    monkeypatch.setenv("BATCHPROMPT_CACHE", str(tmp_path / "cache"))
    for attempt in ("converted", "from the cache"):
        tok = Tokenizer.load(resolve_model(None), [2])
        assert (tok.hf.eos_token, tok.hf.eos_token_id) == ("<|im_end|>", 2), attempt
        # <|im_end|> is special (decoding leaves it out; its log-prob bytes are its own text, as vLLM's)
        assert tok.decode([2]) == "" and tok.token_bytes(2) == b"<|im_end|>", attempt
        assert tok.token_bytes(tok.hf.convert_tokens_to_ids("Ġthe")) == b" the", attempt
        compiler = GrammarCompiler(tok.hf, tok.vocab_size, tok.eos_token_ids)
        matcher = compiler.matcher(Grammar.regex("spam eggs"))
        for t in tok.encode("spam eggs", add_special_tokens=False):
            assert matcher.consume_token(t), (attempt, tok.hf.convert_ids_to_tokens(t), matcher.get_error())
        assert matcher.is_accepting(), attempt


def test_a_tokenizer_cache_is_never_read_half_written(tmp_path, monkeypatch):
    """Converting a GGUF vocabulary writes a cache directory file by file. A process that
    started beside another (a server and a job, Ray replicas) read the directory while the other
    still wrote it, or a write cut off left part of it: the next load took a tokenizer.json
    without its config (another EOS, no chat template). The directory is now renamed into place
    whole; a write that fails leaves nothing."""
    from transformers import PreTrainedTokenizerBase

    monkeypatch.setenv("BATCHPROMPT_CACHE", str(tmp_path / "cache"))
    real_save = PreTrainedTokenizerBase.save_pretrained

    def cut_off(self, directory, *args, **kwargs):
        real_save(self, directory, *args, **kwargs)
        (tmp_path / "written").mkdir(exist_ok=True)
        for name in ("tokenizer_config.json", "chat_template.jinja"):  # the write stops before these
            (type(tmp_path)(directory) / name).unlink(missing_ok=True)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(PreTrainedTokenizerBase, "save_pretrained", cut_off)
    first = Tokenizer.load(resolve_model(None))
    assert (tmp_path / "written").is_dir()  # the cut-off write did happen
    monkeypatch.setattr(PreTrainedTokenizerBase, "save_pretrained", real_save)
    again = Tokenizer.load(resolve_model(None))
    assert again.hf.eos_token == first.hf.eos_token == "<|im_end|>"
    assert again.has_chat_template and again.render("hi") == first.render("hi")
    assert len(list((tmp_path / "cache" / "tokenizers").iterdir())) == 1  # the whole one, nothing left over
