"""A tokenizer converted from a GGUF file, checked against the file itself.

`transformers` builds a fast tokenizer from a GGUF vocabulary, and some of its versions get
a byte-level BPE vocabulary (GPT-2's kind: SmolLM, Llama 3, Qwen) half wrong. transformers
5.17, for one, gives the embedded model a SentencePiece-style decoder and byte fallback on top
of the byte-level one, and makes `<|im_start|>` its EOS token where the file says
`<|im_end|>`. Decoding still looks right, but the grammar engine then reads the space marker
`Ġ` as the two bytes of its UTF-8 form (every regex and JSON schema answer failed or held
control characters), and `<|im_end|>` was no longer a special token (it showed in log-prob
bytes). The file's own metadata says what the tokenizer is; this puts those parts right.
"""
from __future__ import annotations

from pathlib import Path

# What GGUF's tokenizer.ggml.* ids are called in a transformers tokenizer.
_SPECIAL_KEYS = {"bos_token": "tokenizer.ggml.bos_token_id", "eos_token": "tokenizer.ggml.eos_token_id",
                 "unk_token": "tokenizer.ggml.unknown_token_id", "pad_token": "tokenizer.ggml.padding_token_id"}


def gguf_tokenizer_facts(path: str | Path) -> dict[str, object]:
    """The tokenizer's kind ("gpt2" is byte-level BPE, "llama" SentencePiece) and the ids of
    its special tokens, from the file's metadata (no tensor is read)."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    facts: dict[str, object] = {}
    for key in ("tokenizer.ggml.model", *_SPECIAL_KEYS.values()):
        field = reader.fields.get(key)
        if field is not None:
            try:
                facts[key] = field.contents()
            except Exception:  # a field this gguf version cannot decode is left as it was converted
                pass
    return facts


def repair(hf, facts: dict[str, object]) -> list[str]:
    """Put right, in place, what a conversion got wrong about `hf` (a fast tokenizer) by the
    GGUF file's `facts`; returns what was changed, for the log (empty: nothing)."""
    changed: list[str] = []
    backend = getattr(hf, "backend_tokenizer", None)
    if facts.get("tokenizer.ggml.model") == "gpt2" and backend is not None:
        from tokenizers import decoders

        if type(backend.decoder).__name__ != "ByteLevel":
            backend.decoder = decoders.ByteLevel()
            changed.append("decoder: byte-level")
        model = backend.model
        if getattr(model, "byte_fallback", False):
            model.byte_fallback = False  # a byte-level vocabulary has every byte: nothing falls back
            changed.append("byte fallback: off")
    size = len(hf)
    for name, key in _SPECIAL_KEYS.items():
        token_id = facts.get(key)
        if not isinstance(token_id, int) or not 0 <= token_id < size:
            continue
        token = hf.convert_ids_to_tokens(token_id)
        if isinstance(token, str) and getattr(hf, name, None) != token:
            setattr(hf, name, token)
            changed.append(f"{name}: {token}")
    return changed
