"""Forward MXFP4 grouped GEMM for Hopper in Gluon: the decoded weight tile is the register A operand of an
asynchronous wgmma, so the next tile decodes while the tensor cores work on this one.

Same semantics as the Triton kernel (`kernel.py`) for the layouts it covers: forward (trans_w=False), dual None /
"out" (GLU fused or not), sorted expert segments or one route per program, activations in the K order of PERM tiles
(`decode.permute_k`), whole tiles (N % BN == 0, K % BK == 0). Triton's own pipeliner makes a wgmma with a register
operand synchronous (each K step waits for its MMA). Here the pipeline is written out: packed bytes and activations
arrive by cp.async in a ring of STAGES slots, each weight tile is decoded straight into the wgmma A-fragment layout,
and one MMA stays in flight while the next tile decodes. An MMA in flight reads its decoded words from registers
until the next wait, so those words are that wait's dependencies, and consecutive MMAs need distinct values: gate
and up alternate, a down program takes two adjacent row tiles (PAIR), or a single tile steps through K two tiles at
a time. The decode is the Triton kernel's inline PTX and the K order its PERM order, so the outputs are
bit-identical; or, where every scale exponent is <= 128 (NIB), the decode without tables (`decode.e2m1_shift_ptx`)
with the activations in its own K order (`decode.kperm_index(..., nib=True)`): the same products, summed in another
order.

GPU only (Gluon has no interpreter: tests/test_mxfp4_wgmma.py compiles it for sm_90 on the CPU and checks the
SASS, and compares outputs on an sm_90 GPU); `gemm.mxfp4_grouped_gemm` picks it (`tiles.default_config`,
`supported`) and keeps the Triton kernel for every other layout.
"""

import functools

from .. import _launch
from . import options
from .decode import E2M1_CONSTRAINTS, E2M1_PTX, LUT_WORDS, ZERO_PTX, e2m1_shift_ptx

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, \
        warpgroup_mma_wait

    # Triton 3.6 names the cp.async copy async_copy_global_to_shared, later versions async_load
    _cp_async = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
    _barrier = getattr(gl, "thread_barrier", None) or gl.barrier  # renamed after 3.6

    HAS_GLUON = True
except ImportError:  # pragma: no cover - no Triton, or a Triton without Gluon
    HAS_GLUON = False


def _log2(n):
    assert n > 0 and n & (n - 1) == 0, n
    return n.bit_length() - 1


@functools.lru_cache(maxsize=None)  # built at every launch otherwise: ~30 us of host time each (Triton 3.9)
def byte_layout(BN, BK, num_warps):
    """Register layout of a packed weight tile viewed as [BN, BK/32, 16] (row, scale group, byte in group), stored
    in the K order of PERM tiles: stored byte P = (BK/8) t + q of a row is what lane t (of its quad) needs for the
    wgmma A fragment, q < BK/8 in registers (contiguous: wide shared-memory loads), then the fragment's second row
    (r + 8). Rows: lane // 4 (r < 8), warp (16 rows each)."""
    qbits = _log2(BK // 8)

    def pbit(b):  # basis of bit b of the stored byte index P
        return [0, 0, 1 << b] if b < 4 else [0, 1 << (b - 4), 0]

    reg = [pbit(b) for b in range(qbits)] + [[8, 0, 0]]
    lane = [pbit(qbits), pbit(qbits + 1), [1, 0, 0], [2, 0, 0], [4, 0, 0]]
    warp = [[16 << i, 0, 0] for i in range(_log2(num_warps))]
    return gl.DistributedLinearLayout(reg, lane, warp, [], [BN, BK // 32, 16])


if HAS_GLUON:
    @gluon.constexpr_function
    def _PREFETCH_ASM(pf):
        """L2 prefetches of the 128-byte lines [$1, $1 + pf) where $2 != 0."""
        lines = " ".join(f"@p prefetch.global.L2 [$1+{o}];" for o in range(0, pf, 128))
        return "{.reg .pred p; setp.ne.b32 p, $2, 0; " + lines + " mov.b32 $0, 0;}"

    _E2M1 = gl.constexpr(E2M1_PTX)
    _E2M1_SHIFT = gl.constexpr(e2m1_shift_ptx())
    _CONS = gl.constexpr(E2M1_CONSTRAINTS)
    _ZERO = gl.constexpr(ZERO_PTX)
    _LUT_A = gl.constexpr(LUT_WORDS[0])
    _LUT_B = gl.constexpr(LUT_WORDS[1] - (1 << 32))

    @gluon.jit
    def _decode(p, s, BN: gl.constexpr, BK: gl.constexpr, A_LAYOUT: gl.constexpr, NIB: gl.constexpr):
        """p uint8 [BN, BK/32, 16] (byte_layout), s uint8 [BN, BK/32] (its slice) -> bf16 [BN, BK] in the wgmma A
        layout, K in the PERM order (the decode of `decode._dequant`, same bits); NIB: the table-free decode
        (`decode.e2m1_shift_ptx`, same values), K in the order of `decode.kperm_index(..., nib=True)`."""
        if NIB:
            b = (s.to(gl.int32) + 126) << 7
            sb = gl.broadcast(gl.expand_dims(b | (b << 16), 2), p)[0]
            w = gl.inline_asm_elementwise(_E2M1_SHIFT, "=r,=r,=r,=r,r,r,r,r,r", [p, sb], dtype=gl.int32,
                                          is_pure=True, pack=4)
        else:
            b = gl.maximum(s.to(gl.int32) << 7, 0x40)
            sb = gl.broadcast(gl.expand_dims(b | (b << 16), 2), p)[0]
            z = gl.inline_asm_elementwise(_ZERO, "=r,r", [sb], dtype=gl.int32, is_pure=True, pack=1)
            w = gl.inline_asm_elementwise(_E2M1, _CONS, [p, sb, z | _LUT_A, z | _LUT_B], dtype=gl.int32,
                                          is_pure=True, pack=4)
        lo = w.to(gl.int16).to(gl.bfloat16, bitcast=True)
        hi = (w >> 16).to(gl.int16).to(gl.bfloat16, bitcast=True)
        x = gl.join(lo, hi)  # [BN, BK/32, 16, 2]: column 2P + e in stored order
        # stored P = (BK/8) t + 2 s + h -> MMA K index 16 s + 8 h + 2 t + e
        x = gl.reshape(x, [BN, 4, BK // 16, 2, 2])
        x = gl.permute(x, [0, 2, 3, 1, 4])
        x = gl.reshape(x, [BN, BK])
        # w: the bf16x2 words the wgmma reads (LLVM folds the split and re-pack), the dependency to keep alive
        return gl.convert_layout(x, A_LAYOUT, assert_trivial=True), w

    @gluon.jit
    def _prefetch_rows(ptrs, off, lim, PF: gl.constexpr):
        """Prefetch bytes [off, off + PF) of each weight row into L2 (where off < lim, the row's), a 128-byte line per
        instruction, one row per thread (`prefetch_bytes`; a bulk prefetch wants a uniform address: per-thread rows
        became a loop over the lanes)."""
        ok = (off < lim).to(gl.int32)
        gl.inline_asm_elementwise(_PREFETCH_ASM(PF), "=r,l,r", [ptrs + off, ok], dtype=gl.int32, is_pure=False,
                                  pack=1)

    @gluon.jit
    def _tanh(x):
        x = gl.minimum(gl.maximum(x, -20.0), 20.0)
        return 1.0 - 2.0 / (gl.exp(2.0 * x) + 1.0)

    @gluon.jit
    def _glu(g, u, beta1, beta2, ACT: gl.constexpr, LINEAR_UP: gl.constexpr):
        sig = 1.0 / (1.0 + gl.exp(-g))
        if ACT == 1:
            return g * sig * u
        if not LINEAR_UP:
            u = beta2 * _tanh(u / beta2)
        return beta1 * _tanh(g / beta1) * sig * u

    @gluon.jit
    def _issue(step, n_k, slot, w_ptr, b_ptr, a_ptr, w_off, rows_off, m_mask_x, p_smem, q_smem, x_smem,
               BK: gl.constexpr, TWO: gl.constexpr, P_LOAD: gl.constexpr, X_LOAD: gl.constexpr):
        """cp.async of K step `step` (packed weights, activations) into ring slot `slot`; one commit group even
        past the last step, so the group count stays the same every iteration."""
        if step < n_k:
            k0 = step * BK
            _cp_async(p_smem.index(slot), w_ptr + (w_off + k0 // 2))
            if TWO:
                _cp_async(q_smem.index(slot), b_ptr + (w_off + k0 // 2))
            kk = gl.arange(0, BK, layout=gl.SliceLayout(0, X_LOAD))
            _cp_async(x_smem.index(slot), a_ptr + (rows_off + k0 + kk[None, :]), mask=m_mask_x)
        async_copy.commit_group()

    @gluon.jit
    def _ready(k, n_k, w_ptr, b_ptr, a_ptr, w_off, rows_off, m_mask_x, p_smem, q_smem, x_smem,
               BK: gl.constexpr, STAGES: gl.constexpr, TWO: gl.constexpr, P_LOAD: gl.constexpr,
               X_LOAD: gl.constexpr, P_LAYOUT: gl.constexpr):
        """Wait for K step k's copies, refill the slot of step k-2 with step k+STAGES-2, and read step k's packed
        tiles. (Reading them before the refill needs more barriers: the compiler cannot tell the slots apart.)"""
        async_copy.wait_group(STAGES - 3)
        fence_async_shared()  # the copies' writes, before the wgmma's async-proxy reads of the activations
        _barrier()  # every warp's copies landed; every warp is past its wait for step k-2's MMAs
        _issue(k + STAGES - 2, n_k, (k + STAGES - 2) % STAGES, w_ptr, b_ptr, a_ptr, w_off, rows_off, m_mask_x,
               p_smem, q_smem, x_smem, BK, TWO, P_LOAD, X_LOAD)
        slot = k % STAGES
        p = p_smem.index(slot).load(P_LAYOUT)
        q = q_smem.index(slot).load(P_LAYOUT) if TWO else p
        return p, q, x_smem.index(slot).permute((1, 0))

    @gluon.jit
    def _mma(p, s, xt, acc, acc_other, w_prev, BN: gl.constexpr, BK: gl.constexpr, A_LAYOUT: gl.constexpr,
             NIB: gl.constexpr):
        """Decode one weight tile, issue its MMA into acc and wait for the MMA before it (which read w_prev, the
        words kept in their registers until here). Returns (acc, acc_other, this tile's words)."""
        wt, w = _decode(p, s, BN, BK, A_LAYOUT, NIB)
        acc = warpgroup_mma(wt, xt, acc, is_async=True)
        acc, acc_other, w_prev = warpgroup_mma_wait(1, deps=[acc, acc_other, w_prev])
        return acc, acc_other, w

    @gluon.jit
    def _zero_row(m, pid_n, c_ptr, c_rows_ptr, stride_cm, N, W: gl.constexpr, DUAL: gl.constexpr, ACT: gl.constexpr,
                  SCATTER_C: gl.constexpr, num_warps: gl.constexpr):
        """Zeros in the W output columns of row m a program would have computed."""
        if SCATTER_C:
            row = gl.load(c_rows_ptr + m).to(gl.int64)
        else:
            row = m.to(gl.int64)
        n = pid_n * W + gl.arange(0, W, layout=gl.BlockedLayout([1], [32], [num_warps], [0]))
        zero = gl.zeros([W], c_ptr.dtype.element_ty, gl.BlockedLayout([1], [32], [num_warps], [0]))
        gl.store(c_ptr + row * stride_cm + n, zero)
        if DUAL and ACT == 0:
            gl.store(c_ptr + row * stride_cm + N + n, zero)

    @gluon.jit
    def mxfp4_wgmma_kernel(
        a_ptr, a_rows_ptr, stride_am,
        w_ptr, ws_ptr, b_ptr, bs_ptr, stride_we, stride_wr, stride_se, stride_sr,
        lo_ptr, hi_ptr, bcum_ptr, eid_ptr, c_ptr, c_rows_ptr, stride_cm, c_pos_ptr,
        N, K, E, beta1, beta2,
        BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr,
        E_CHUNK: gl.constexpr, NUM_E_CHUNKS: gl.constexpr,
        DUAL: gl.constexpr, PAIR: gl.constexpr, TWO: gl.constexpr, ACT: gl.constexpr, LINEAR_UP: gl.constexpr,
        GATHER_A: gl.constexpr, A_DIV: gl.constexpr, SCATTER_C: gl.constexpr,
        P_LAYOUT: gl.constexpr, NIB: gl.constexpr, ROW_EXPERT: gl.constexpr, C_PERM: gl.constexpr,
        PF: gl.constexpr, num_warps: gl.constexpr,
    ):
        G: gl.constexpr = BK // 32
        MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                      instr_shape=[16, BM, 16])
        A_LAYOUT: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
        S_LAYOUT: gl.constexpr = gl.SliceLayout(2, P_LAYOUT)
        P_LOAD: gl.constexpr = gl.BlockedLayout([1, 1, 16], [32 // G, G, 1], [num_warps, 1, 1], [2, 1, 0])
        X_LOAD: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (BK // 8), BK // 8], [num_warps, 1], [1, 0])
        P_SMEM: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [2, 1, 0])
        X_SMEM: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)

        pid = gl.program_id(0)
        num_n = N // (BN * (1 + PAIR))  # PAIR: rows [n, n + BN) and [n + BN, n + 2 BN), the second as `b`
        pid_m = pid // num_n
        pid_n = pid % num_n
        if ROW_EXPERT:
            # one row per program (decode), its expert read from expert_ids; another rank's expert (>= E): zeros
            e = gl.load(eid_ptr + pid_m)
            if e >= E:
                _zero_row(pid_m, pid_n, c_ptr, c_rows_ptr, stride_cm, N, BN * (1 + PAIR), DUAL, ACT, SCATTER_C,
                          num_warps)
                return
            m_start = pid_m
            seg_end = pid_m + 1
        else:
            total_blocks = gl.load(bcum_ptr + E)
            if pid_m >= total_blocks:
                return
            e = pid_m * 0
            for i in range(NUM_E_CHUNKS):
                idx = 1 + i * E_CHUNK + gl.arange(0, E_CHUNK, layout=gl.BlockedLayout([1], [32], [num_warps], [0]))
                ends = gl.load(bcum_ptr + idx, mask=idx <= E, other=2147483647)
                e += gl.sum((ends <= pid_m).to(gl.int32), axis=0)
            blk0 = gl.load(bcum_ptr + e)
            seg_end = gl.load(hi_ptr + e)
            m_start = gl.load(lo_ptr + e) + (pid_m - blk0) * BM
        e64 = e.to(gl.int64)

        # activation rows of this tile, for the cp.async tiles [BM, BK]
        offs_mx = m_start + gl.arange(0, BM, layout=gl.SliceLayout(1, X_LOAD))
        mx_mask = offs_mx < seg_end
        if GATHER_A:
            rows_x = gl.load(a_rows_ptr + offs_mx, mask=mx_mask, other=0).to(gl.int64)
        else:
            rows_x = (offs_mx // A_DIV).to(gl.int64)
        rows_off = rows_x[:, None] * stride_am
        m_mask_x = gl.broadcast(mx_mask[:, None], rows_off)[0]
        m_mask_x = gl.broadcast(m_mask_x, gl.full([BM, BK], 0, gl.int32, X_LOAD))[0]
        rows_off = gl.broadcast(rows_off, gl.full([BM, BK], 0, gl.int64, X_LOAD))[0]

        # packed weight pointers [BN, G, 16] and scale pointers [BN, G]
        n_p = pid_n * BN * (1 + PAIR) + gl.arange(0, BN, layout=gl.SliceLayout(1, gl.SliceLayout(2, P_LOAD)))
        g_p = gl.arange(0, G, layout=gl.SliceLayout(0, gl.SliceLayout(2, P_LOAD)))
        q_p = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(1, P_LOAD)))
        w_off = (e64 * stride_we + n_p[:, None, None].to(gl.int64) * stride_wr + g_p[None, :, None] * 16
                 + q_p[None, None, :])
        n_s = pid_n * BN * (1 + PAIR) + gl.arange(0, BN, layout=gl.SliceLayout(1, S_LAYOUT))
        g_s = gl.arange(0, G, layout=gl.SliceLayout(0, S_LAYOUT))
        s_off = e64 * stride_se + n_s[:, None].to(gl.int64) * stride_sr + g_s[None, :]

        p_smem = gl.allocate_shared_memory(gl.uint8, [STAGES, BN, G, 16], P_SMEM)
        if TWO:
            q_smem = gl.allocate_shared_memory(gl.uint8, [STAGES, BN, G, 16], P_SMEM)
        else:
            q_smem = p_smem
        x_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BM, BK], X_SMEM)

        n_k = K // BK
        if PF:  # one pointer per weight row of the program (both weights), rows over the threads
            PF_L: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])
            r = gl.arange(0, 2 * BN, layout=PF_L)
            row = (pid_n * BN * (1 + PAIR) + r % BN).to(gl.int64) * stride_wr + e64 * stride_we
            pf_ptrs = gl.where(r < BN, w_ptr + row, b_ptr + row)
            # a single weight (b is w): the second half of the threads would ask for the same lines again
            pf_lim = gl.where((r < BN) | (TWO != 0), K // 2, 0)
            PF_STEPS: gl.constexpr = PF // (BK // 2)
            _prefetch_rows(pf_ptrs, 0, pf_lim, PF)
        for i in gl.static_range(STAGES - 2):
            _issue(i, n_k, i, w_ptr, b_ptr, a_ptr, w_off, rows_off, m_mask_x, p_smem, q_smem, x_smem,
                   BK, TWO, P_LOAD, X_LOAD)

        acc = gl.zeros([BN, BM], gl.float32, MMA)
        acc2 = gl.zeros([BN, BM], gl.float32, MMA)
        wa = gl.zeros([BN, G, 16], gl.int32, P_LAYOUT)
        wb = wa
        # scales: prefetched one step ahead by hand (too narrow for cp.async)
        s_nxt = gl.load(ws_ptr + s_off)
        s2_nxt = gl.load(bs_ptr + s_off) if TWO else s_nxt
        # one MMA in flight while the next tile decodes: its words (wa / wb alternately) stay in their registers
        # until the wait after the next MMA, so consecutive tiles need distinct values: gate and up alternate;
        # a single GEMM is unrolled by two steps
        if TWO:
            for k in range(n_k):
                if PF:  # the next run, two or more K steps ahead of its copies
                    if k % PF_STEPS == 0:
                        _prefetch_rows(pf_ptrs, (k // PF_STEPS + 1) * PF, pf_lim, PF)
                s_cur = s_nxt
                s2_cur = s2_nxt
                k_nxt = gl.minimum(k + 1, n_k - 1) * G
                s_nxt = gl.load(ws_ptr + s_off + k_nxt)
                s2_nxt = gl.load(bs_ptr + s_off + k_nxt)
                p, q, xt = _ready(k, n_k, w_ptr, b_ptr, a_ptr, w_off, rows_off, m_mask_x, p_smem, q_smem, x_smem,
                                  BK, STAGES, TWO, P_LOAD, X_LOAD, P_LAYOUT)
                acc, acc2, wa = _mma(p, s_cur, xt, acc, acc2, wb, BN, BK, A_LAYOUT, NIB)
                acc2, acc, wb = _mma(q, s2_cur, xt, acc2, acc, wa, BN, BK, A_LAYOUT, NIB)
        else:
            for k in range(0, n_k, 2):
                if PF:
                    if k % PF_STEPS == 0:
                        _prefetch_rows(pf_ptrs, (k // PF_STEPS + 1) * PF, pf_lim, PF)
                s_cur = s_nxt
                s_nxt = gl.load(ws_ptr + s_off + (k + 1) * G)
                p, q, xt = _ready(k, n_k, w_ptr, b_ptr, a_ptr, w_off, rows_off, m_mask_x, p_smem, q_smem, x_smem,
                                  BK, STAGES, TWO, P_LOAD, X_LOAD, P_LAYOUT)
                acc, acc2, wa = _mma(p, s_cur, xt, acc, acc2, wb, BN, BK, A_LAYOUT, NIB)
                s_cur = s_nxt
                s_nxt = gl.load(ws_ptr + s_off + gl.minimum(k + 2, n_k - 1) * G)
                p, q, xt = _ready(k + 1, n_k, w_ptr, b_ptr, a_ptr, w_off, rows_off, m_mask_x, p_smem, q_smem,
                                  x_smem, BK, STAGES, TWO, P_LOAD, X_LOAD, P_LAYOUT)
                acc, acc2, wb = _mma(p, s_cur, xt, acc, acc2, wa, BN, BK, A_LAYOUT, NIB)
        # the last MMA's words stay live until it is done
        acc, acc2, wa, wb = warpgroup_mma_wait(0, deps=[acc, acc2, wa, wb])
        async_copy.wait_group(0)

        offs_m = m_start + gl.arange(0, BM, layout=gl.SliceLayout(0, MMA))
        m_mask = offs_m < seg_end
        offs_n = pid_n * BN * (1 + PAIR) + gl.arange(0, BN, layout=gl.SliceLayout(1, MMA))
        if SCATTER_C:
            crow = gl.load(c_rows_ptr + offs_m, mask=m_mask, other=0).to(gl.int64)
        else:
            crow = offs_m.to(gl.int64)
        if C_PERM:  # output column n at position c_pos[n]: the K order of the GEMM that reads C next
            offs_n = gl.load(c_pos_ptr + offs_n)
        c_ptrs = c_ptr + crow[None, :] * stride_cm + offs_n[:, None]
        c_mask = gl.broadcast(m_mask[None, :], c_ptrs)[0]
        if DUAL:
            if ACT == 0:
                gl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=c_mask)
                gl.store(c_ptrs + N, acc2.to(c_ptr.dtype.element_ty), mask=c_mask)
            else:
                gl.store(c_ptrs, _glu(acc, acc2, beta1, beta2, ACT, LINEAR_UP).to(c_ptr.dtype.element_ty),
                         mask=c_mask)
        else:
            gl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=c_mask)
            if PAIR:
                gl.store(c_ptrs + BN, acc2.to(c_ptr.dtype.element_ty), mask=c_mask)


def supported(meta, cfg, N, K):
    """Whether a launch of `gemm._GemmLaunch` (its meta and tile) is one this kernel computes."""
    pair = _pair(meta, cfg)
    return (HAS_GLUON and not meta["TRANS_W"] and meta["DUAL"] in (0, 1)
            and meta["PTX"] and meta["A_KPERM"] and meta["EVEN"] and meta["PERM"]
            and cfg["BN"] == 16 * cfg["num_warps"] and cfg["num_warps"] in (4, 8) and cfg["BK"] in (64, 128)
            and cfg["BM"] in (16, 32, 64) and int(cfg["num_stages"]) >= 3
            and shape_supported(N, K, cfg["BN"], cfg["BK"], meta["DUAL"], pair))


def shape_supported(N, K, BN, BK, dual, pair):
    """The GEMM widths a tile (BN, BK, pair) computes: whole K tiles, whole n-tiles (two where a program pairs them)
    and, for one weight without pairing, an even count of K tiles (it steps through K two tiles at a time)."""
    return K % BK == 0 and N % (BN * (1 + pair)) == 0 and bool(dual or pair or (K // BK) % 2 == 0)


def _pair(meta, cfg):
    # PAIR (single GEMMs): a program computes two adjacent BN-row tiles, alternating like gate and up
    return int(bool(cfg.get("PAIR")) and meta["DUAL"] == 0)


def prefetch_bytes(K, BK):
    """The L2 prefetch run of a launch (`options` l2_prefetch, read when a launch is planned), where it is a
    multiple of a K step's BK/2 bytes and divides a row's K/2 bytes; else 0. A K step copies BK/2 = 64 bytes of each
    row, so without it DRAM serves each 128-byte line in two halves a step apart; with it, whole lines (1,024 tokens
    of K3 ~9% faster, 64 tokens ~20%, `bench/moe.py` on an H200). Further ahead or in longer runs was slower (L2
    holds fewer of them)."""
    pf = options.get("l2_prefetch")
    return pf if pf and pf % (BK // 2) == 0 and (K // 2) % pf == 0 else 0


def prepare(nblocks, meta, cfg, N, K):
    """The launch over nblocks row blocks of a tile cfg and meta of `gemm._GemmLaunch`, bound once: a function of
    the Triton kernel's arguments, in its order, which the launch plans of `gemm` keep."""
    c_pos = cfg.get("c_pos")
    BN, pair = cfg["BN"], _pair(meta, cfg)
    grid = (nblocks * (N // (BN * (1 + pair))),)
    kernel = _launch.Launcher(
        mxfp4_wgmma_kernel, BM=cfg["BM"], BN=BN, BK=cfg["BK"], STAGES=int(cfg["num_stages"]),
        E_CHUNK=meta["E_CHUNK"], NUM_E_CHUNKS=meta["NUM_E_CHUNKS"], DUAL=meta["DUAL"], PAIR=pair,
        TWO=meta["DUAL"] or pair, ACT=meta["ACT"],
        LINEAR_UP=meta["LINEAR_UP"], GATHER_A=meta["GATHER_A"], A_DIV=meta["A_DIV"], SCATTER_C=meta["SCATTER_C"],
        P_LAYOUT=byte_layout(BN, cfg["BK"], cfg["num_warps"]), NIB=int(cfg.get("NIB", 0)),
        ROW_EXPERT=meta["ROW_EXPERT"], C_PERM=c_pos is not None,
        PF=prefetch_bytes(K, cfg["BK"]), num_warps=cfg["num_warps"])

    def run(args):
        (a, _a2, a_rows, stride_am, w, ws, b, bs, swe, swr, sse, ssr, lo, hi, bcum, eid, c, c_rows, stride_cm,
         N, K, E, beta1, beta2) = args
        if pair:  # the second tile's rows as the `b` weight
            b, bs = w[:, BN:], ws[:, BN:]
        kernel(grid, (a, a_rows, stride_am, w, ws, b, bs, swe, swr, sse, ssr, lo, hi, bcum, eid, c, c_rows, stride_cm,
                      c_pos if c_pos is not None else eid, N, K, E, beta1, beta2))

    return run

