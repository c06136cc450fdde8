"""Grouped GEMM over expert-sorted row segments with MXFP4 weights decoded in registers: the host side (checks,
launch plans, launches) of the Triton kernel (`kernel.py`) and the Gluon one (`wgmma.py`).

One call computes, for every expert e of a layer and every sorted row m of its segment
`expert_offsets[e] <= m < expert_offsets[e + 1]`:

    C[c_row(m)] = A[a_row(m)] @ W_e^T                              (dual=None)
    C[c_row(m)] = A[a_row(m)] @ W_e^T + A2[a_row(m)] @ B_e^T       (dual="in": backward of gate+up)
    C[c_row(m)] = [A W_e^T | A B_e^T]  or  act(A W_e^T, A B_e^T)   (dual="out": gate+up, optional fused GLU)

where W_e / B_e are MXFP4 matrices as compressed-tensors stores them (`decode.py`): `packed` uint8 [E, rows,
cols/2] and `scale` uint8 [E, rows, cols/32]. With trans_w=False the stored matrix is [N, K] (a forward projection,
groups along K); with trans_w=True it is [K, N] and used untransposed (the backward of a projection, groups along
N). Operands are bf16 (A is rounded to bf16 in registers), accumulation is fp32. With `a_scale`, A is MXFP8 (E4M3
codes and their E8M0 scales) and the forward layouts run on FP8 tensor cores (W4A8, `w4a8.py`).

On sm_90 the forward tiles of one and two rows per expert run the Gluon kernel (same decode, bit-identical outputs
in the table decode's K order). `reference.mxfp4_grouped_gemm_ref` has the same signature and semantics in PyTorch.
Runs under TRITON_INTERPRET=1 on CPU tensors (small shapes, for CI).
"""

import torch

from .. import _launch
from .._host import cdiv, interpreter_enabled, next_pow2
from . import tiles, w4a8, wgmma
from .decode import HAS_TRITON, decode_mode, kperm_index, kperm_position
from .kernel import _block_prefix_kernel, _dequant_kernel, _mxfp4_grouped_gemm_kernel, _route_ids_kernel

ACTS = {None: 0, "silu": 1, "situ": 2}
DUALS = {None: 0, "out": 1, "in": 2}


def available(device):
    """True when the kernels can run on tensors of `device` (CUDA, or any device under TRITON_INTERPRET=1)."""
    if not HAS_TRITON:
        return False
    device = torch.device(device)
    return device.type == "cuda" or (interpreter_enabled() and device.type == "cpu")


def dequantize_bf16(packed, scale):
    """MXFP4 -> bf16 for whole expert stacks in one launch: packed uint8 [..., R, C/2], scale uint8 [..., R, C/32]
    -> bf16 [..., R, C], the same bits as the GEMM's in-register decode (and as `reference.dequant_ref`). For
    prefill, where an expert's weights serve hundreds of rows and a bf16 tensor-core GEMM outruns decoding in every
    tile. Scales of 0xFF (NaN) are the caller's to refuse (the model checks them at load)."""
    C = packed.shape[-1] * 2
    if scale.shape[:-1] != packed.shape[:-1] or scale.shape[-1] * 32 != C:
        raise ValueError(f"dequantize_bf16: packed {tuple(packed.shape)} and scale {tuple(scale.shape)} do not fit "
                         "[..., R, C/2] / [..., R, C/32]")
    out = torch.empty(*packed.shape[:-1], C, device=packed.device, dtype=torch.bfloat16)
    R = packed.numel() // (C // 2)
    if R:
        BR, BC = 32, 128
        _dequant_kernel[(cdiv(R, BR), cdiv(C, BC))](
            packed.contiguous(), scale.contiguous(), out, R, C, BR=BR, BC=BC,
            PTX=decode_mode(packed.device) == "ptx", num_warps=4)
    return out


def scales_fit_table_free(*scales):
    """Whether every E8M0 exponent in these scale stacks is at most 128 (2^1: blocks whose largest |w| is below 16),
    the range of the Gluon kernel's table-free decode. One reduction and a host sync per stack: callers cache it."""
    return all(int(s.max()) <= 128 for s in scales if s.numel())


def route_expert_ids(topk_idx, num_experts, x=None, x_kperm=0, x_nib=False):
    """topk_idx [T, k] (any integer dtype) -> (int32 [T*k] the routes' experts, the `expert_ids` of
    `mxfp4_grouped_gemm`; int32 [1], 1 when every id lies in [0, num_experts)) in one launch: check the flag with
    torch._assert_async, no host synchronisation (the comparisons in PyTorch take five launches).
    With x [T, K] (and x_kperm=BK): (ids, flag, `permute_k(x, BK, nib=x_nib)`) from the same launch, the decode's
    gate+up input in its tile's K order (one launch and its host time less than `permute_k` apart)."""
    flat = topk_idx.reshape(-1).contiguous()
    buf = torch.empty(flat.numel() + 1, dtype=torch.int32, device=flat.device)  # one allocation: host time
    ids, ok = buf[:-1], buf[-1:]
    block = min(1024, next_pow2(max(flat.numel(), 16)))
    if x is None:
        _launch.launch(_route_ids_kernel, (1,), (flat, ids, ok, flat.numel(), num_experts, flat, flat, flat, 0),
                       BLOCK=block, HAS_X=False, BLOCK_K=16)
        return ids, ok
    if x.dim() != 2 or x.shape[0] != topk_idx.shape[0]:
        raise ValueError(f"x must be [T={topk_idx.shape[0]}, K], got {tuple(x.shape)}")
    x = x.contiguous()
    K = x.shape[1]
    xp = torch.empty_like(x)
    _launch.launch(_route_ids_kernel, (1 + x.shape[0],),
                   (flat, ids, ok, flat.numel(), num_experts, x, kperm_index(K, x_kperm, x.device, x_nib), xp, K),
                   BLOCK=block, HAS_X=True, BLOCK_K=min(1024, next_pow2(K)))
    return ids, ok, xp


def block_prefix(lo, hi, BM, block=1024):
    """[E+1] int32: cumulative number of BM-row blocks over the segments lo[e] <= m < hi[e] (integer [E], hi >= lo;
    what the GEMM kernel searches), in one launch (five in PyTorch). `block`: segments per step of the kernel's
    running sum."""
    E = lo.numel()
    bcum = torch.empty(E + 1, dtype=torch.int32, device=lo.device)
    _launch.launch(_block_prefix_kernel, (1,), (lo, hi, bcum, E), BM=BM, BLOCK=min(block, next_pow2(max(E, 16))))
    return bcum


def tail_split(lo, hi, BM, tail):
    """Where each segment lo[e] <= m < hi[e] ends for the BM-row tiles when a last block of at most `tail` rows
    goes to a launch of `tail`-row tiles instead (int32 [E]; that launch covers [the result, hi[e])). At 16K tokens
    of K3 an expert has ~293 rows: three 128-row tiles compute 384 rows, two and a 64-row tile 320."""
    r = (hi - lo) % BM
    return hi - torch.where(r <= tail, r, torch.zeros_like(r))


def _shapes(a, w_packed, w_scale, trans_w):
    if w_packed.dim() != 3 or w_scale.dim() != 3:
        raise ValueError("stacked MXFP4 weights must be [E, rows, cols/2] and [E, rows, cols/32]")
    E, R, Cp = w_packed.shape
    if w_scale.shape != (E, R, Cp * 2 // 32):
        raise ValueError(f"weight_scale {tuple(w_scale.shape)} does not match weight_packed {tuple(w_packed.shape)}")
    N, K = (2 * Cp, R) if trans_w else (R, 2 * Cp)
    if a.shape[-1] != K:
        raise ValueError(f"activations have {a.shape[-1]} columns, the weights need K={K}")
    return E, N, K


def mxfp4_grouped_gemm(a, w_packed, w_scale, expert_offsets, *, trans_w=False, a_rows=None, c_rows=None,
                       num_c_rows=None, a2=None, b_packed=None, b_scale=None, dual=None, act=None,
                       act_params=(4.0, 25.0), out_dtype=torch.float32, config=None, a_kperm=0, expert_ids=None,
                       a_row_div=1, a_nib=False, c_kperm=0, c_nib=False, a_scale=None):
    """Grouped MXFP4 GEMM (see the module docstring).

    a [Ra, K] float (bf16 preferred); w_packed/w_scale stacked MXFP4 [E, N, K/2]/[E, N, K/32] (or [E, K, N/2]/
    [E, K, N/32] with trans_w); expert_offsets int32 [E+1] (sorted segment starts, last = M); a_rows int32 [M]
    (row of `a` for sorted row m, default m); c_rows int32 [M] (row of C written by sorted row m, default m; C has
    num_c_rows rows, default M, and must be covered); dual None | "out" | "in" with b_packed/b_scale (and a2 for
    "in"); act None | "silu" | "situ" (dual="out" only; act_params = (beta1, beta2 or None = linear up));
    returns C [num_c_rows, N] (dual="out" without act: [num_c_rows, 2N] = [A W^T | A B^T]) in out_dtype.
    a_kperm=BK (forward GEMMs only): the columns of `a` (and `a2`) are in the K order of PERM tiles with this BK
    (`permute_k`), which fixes the tile's BK and PERM.
    a_nib (with a_kperm): the columns are in the order of the Gluon kernel's table-free decode instead
    (`permute_k(a, BK, nib=True)`; `tiles.kperm_tile` says where the default tile takes it); every scale exponent of
    the weights must be <= 128 (`scales_fit_table_free`), which is not checked here.
    expert_ids int32 [M] instead of expert_offsets (forward only; expert_offsets=None): rows in any order, one per
    program at BM=16, row m's expert expert_ids[m] (E or more: the row is zeros); without a_rows row m reads
    row m // a_row_div of `a`. For decode, where sorting the few routes costs more launches than it saves.
    c_kperm=BK (c_nib): C's columns written in the order of `permute_k(C, BK, nib=c_nib)`, the `a_kperm` / `a_nib`
    input of the GEMM that reads C next (gate+up with the GLU fused, then down), instead of a copy in between; the
    Gluon tiles only. (The Triton kernel's 2-byte scattered stores would cost more than `permute_k` afterwards.)
    a_scale uint8 [Ra, K/32] (W4A8): `a` holds MXFP8 elements (float8_e4m3fn, or their uint8 codes) and these are
    their E8M0 scales (`w4a8.quantize_mxfp8`); forward layouts only (trans_w=False, dual None or "out"), activations
    in stored K order (no a_kperm / a_nib / c_kperm), on the Triton W4A8 kernel.
    config: a tile of the caller's own (bench/ and tests: BM, BN, BK, num_warps, num_stages, PERM, TAIL, WG, PAIR).
    Launch plans: what this function works out from a call's shapes, strides and options (the checks, the tiles, the
    tail launches, each kernel's constexprs) is kept per call signature (`_plan_key`), so a repeated call (every
    decode step) only allocates C, splits the segments and launches. The tile tables and options are part of the
    signature (`tiles.tile_state`); after patching this package's functions, `clear_plans()`. Calls with a
    `config` are planned afresh every time.
    """
    opts = (trans_w, num_c_rows, dual, act, tuple(act_params), out_dtype, a_kperm, a_row_div, a_nib, c_kperm, c_nib,
            a_scale is not None)
    if a_scale is not None:  # W4A8: the scales ride in the kernel's second activation slot (no dual="in" there)
        a2 = a_scale
    key = None if config else _plan_key(a, w_packed, w_scale, expert_offsets, a_rows, c_rows, a2, b_packed, b_scale,
                                        expert_ids, opts)
    plan = _PLANS.get(key) if key is not None else None
    if plan is None:
        plan = _Plan(a, w_packed, w_scale, expert_offsets, a_rows, c_rows, a2, b_packed, b_scale, expert_ids, opts,
                     config)
        if key is not None:
            if len(_PLANS) >= _MAX_PLANS:  # shapes that keep changing: start over rather than grow
                _PLANS.clear()
            _PLANS[key] = plan
    return plan(a, w_packed, w_scale, expert_offsets, a_rows, c_rows, a2, b_packed, b_scale, expert_ids)


_PLANS = {}  # `_plan_key` -> _Plan
_MAX_PLANS = 1024


def clear_plans():
    """Forget `mxfp4_grouped_gemm`'s launch plans (after patching this package's functions: the plans keep what
    they returned)."""
    _PLANS.clear()


def _plan_key(a, w_packed, w_scale, expert_offsets, a_rows, c_rows, a2, b_packed, b_scale, expert_ids, opts):
    """Everything a plan depends on: shapes, strides and dtypes that the checks and tiles read, which optional
    tensors are given (their dtypes and alignment are the kernel launcher's business), the options and tables."""
    return (a.shape, a.dtype, w_packed.shape, w_packed.stride(), w_packed.dtype, w_scale.shape,
            w_scale.stride(), None if b_packed is None else (b_packed.shape, b_packed.stride()),
            None if b_scale is None else (b_scale.shape, b_scale.stride()), None if a2 is None else a2.shape,
            -1 if a_rows is None else a_rows.numel(), -1 if expert_ids is None else expert_ids.numel(),
            expert_offsets is None, c_rows is None, opts, tiles.tile_state(a.device))


def _check_a8(a, a_scale, trans_w, dual, permuted, config):
    """The W4A8 call's operands: E4M3 elements [Ra, K] with uint8 scales [Ra, K/32], a forward layout in stored K
    order."""
    fp8 = w4a8.FP8_E4M3
    if a.dtype not in (torch.uint8, fp8) or a.dim() != 2:
        raise ValueError(f"W4A8: a must hold MXFP8 elements (float8_e4m3fn or uint8 codes) [rows, K], got {a.dtype} "
                         f"{tuple(a.shape)}")
    if a_scale.dtype != torch.uint8 or a_scale.shape != (a.shape[0], a.shape[1] // 32):
        raise ValueError(f"W4A8: a_scale must be uint8 [{a.shape[0]}, {a.shape[1] // 32}] (one E8M0 scale per 32 "
                         f"elements of a), got {a_scale.dtype} {tuple(a_scale.shape)}")
    if trans_w or dual == "in" or permuted:
        raise ValueError("W4A8 runs the forward layouts (trans_w=False, dual None or 'out') in stored K order "
                         "(no a_kperm, a_nib or c_kperm)")
    if config and int(config.get("WG", 0)):
        raise ValueError("W4A8 runs on the Triton kernel, not the Gluon tiles (WG)")


class _Plan:
    """The launches of one call signature of `mxfp4_grouped_gemm`: the checks, the tile, the tail launches and
    their kernels, worked out once."""

    def __init__(self, a, w_packed, w_scale, expert_offsets, a_rows, c_rows, a2, b_packed, b_scale, expert_ids, opts,
                 config):
        trans_w, num_c_rows, dual, act, act_params, out_dtype, a_kperm, a_row_div, a_nib, c_kperm, c_nib, a8 = opts
        if a8:
            _check_a8(a, a2, trans_w, dual, a_kperm or a_nib or c_kperm, config)
        E, N, K = _shapes(a, w_packed, w_scale, trans_w)
        if K % 32 or N % 32:
            raise ValueError("MXFP4 grouped GEMM needs N and K to be multiples of 32")
        if (expert_offsets is None) == (expert_ids is None):
            raise ValueError("give the rows' experts as exactly one of expert_offsets or expert_ids")
        if expert_ids is not None and (trans_w or dual == "in"):
            raise ValueError("expert_ids (one row per program) is for the forward layouts")
        M = (a_rows.numel() if a_rows is not None else expert_ids.numel() if expert_ids is not None
             else a.shape[0] * a_row_div)
        if act is not None and dual != "out":
            raise ValueError("a fused activation needs dual='out'")
        ncols = 2 * N if (dual == "out" and act is None) else N
        # rows of other ranks' experts (expert_ids >= E): the kernel writes zeros there (one launch less than filling)
        self.c_shape, self.out_dtype = (num_c_rows if num_c_rows is not None else M, ncols), out_dtype
        self.steps = []
        if M == 0:
            return
        # one row per program with expert_ids: the tiles of one row per expert (BM=16)
        cfg = dict(tiles.default_config(M, M if expert_ids is not None else E, N, K, dual, trans_w,
                                        row_expert=expert_ids is not None))
        if a8:  # the W4A8 kernel: the default tile's height, its own tile table, plain K order, one launch
            cfg = w4a8.a8_tile(cfg["BM"], K)
        if config:
            if {"BM", "BN", "BK"} & set(config):  # a tile of the caller's own: plain K order, one launch unless asked
                cfg.update(PERM=0, TAIL=())
            cfg.update(config)
        if a_kperm:
            if trans_w:
                raise ValueError("a_kperm is for forward GEMMs (trans_w=False)")
            kperm_index(K, a_kperm)
            if config and config.get("BK", a_kperm) != a_kperm:
                raise ValueError(f"a_kperm={a_kperm} needs a tile with BK={a_kperm}, got BK={config['BK']}")
            if cfg["BK"] != a_kperm or not cfg.get("PERM"):  # the default tile is not K-permuted at this BK
                BN, _, warps, stages = tiles._PERM_TILES.get((cfg["BM"], dual), tiles._TILES[cfg["BM"]])[:4]
                cfg.update(BN=BN, BK=a_kperm, num_warps=warps, num_stages=stages)
            cfg.update(PERM=1)
        if c_kperm:
            if act is None or not cfg.get("WG"):
                raise ValueError("c_kperm: C in another GEMM's K order needs the GLU fused and a Gluon tile (WG=1; "
                                 f"`kperm_tile`), got act={act!r}, tile {cfg}")
            cfg["c_pos"] = kperm_position(N, c_kperm, a.device, c_nib)
        if a_nib:
            if not a_kperm or not cfg.get("WG"):
                raise ValueError("a_nib: activations in the table-free decode's order need a_kperm and a Gluon tile "
                                 f"(WG=1; `kperm_tile`), got a_kperm={a_kperm}, tile {cfg}")
            cfg["NIB"] = 1
        if a2 is not None and a2.shape != a.shape and not a8:
            raise ValueError("a2 must have the shape of a")
        b_packed = w_packed if b_packed is None else b_packed
        b_scale = w_scale if b_scale is None else b_scale
        if dual is not None and (b_packed.shape != w_packed.shape or b_packed.stride() != w_packed.stride()
                                 or b_scale.stride() != w_scale.stride()):
            raise ValueError("the two weights of a dual GEMM must have the same shape and strides")
        beta1, beta2 = act_params if act == "situ" else (1.0, 1.0)
        self.w_strides = (w_packed.stride(0), w_packed.stride(1), w_scale.stride(0), w_scale.stride(1))
        self.scalars = (N, K, E, float(beta1), float(beta2 if beta2 is not None else 1.0))
        e_chunk = min(1024, next_pow2(E))
        meta = dict(
            E_CHUNK=e_chunk, NUM_E_CHUNKS=cdiv(E, e_chunk),
            TRANS_W=bool(trans_w), DUAL=DUALS[dual], ACT=ACTS[act], LINEAR_UP=(act == "situ" and beta2 is None),
            GATHER_A=a_rows is not None, A_DIV=int(a_row_div), SCATTER_C=c_rows is not None,
            OP_F32=interpreter_enabled(), ROW_EXPERT=expert_ids is not None,
            PTX=decode_mode(a.device) == "ptx", A_KPERM=bool(a_kperm))
        if expert_ids is not None:
            self.steps.append((0, _GemmLaunch(cfg, M, N, K, meta, config)))
            return
        nblocks = min(E, M) + cdiv(M, cfg["BM"])
        # full BM-row blocks (and last blocks longer than the first tail height) first, then each expert's short
        # last block in the tiles of the largest tail height it fits (one block per expert in each tail launch)
        for t in sorted(tiles.tails(cfg.get("TAIL", ())), reverse=True):
            if not 0 < t < cfg["BM"]:
                continue
            self.steps.append((t, _GemmLaunch(cfg, nblocks, N, K, meta, config)))
            cfg, nblocks = tiles.tail_config(cfg, t, dual, trans_w, config), min(E, M)
        self.steps.append((0, _GemmLaunch(cfg, nblocks, N, K, meta, config)))

    def __call__(self, a, w_packed, w_scale, expert_offsets, a_rows, c_rows, a2, b_packed, b_scale, expert_ids):
        c = torch.empty(self.c_shape, dtype=self.out_dtype, device=a.device)
        if not self.steps:
            return c
        a = a.contiguous()
        if a.dtype == w4a8.FP8_E4M3:  # W4A8: the kernel reads the codes as bytes
            a = a.view(torch.uint8)
        ids = expert_ids if expert_ids is not None else a  # a placeholder where not read
        head = (a, a if a2 is None else a2.contiguous(), ids if a_rows is None else a_rows, a.stride(0), w_packed,
                w_scale, w_packed if b_packed is None else b_packed, w_scale if b_scale is None else b_scale,
                *self.w_strides)
        rest = (c, ids if c_rows is None else c_rows, c.stride(0), *self.scalars)
        if expert_ids is not None:
            self.steps[0][1](head, ids, ids, ids, rest)
            return c
        lo, hi = expert_offsets[:-1], expert_offsets[1:]
        for t, launch in self.steps[:-1]:  # each tail launch covers [the split, hi) of its segments
            mid = tail_split(lo, hi, launch.BM, t)
            launch(head, lo, mid, ids, rest)
            lo = mid
        self.steps[-1][1](head, lo, hi, ids, rest)
        return c


class _GemmLaunch:
    """One launch of a plan: tile cfg over nblocks row blocks (an upper bound: programs past the real count return
    at once) times the n-tiles. Called with sorted segments lo[e] <= m < hi[e], whose block prefix sum is formed
    per call, or the ids of ROW_EXPERT."""

    def __init__(self, cfg, nblocks, N, K, meta, config):
        BM, BN, BK = cfg["BM"], cfg["BN"], cfg["BK"]
        trans_w = meta["TRANS_W"]
        self.BM, self.row_expert = BM, meta["ROW_EXPERT"]
        self.meta = dict(
            meta, BM=BM, BN=BN, BK=BK,
            PERM=bool(int(cfg.get("PERM", 0))) and not trans_w and BK >= 32,
            # whole tiles in the forward layout: loads without masks (the other layouts keep theirs)
            EVEN=not trans_w and K % BK == 0 and N % BN == 0,
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
        gluon = False
        if int(cfg.get("A8", 0)):  # the layout was checked with the plan (`_check_a8`); a caller's tile here
            if BK % 32 or K % BK:
                raise ValueError(f"the W4A8 kernel computes whole 32-column K blocks (tile {cfg}, K={K})")
            self.grid, self.kernel = (nblocks * cdiv(N, BN),), w4a8.launcher(self.meta)
            self.run = self._run_a8
            return
        if int(cfg.get("WG", 0)):
            gluon = wgmma.supported(self.meta, cfg, N, K)
            # NIB, c_pos: no other kernel reads / writes those K orders
            if not gluon and ((config and config.get("WG")) or cfg.get("NIB") or cfg.get("c_pos") is not None):
                raise ValueError(f"the wgmma kernel does not compute this launch (tile {cfg})")
        self.grid, self.kernel = (nblocks * cdiv(N, BN),), None
        self.run = wgmma.prepare(nblocks, self.meta, cfg, N, K) if gluon else self._run_triton

    def __call__(self, head, lo, hi, eid, rest):
        self.run(head + (lo, hi, eid if self.row_expert else block_prefix(lo, hi, self.BM), eid) + rest)

    def _run_a8(self, args):
        self.kernel(self.grid, args)

    def _run_triton(self, args):
        if self.kernel is None:
            self.kernel = _launch_gemm(self.grid, args, self.meta)
        else:
            self.kernel(self.grid, args)


_STAGES_THAT_FIT = {}  # (specialisation) -> num_stages that compiled within the GPU's shared memory


def _launch_gemm(grid, args, meta):
    """Launch with the configured pipeline depth, or the deepest that fits in shared memory: the default tiles were
    chosen on forward GEMMs, and the backward's layouts (trans_w, dual="in") of the same tile may need more (at
    BM=128: 237,568 > 232,448 bytes on an H200). Out-of-resources is raised at compile time, before anything runs.
    Returns the launcher that worked, for the plan's later calls."""
    key = tuple(sorted((k, v) for k, v in meta.items() if k != "num_stages"))
    stages = _STAGES_THAT_FIT.get(key, meta["num_stages"])
    while True:
        kernel = _launch.Launcher(_mxfp4_grouped_gemm_kernel, **dict(meta, num_stages=stages))
        try:
            kernel(grid, args)
            _STAGES_THAT_FIT[key] = stages
            return kernel
        except Exception as ex:  # triton.runtime.errors.OutOfResources (its module moved between versions)
            if type(ex).__name__ != "OutOfResources" or stages <= 1:
                raise
            stages -= 1
