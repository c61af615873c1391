"""ModelArgs: the shape of a Llama-family model, read from a HF config.json or GGUF metadata."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

#: HF `model_type` / GGUF `general.architecture` values this package runs.
SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")
#: The context each architecture's `transformers` config takes where config.json names none.
DEFAULT_MAX_POSITION = {"llama": 2048, "mistral": 4096 * 32, "qwen2": 32768, "qwen3": 32768}
#: RoPE scalings computed here: HF's `linear` and `llama3`, and a GGUF's `rope_freqs` factors.
SUPPORTED_ROPE_SCALINGS = ("linear", "llama3", "freq_factors")


class Unsupported(ValueError):
    """A model file read whole, of a kind or with a part this code does not compute: refused,
    never run to give wrong answers. `file`: the file that says so, where not the source."""

    def __init__(self, message: str, file=None):
        super().__init__(message)
        self.file = file


def check_architecture(arch: str) -> None:
    if arch not in SUPPORTED_ARCHITECTURES:
        raise Unsupported(f"model architecture {arch!r} is not supported; "
                          f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")


@dataclass(frozen=True)
class ModelArgs:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position: int = 8192
    rms_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    tie_embeddings: bool = False
    attention_bias: bool = False  # a bias on q, k and v (Qwen2's, and Llama's and Qwen3's attention_bias)
    o_bias: bool = False  # a bias on the attention's output (Llama's and Qwen3's attention_bias)
    qk_norm: bool = False  # Qwen3 normalizes q and k per head
    architecture: str = "llama"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        check_architecture(self.architecture)
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")
        kind = (self.rope_scaling or {}).get("rope_type")
        if kind is not None and kind not in SUPPORTED_ROPE_SCALINGS:
            raise Unsupported(f"rope scaling {kind!r} is not supported (supported: linear, llama3, and dynamic, "
                              f"which is the plain RoPE within max_position_embeddings)")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def flops_per_token(self, context: int = 0, with_head: bool = True) -> float:
        """Forward FLOPs of one token: 2 per weight of every matmul, plus attention over `context`."""
        per_layer = self.hidden_size * (self.q_size + 2 * self.kv_size) + self.q_size * self.hidden_size
        per_layer += 3 * self.hidden_size * self.intermediate_size
        flops = 2.0 * per_layer * self.num_layers
        flops += 4.0 * self.num_layers * self.q_size * context
        if with_head:
            flops += 2.0 * self.hidden_size * self.vocab_size
        return flops

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> "ModelArgs":
        if not isinstance(cfg, dict):
            raise ValueError(f"config.json must hold a JSON object, got {type(cfg).__name__}")
        arch = cfg.get("model_type", "llama")
        check_architecture(arch)  # first: another family lacks the keys read below
        missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                               "num_attention_heads") if k not in cfg]
        if missing:
            raise ValueError(f"config.json lacks {', '.join(missing)}")
        # What the model would compute otherwise: refused, never computed without (wrong answers).
        if cfg.get("mlp_bias"):
            raise Unsupported("mlp_bias=true is not supported (the MLP has no bias here)")
        act = cfg.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise Unsupported(f"hidden_act {act!r} is not supported; the MLP computes silu")
        heads = cfg["num_attention_heads"]
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        # Where a model's attention is not computed here, its context is cut to where the
        # answers are the same (as vLLM's --disable-sliding-window cuts it to the window).
        context = min(n for n in (cfg.get("max_position_embeddings") or DEFAULT_MAX_POSITION[arch],
                                  sliding_window(cfg, arch)) if n)
        biased = arch != "mistral" and bool(cfg.get("attention_bias", False))
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            max_position=context,
            rms_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=_rope_theta(cfg),
            rope_scaling=_rope_scaling(cfg),
            tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=arch == "qwen2" or biased,  # Qwen2's q, k and v have one whatever the config says
            o_bias=arch != "qwen2" and biased,
            qk_norm=arch == "qwen3",
            architecture=arch,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )


def _rope_theta(cfg: dict[str, Any]) -> float:
    if "rope_theta" in cfg:
        return float(cfg["rope_theta"])
    params = cfg.get("rope_parameters") or {}
    return float(params.get("rope_theta", 10000.0))


def _rope_scaling(cfg: dict[str, Any]) -> dict[str, Any] | None:
    scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters")
    if not scaling:
        return None
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    # "dynamic" (NTK) changes nothing within max_position_embeddings (transformers rescales only past
    # it, and reads no original_max_position_embeddings for it): the context is at most that
    return None if kind in ("default", "dynamic") else dict(scaling, rope_type=kind)


def sliding_window(cfg: dict[str, Any], arch: str) -> int | None:
    """The sliding window of attention that some layer of this config uses in `transformers`
    (Mistral's `sliding_window`, 4,096 where config.json leaves it out; Qwen2's and Qwen3's with
    `use_sliding_window`, from layer `max_window_layers` on; or `layer_types`), or None."""
    window = cfg.get("sliding_window", 4096)
    if arch == "mistral" or not window:  # Mistral's attention applies it in every layer
        return window or None
    if arch == "llama" or not cfg.get("use_sliding_window"):
        return None
    types = cfg.get("layer_types")
    if isinstance(types, list):
        return window if "sliding_attention" in types else None
    return window if cfg.get("max_window_layers", 28) < cfg.get("num_hidden_layers", 0) else None
