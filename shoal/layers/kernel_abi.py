"""The C entry points of the kernel library (`csrc/`): their ctypes signatures, and which
entry point takes which dtypes. `cpu_kernels` wraps them in typed methods."""

from __future__ import annotations

import ctypes
from typing import Any

import torch

_P, _I, _D = ctypes.c_void_p, ctypes.c_int64, ctypes.c_double
_DECODE_ARGS = [_P] * 6 + [_I] * 6 + [_D, _I]
_PREFILL_ARGS = [_P, _I, _P, _P, _P, _P, _I, _P, _I, _I, _I, _I, _I, _I, _D, _I]
_GEMM_ARGS = [_P, _I, _I, _I, _P, _I, _P, _I, _P, _I]
_GEMM512_ARGS = [_P, _I, _I, _I, _P, _I, _I, _P, _I, _P, _I, _I]
_ROPE_ARGS = [_P, _I, _I, _I, _I, _I, _P, _P, _P, _P, _P, _P, _I]
SIGNATURES: dict[str, list[Any]] = {
    "paged_decode_f32": _DECODE_ARGS,
    "paged_decode_f64": _DECODE_ARGS,
    "paged_decode_f32_bf16kv": _DECODE_ARGS,
    "paged_decode_bf16": _DECODE_ARGS,
    "paged_prefill_f32": _PREFILL_ARGS,
    "paged_prefill_f64": _PREFILL_ARGS,
    "paged_prefill_bf16": _PREFILL_ARGS,
    "paged_prefill_f32_bf16kv": _PREFILL_ARGS,
    "gemm_f32": _GEMM_ARGS,
    "gemm_bf16w": _GEMM_ARGS,
    "gemm_quant": [_P, _I, _I, _I, _I, _P, _I, _P, _I, _P, _I],
    "gemm512_f32": _GEMM512_ARGS,
    "gemm512_bf16": _GEMM512_ARGS,
    "rope_store_f32_bf16kv": _ROPE_ARGS,
    "scatter_blocks": [_P, _P, _I, _P, _I, _I, _I],
    "gather_blocks": [_P, _P, _I, _P, _I, _I, _I],
    "argmax_f32": [_P, _I, _I, _I, _P, _I],
    "argmax_bf16": [_P, _I, _I, _I, _P, _I],
    "quantize_rows": [_P, _I, _I, _I, _I, _P, _P, _I],
    "qgemm": [_I, _I, _P, _P, _I, _I, _P, _I, _P, _I, _P, _I],
    "decode_step_f32": [_P, _P, _P, _I, _P, _P, _P, _P, _P, _P, _I],
    "decode_step_bf16kv": [_P, _P, _P, _I, _P, _P, _P, _P, _P, _P, _I],
}
SUFFIX = {torch.float32: "f32", torch.float64: "f64", torch.bfloat16: "bf16"}
for _s in SUFFIX.values():
    SIGNATURES[f"rms_norm_{_s}"] = [_P, _I, _P, _P, _P, _I, _I, _D, _I]
    SIGNATURES[f"silu_mul_{_s}"] = [_P, _I, _P, _I, _I, _I]
    SIGNATURES[f"rope_store_{_s}"] = _ROPE_ARGS
DECODE = {  # (query dtype, KV cache dtype)
    (torch.float32, torch.float32): "paged_decode_f32",
    (torch.float64, torch.float64): "paged_decode_f64",
    (torch.float32, torch.bfloat16): "paged_decode_f32_bf16kv",
    (torch.bfloat16, torch.bfloat16): "paged_decode_bf16",
}
PREFILL = {  # (query dtype, KV cache dtype)
    (torch.float32, torch.float32): "paged_prefill_f32",
    (torch.float64, torch.float64): "paged_prefill_f64",
    (torch.bfloat16, torch.bfloat16): "paged_prefill_bf16",
    (torch.float32, torch.bfloat16): "paged_prefill_f32_bf16kv",
}
GEMM = {torch.float32: "gemm_f32", torch.bfloat16: "gemm_bf16w"}
GEMM512 = {torch.float32: "gemm512_f32", torch.bfloat16: "gemm512_bf16"}
