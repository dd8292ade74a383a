"""The C++ CPU kernels, called by ctypes: typed entry points over one compiled build.

The library is compiled with the system's C++ compiler on first use (`kernel_library`).
Without a compiler (or with `SHOAL_DISABLE_CPU_KERNELS=1`) callers fall back to pure torch.

The engine uses the build for `-march=native`: the compiler picks the vector ISA this CPU has
(AVX-512, AVX2 + FMA, Arm's NEON/SVE), and `csrc/simd.h` adds explicit vector code for the first
two; `CpuKernels.isa` says which one a build holds. Other targets can be built on the same
machine (`build("x86-64-v3")` is the AVX2 + FMA path), which is how the tests run every path
this CPU can execute. The matrix products need AVX2 + FMA (`gemm.cpp`) or AVX-512
(`gemm512.cpp`) and exist only in such builds.
"""

from __future__ import annotations

import ctypes
import functools
import os
from typing import Any

import torch

from shoal.layers import kernel_library
from shoal.layers.kernel_abi import DECODE, GEMM, GEMM512, PREFILL, SIGNATURES, SUFFIX
from shoal.layers.weight_packing import PANEL


def _product_out(m: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    """An `[m, n]` output for a product kernel. Rows a multiple of 1 KiB apart map to the same
    few cache sets, and the kernels write a 16-column strip down all rows at once: SmolLM2's LM
    head (49152 columns) ran 3x slower. Such rows get a panel of padding."""
    ldc = n + PANEL if n % 256 == 0 else n
    return torch.empty(m, ldc, dtype=dtype)[:, :n]


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _threads() -> int:
    return torch.get_num_threads()


class CpuKernels:
    """One build of the kernels, with typed entry points. Tensors must be on the CPU."""

    def __init__(self, lib: ctypes.CDLL, march: str) -> None:
        self.lib, self.march = lib, march
        lib.shoal_isa.restype = ctypes.c_char_p
        self.isa: str = lib.shoal_isa().decode()
        # bfloat16 prefill tiles on AMX: built for it, and the OS lent this process the tiles.
        self.amx_tiles: bool = bool(lib.shoal_amx_tiles())
        # Quantized products of 16 rows or more on AMX-INT8 tiles (`csrc/qtile_amx.h`).
        self.amx_int8: bool = bool(lib.shoal_qgemm_amx())
        # Whether two-level quantized products of many rows (prefill) run faster as integer
        # products than as the float32 kernel over dequantized panels: with AMX (3.2x on a
        # Xeon) or 512-bit VNNI tiles (1.7x there; 256-bit VNNI ties, AVX2 loses).
        self.integer_prefill: bool = self.amx_int8 or bool(lib.shoal_qgemm_pairs())
        for name, args in SIGNATURES.items():
            fn = getattr(lib, name, None)
            if fn is not None:
                fn.restype, fn.argtypes = None, args

    def _fn(self, name: str) -> Any:
        return getattr(self.lib, name)

    # -- dense projections (AVX2 + FMA builds) ------------------------------------------------
    def has_gemm(self, weight_dtype: torch.dtype) -> bool:
        """Whether float32 activations meet a packed weight of this dtype here."""
        return hasattr(self.lib, GEMM.get(weight_dtype, "-"))

    def gemm(
        self, x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """`x @ W.T + bias` for float32 rows `x` `[M, K]` and a weight packed by
        `weight_packing.pack_weight`."""
        assert x.dtype == torch.float32 and x.dim() == 2
        if x.stride(1) != 1:
            x = x.contiguous()
        m, k = x.shape
        assert packed.shape[1] == k and (bias is None or bias.dtype == torch.float32)
        out = _product_out(m, n, torch.float32)
        self._fn(GEMM[packed.dtype])(
            x.data_ptr(),
            m,
            k,
            x.stride(0),
            packed.data_ptr(),
            n,
            out.data_ptr(),
            out.stride(0),
            _ptr(bias),
            _threads(),
        )
        return out

    def has_gemm512(self, dtype: torch.dtype) -> bool:
        """Whether `dtype` rows meet a weight of `dtype` in the AVX-512 kernel here (bfloat16
        takes AVX512_BF16)."""
        return hasattr(self.lib, GEMM512.get(dtype, "-"))

    def gemm512(
        self,
        x: torch.Tensor,
        packed: torch.Tensor,
        n: int,
        bias: torch.Tensor | None,
        silu: bool = False,
    ) -> torch.Tensor:
        """`x @ W.T + bias` for rows `x` `[M, K]` and a weight of x's dtype packed by
        `weight_packing.pack_for_gemm512` (float32 sums, rounded once; `bias` float32 in panel
        order, see `weight_packing.pack_bias`). With `silu`, W is packed by
        `weight_packing.pack_gate_up` and the result is silu(gate) * up, `n` its columns."""
        assert x.dim() == 2 and packed.dtype == x.dtype
        if x.stride(1) != 1:
            x = x.contiguous()
        m, k = x.shape
        panels = packed.shape[0]
        assert packed.stride(0) == k * PANEL and (bias is None or bias.numel() == panels * PANEL)
        out = _product_out(m, n, x.dtype)
        self._fn(GEMM512[x.dtype])(
            x.data_ptr(),
            m,
            k,
            x.stride(0),
            packed.data_ptr(),
            panels,
            n,
            out.data_ptr(),
            out.stride(0),
            _ptr(bias),
            int(silu),
            _threads(),
        )
        return out

    # -- decode attention -----------------------------------------------------------------------
    def decodes(self, q_dtype: torch.dtype, kv_dtype: torch.dtype) -> bool:
        return (q_dtype, kv_dtype) in DECODE

    def paged_decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        out: torch.Tensor,
        scale: float,
    ) -> None:
        """out[b] = attention of q[b] ([heads, dim]) over the first context_lens[b] cached
        tokens, read in place from the blocks of block_tables[b]."""
        for t in (q, k_cache, v_cache, block_tables, context_lens, out):
            assert t.is_contiguous()
        batch, heads, dim = q.shape
        _, block_size, kv_heads, _ = k_cache.shape
        self._fn(DECODE[q.dtype, k_cache.dtype])(
            q.data_ptr(),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            block_tables.data_ptr(),
            context_lens.data_ptr(),
            out.data_ptr(),
            batch,
            heads,
            kv_heads,
            dim,
            block_size,
            block_tables.shape[1],
            scale,
            _threads(),
        )

    def prefills(self, q_dtype: torch.dtype, kv_dtype: torch.dtype) -> bool:
        return (q_dtype, kv_dtype) in PREFILL

    def paged_prefill(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        spans: torch.Tensor,
        block_tables: torch.Tensor,
        out: torch.Tensor,
        scale: float,
    ) -> None:
        """Causal attention of every prefill chunk of a step, keys and values read in place.

        `spans[i] = (first row, query tokens, context length)` of chunk i, whose queries are
        the last of its context's positions; `block_tables[i]` holds its sequence's blocks.
        `q` and `out` are `[T, heads, dim]` with contiguous heads; token rows may be strided.
        """
        for t in (k_cache, v_cache, spans, block_tables):
            assert t.is_contiguous()
        for t in (q, out):
            assert t.stride(2) == 1 and t.stride(1) == t.shape[2]
        _, heads, dim = q.shape
        _, block_size, kv_heads, _ = k_cache.shape
        self._fn(PREFILL[q.dtype, k_cache.dtype])(
            q.data_ptr(),
            q.stride(0),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            spans.data_ptr(),
            block_tables.data_ptr(),
            spans.shape[0],
            out.data_ptr(),
            out.stride(0),
            heads,
            kv_heads,
            dim,
            block_size,
            block_tables.shape[1],
            scale,
            _threads(),
        )

    # -- element-wise work of a layer -----------------------------------------------------------
    def elementwise(self, dtype: torch.dtype) -> bool:
        return dtype in SUFFIX

    def rms_norm(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`rmsnorm(x) * weight`; with `residual`, first `residual += x` (in place) and the sum
        is normalized. Rows of `x` may be strided; `residual` must be contiguous."""
        h = x.shape[-1]
        rows = x if x.dim() == 2 and x.stride(1) == 1 else x.reshape(-1, h).contiguous()
        out = torch.empty(rows.shape, dtype=x.dtype)
        self._fn(f"rms_norm_{SUFFIX[x.dtype]}")(
            rows.data_ptr(),
            rows.stride(0),
            _ptr(residual),
            weight.data_ptr(),
            out.data_ptr(),
            rows.shape[0],
            h,
            eps,
            _threads(),
        )
        return out.view(x.shape)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """`silu(gate) * up` of a `[M, 2N]` gate-up product (rows may be strided): `[M, N]`."""
        assert gate_up.dim() == 2 and gate_up.stride(1) == 1
        m, n = gate_up.shape[0], gate_up.shape[1] // 2
        out = torch.empty(m, n, dtype=gate_up.dtype)
        self._fn(f"silu_mul_{SUFFIX[gate_up.dtype]}")(
            gate_up.data_ptr(), gate_up.stride(0), out.data_ptr(), m, n, _threads()
        )
        return out

    def argmax(self, logits: torch.Tensor) -> torch.Tensor | None:
        """Each row's index of its largest value, the first on ties (torch's rule); None for a
        dtype the kernel does not read (it takes float32 and bfloat16)."""
        if logits.dtype not in (torch.float32, torch.bfloat16) or logits.stride(1) != 1:
            return None
        rows, n = logits.shape
        out = torch.empty(rows, dtype=torch.int64)
        self._fn(f"argmax_{SUFFIX[logits.dtype]}")(
            logits.data_ptr(), logits.stride(0), rows, n, out.data_ptr(), _threads()
        )
        return out

    def ropes(self, act_dtype: torch.dtype, kv_dtype: torch.dtype) -> bool:
        if act_dtype == kv_dtype:
            return act_dtype in SUFFIX
        return (act_dtype, kv_dtype) == (torch.float32, torch.bfloat16)

    def rope_store(
        self,
        qkv: torch.Tensor,
        heads: int,
        kv_heads: int,
        cos: torch.Tensor,
        sin: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> None:
        """Rotate the q and k heads of `qkv` rows `[T, (heads + 2 kv_heads) * dim]` in place
        (tables `[positions, dim]` in float32, float64 for float64) and store k and v at
        `slots` of the caches."""
        assert qkv.dim() == 2 and qkv.stride(1) == 1
        assert positions.dtype == slots.dtype == torch.int64
        dim = cos.shape[1]
        name = (
            "rope_store_f32_bf16kv"
            if (qkv.dtype, k_cache.dtype) == (torch.float32, torch.bfloat16)
            else f"rope_store_{SUFFIX[qkv.dtype]}"
        )
        self._fn(name)(
            qkv.data_ptr(),
            qkv.stride(0),
            qkv.shape[0],
            heads,
            kv_heads,
            dim,
            cos.data_ptr(),
            sin.data_ptr(),
            positions.data_ptr(),
            slots.data_ptr(),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            _threads(),
        )

    # -- whole blocks, for the KV store's demotions and promotions ------------------------------
    def scatter_blocks(
        self, srcs: list[int], caches: list[torch.Tensor], block_ids: torch.Tensor
    ) -> None:
        """`caches[c][block_ids[b]] = block b's bytes [c]`, each block one buffer
        `[caches, block bytes]` at address `srcs[b]`."""
        assert all(c.is_contiguous() for c in caches) and len(srcs) == len(block_ids)
        ptrs = (ctypes.c_void_p * len(caches))(*[c.data_ptr() for c in caches])
        block_bytes = caches[0][0].numel() * caches[0].element_size()
        self._fn("scatter_blocks")(
            (ctypes.c_void_p * len(srcs))(*srcs),
            ptrs,
            len(caches),
            block_ids.data_ptr(),
            len(block_ids),
            block_bytes,
            _threads(),
        )

    def gather_blocks(
        self, caches: list[torch.Tensor], block_ids: torch.Tensor
    ) -> list[torch.Tensor]:
        """Each block's bytes in every cache, one new uint8 tensor `[caches * block bytes]` per
        block (so each can outlive the others)."""
        assert all(c.is_contiguous() for c in caches)
        first = caches[0]
        block_bytes = first[0].numel() * first.element_size()
        out = [torch.empty(len(caches) * block_bytes, dtype=torch.uint8) for _ in block_ids]
        ptrs = (ctypes.c_void_p * len(caches))(*[c.data_ptr() for c in caches])
        self._fn("gather_blocks")(
            (ctypes.c_void_p * len(out))(*[t.data_ptr() for t in out]),
            ptrs,
            len(caches),
            block_ids.data_ptr(),
            len(block_ids),
            block_bytes,
            _threads(),
        )
        return out


@functools.cache
def build(march: str = "native") -> CpuKernels | None:
    """The kernels compiled for `-march=<march>`, or None without a working compiler."""
    path = kernel_library.compiled(march)
    return None if path is None else CpuKernels(ctypes.CDLL(str(path)), march)


@functools.cache
def native() -> CpuKernels | None:
    """The kernels the engine uses: built for this CPU, or for `$SHOAL_CPU_TARGET` (another
    target it runs, e.g. `x86-64-v3` for the AVX2 path on an AVX-512 machine, to measure what
    such a chip's build does); None where they cannot be built."""
    if os.environ.get("SHOAL_DISABLE_CPU_KERNELS"):
        return None
    return build(os.environ.get("SHOAL_CPU_TARGET") or "native")


def for_tensor(x: torch.Tensor) -> CpuKernels | None:
    """The native kernels if they take `x`'s element-wise work (a CPU tensor of their dtypes)."""
    kernels = native() if x.device.type == "cpu" else None
    return kernels if kernels is not None and kernels.elementwise(x.dtype) else None
