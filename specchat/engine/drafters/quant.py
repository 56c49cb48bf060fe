"""Mode `quant`: an int8 weight copy of the target drafts; the target's own weights verify.

On the llama.cpp engine the copy is a smaller quantisation of the target's own GGUF file (made once with
llama.cpp's quantizer into the user cache, models.quantized_gguf), drafting as drafters/gguf.py.

On a CPU where the lean runner and its kernel run (backend "int8", the default there), the draft is the
target's lean runner with every matrix as int8 and a float32 scale per output row (smallbatch.Int8Weights,
round to nearest): the kernel widens the int8 weights to float32 as it streams them, so a draft step reads a
quarter of the target's bytes while activations, products and sums stay float32, so it agrees with the float32
target's greedy token at ~0.98 of reply positions on the default model.

Elsewhere on CPU the copy uses torch.ao dynamic quantisation (int8 weights, activations quantised per step,
fbgemm/x86 kernels). torch.ao.quantization is deprecated in favour of torchao, but torchao's int8
paths run in eager mode through tensor-subclass dispatch, slower than the fp32 model itself on CPU:
a draft that is slower than the target is no draft. On CUDA the copy uses torchao's Int8WeightOnlyConfig when torchao is installed; without it
there is no int8 path and the mode is unavailable.

The copy shares the target's embedding and norms (kept in float32 for the int8 kernels, which take
float32 activations). The lean int8 copy also drafts on the target's own KV cache (ModelDrafter.shares_target_cache):
it attends to the target's keys and values for the whole context, and nothing is fed twice (the other backends keep
a KV cache of their own, re-synced to `state.tokens`, which feeds a whole prompt on its first round).
Extra memory: the int8 weights with their scales; float32 norms if the target is not float32; the draft KV cache
for the backends that keep one.
"""

from __future__ import annotations

import copy
import warnings

import torch

from specchat.engine.errors import ModeUnavailable
from specchat.engine.drafters.copydraft import CopyDrafter, shared_copy
from specchat.engine.runner import lean_runner, unsupported
from specchat.engine.smallbatch import Int8Weights, int8_usable


def _linears(model) -> list[tuple[str, torch.nn.Linear]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]


def _module_bytes(module: torch.nn.Module) -> int:
    """Bytes of a dynamic-quantised linear: int8 weight, one float scale and zero point per output row, bias."""
    weight, bias = module._packed_params._weight_bias()
    return weight.numel() + weight.shape[0] * 16 + (bias.numel() * bias.element_size() if bias is not None else 0)


@torch.no_grad()
def torch_ao_int8_copy(model):
    """(draft, extra bytes): every Linear as torch.ao dynamic int8 (per-channel weight scales); float32 activations."""
    from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

    draft = shared_copy(model)
    extra = 0
    for name, linear in _linears(draft):
        # a float32 stand-in for one layer at a time (the target's own tensor when it is float32: no copy)
        fp32 = torch.nn.Linear(linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta")
        fp32.weight = torch.nn.Parameter(linear.weight.float(), requires_grad=False)
        if linear.bias is not None:
            fp32.bias = torch.nn.Parameter(linear.bias.float(), requires_grad=False)
        with warnings.catch_warnings():  # torch.ao's deprecation notices: the choice is explained above
            warnings.simplefilter("ignore", DeprecationWarning)
            warnings.simplefilter("ignore", UserWarning)
            qlinear = quantize_dynamic(
                torch.nn.Sequential(fp32), {torch.nn.Linear: per_channel_dynamic_qconfig}, dtype=torch.qint8, inplace=True
            )[0]
        parent, _, attr = name.rpartition(".")
        setattr(draft.get_submodule(parent) if parent else draft, attr, qlinear)
        extra += _module_bytes(qlinear)
    if model.get_input_embeddings().weight.dtype != torch.float32:
        # the int8 kernels take float32 inputs: cast the (shared) embedding output, keep the small norms in float32
        draft.get_input_embeddings().register_forward_hook(lambda mod, args, out: out.float())
        for module in draft.modules():
            if "RMSNorm" in type(module).__name__ or isinstance(module, torch.nn.LayerNorm):
                for pname, p in list(module.named_parameters(recurse=False)):
                    setattr(module, pname, torch.nn.Parameter(p.detach().float(), requires_grad=False))
                    extra += p.numel() * 4
    return draft.eval(), extra


def torchao_int8_copy(model):
    """(draft, extra bytes): torchao int8 weight-only linears (the maintained path; fast on CUDA)."""
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    draft = copy.deepcopy(model)  # quantize_ replaces weights in place: the copy must own them
    quantize_(draft, Int8WeightOnlyConfig())
    extra = sum(m.weight.numel() for _, m in _linears(draft))  # int8: one byte per weight (scales are small)
    extra += sum(p.numel() * p.element_size() for n, p in draft.named_parameters() if "embed" in n or "norm" in n)
    return draft.eval(), extra


def cpu_int8_engine() -> str | None:
    """A torch.ao quantised engine with int8 linear kernels on this CPU, or None."""
    engines = torch.backends.quantized.supported_engines
    return next((e for e in ("x86", "fbgemm", "qnnpack") if e in engines), None)


class QuantDrafter(CopyDrafter):
    name = "quant"

    @classmethod
    def build(cls, target, draft=None, *, quant_backend: str = "auto", **options) -> "QuantDrafter":
        device = target.device
        backend = quant_backend
        if backend == "auto":
            lean_int8 = device.type == "cpu" and target.dtype == torch.float32 and unsupported(target) is None and int8_usable()
            backend = "int8" if lean_int8 else "torch.ao" if device.type == "cpu" else "torchao"
        if backend == "int8":
            if device.type != "cpu" or target.dtype != torch.float32:
                raise ModeUnavailable(f"mode 'quant' with int8 kernels needs a float32 target on the CPU, not {target.dtype} on {device}")
            if unsupported(target) is not None or not int8_usable():
                why = unsupported(target) or "the fused kernel is not built (no C compiler, or SPECCHAT_KERNEL=torch)"
                raise ModeUnavailable(f"mode 'quant' with int8 kernels needs the lean runner and its kernel: {why}")
            lean = lean_runner(target).with_weights(Int8Weights.of)
            extra = sum(w.nbytes for b in lean.blocks for w in (b.qkv_w, b.o_w, b.gate_up_w, b.down_w)) + lean.head_w.nbytes
            return cls(target, backend=backend, weight_bytes=extra, lean=lean)
        if backend == "torch.ao":
            if device.type != "cpu":
                raise ModeUnavailable(f"mode 'quant': torch.ao dynamic int8 runs on CPU only, the target is on {device}")
            if cpu_int8_engine() is None:
                raise ModeUnavailable("mode 'quant': this PyTorch build has no int8 CPU engine (fbgemm/x86/qnnpack)")
            model, extra = torch_ao_int8_copy(target)
        elif backend == "torchao":
            try:
                import torchao  # noqa: F401
            except ImportError:
                raise ModeUnavailable(f"mode 'quant' on {device.type} needs torchao for int8 weights: pip install torchao") from None
            model, extra = torchao_int8_copy(target)
        else:
            raise ModeUnavailable(f"unknown quant backend {quant_backend!r}; use auto, int8, torch.ao or torchao")
        return cls(model, backend=backend, weight_bytes=extra)

    def __init__(self, model, *, backend: str, weight_bytes: int, lean=None) -> None:
        super().__init__(model, lean=lean)
        self.backend, self.weight_bytes = backend, weight_bytes
        self.shares_target_cache = backend == "int8"  # the target's layout: the lean runner's KVCache

