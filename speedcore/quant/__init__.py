"""Weight-only quantized linear layers (kernels/quant_*.cu): INT4 AWQ and GPTQ checkpoints as stored, and INT8.

Formats (bit-exact; ``y = x @ W`` with ``W`` of shape (K, N), K = in_features, N = out_features):

* AWQ "GEMM" (AutoAWQ / llm-awq, 4 bits, zero points): ``qweight`` int32 (K, N/8) packs 8 values along N in the
  order [0, 2, 4, 6, 1, 3, 5, 7] (``qweight[k, j] |= q[k, 8j + AWQ_ORDER[i]] << 4i``); ``qzeros`` int32
  (K/G, N/8) packed the same way; ``scales`` (K/G, N).  ``W[k, n] = (q[k, n] - z[k // G, n]) * s[k // G, n]``.
* GPTQ (AutoGPTQ, checkpoint_format "gptq"): ``qweight`` int32 (K/8, N) packs 8 values along K in plain order;
  ``qzeros`` int32 (ceil(K/G), N/8) packs along N in plain order and stores zero - 1; ``scales`` (ceil(K/G), N);
  ``g_idx`` int32 (K) (act-order when it is not ``k // G``).
  ``W[k, n] = s[g_idx[k], n] * (q[k, n] - (zeros[g_idx[k], n] + 1))``.
* INT8 weight-only: ``weight`` int8 (N, K) (the nn.Linear layout), one scale per output channel:
  ``W[k, n] = weight[n, k] * scales[n]``.

The linear functions take the checkpoint tensors as stored, or the result of ``prepack_awq`` / ``prepack_gptq``
/ ``prepack_int8`` (checked once, a tile-major copy of the weight the kernel streams as contiguous 16 KB blocks,
act-order rows sorted by group): prepack once per layer for speed.  Prepacking also builds a second,
fragment-major copy (same size as the weight; INT4 plus per-group scale/zero records, ~5%) for the M <= 16
streaming kernels: ``gemv_stream_kernel`` (every warp streams 4 KB chunks straight into mma fragments) where
K and G are multiples of 128 (``use_stream``), its cp.async.bulk twin ``gemv_bulk_kernel`` for INT4 at M = 1 on
large layers with N <= K on sm_90+ (``use_bulk``), else ``gemv_kernel`` or the tile-major kernel (``use_gemv``),
all from H200 measurements.  INT4 layers with that copy can also take ``quant_marlin_kernel`` at 17 <= M <= 128 (a
tensor-core kernel that stages x once per 256-channel CTA, stream-K over the SMs; ``use_marlin``, where it
measured ahead; ``SPEEDCORE_QUANT_MARLIN=1`` / ``0`` forces it on / off).  On sm_90 (H100/H200),
prepack also builds a wgmma-major INT4 copy (the packed weight's size again) and INT4 layers with N % 256 == 0, K
and G multiples of 128 take ``w4_wgmma_kernel`` at 17 <= M <= 1024 (up to M = 8192 from N = 4096; tile shape per
problem: ``w4wgmma_shape``; kernels/quant_sm90.cu: wgmma with the dequantized weights as the register A operand, TMA
x tiles, split-K where the tiles do not fill the GPU), before every other choice including the dense path
(``use_w4wgmma``, where it measured ahead; ``SPEEDCORE_QUANT_W4WGMMA=1`` extends it to 17 <= M <= 8192, ``0`` turns
it and the copy off).  INT8 layers with N % 256 == 0 and K % 64 == 0 get a wgmma-major INT8 copy as well and take
the kernel's INT8 variant at 17 <= M <= 8192 (``use_w8wgmma``; ``SPEEDCORE_QUANT_W8WGMMA=0`` turns it off).  Split-K
launches use a per-stream scratch buffer and zeroed counters kept by this package (an outgrown buffer stays
allocated, so CUDA graphs captured with it stay valid; graphs captured on one stream share it: replay them in
order, not concurrently).

This package also holds round-to-nearest quantizers producing exactly these formats from a float weight (N, K),
NumPy reference dequantizers, a safetensors reader, and GPU dequantizers.  NumPy-only functions need no GPU.

The package, one module per concern (each kernel family beside its ``kernels/`` source):

* ``formats``: the checkpoint formats in NumPy (packers, quantizers, reference dequantizers, safetensors reader);
  ``layouts``: the prepacked layouts in NumPy (reference packers and consumer-side inverses, for tests);
* one module per kernel family, each with its launch-shape heuristic (pure, cached functions), shared-memory
  budget, dispatch predicate and launch: ``mma`` (quant_mma_kernel, kernels/quant_mma.cu), ``gemv`` (gemv_kernel,
  quant_gemv.cu), ``stream`` (gemv_stream_kernel, quant_stream.cu), ``bulk`` (gemv_bulk_kernel, quant_bulk.cu),
  ``marlin`` (quant_marlin_kernel, quant_marlin.cu), ``w4wgmma`` (w4_wgmma_kernel, INT4 and INT8, quant_sm90.cu),
  ``dense`` (dequantize + a dense GEMM above MAX_MMA_M, quant_dense.cu);
* ``prepack``: the prepacked weight classes, prepack_awq / prepack_gptq / prepack_int8 and the fragment-major
  copies (quant_pack.cu); ``linear``: awq_linear, gptq_linear, int8_linear and the dispatch among the families.

Every name of the former single module ``speedcore.quant`` is re-exported here.  The dispatch switches
(``_MARLIN_MODE``, ``_STREAM_MODE``, ``_W4WGMMA_OVERRIDE``, ...) and patched functions (``launch``, ...) live in
their submodules; binding one on this package (``Q._MARLIN_MODE = "on"``, ``monkeypatch.setattr(Q, "launch",
spy)``) rebinds it in every submodule that holds it, so the code that reads it sees the new value.
"""
from __future__ import annotations

import sys
import types

from .. import _arrays as A
from .._compile import Kernel
from .._launch import MAX_CLUSTER, LaunchConfig, device_info, get_kernel, launch
from . import _common, bulk, dense, formats, gemv, layouts, linear, marlin, mma, prepack, stream, w4wgmma
from .formats import (AWQ_ORDER, dequantize_awq_reference, dequantize_gptq_reference, dequantize_int8_reference,
                      FMT_AWQ, FMT_GPTQ, FMT_INT8, KIND_INT4, KIND_INT8, load_safetensors, pack_awq, pack_cols,
                      pack_rows, quantize_awq, quantize_gptq, quantize_int8, unpack_awq, unpack_cols, unpack_rows,
                      _AWQ_POS, _FMT_NAMES, _group, _np_float, _ST_DTYPES)
from .layouts import (gemv_pack_groups_reference, gemv_pack_int4_reference, gemv_pack_int8_reference,
                      gemv_unpack_int4_reference, w4wgmma_groups_reference, w4wgmma_pack_reference,
                      w4wgmma_unpack_reference, w8wgmma_pack_reference, w8wgmma_unpack_reference, _AWQ_NIB)
from ._common import (_aligned_rows, _aligned_rows_x, _alloc_out, _as_dtype, _check_aligned, _check_common,
                      _check_matrix, _env_switch, _finish, _row_stride, _rows_copy, _validate_awq, _validate_gptq,
                      _x_rows)
from .mma import (BLOCK_N, MAX_MMA_M, mma_config, MMAConfig, MT_CHOICES, packed_shape, smem_bytes, STAGES, THREADS,
                  W_STAGE_BYTES, _block_k, _check_packed, _ITEM, _launch_mma, _mma_kernel, _pack, _PACK_KERNELS, _plan,
                  _x_stride)
from .dense import (dequant_int4_grid, DEQUANT_ROWS, dequantize_awq, dequantize_gptq, use_dense, _aligned_copy,
                    _dense_int4, _dequant_int8_kernel, _dequant_int8_launch, _dequant_kernel, _dequant_launch,
                    _lib_module)
from .gemv import (gemv_block_n, gemv_config, GEMV_CTAS_PER_SM, GEMV_GROUP_BYTES, GEMV_MAX_M, gemv_schedule,
                   gemv_smem_bytes, gemv_stages, GEMV_STEP_K, gemv_supported, GEMV_WARPS, GemvConfig, use_gemv,
                   _gemv_kernel, _GEMV_MODE, _gemv_plan, _gemv_scratch, _launch_gemv)
from .stream import (chunk_order, STREAM_CHUNK_K, stream_config, STREAM_INT8_MIN_WARPS, stream_max_warps,
                     STREAM_NBC_CHOICES, STREAM_PREFETCH, STREAM_SPLIT_COST_CHUNKS, stream_supported, StreamConfig,
                     stream_layout, use_stream, WL_FRAGMENT, WL_WGMMA, _launch_chunks, _launch_stream, _packing_warps,
                     _STREAM_DEFINES, _stream_kernel, _STREAM_MODE, _STREAM_OVERRIDE, _stream_plan)
from .bulk import (bulk_config, BULK_MAX_WARPS, bulk_smem_bytes, BULK_SMEM_PER_CTA, BULK_SMEM_PER_SM, bulk_stage_bytes,
                   BULK_X_PITCH, BulkConfig, use_bulk, _bulk_kernel, _BULK_MODE, _BULK_OVERRIDE, _bulk_plan,
                   _launch_bulk)
from .marlin import (MARLIN_BLOCKS, marlin_config, MARLIN_MT_CHOICES, marlin_ranges, marlin_segments, marlin_smem_bytes,
                     marlin_stages, marlin_supported, MARLIN_WARPS, marlin_workspace_floats, MARLIN_X_PITCH,
                     MarlinConfig, use_marlin, _launch_marlin, _marlin_cost, _MARLIN_DEFINES, _marlin_fits,
                     _marlin_kernel, _MARLIN_M_RANGE, _MARLIN_MODE, _MARLIN_OVERRIDE, _marlin_plan)
from .w4wgmma import (use_w4wgmma, use_w8wgmma, W4WGMMA_AUTO_M, W4WGMMA_AUTO_NARROW_M, W4WGMMA_AUTO_NARROW_N,
                      W4WGMMA_AUTO_WIDE_MAX_M, W4WGMMA_AUTO_WIDE_N, W4WGMMA_BK, W4WGMMA_BLK, W4WGMMA_BLOCK_BYTES,
                      W4WGMMA_CANDIDATES, w4wgmma_config, W4WGMMA_CTA_US, w4wgmma_epilogue_bytes, W4WGMMA_GROUP_STEPS,
                      w4wgmma_gs4_built, w4wgmma_m_group, W4WGMMA_M_RANGE, W4WGMMA_MAX_SPLITS, W4WGMMA_MAX_STAGES,
                      W4WGMMA_NO_GS4, W4WGMMA_PUSH_MIN_STAGES, w4wgmma_rows_per_rank, w4wgmma_rx_bytes, w4wgmma_shape,
                      W4WGMMA_SHAPES, w4wgmma_smem_bytes, W4WGMMA_SMEM_LIMIT, W4WGMMA_SOURCE, W4WGMMA_SPLIT_PACK,
                      w4wgmma_stage_bytes, W4WGMMA_STAGE_CHUNKS, w4wgmma_stages, W4WGMMA_STEP_US, w4wgmma_supported,
                      W4WGMMA_TAIL_GAP_US, W4WGMMA_TAIL_MIN_GAIN, w4wgmma_work, W4WgmmaConfig, W8WGMMA_BLOCK_BYTES,
                      W8WGMMA_M_RANGE, w8wgmma_supported, W8WGMMA_VARIANTS, _launch_w4wgmma, _w4_applies,
                      _w4_cluster_ctas, _w4wgmma_best_split, _w4wgmma_epilogue_fits, _w4wgmma_groups, _w4wgmma_kernel,
                      _W4WGMMA_MODE, _W4WGMMA_OVERRIDE, _W4WGMMA_PACK, _w4wgmma_pack, _w4wgmma_pick, _w4wgmma_plan,
                      _w4wgmma_splits, _w4wgmma_tail, _w4wgmma_tiles_time, _w4wgmma_time, _W8WGMMA_MODE, _W8WGMMA_PACK,
                      _w8wgmma_pack)
from .prepack import (AWQWeight, compact_applies, GPTQWeight, Int8Weight, prepack_awq, PREPACK_COPIES, prepack_gptq,
                      prepack_int8, _cc, _check_copies, _classify_g_idx, _make_compact,
                      _fast_group_ok, _FastLayer, _gather_kernel, _gather_x, _gemv_pack, _GEMV_PACK_GROUPS,
                      _GEMV_PACK_INT4, _GEMV_PACK_INT8, _GemvLayer, _make_fast, _obj_ptr, _permute_gptq,
                      _PERMUTE_KERNEL, _to_device_like, _want_gemv_layout)
from .linear import (awq_linear, gptq_linear, int8_linear, _fast_call, _launch_linear)


def all_kernels() -> list:
    """Every variant this module can launch (for ``python -m speedcore compile``)."""
    out = []
    for dtype in A.HALF_DTYPES:
        for fmt in (FMT_AWQ, FMT_GPTQ, FMT_INT8):
            for mt in MT_CHOICES:
                out.append(_mma_kernel(dtype, fmt, mt))
        for fmt in (FMT_AWQ, FMT_GPTQ):
            out.append(_dequant_kernel(dtype, fmt))
        out.append(_dequant_int8_kernel(dtype))
        out.append(_gather_kernel(dtype))
        for kind in (KIND_INT4, KIND_INT8):
            for mt in (1, 2):
                out.append(_gemv_kernel(dtype, kind, mt))
                out.append(_stream_kernel(dtype, kind, mt))
                if mt == 2:
                    out.extend(_stream_kernel(dtype, kind, mt, nbc=c) for c in STREAM_NBC_CHOICES[1:])
                if kind == KIND_INT4:  # on the wgmma-major copy (compact layers)
                    out.extend(_stream_kernel(dtype, kind, mt, nbc=c, wl=WL_WGMMA)
                               for c in (STREAM_NBC_CHOICES if mt == 2 else (1,)))
                out.append(_bulk_kernel(dtype, kind, mt))
        for mt in MARLIN_MT_CHOICES:
            out.append(_marlin_kernel(dtype, mt))

        def w4(mt, blk, gs=1, ks=1, kind=KIND_INT4):  # the unsplit ring, and the two-rank split's where it differs
            for stages in dict.fromkeys(w4wgmma_stages(mt, blk, ks, kind, splits) for splits in (1, 2)):
                out.append(_w4wgmma_kernel(dtype, mt, blk, stages, gs=gs, ks=ks, kind=kind))
        for blk, mts in W4WGMMA_SHAPES.items():
            for mt in mts:
                w4(mt, blk)
                for gs in W4WGMMA_GROUP_STEPS[1:]:
                    if gs != 4 or w4wgmma_gs4_built(blk, mt, 1):
                        w4(mt, blk, gs=gs)
                if mt == 64:  # 128-k stages (ks = 2): gs 4 the default, gs 1 for measurements
                    for gs in (1, 4):
                        w4(mt, blk, gs=gs, ks=2)
        for blk, mt, gs, ks in sorted(W8WGMMA_VARIANTS):
            w4(mt, blk, gs=gs, ks=ks, kind=KIND_INT8)
    out.append(_PERMUTE_KERNEL)
    out.extend(_PACK_KERNELS.values())
    out.extend(_GEMV_PACK_INT4.values())
    out.extend(_GEMV_PACK_GROUPS.values())
    out.append(_GEMV_PACK_INT8)
    out.extend(_W4WGMMA_PACK.values())
    out.append(_W8WGMMA_PACK)
    return out


_SUBMODULES = (formats, layouts, _common, mma, dense, gemv, stream, bulk, marlin, w4wgmma, prepack, linear)
_UNSET = object()


def _holders() -> dict:
    """name -> the submodules that bind that name to the same object as this package (taken once, at import)."""
    out = {}
    for name, value in list(globals().items()):
        if name.startswith("__") or isinstance(value, types.ModuleType):
            continue
        mods = tuple(m for m in _SUBMODULES if m.__dict__.get(name, _UNSET) is value)
        if mods:
            out[name] = mods
    return out


class _Package(types.ModuleType):
    """speedcore.quant with the single module's patching semantics: binding a re-exported name here also rebinds it
    in the submodules that hold it (the one that defines it and those that import it)."""

    def __setattr__(self, name, value):
        for mod in _HOLDERS.get(name, ()):
            setattr(mod, name, value)
        super().__setattr__(name, value)


_HOLDERS = _holders()
sys.modules[__name__].__class__ = _Package
from .checkpoint import quantize_checkpoint  # noqa: E402  (NumPy only: checkpoints in AutoAWQ / AutoGPTQ's format)
