"""ModelArgs: the shape of a Llama-family model, read from a HF config.json or GGUF metadata."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

#: HF `model_type` / GGUF `general.architecture` values this package runs.
SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")


def check_architecture(arch: str) -> None:
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"model architecture {arch!r} is not supported; "
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
    attention_bias: bool = False  # Qwen2 puts a bias on q, k and v
    qk_norm: bool = False  # Qwen3 normalizes q and k per head
    architecture: str = "llama"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        check_architecture(self.architecture)
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")

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
            raise ValueError("mlp_bias=true is not supported (the MLP has no bias here)")
        act = cfg.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ValueError(f"hidden_act {act!r} is not supported; the MLP computes silu")
        heads = cfg["num_attention_heads"]
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            max_position=cfg.get("max_position_embeddings", 8192),
            rms_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=_rope_theta(cfg),
            rope_scaling=_rope_scaling(cfg),
            tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", arch == "qwen2")),
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
    return None if kind == "default" else dict(scaling, rope_type=kind)
