"""A decode-only step of a quantized Llama-family model through one C++ call
(`layers/csrc/decode_step.cpp`) instead of nine Python-dispatched ops per layer.

At batch 1 a layer's products take tens of microseconds: the per-op path spent more than that
again in Python, ctypes and waking OpenMP threads. The fused step takes the same weights, norms,
rotary tables and KV caches, described once to C++ as an array of structs, and runs every
layer in one parallel region. It is used for steps whose rows are all single-token decodes,
where every projection is quantized (`QuantizedLinear`), activations are float32 and the KV
cache float32 or bfloat16; anything else (prefill chunks, drafts, Qwen3's q/k norms) takes the
per-op path, which computes the same thing.
"""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING, cast

import torch

from shoal.layers import cpu_kernels
from shoal.layers.attention import AttentionMetadata
from shoal.layers.quant_formats import FORMAT_IDS
from shoal.layers.quantized_linear import QuantizedGateUp, QuantizedLinear

if TYPE_CHECKING:
    from shoal.models.llama import DecoderLayer, LlamaForCausalLM

_I64, _P = ctypes.c_int64, ctypes.c_void_p
_STEPS = {torch.float32: "decode_step_f32", torch.bfloat16: "decode_step_bf16kv"}


RUNS = 3  # of one format a product may have (a GGUF mix's q/k/v: up to three)


class _QWeight(ctypes.Structure):
    _fields_ = [("data", _P), ("n", _I64), ("k", _I64), ("fmt", _I64)]


class _Product(ctypes.Structure):
    _fields_ = [("runs", _QWeight * RUNS)]  # n == 0 ends the list


class _Layer(ctypes.Structure):
    _fields_ = [
        ("input_norm", _P),
        ("post_norm", _P),
        ("qkv", _Product),
        ("o", _Product),
        ("gate_up", _Product),
        ("down", _Product),
        ("qkv_bias", _P),
        ("k_cache", _P),
        ("v_cache", _P),
    ]


class _Dims(ctypes.Structure):
    _fields_ = [
        *((name, _I64) for name in ("hidden", "heads", "kv_heads", "dim", "inter", "layers")),
        ("block_size", _I64),
        ("max_blocks", _I64),
        ("eps", ctypes.c_double),
        ("levels", _I64),
    ]


def _product(module: torch.nn.Module) -> _Product:
    assert isinstance(module, QuantizedLinear)
    runs = [_QWeight(w.data.data_ptr(), w.n, w.k, FORMAT_IDS[w.fmt.name]) for w in module.runs]
    return _Product((_QWeight * RUNS)(*runs))


def _layers(model: LlamaForCausalLM) -> list[DecoderLayer]:
    return [cast("DecoderLayer", layer) for layer in model.layers]


def supported(model: LlamaForCausalLM) -> bool:
    """Whether every layer of `model` can run in the fused step on this machine."""
    kernels = cpu_kernels.native()
    kv = model.attention_layers[0].k_cache.dtype
    if kernels is None or model.act_dtype != torch.float32 or kv not in _STEPS:
        return False
    cfg = model.config
    if cfg.qk_norm or cfg.num_heads % cfg.num_kv_heads:
        return False
    # A kv head's query heads are quantized on their own: whole blocks of 32.
    if cfg.num_heads // cfg.num_kv_heads * cfg.head_dim % 32:
        return False
    for layer in _layers(model):
        attn, mlp = layer.self_attn, layer.mlp
        projections = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        if not all(isinstance(p, QuantizedLinear) and len(p.runs) <= RUNS for p in projections):
            return False
        if not isinstance(mlp.gate_up_proj, QuantizedGateUp):
            return False
        if any(p.bias is not None for p in projections[1:]):
            return False
        norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
        if any(n.dtype != torch.float32 for n in norms):
            return False
    return True


class FusedDecode:
    """The fused step for one model; its description of the layers is rebuilt whenever the
    KV caches change."""

    def __init__(self, model: LlamaForCausalLM) -> None:
        self.model = model
        self._layers: ctypes.Array[_Layer] | None = None
        self._caches: tuple[int, ...] = ()

    def _describe(self) -> ctypes.Array[_Layer]:
        caches = tuple(a.k_cache.data_ptr() for a in self.model.attention_layers)
        if self._layers is None or caches != self._caches:
            rows = []
            for layer in _layers(self.model):
                attn, mlp = layer.self_attn, layer.mlp
                bias = cast(QuantizedLinear, attn.qkv_proj).bias
                rows.append(
                    _Layer(
                        layer.input_layernorm.weight.data_ptr(),
                        layer.post_attention_layernorm.weight.data_ptr(),
                        _product(attn.qkv_proj),
                        _product(attn.o_proj),
                        _product(mlp.gate_up_proj),
                        _product(mlp.down_proj),
                        None if bias is None else bias.data_ptr(),
                        attn.k_cache.data_ptr(),
                        attn.v_cache.data_ptr(),
                    )
                )
            self._layers, self._caches = (_Layer * len(rows))(*rows), caches
        return self._layers

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> None:
        """Run every layer on the embeddings `x` `[batch, hidden]` (float32, contiguous),
        leaving the final hidden states in `x`."""
        kernels = cpu_kernels.native()
        assert kernels is not None and meta.decode_block_tables is not None
        assert meta.decode_lens is not None
        cfg, tables = self.model.config, meta.decode_block_tables
        cache = self.model.attention_layers[0].k_cache
        dims = _Dims(
            cfg.hidden_size,
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
            cfg.intermediate_size,
            cfg.num_layers,
            cache.shape[1],
            tables.shape[1],
            cfg.rms_norm_eps,
            self.model.activation_levels,
        )
        rotary = self.model.rotary
        getattr(kernels.lib, _STEPS[cache.dtype])(
            ctypes.addressof(self._describe()),
            ctypes.addressof(dims),
            x.data_ptr(),
            x.shape[0],
            positions.data_ptr(),
            meta.slot_mapping.data_ptr(),
            tables.data_ptr(),
            meta.decode_lens.data_ptr(),
            rotary.cos.data_ptr(),
            rotary.sin.data_ptr(),
            torch.get_num_threads(),
        )
