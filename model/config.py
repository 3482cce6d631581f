"""ModelArgs: the few numbers a forward needs, read from an HF ``config.json`` (or its dict)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

SUPPORTED_FAMILIES = ("llama", "opt")


class UnsupportedModel(ValueError):
    """The checkpoint's architecture or a config field is something we do not implement."""


@dataclass(frozen=True)
class ModelArgs:
    family: str  # llama | opt
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    max_position: int
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    tie_embeddings: bool = True
    bos_token_id: Optional[int] = None
    eos_token_ids: tuple[int, ...] = ()
    # OPT only
    do_layer_norm_before: bool = True
    word_embed_proj_dim: Optional[int] = None
    activation: str = "silu"
    attention_bias: bool = False
    mlp_bias: bool = False

    def __post_init__(self):
        if self.family not in SUPPORTED_FAMILIES:
            raise UnsupportedModel(f"unsupported model family {self.family!r}; supported: {SUPPORTED_FAMILIES}")
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedModel(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V one token takes over all layers, at 2 bytes per element."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * 2

    @staticmethod
    def from_hf(cfg: dict) -> "ModelArgs":
        """Build from a Hugging Face config dict (``config.json``)."""
        mtype = cfg.get("model_type", "")
        archs = cfg.get("architectures") or []
        if mtype in ("llama", "mistral", "qwen2") or any("Llama" in a for a in archs):
            return _llama_args(cfg)
        if mtype == "opt" or any(a.startswith("OPT") for a in archs):
            return _opt_args(cfg)
        raise UnsupportedModel(
            f"unsupported architecture (model_type={mtype!r}, architectures={archs}); supported: LLaMA, OPT")


def _eos(cfg: dict) -> tuple[int, ...]:
    eos = cfg.get("eos_token_id")
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)


def _llama_args(cfg: dict) -> ModelArgs:
    scaling = cfg.get("rope_scaling")
    if scaling and scaling.get("rope_type", scaling.get("type")) not in (None, "default"):
        raise UnsupportedModel(f"unsupported rope_scaling {scaling!r}")
    if cfg.get("hidden_act", "silu") != "silu":
        raise UnsupportedModel(f"unsupported hidden_act {cfg.get('hidden_act')!r} for LLaMA")
    heads = cfg["num_attention_heads"]
    rope_theta = cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)
    return ModelArgs(
        family="llama", vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
        num_layers=cfg["num_hidden_layers"], num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        intermediate_size=cfg["intermediate_size"],
        max_position=cfg.get("max_position_embeddings", 2048),
        norm_eps=cfg.get("rms_norm_eps", 1e-6), rope_theta=float(rope_theta),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        bos_token_id=cfg.get("bos_token_id"), eos_token_ids=_eos(cfg),
        attention_bias=bool(cfg.get("attention_bias", False)), mlp_bias=bool(cfg.get("mlp_bias", False)),
    )


def _opt_args(cfg: dict) -> ModelArgs:
    act = cfg.get("activation_function", "relu")
    if act not in ("relu", "gelu"):
        raise UnsupportedModel(f"unsupported activation_function {act!r} for OPT")
    hidden = cfg["hidden_size"]
    proj = cfg.get("word_embed_proj_dim")
    return ModelArgs(
        family="opt", vocab_size=cfg["vocab_size"], hidden_size=hidden,
        num_layers=cfg["num_hidden_layers"], num_heads=cfg["num_attention_heads"],
        num_kv_heads=cfg["num_attention_heads"], head_dim=hidden // cfg["num_attention_heads"],
        intermediate_size=cfg["ffn_dim"], max_position=cfg.get("max_position_embeddings", 2048),
        norm_eps=1e-5, tie_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        bos_token_id=cfg.get("bos_token_id"), eos_token_ids=_eos(cfg),
        do_layer_norm_before=bool(cfg.get("do_layer_norm_before", True)),
        word_embed_proj_dim=proj if proj and proj != hidden else None,
        activation=act, attention_bias=bool(cfg.get("enable_bias", True)), mlp_bias=bool(cfg.get("enable_bias", True)),
    )
