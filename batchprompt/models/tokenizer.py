"""Tokenizer and chat template, taken from the model's own files."""
from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
import threading
from pathlib import Path
from typing import Sequence

from .gguf_tokenizer import gguf_tokenizer_facts, repair
from .loader import ModelNotFoundError, ModelSource, check_tokenizer_files

Message = dict[str, str]


log = logging.getLogger("batchprompt")


def cache_dir() -> Path:
    root = os.environ.get("BATCHPROMPT_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "batchprompt")
    return Path(root)


def _save_whole(hf, cached: Path) -> None:
    """Write the converted tokenizer to `cached` whole or not at all: into a directory of its
    own, renamed into place. Processes that start together (replicas, a server and a job) each
    convert; the first rename wins, and none reads a directory another is still writing."""
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=f".{cached.name}-", dir=cached.parent)
    except OSError:  # a read-only home only costs the next start a few seconds
        return
    try:
        hf.save_pretrained(tmp)
        os.rename(tmp, cached)
    except OSError:  # another process's rename came first, or the disk is full or read-only
        pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


class Tokenizer:
    """Wraps a `transformers` tokenizer: prompt rendering with the model's Jinja chat template."""

    def __init__(self, hf_tokenizer, extra_eos: Sequence[int] = ()):
        self.hf = hf_tokenizer
        eos = {i for i in extra_eos if i is not None}
        if hf_tokenizer.eos_token_id is not None:
            eos.add(hf_tokenizer.eos_token_id)
        self.eos_token_ids: frozenset[int] = frozenset(eos)
        self.has_chat_template = bool(getattr(hf_tokenizer, "chat_template", None))
        # Callers' threads encode while the engine thread decodes; the Rust tokenizer may not
        # be entered from two threads at once ("Already borrowed"), so calls take turns.
        self._lock = threading.Lock()
        self._byte_decoder: dict[str, int] | None = None  # token_bytes': made on first use
        self._special_ids: frozenset[int] = frozenset()
        self._max_token_bytes: int | None = None  # most input bytes one token covers: on first use

    @classmethod
    def load(cls, source: ModelSource, extra_eos: Sequence[int] = ()) -> "Tokenizer":
        from transformers import AutoTokenizer

        if source.kind == "hf_dir":
            check_tokenizer_files(source)
            try:
                return cls(AutoTokenizer.from_pretrained(str(source.path)), extra_eos)
            except Exception as e:  # noqa: BLE001 - transformers raises its own kinds (OSError, ValueError, ...)
                raise ModelNotFoundError(f"{source.path}: its tokenizer cannot be loaded: {type(e).__name__}: "
                                         f"{e}") from e
        # Converting a GGUF vocabulary takes seconds; keep the converted files in a cache, one
        # per file and transformers version (versions convert differently).
        import transformers

        stat = source.path.stat()
        key = hashlib.sha256(f"{source.path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}:"
                             f"{transformers.__version__}".encode()).hexdigest()[:16]
        cached = cache_dir() / "tokenizers" / key
        if cached.is_dir():  # renamed into place whole (_save_whole), and put right before
            try:
                return cls(AutoTokenizer.from_pretrained(str(cached)), extra_eos)
            except Exception as e:  # damaged since: convert again (and leave it for the user to delete)
                log.warning("the cached tokenizer %s cannot be read (%s); converting %s again; delete the "
                            "directory to cache it anew", cached, e, source.path.name)
        hf = AutoTokenizer.from_pretrained(str(source.path.parent), gguf_file=source.path.name)
        changed = repair(hf, gguf_tokenizer_facts(source.path))
        if changed:
            log.info("the tokenizer that transformers %s made of %s was put right by the file: %s",
                     transformers.__version__, source.path.name, "; ".join(changed))
        _save_whole(hf, cached)
        return cls(hf, extra_eos)

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    def encode(self, text: str, add_special_tokens: bool = True, limit: int | None = None) -> list[int]:
        """`text` as a prompt, the way the model's own tokenizer encodes it by default
        (`tokenizer(text)`): with the BOS token where the tokenizer adds one (Llama), as vLLM
        does for a completion prompt. `add_special_tokens=False` for a piece of text that
        continues a sequence (a choice label after the prompt). `limit`: TooManyTokens, without
        encoding, for a text too long to be `limit` tokens or fewer (no token covers more bytes
        than the vocabulary's longest), so that megabytes of text do not hold the tokenizer,
        which every other caller waits for, only to be refused."""
        _check_unicode(text)
        if limit is not None:
            size = len(text.encode("utf-8"))
            if size > limit * self.max_token_bytes:
                raise TooManyTokens(-(-size // self.max_token_bytes), limit)
        with self._lock:
            return self.hf.encode(text, add_special_tokens=add_special_tokens)

    @property
    def max_token_bytes(self) -> int:
        """The most bytes of text one token can stand for: byte-level BPE writes one character
        per byte; other vocabularies are counted in UTF-8 bytes, doubled for a normalizer that
        shortens text (NFKC's "ﬁ" to "fi")."""
        if self._max_token_bytes is None:
            with self._lock:
                pieces = self.hf.convert_ids_to_tokens(list(range(len(self.hf))))
            pieces = [p for p in pieces if isinstance(p, str)]
            decoder = getattr(getattr(self.hf, "backend_tokenizer", None), "decoder", None)
            if "ByteLevel" in repr(decoder):
                most = max(map(len, pieces), default=1)
            else:
                most = 2 * max((len(p.encode("utf-8", "surrogatepass")) for p in pieces), default=1)
            self._max_token_bytes = max(most, 1)
        return self._max_token_bytes

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        with self._lock:
            return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """One token as log-probs name it: its text, and a special token's own (`<|im_end|>`, as
        vLLM names it), which decode() drops: two special tokens both read "" and one hid the other."""
        with self._lock:
            return self.hf.decode([token_id], skip_special_tokens=False)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for, as OpenAI's log-prob `bytes` give them: a token that
        holds part of a character (an emoji's first bytes) has its own bytes, where its text is
        U+FFFD. Byte-level BPE (GPT-2, Llama 3, SmolLM) maps each byte to a character of its
        pieces; SentencePiece writes a lone byte as <0xNN>; a special token is its own text."""
        if self._byte_decoder is None:
            decoder = getattr(getattr(self.hf, "backend_tokenizer", None), "decoder", None)
            self._byte_decoder = _byte_level_table() if "ByteLevel" in repr(decoder) else {}
            self._special_ids = frozenset(getattr(self.hf, "all_special_ids", ()))
        with self._lock:
            piece = self.hf.convert_ids_to_tokens(token_id)
        if token_id not in self._special_ids and isinstance(piece, str):
            if self._byte_decoder and all(c in self._byte_decoder for c in piece):
                return bytes(self._byte_decoder[c] for c in piece)
            if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                try:
                    return bytes([int(piece[3:5], 16)])
                except ValueError:
                    pass
        return self.token_text(token_id).encode("utf-8", "surrogatepass")

    def render(self, prompt: str | Sequence[Message], system: str | None = None, *,
               add_generation_prompt: bool = True, continue_final_message: bool = False,
               template_kwargs: dict | None = None) -> str:
        """The text the model sees: chat messages through the template, ending with the
        assistant's turn opened (or, continue_final_message, the last message left open, as
        vLLM's request fields ask); `template_kwargs` are the template's own variables. Without
        a chat template (a base model) one user message is its text as written, and anything more
        is NoChatTemplate (its roles would be lost)."""
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        if system is not None and not (messages and messages[0].get("role") == "system"):
            messages.insert(0, {"role": "system", "content": system})
        if not self.has_chat_template:
            if (template_kwargs or {}).get("tools"):  # they were dropped without a word
                raise NoChatTemplate("this model has no chat template, so the tools cannot be shown to it: leave "
                                     "tools out")
            if len(messages) == 1 and messages[0].get("role") == "user" and isinstance(messages[0].get("content"), str):
                return messages[0]["content"]
            raise NoChatTemplate(f"this model has no chat template, so {_conversation(messages)} cannot be rendered "
                                 f"(it renders one user message as its text alone): send the prompt alone, "
                                 f"without a system prompt, or use a model with a chat template")
        return self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                           continue_final_message=continue_final_message, **(template_kwargs or {}))

    def encode_prompt(self, prompt: str | Sequence[Message], system: str | None = None, *,
                      add_generation_prompt: bool = True, continue_final_message: bool = False,
                      add_special_tokens: bool = False, template_kwargs: dict | None = None,
                      limit: int | None = None) -> list[int]:
        """The rendered prompt's tokens. A chat template writes every special token itself (the
        BOS too, where the model wants one), so nothing is added (unless add_special_tokens, as
        vLLM's field asks): the tokens equal `apply_chat_template(..., tokenize=True)`'s and a
        template's BOS is never doubled. Without a template the joined text is a raw prompt and
        gets what `encode` adds."""
        text = self.render(prompt, system, add_generation_prompt=add_generation_prompt,
                           continue_final_message=continue_final_message, template_kwargs=template_kwargs)
        return self.encode(text, add_special_tokens=add_special_tokens or not self.has_chat_template, limit=limit)


class NoChatTemplate(ValueError):
    """A conversation that a model without a chat template cannot render."""


def _conversation(messages: Sequence[Message]) -> str:
    roles = [m.get("role") for m in messages]
    if "system" in roles:
        return "a system prompt"
    if len(messages) != 1:
        return f"a conversation of {len(messages)} messages"
    return f"{'an' if str(roles[0])[:1] in 'aeiou' else 'a'} {roles[0]!r} message"


class TooManyTokens(ValueError):
    """A text longer than `limit` tokens, known without encoding it: `at_least` tokens."""

    def __init__(self, at_least: int, limit: int):
        super().__init__(f"the text is at least {at_least} tokens long, more than {limit}")
        self.at_least, self.limit = at_least, limit


def _byte_level_table() -> dict[str, int]:
    """Byte-level BPE's character for each byte, reversed (GPT-2's bytes_to_unicode)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return {c: b for b, c in bytes_to_unicode().items()}


class InvalidText(ValueError):
    """A text that is not valid Unicode (a lone surrogate): the request's fault."""


def _check_unicode(text: str) -> None:
    """A lone surrogate (JSON's "\\ud800" without its pair) is not text the tokenizer can
    encode: say so, rather than the tokenizer's own TypeError."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidText(f"the text holds a lone surrogate {text[e.start]!r}, which is not valid Unicode (a "
                         f"character cut in half?): pair it or remove it") from None
    except AttributeError:  # not a str: the tokenizer says what it takes
        pass
