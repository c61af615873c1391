"""The pool's tokenizer: the model's own tokenizer files, loaded without its weights.

Prompts are rendered here, client-side, with the model's chat template (from its tokenizer
files), so every endpoint receives the very token ids a local engine would run. `tokenizer`
names the files: a local model (a .gguf file or a Hugging Face directory), 'smollm2-135m' for
the embedded model, or a hub id (only the tokenizer's files are fetched); by default the
served model's name."""
from __future__ import annotations

import json
from pathlib import Path

from ..models import ModelNotFoundError, Tokenizer
from ..models.loader import EMBEDDED_HUB_ID, EMBEDDED_NAMES, resolve_model
from .errors import PoolError


def load_tokenizer(name: str | None) -> tuple[Tokenizer, int | None]:
    """(the tokenizer, the model's context length where its config says it). Servers that serve
    the embedded model under its hub id (vLLM's name for it) get the embedded files: the same
    tokenizer, with no download."""
    if name is not None and str(name).lower() == EMBEDDED_HUB_ID.lower():
        name = None
    local = name is None or str(name).lower() in EMBEDDED_NAMES or Path(str(name)).expanduser().exists()
    try:
        if local:
            source = resolve_model(name)
            return Tokenizer.load(source), _local_context(source)
        return _hub_tokenizer(str(name))
    except ModelNotFoundError as e:
        raise PoolError(f"cannot load the tokenizer {name!r} to render prompts: {e}. Give the model's tokenizer: "
                        f"a local model directory or .gguf file, or a hub id (bp.EndpointPool(tokenizer=...), "
                        f"batchprompt run --tokenizer)") from None


#: The files of a hub repository that its tokenizer (and its context length) are read from.
TOKENIZER_PATTERNS = ["*.json", "*.jinja", "tokenizer*", "*.model", "*.tiktoken", "vocab*", "merges.txt"]


def _hub_tokenizer(repo_id: str) -> tuple[Tokenizer, int | None]:
    try:
        from huggingface_hub import snapshot_download
        from transformers import AutoTokenizer

        # The tokenizer's files in one call, then read from disk: AutoTokenizer fetched them one by
        # one, each retried, and offline a served name that is no hub id took about 50 s to fail.
        path = Path(snapshot_download(repo_id, allow_patterns=TOKENIZER_PATTERNS))
        hf = AutoTokenizer.from_pretrained(str(path))
    except Exception as e:  # offline, unknown repo, gated repo
        raise PoolError(f"cannot load the tokenizer of {repo_id!r} ({type(e).__name__}: {e}); the pool renders "
                        f"prompts with the model's own tokenizer: give it as a local model directory or .gguf "
                        f"file, or 'smollm2-135m' for the embedded model (bp.EndpointPool(tokenizer=...), "
                        f"batchprompt run --tokenizer)") from None
    try:
        ctx = json.loads((path / "config.json").read_text()).get("max_position_embeddings")
    except (OSError, ValueError, AttributeError):  # a tokenizer-only repo: the servers' limit then applies
        ctx = None
    return Tokenizer(hf), ctx if isinstance(ctx, int) else None


def _local_context(source) -> int | None:
    try:
        if source.kind == "hf_dir":
            return json.loads((source.path / "config.json").read_text()).get("max_position_embeddings")
        import gguf

        reader = gguf.GGUFReader(str(source.path))
        arch = reader.fields["general.architecture"].contents()
        field = reader.fields.get(f"{arch}.context_length")
        return int(field.contents()) if field is not None else None
    except Exception:  # noqa: BLE001  (unknown: the servers' own limit applies)
        return None
