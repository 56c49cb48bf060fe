"""What every command shares: each command's defaults, the option decorators, the typed options a command builds
once from them (Options), one-line user errors, loading models and a session.

Commands import this module; it imports no command.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import os
import signal
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import click
from click.core import ParameterSource

from specchat import heap, threads
from specchat.engine import gguf_header
from specchat.engine.errors import NOT_ON_LEAN, TORCH_ONLY
from specchat.engine.sampling_params import SamplingParams
from specchat.modes import MODES

# Nothing here imports torch at module level (neither may a command module): `specchat --help`, --version and
# argument errors answer before torch loads, and the environment below is set before torch starts its threads.


class UserError(click.ClickException):
    """One clear line, exit status 1, never a traceback."""


class BadOption(UserError):
    """An option value found unusable before any model loads: one line, exit status 2 (as click's usage errors)."""

    exit_code = 2


class Declined(UserError):
    """The user answered no to a first start's conversion: one line, exit status 1, nothing converted."""

    def show(self, file=None) -> None:
        click.echo(f"specchat: {self.format_message()}", err=True)


INTERRUPTED = 130  # the exit status after Ctrl+C (128 + SIGINT, as shells report it)


@contextlib.contextmanager
def user_errors():
    """Turn the errors a user can cause into one-line messages (the error classes are imported only once
    something failed: entering this must not import torch)."""
    try:
        yield
    except Exception as e:
        from specchat.engine.remote import RemoteError
        from specchat.remote_session import RemoteUnavailable

        if isinstance(e, (RemoteError, RemoteUnavailable)):  # before the local engine's errors, which import torch
            raise UserError(str(e)) from None
        from specchat.engine.errors import ModeUnavailable
        from specchat.engine.llamacpp import EngineError
        from specchat.models import ModelError
        from specchat.conversation import PromptTooLong

        if isinstance(e, (ModelError, ModeUnavailable, PromptTooLong, EngineError)):
            raise UserError(str(e)) from None
        raise


# ---------------------------------------------------------------- the process


def prepare_process() -> None:
    """Called first by the `specchat` command, before anything imports torch: how OpenMP threads wait (threads.py),
    how the heap keeps freed pages (heap.py) and what Ctrl+C does."""
    if "torch" not in sys.modules:
        threads.prepare_process()
        heap.keep_freed_pages()
        signal.signal(signal.SIGINT, _on_ctrl_c)


def _on_ctrl_c(signum, frame) -> None:
    """Ctrl+C raises KeyboardInterrupt, except in the middle of an import or a finalizer: in an import it can
    abort the process (torch registers operators through C++ callbacks that must not raise) or leave a
    half-imported module that fails later with a misleading error; in a `__del__` or a weakref callback it is
    printed and dropped.
    There it is raised again 50 ms on, until neither is running."""
    while frame is not None:
        code = frame.f_code
        # an exception raised in a finalizer or a weakref callback (WeakKeyDictionary's `remove`) is printed and dropped
        if code.co_filename.startswith("<frozen importlib") or code.co_name == "__del__" or code.co_filename.endswith(("weakref.py", "_weakrefset.py")):
            threading.Timer(0.05, os.kill, (os.getpid(), signal.SIGINT)).start()
            return
        frame = frame.f_back
    raise KeyboardInterrupt


# ---------------------------------------------------------------- what a command runs with


@dataclass(frozen=True)
class Defaults:
    """What a command runs with where no option says otherwise: its options' click defaults (so its --help shows
    them) and, for a setting it has no option for, the value its Options take."""

    mode: str | None = None  # None: draft with --draft, else off
    draft_lens: tuple[int, ...] = (4,)  # K: a session's is the first (where K is measured, where it starts); bench measures each
    measured_k: bool = False  # -k's default is auto: K chosen each round from measured costs (engine.draft_length); bench's list has auto
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    max_new_tokens: int = 256
    engine: str = "auto"
    timeout: float = 120.0  # --server: seconds to wait for the server's next chunk
    sampled_only: bool = False  # temperature 0 is taken as the default: greedy output has no distribution to test


# Each command's defaults, the one place they are set. The chat samples, as chat apps do (Ollama, LM Studio):
# greedy decoding makes a small model loop ("a mystic realm," fifteen times on the default model); exact either way.
DEFAULTS = {
    "chat": Defaults(mode="auto", temperature=0.7, top_p=0.9, measured_k=True),  # auto: each round the mode measured fastest
    "generate": Defaults(measured_k=True),
    "verify": Defaults(temperature=1.0, sampled_only=True),
    "bench": Defaults(draft_lens=(2, 4, 8), measured_k=True, seed=0, max_new_tokens=128),
    # these score and train with torch's view of the target's layers, greedily
    "tune": Defaults(mode="off", seed=0, max_new_tokens=48, engine="torch"),
    "train-head": Defaults(mode="off", seed=0, max_new_tokens=16, engine="torch"),
}


@dataclass(frozen=True)
class ModelOptions:
    """--target ... --threads: which models load, from where, and where they run (load_models reads only these)."""

    target: str | None = None  # None: the embedded default model
    draft: str | None = None
    download: bool = False
    yes: bool = False
    device: str = "auto"
    engine: str = "auto"
    dtype: str = "auto"
    device_map: str | None = None
    trust_remote_code: bool = False
    threads: int | None = None


@dataclass(frozen=True)
class ModeSettings:
    """--skip-layers ... --draft-vocab, parsed; None leaves the mode its own setting (tuned, trained or built in)."""

    skip_layers: tuple[int, ...] | None = None
    exit_layer: int | None = None
    rank: float | int | None = None
    head_file: str | None = None  # a string: bench writes these settings into results.json
    draft_vocab: int | None = None

    @classmethod
    def parse(cls, params: dict) -> ModeSettings:
        """From click's values: BadOption for a list or rank that is not one, UserError for a --head that is not a head."""
        return cls(skip_layers=parse_skip_layers(params.get("skip_layers")), exit_layer=params.get("exit_layer"),
                   rank=parse_rank(params.get("rank")), head_file=check_head_file(params.get("head_file")),
                   draft_vocab=params.get("draft_vocab"))

    def drafter_options(self) -> dict:
        """The settings given, as the keyword options a drafter's `build` reads."""
        out = {name: value for name, value in vars(self).items() if value is not None}
        if "skip_layers" in out:
            out["skip_layers"] = list(out["skip_layers"])
        return out


def parse_skip_layers(text: str | None) -> tuple[int, ...] | None:
    if not text:
        return None
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise BadOption(f"--skip-layers must be comma-separated layer numbers, got {text!r}") from None


def parse_rank(text: str | None) -> float | int | None:
    """A fraction of the full rank (0.25) or a rank (8)."""
    if text is None:
        return None
    try:
        rank = float(text)
    except ValueError:
        raise BadOption(f"--rank must be a fraction or an integer, got {text!r}") from None
    return int(rank) if rank >= 1 else rank


def check_head_file(name: str | None) -> str | None:
    if not name:
        return None
    path = Path(name).expanduser()
    if not path.with_suffix(".safetensors").is_file():
        if path.is_file():  # a file, but not a head's weights (nor beside them)
            raise UserError(f"--head {name}: not a draft head (a .safetensors file from `specchat train-head`, "
                            f"with its .json beside it)")
        raise UserError(f"--head {name}: no such file")
    return str(path)


@dataclass(frozen=True)
class Options:
    """The options the commands share, typed and checked: built once per command (from_click) and handed down.
    What lies below the CLI gets the values it needs (a SamplingParams, a drafter's options), never this."""

    command: str
    models: ModelOptions
    mode: str  # resolved: the command's default, else draft with --draft, else off
    draft_len: int  # K, or where it starts when measured
    sampling: SamplingParams
    seed: int | None
    max_new_tokens: int
    settings: ModeSettings = ModeSettings()
    adaptive: bool = False
    measured_k: bool = False  # -k auto
    accept_rule: str = "exact"  # parsed by the engine (acceptance.parse_rule, which needs torch) when loading
    system: str | None = None
    servers: tuple[tuple[str | None, str], ...] = ()  # --server as (name or None, url)
    timeout: float = Defaults.timeout
    given: frozenset[str] = frozenset()  # the parameters the user set: --server refuses a --mode or -k given

    @classmethod
    def from_click(cls, command: str, ctx: click.Context | None = None) -> Options:
        """From the parameters of `ctx` (default: the command being invoked); a setting the command has no option
        for takes DEFAULTS[command]. Values click's types cannot check are refused here, in one line."""
        ctx = ctx or click.get_current_context()
        params, defaults = ctx.params, DEFAULTS[command]
        fallback = {**vars(ModelOptions()), "engine": defaults.engine}  # tune and train-head have no --engine
        models = ModelOptions(**{name: params.get(name, value) for name, value in fallback.items()})
        temperature = params.get("temperature", defaults.temperature)
        if temperature == 0 and defaults.sampled_only:
            temperature = defaults.temperature
        sampling = SamplingParams(temperature, params.get("top_k", defaults.top_k), params.get("top_p", defaults.top_p))
        draft_len = params.get("draft_len", "auto" if defaults.measured_k else defaults.draft_lens[0])
        return cls(
            command=command,
            models=models,
            mode=params.get("mode") or defaults.mode or ("draft" if models.draft else "off"),
            draft_len=defaults.draft_lens[0] if draft_len == "auto" else draft_len,
            sampling=sampling,
            seed=params.get("seed", defaults.seed),
            max_new_tokens=params.get("max_new_tokens", defaults.max_new_tokens),
            settings=ModeSettings.parse(params),
            adaptive=params.get("adaptive", False),
            measured_k=draft_len == "auto",
            accept_rule=params.get("accept_rule", "exact"),
            system=params.get("system"),
            servers=parse_servers(params.get("servers", ())),
            timeout=params.get("timeout", defaults.timeout),
            given=frozenset(name for name in params if ctx.get_parameter_source(name) not in (None, ParameterSource.DEFAULT)),
        )


def parse_servers(specs) -> tuple[tuple[str | None, str], ...]:
    """--server [NAME=]URL values as (name or None, url); names must differ."""
    out = []
    for spec in specs:
        name, sep, url = spec.partition("=")
        if not sep or "://" in name:
            name, url = None, spec
        elif not name.strip() or not url.strip():
            raise BadOption(f"--server {spec}: expected URL or NAME=URL")
        out.append((name.strip() if name else None, url.strip()))
    if not out:
        return ()
    from specchat.tui.keys import MAX_MODES

    if len(out) > MAX_MODES:
        raise BadOption(f"--server: at most {MAX_MODES} configurations (the mode keys are F2..F11)")
    names = [n for n, _ in out if n]
    if len(set(names)) != len(names):
        raise BadOption("--server: two configurations with the same name")
    if len(out) > 1 and len(names) != len(out):
        raise BadOption("--server: name each of several servers, as NAME=URL")
    return tuple(out)


# ---------------------------------------------------------------- the options


def apply(options: list, f):
    """Decorate `f` with click options, the first listed first in --help."""
    return functools.reduce(lambda g, opt: opt(g), reversed(options), f)


ENGINE_HELP = ("What runs the models: llama.cpp (GGUF files on the CPU), lean (GGUF files on the CPU, read in place by specchat's own "
               "kernel: modes off, suffix, lookup, draft, layerskip, earlyexit, auto) or torch. auto, for a .gguf target on the CPU: lean or llama.cpp, "
               "whichever ran it faster on this CPU (measured once), llama.cpp for a file the lean engine does not read.")


def _model_options(f, *, draft: bool, engine_help: str = ENGINE_HELP):
    """--engine comes with --draft: the commands that load only the target (tune, train-head) need torch's view of
    the target's layers, and run on torch."""
    return apply([
        click.option("--target", metavar="MODEL", help="HF model id (local cache), directory, or .gguf file. Default: embedded SmolLM2-135M-Instruct."),
        *([click.option("--draft", metavar="MODEL", help="Draft model for mode 'draft' (must share the target's tokenizer).")] if draft else []),
        click.option("--download", is_flag=True, help="Let a Hugging Face id missing from the local cache be downloaded (default: the local cache only, no network)."),
        click.option("-y", "--yes", is_flag=True,
                     help="Let a first start write more than 1 GB into the user cache (a GGUF converted for torch) without asking. "
                          "Without it such a start asks [y/N] (the chat: a dialog); declining exits with status 1, nothing "
                          "converted; with no terminal to ask, it exits with status 2. `specchat cache` lists and removes what was written."),
        click.option("--device", default=ModelOptions.device, show_default=True, help="auto (cuda > mps > cpu), cpu, cuda, cuda:1, mps."),
        *([click.option("--engine", type=click.Choice(["auto", "torch", "llama.cpp", "lean"]), default=ModelOptions.engine, show_default=True,
                        help=engine_help)]
          if draft else []),
        click.option("--dtype", default=ModelOptions.dtype, show_default=True, help="auto (cuda: bf16, cpu: float32), float32, bfloat16, float16."),
        click.option("--device-map", default=None, metavar="MAP", help="'auto' spreads a large target over GPUs and CPU memory (accelerate)."),
        click.option("--trust-remote-code", is_flag=True, help="Allow model repositories to run their own code (off by default)."),
        click.option("--threads", type=click.IntRange(min=1), default=None, help="CPU threads for torch and llama.cpp (default: the physical cores other work leaves free, re-chosen as that changes)."),
    ], f)


def model_options(f):
    """--target/--draft, where they run, how many CPU threads."""
    return _model_options(f, draft=True)


def bench_model_options(f):
    """model_options for bench, which runs on torch (its quality checks score the target's outputs with torch)."""
    return _model_options(f, draft=True, engine_help="bench runs on torch (auto means torch here); benchmarks/engines.py "
                                                     "measures the lean and llama.cpp engines' modes.")


def target_options(f):
    """model_options without --draft (commands that load only the target)."""
    return _model_options(f, draft=False)


def mode_setting_options(f):
    """The settings of the self-speculative modes."""
    return apply([
        click.option("--skip-layers", metavar="LIST", help="layerskip: layers to skip, e.g. 3,5,7 (default: tuned or built-in)."),
        click.option("--exit-layer", type=click.IntRange(min=1), default=None, help="earlyexit: layers run by the draft pass."),
        click.option("--rank", metavar="R", default=None, help="lowrank: rank as a fraction (0.25) or an integer."),
        click.option("--head", "head_file", metavar="FILE", default=None, help="head: a draft head's .safetensors (default: the one trained for this target, or the shipped one)."),
        click.option("--draft-vocab", type=click.IntRange(min=1), default=None, metavar="N",
                     help="draft: the draft model's LM head scores only its N lowest token ids and its end tokens (default: all)."),
    ], f)


class DraftLength(click.ParamType):
    """-k: a positive integer, or auto (K measured each round)."""

    name = "K|auto"

    def convert(self, value, param, ctx):
        if value == "auto" or (isinstance(value, int) and value >= 1):
            return value
        if isinstance(value, str) and value.isdigit() and int(value) >= 1:
            return int(value)
        self.fail(f"{value!r} is not a positive integer or auto", param, ctx)


DRAFT_LEN = DraftLength()


def generation_options(command: str):
    """Decoding settings shared by the chat and the headless commands, with `command`'s defaults (DEFAULTS)."""
    d = DEFAULTS[command]
    mode = "Draft mode." if d.mode else "Draft mode (default: draft if --draft is given, else off)."
    greedy = f"0 is taken as {d.temperature:g}: greedy output has no distribution to test." if d.sampled_only else "0 is greedy."
    return lambda f: apply([
        click.option("--mode", type=click.Choice(list(MODES)), default=d.mode, show_default=bool(d.mode), help=mode),
        click.option("-k", "--draft-len", type=DRAFT_LEN, default="auto" if d.measured_k else d.draft_lens[0], show_default=True,
                     help=f"Draft tokens per round (K), or auto: per mode, the K with the most tokens per second as measured (from {d.draft_lens[0]})."),
        click.option("--temperature", type=click.FloatRange(min=0), default=d.temperature, show_default=True, help=greedy),
        click.option("--top-k", type=click.IntRange(min=0), default=d.top_k, show_default=True, help="0 disables."),
        click.option("--top-p", type=click.FloatRange(0, 1, min_open=True), default=d.top_p, show_default=True, help="Nucleus sampling (1 disables)."),
        click.option("--seed", type=int, default=d.seed, show_default=d.seed is not None, help="Makes sampling reproducible."),
        click.option("--max-new-tokens", type=click.IntRange(min=1), default=d.max_new_tokens, show_default=True),
        mode_setting_options,
        click.option("--adaptive", is_flag=True, help="Adjust K from recent acceptance."),
        click.option("--accept", "accept_rule", default="exact", show_default=True, help="exact, or an approximate rule approx:<param> (labelled exact: false)."),
    ], f)


def server_options(f):
    """--server (the chat, generate, bench): a serving engine runs the target instead of this machine."""
    return apply([
        click.option("--server", "servers", multiple=True, metavar="[NAME=]URL",
                     help="A serving engine (llama-server or vLLM, OpenAI-compatible) instead of a local model; repeat with NAME=URL "
                          "for one configuration each (the mode keys switch). API key: $SPECCHAT_API_KEY."),
        click.option("--timeout", type=click.FloatRange(min=0, min_open=True), default=Defaults.timeout, show_default=True,
                     help="--server: seconds to wait for the server's next chunk."),
    ], f)


def system_option(f):
    """--system, for the commands that use the chat template (the chat, generate)."""
    return click.option("--system", metavar="TEXT", default=None, help="A system message at the start of the conversation.")(f)


def likely_gguf_engine(models: ModelOptions) -> bool:
    """Whether models.pick_engine will choose llama.cpp or the lean engine, told without importing torch or
    llama.cpp (the choice itself needs both)."""
    gguf = [spec is None or spec.endswith(".gguf") for spec in (models.target, models.draft or ".gguf")]
    return models.engine != "torch" and all(gguf) and models.device in ("auto", "cpu")


def llama_cpp_installed() -> bool:
    """llama-cpp-python on sys.path, looked for without importing it."""
    return any((Path(p or ".") / "llama_cpp" / "__init__.py").is_file() for p in sys.path)


def hub_environment(download: bool) -> None:
    """Hub ids come from the local cache, without a network call, unless --download. huggingface_hub reads these
    once, when it is first imported (with transformers, by the engine's modules): set them before anything does,
    or it fetches its agent registry from the Hub even for a model it then reads from the cache."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    # transformers' GGUF conversion draws its bar with tqdm.auto directly (a page of lines on a terminal, a log full
    # of them in the chat): each stage has its own line instead. tqdm reads this when it is first imported.
    os.environ.setdefault("TQDM_DISABLE", "1")
    os.environ["HF_HUB_OFFLINE"] = "0" if download else "1"


def preflight(options: Options) -> None:
    """Refuse what is wrong with the model options before torch or a model loads (the chat is on screen before
    its models load: a missing file must not flash it). models.resolve and pick_engine check the same again
    when loading, with the same words; this only answers sooner. Options that do not go together are BadOption
    (exit status 2, as click's usage errors); a model that is missing or unreadable is a UserError (1)."""
    models, mode = options.models, options.mode
    hub_environment(models.download)
    if mode == "draft" and not models.draft:
        raise BadOption("--mode draft needs a draft model: pass --draft MODEL")
    if models.engine == "llama.cpp" and models.device not in ("auto", "cpu"):
        raise BadOption(f"--engine llama.cpp runs on the CPU; the device is {models.device} (use --engine torch)")
    if models.engine == "llama.cpp" and mode in TORCH_ONLY:
        raise BadOption(f"mode {mode!r} needs the torch engine (--engine torch): it {TORCH_ONLY[mode]}")
    if models.engine == "lean" and models.device not in ("auto", "cpu"):
        raise BadOption(f"--engine lean runs on the CPU; the device is {models.device} (use --engine torch)")
    if models.engine == "lean" and mode in NOT_ON_LEAN:
        raise BadOption(f"mode {mode!r} builds on transformers' modules: it runs on --engine torch (or llama.cpp), not yet on --engine lean")
    for flag in ("target", "draft"):
        spec = getattr(models, flag)
        if spec is None:
            continue
        path = Path(spec).expanduser()
        if models.engine in ("llama.cpp", "lean") and path.suffix != ".gguf":
            raise BadOption(f"--engine {models.engine} runs .gguf files; {spec} is not one (use --engine torch)" if flag == "target" else
                            f"the target runs on {models.engine}, so the draft must be a .gguf file too, not {spec} (or use --engine torch)")
        if path.suffix == ".gguf" and not path.is_file():
            raise UserError(f"GGUF file not found: {path}")
        if path.suffix == ".gguf" and (problem := gguf_header.problem(path)):  # not GGUF, or cut short: before a loader chokes
            raise UserError(problem)
        if path.is_dir() and not (path / "config.json").is_file():
            raise UserError(f"{path} is not a model directory (no config.json)")
        if path.exists() or path.suffix == ".gguf":
            continue
        if spec.count("/") > 1 or spec.startswith((".", "/", "~")):
            raise UserError(f"model path not found: {spec}")
        if not models.download:  # a hub id: from the local cache only
            from huggingface_hub import try_to_load_from_cache

            if not isinstance(try_to_load_from_cache(spec, "config.json"), str):
                hf_home = os.environ.get("HF_HOME", "~/.cache/huggingface")
                raise UserError(f"model {spec!r} not found in the local Hugging Face cache ({hf_home}); pass --download to "
                                f"fetch it from the Hub, or pass a local directory or .gguf file")


def can_ask_on_terminal() -> bool:
    """Whether a question can be put to the user on this terminal (stdin and stderr both one)."""
    return sys.stdin is not None and sys.stdin.isatty() and sys.stderr.isatty()


def ask_before_writing(yes: bool, progress, paths: list[Path]) -> None:
    """A start on torch that would convert GGUF files into more than models.CONSENT_BYTES of the user cache goes on
    only with --yes or the user's yes: `progress.confirm(question)` where it has one (the chat's dialog), else
    [y/N] on a terminal. No means Declined (exit status 1); no way to ask means BadOption (2), naming --yes."""
    from specchat import models
    from specchat.fmt import size

    plans: dict[Path, tuple[Path, int]] = {}  # one conversion per content, however many paths name it
    for path in paths:
        if path.is_file() and (n := models.conversion_bytes(path)):
            plans.setdefault(models.converted_dir(path), (path, n))
    total = sum(n for _, n in plans.values())
    if total <= models.CONSENT_BYTES or yes:
        return
    what = " and ".join(path.name for path, _ in plans.values())
    writes = f"writing about {size(total)} into {models.models_dir()}"
    confirm = getattr(progress, "confirm", None)
    if confirm is None and can_ask_on_terminal():
        def confirm(question):
            try:
                return click.confirm(question, default=False, err=True)
            except click.Abort:  # Ctrl+C or Ctrl+D at the prompt: as Ctrl+C anywhere (one line, status 130)
                raise KeyboardInterrupt from None
    if confirm is None:
        raise BadOption(f"this first start on torch converts {what} once, {writes}: pass --yes to allow it")
    plan = "\n".join((models.conversion_plan(path) or path.name).removesuffix("...") + "." for path, _ in plans.values())
    if not confirm(f"{plan}\nThis first start writes about {size(total)} into the user cache. Go ahead?"):
        raise Declined("declined: nothing converted (--yes skips the question; `specchat cache` lists what the cache holds)")


def load_models(models: ModelOptions, progress):
    """Target and draft (or None) from the model options, each stage shown by `progress.status(text)` (a Rich
    Console on stderr, or the chat's own display): (target, draft, device, dtype). A start that would convert more
    than models.CONSENT_BYTES asks first (ask_before_writing), through `progress.confirm(question) -> bool` where
    `progress` has one."""
    hub_environment(models.download)
    if likely_gguf_engine(models):  # before torch (and OpenMP with it) loads
        threads.prepare_for_gguf()
    threads.set_threads(models.threads)
    from specchat.models import (check_same_tokenizer, check_same_vocab, conversion_plan, convert_gguf, default_gguf, is_gguf,
                                 gguf_path, lean_reads, load_model, load_tokenizer, pick_device, pick_dtype, pick_engine,
                                 tokenizer_cached)

    specs = [models.target, *([models.draft] if models.draft else [])]
    device = pick_device(models.device)
    dtype = pick_dtype(models.dtype, device)
    if (models.engine == "auto" and likely_gguf_engine(models) and llama_cpp_installed() and device.type == "cpu"
            and lean_reads(models.target, models.draft)):
        from specchat import choose_engine, threads as thread_policy

        if not choose_engine.known(gguf_path(models.target), thread_policy.setting()):
            with progress.status(f"Measuring once which engine runs {gguf_path(models.target).name} faster on this CPU, "
                                 "llama.cpp or specchat's lean kernel (the first time this also compiles the kernel: ~35 s)..."):
                pick_engine(models.engine, models.target, device, models.draft)
    engine = pick_engine(models.engine, models.target, device, models.draft)
    if engine == "torch":  # before anything is converted or compiled: a start that writes gigabytes asks first
        ask_before_writing(models.yes, progress, [default_gguf() if spec is None else Path(spec).expanduser() for spec in specs if is_gguf(spec)])
    tokenizers = [None, None]
    cached = all(tokenizer_cached(spec) for spec in specs)
    once = "" if cached else " (first start: converting the GGUF tokenizers once into the user cache, tens of seconds)"
    if models.draft:  # the vocabularies first: a mismatch is one line in a second, not after both models load
        with progress.status(f"Comparing the tokenizers of target and draft{once}..."):
            tokenizers = [load_tokenizer(spec, trust_remote_code=models.trust_remote_code, download=models.download)
                          for spec in (models.target, models.draft)]
        once = ""
        if None not in tokenizers:
            check_same_vocab(models.target or "SmolLM2-135M-Instruct (default)", tokenizers[0], models.draft, tokenizers[1])
    kwargs = dict(device_map=models.device_map, trust_remote_code=models.trust_remote_code, download=models.download, engine=engine)
    where = {"llama.cpp": "llama.cpp on the CPU", "lean": "the CPU (specchat's lean kernel, reading the file in place)"}.get(engine, f"{device} ({dtype})")
    once = once if engine in ("llama.cpp", "lean") else ""  # torch takes the tokenizer from the GGUF's conversion below
    if engine in ("torch", "lean") and device.type == "cpu":  # the lean runner's kernel is compiled once per machine: say so
        from specchat.engine import smallbatch
        from specchat.store import cache_dir

        if smallbatch.needs_build(cache_dir() / "kernels"):
            with progress.status("Compiling specchat's small-batch kernel once for this CPU (cc -O3 -march=native: 33 s "
                                 "on the 2-core reference machine)..."):
                smallbatch.load(cache_dir() / "kernels")
    for spec in specs if engine == "torch" else []:  # a GGUF for torch is dequantised once first: say how big, how long
        path = default_gguf() if spec is None else Path(spec).expanduser()
        plan = conversion_plan(path) if is_gguf(spec) and path.is_file() else None
        if plan is not None:
            with progress.status(plan):
                convert_gguf(path)
    if engine == "llama.cpp":
        from specchat import repack_probe

        if not repack_probe.known():
            with progress.status("Testing llama.cpp's weight repacking once on this CPU, in a child process (a second)..."):
                repack_probe.verdict()
    with progress.status(f"Loading target {models.target or 'SmolLM2-135M-Instruct (default)'} on {where}{once}..."):
        target = load_model(models.target, device, dtype, tokenizer=tokenizers[0], **kwargs)
    draft = None
    if models.draft:
        with progress.status(f"Loading draft {models.draft}..."):
            draft = load_model(models.draft, device, dtype, tokenizer=tokenizers[1], **kwargs)
        check_same_tokenizer(target, draft)
    return target, draft, device, dtype


def load_session(options: Options, *, quiet: bool = False, progress=None):
    """Load models and build a Session from the generation options, each stage shown by `progress` (default: a
    spinner line on stderr), or, with --server, a RemoteSession: no model loads here and torch is never imported."""
    if options.servers:
        return load_remote_session(options)
    preflight(options)  # sets the hub's environment before the imports below (transformers, and huggingface_hub with it)
    models = options.models
    if likely_gguf_engine(models):  # before torch (and OpenMP with it) loads
        threads.prepare_for_gguf()
    from rich.console import Console

    progress = progress or Console(stderr=True, quiet=quiet)
    with progress.status("Starting the engine (importing torch and transformers)..."):
        from specchat.engine.acceptance import parse_rule
        from specchat.engine.loop import AdaptiveK
        from specchat.models import LLAMA_CPP_INSTALL, is_gguf
        from specchat.session import Session

    try:
        rule = parse_rule(options.accept_rule)
    except ValueError as e:
        raise BadOption(str(e)) from None
    with user_errors():
        target, draft, device, dtype = load_models(models, progress)
        with progress.status(f"Preparing mode {options.mode}..."):  # auto's candidates: quantised copies, the suffix index, the head
            session = Session(
                target,
                draft,
                mode=options.mode,
                k=options.draft_len,
                sampling=options.sampling,
                seed=options.seed,
                max_new_tokens=options.max_new_tokens,
                mode_options=options.settings.drafter_options(),
            )
    session.controls.rule = rule
    if options.system:
        session.set_system(options.system)
    if options.adaptive:
        # -k is the starting length; the schedule moves it within [1, max(16, 2K)]; model drafts also stop
        # when their top probability is below 0.7
        session.controls.adaptive = AdaptiveK(start=options.draft_len, k_max=max(16, 2 * options.draft_len), p_min=0.7)
    elif options.measured_k:
        session.measure_k(options.draft_len)
    if models.engine == "auto" and is_gguf(models.target):  # which engine auto measured faster, and by how much
        from specchat import choose_engine
        from specchat.models import gguf_path

        if (choice := choose_engine.made(gguf_path(models.target))) is not None:
            session.notices.append(choice.reason)
    if session.info.engine == "torch" and models.engine == "auto" and is_gguf(models.target) and device.type == "cpu" \
            and (not models.draft or is_gguf(models.draft)):
        session.notices.append(f"llama-cpp-python is not installed, so this GGUF runs dequantised on torch; on llama.cpp plain "
                               f"decoding of the default model ran 2.3x faster on the reference machine: {LLAMA_CPP_INSTALL}")
    # the device and dtype as chosen (a GGUF on llama.cpp keeps its file's type)
    label = str(dtype).removeprefix("torch.") if session.info.engine == "torch" else session.info.dtype
    session.info = dataclasses.replace(session.info, device=str(device), dtype=label)
    # torch, transformers and the models are hundreds of thousands of Python objects that live as long as the
    # process: out of the cyclic collector's reach, its full passes no longer hold the GIL over them mid-reply
    gc.freeze()
    return session


# what a server runs is the server's: these options would have no effect with --server
LOCAL_ONLY = ("target", "draft", "download", "device", "engine", "dtype", "device_map", "trust_remote_code", "threads",
              "adaptive", "accept_rule", "skip_layers", "exit_layer", "rank", "head_file", "draft_vocab")
FLAGS = {"accept_rule": "--accept", "head_file": "--head"}  # where the flag is not the parameter's name


def local_options_given(options: Options) -> list[str]:
    """The LOCAL_ONLY options set to anything but their defaults, as their flags."""
    chosen = {**vars(options.models), **vars(options.settings), "adaptive": options.adaptive, "accept_rule": options.accept_rule}
    unset = {**vars(ModelOptions()), **vars(ModeSettings()), "adaptive": False, "accept_rule": "exact"}
    return [FLAGS.get(name, "--" + name.replace("_", "-")) for name in LOCAL_ONLY if chosen[name] != unset[name]]


def load_remote_session(options: Options):
    """--server: ask each endpoint what it is, then a RemoteSession over them."""
    from specchat.engine.remote import RemoteError, connect
    from specchat.remote_session import RemoteSession

    if flags := local_options_given(options):
        raise BadOption(f"--server: the server runs the model and its speculation; leave out {', '.join(flags)}")
    for name, flag in (("mode", "--mode"), ("draft_len", "-k")):
        if name in options.given:
            raise BadOption(f"--server: {flag} is the server's setting (name several configurations with NAME=URL; the "
                            f"pinned llama-server ignores a request's draft length)")
    try:
        servers = [connect(url, name, timeout=min(options.timeout, 10.0)) for name, url in options.servers]
    except RemoteError as e:
        raise UserError(str(e)) from None
    session = RemoteSession(servers, sampling=options.sampling, seed=options.seed, max_new_tokens=options.max_new_tokens,
                            timeout=options.timeout)
    if options.system:
        session.set_system(options.system)
    return session


def config_summary(session) -> dict:
    """The settings a result was produced with (every summary and report starts with these)."""
    sampling, info = session.controls.sampling, session.info
    if info.remote:  # the server's threads and device are its own
        server = info.server
        return {
            "target": server.model, "server": server.url, "engine": server.engine,
            "server_version": server.version, "speculative": server.speculative, "draft": None,
            "mode": session.mode, "draft_len": session.controls.k, "temperature": sampling.temperature,
            "top_k": sampling.top_k, "top_p": sampling.top_p, "seed": session.seed, "device": "server", "dtype": "",
            "threads": None, "accept": session.controls.rule.name,
        }
    import torch

    return {
        "target": session.target.name,
        "draft": session.draft.name if session.draft else None,
        "mode": session.mode,
        "draft_len": "auto" if session.snapshot().k_measured else session.controls.k,
        "temperature": sampling.temperature,
        "top_k": sampling.top_k,
        "top_p": sampling.top_p,
        "seed": session.seed,
        "engine": info.engine,
        "device": info.device,
        "dtype": info.dtype,
        "threads": torch.get_num_threads(),
        "threads_adaptive": threads.adaptive(),
        "accept": session.controls.rule.name,
    }
