"""W4A8: MXFP4 weights times MXFP8 activations on FP8 tensor cores (Triton), and the MXFP8 quantiser that feeds it.

MXFP8 (OCP MX v1.0): E4M3 elements, one E8M0 scale per 32 values along K. `quantize_mxfp8` gives the codes and
scales of `transformers_kimi3.mxfp8.quantize_mxfp8` (the emulation, the reference) bit for bit: scale exponent
floor(log2(amax)) - 8 clamped to [-127, 127] (an all-zero block: -127), elements rounded to nearest even and
saturated at +-448, signs (negative zero too) kept. All of it is integer and power-of-two arithmetic on fp32 bits, so
no device's float8 conversion or rounding mode is involved. Non-finite inputs are refused on the device
(`torch._assert_async`, no host synchronisation).

`_w4a8_grouped_gemm_kernel` is the forward layouts of `kernel._mxfp4_grouped_gemm_kernel` (sorted segments or one
route per program, gathered rows, scattered outputs, gate+up with the GLU fused) with FP8 operands: each E2M1
weight code becomes the E4M3 code of the same value (exact: E2M1 values are E4M3 values), each 32-wide K block is
one FP8 x FP8 MMA from zero, and its fp32 result is scaled by the weight row's and the token row's E8M0 scales
before it joins the accumulator, since both scales change every 32 columns. The products are exact; only the order
and precision of the sums differ from the emulation (fp32 over all of K there).
`gemm.mxfp4_grouped_gemm(codes, ..., a_scale=scales)` plans and launches it.
"""

import torch

from .. import _launch
from .._host import cdiv
from .decode import HAS_TRITON

FP8_E4M3 = getattr(torch, "float8_e4m3fn", None)

# E2M1 -> E4M3 for 4 packed bytes ($2) in 9 instructions: E4M3 codes of the low and high nibble of each byte as one
# 16-bit pair (low nibble = even column), bytes 0-1 in $0 and 2-3 in $1. A prmt selector nibble's 3 low bits pick
# one of the 8 bytes {a, b}, the codes of the E2M1 magnitudes 0, .5, 1, 1.5 | 2, 3, 4, 6: the bytes masked to
# 0x77777777 are the selectors, in column order. The signs: with bit 3 set, prmt replicates the top bit of the byte
# it picks, which for an odd nibble is its own sign and for an even one is its sign once the word is shifted left by
# 4; lop3 keeps bit 7 of that (a | (b & c), 0xF8). Each output pair depends only on its own input byte, so Triton's
# choice of which 4 elements share a pack does not matter.
E2M1_TO_E4M3_PTX = "{" + "\n".join(ln.strip() for ln in """
    .reg .b32 m, m2, x4, ta, tb, c0, c1, sg0, sg1;
    mov.b32 ta, 0x3C383000;
    mov.b32 tb, 0x4C484440;
    and.b32 m, $2, 0x77777777;
    shr.u32 m2, m, 16;
    shl.b32 x4, $2, 4;
    prmt.b32 c0, ta, tb, m;
    prmt.b32 c1, ta, tb, m2;
    prmt.b32 sg0, $2, x4, 0x9D8C;
    prmt.b32 sg1, $2, x4, 0xBFAE;
    lop3.b32 $0, c0, sg0, 0x80808080, 0xF8;
    lop3.b32 $1, c1, sg1, 0x80808080, 0xF8;
""".strip().splitlines()) + "}"

if HAS_TRITON:
    import triton
    import triton.language as tl

    from .decode import _e8m0_to_f32
    from .kernel import _rows_and_columns, _segment_rows, _store_ct, _zero_route_row

    @triton.jit
    def _pow2(e):
        """2^e as fp32 for int32 e in [-126, 127], from its bits."""
        return ((e + 127) << 23).to(tl.float32, bitcast=True)

    @triton.jit
    def _mxfp8_quantize_kernel(x_ptr, q_ptr, s_ptr, bad_ptr, R, K, stride_xr,
                               BR: tl.constexpr, BG: tl.constexpr):
        """Rows [BR] x blocks [BG] of x [R, K] -> E4M3 codes q [R, K] (uint8), E8M0 scales s [R, K/32] (uint8);
        the count of non-finite values is added to bad_ptr[0]."""
        r = tl.program_id(0) * BR + tl.arange(0, BR)
        g = tl.program_id(1) * BG + tl.arange(0, BG)
        j = tl.arange(0, 32)
        col = g[None, :, None] * 32 + j[None, None, :]
        ok = (r[:, None, None] < R) & (col < K)
        r64 = r.to(tl.int64)[:, None, None]
        x = tl.load(x_ptr + r64 * stride_xr + col, mask=ok, other=0.0).to(tl.float32)
        bits = x.to(tl.int32, bitcast=True)
        bad = ((bits & 0x7F800000) == 0x7F800000) & ok
        n_bad = tl.sum(tl.sum(tl.sum(bad.to(tl.int32), axis=2), axis=1), axis=0)
        if n_bad > 0:
            tl.atomic_add(bad_ptr, n_bad)
        ax = (bits & 0x7FFFFFFF).to(tl.float32, bitcast=True)
        # block scale: floor(log2(amax)) - 8 from amax's exponent field (0: zero or fp32-subnormal amax -> -127)
        eb = tl.max(ax, axis=2).to(tl.int32, bitcast=True) >> 23
        se = tl.where(eb == 0, -127, tl.minimum(tl.maximum(eb - 135, -127), 127))
        a = tl.minimum(ax * _pow2(-se)[:, :, None], 448.0)  # |x| / scale < 512, saturated at 448
        # nearest E4M3 value: quantum 2^(max(floor(log2 a), -6) - 3); y = a / quantum < 16 is exact, and so is its
        # split into integer and fraction, so the round to nearest even needs no rounding mode
        fl = (a.to(tl.int32, bitcast=True) >> 23) - 127
        qe = tl.maximum(fl, -6) - 3
        y = a * _pow2(-qe)
        yi = y.to(tl.int32)
        frac = y - yi.to(tl.float32)
        up = (frac > 0.5) | ((frac == 0.5) & ((yi & 1) == 1))
        m = yi + up.to(tl.int32)
        # value m 2^qe with m in [0, 16]: code ((qe + 9) << 3) + m (exponent field qe + 10 for m >= 8, which a
        # carry at m = 16 bumps; subnormals at qe = -9), then the sign
        code = ((qe + 9) << 3) + m
        code = code | ((bits >> 24) & 0x80)
        tl.store(q_ptr + r64 * K + col, code.to(tl.uint8), mask=ok)
        gm = (r[:, None] < R) & (g[None, :] < K // 32)
        tl.store(s_ptr + r.to(tl.int64)[:, None] * (K // 32) + g[None, :], (se + 127).to(tl.uint8), mask=gm)

    _E2M1_TO_E4M3 = tl.constexpr(E2M1_TO_E4M3_PTX)

    @triton.jit
    def _e4m3_of_e2m1(c):
        """E2M1 codes sEEM (int32 0..15) -> the E4M3 codes of the same values: 0.5 -> 0x30, magnitudes 1..6
        (codes 2..7) -> (code + 12) << 2, the sign to bit 7."""
        mag = c & 7
        body = tl.where(mag >= 2, (mag + 12) << 2, tl.where(mag == 1, 0x30, 0))
        return body | ((c & 8) << 4)

    @triton.jit
    def _mma_order(x, R: tl.constexpr):
        """[R, 32] columns of a K block in the MMA's K order: K index 16 h + 4 t + r takes stored column
        8 t + 4 h + r. A thread of the FP8 MMA's register operand holds K indices 4 t .. 4 t + 3 and 16 + 4 t ..
        16 + 4 t + 3 of its rows; in this order they are 4 adjacent packed weight bytes, one 32-bit piece instead of
        two 16-bit ones to be joined. Weights and activations take the same order: the same sum, in another order."""
        return tl.reshape(tl.permute(tl.reshape(x, (R, 4, 2, 4)), (0, 2, 1, 3)), (R, 32))

    @triton.jit
    def _weight_block(w_ptrs, s_ptrs, n_mask, BN: tl.constexpr, PTX: tl.constexpr):
        """A 32-column K block of BN weight rows from its packed bytes' pointers [BN, 16] and its scales' [BN]:
        (E4M3 codes [BN, 32] as fp8, scales [BN] fp32). PTX: the byte-lookup decode (E2M1_TO_E4M3_PTX); else
        integer arithmetic (the interpreter)."""
        p = tl.load(w_ptrs, mask=n_mask[:, None], other=0)
        if PTX:
            pair = tl.inline_asm_elementwise(_E2M1_TO_E4M3, "=r,=r,r", [p], dtype=tl.int16, is_pure=True, pack=4)
            codes = tl.reshape(tl.join((pair & 0xFF).to(tl.uint8), ((pair >> 8) & 0xFF).to(tl.uint8)), (BN, 32))
        else:
            p = p.to(tl.int32)
            codes = tl.reshape(tl.join(_e4m3_of_e2m1(p & 15), _e4m3_of_e2m1(p >> 4)), (BN, 32))
        codes = _mma_order(codes, BN)
        s = tl.load(s_ptrs, mask=n_mask, other=127)
        return codes.to(tl.uint8).to(tl.float8e4nv, bitcast=True), _e8m0_to_f32(s)

    @triton.jit
    def _w4a8_grouped_gemm_kernel(
        a_ptr, as_ptr, a_rows_ptr, stride_am,
        w_ptr, ws_ptr, b_ptr, bs_ptr, stride_we, stride_wr, stride_se, stride_sr,
        lo_ptr, hi_ptr, bcum_ptr, eid_ptr, c_ptr, c_rows_ptr, stride_cm,
        N, K, E, beta1, beta2,
        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
        E_CHUNK: tl.constexpr, NUM_E_CHUNKS: tl.constexpr,
        DUAL: tl.constexpr, ACT: tl.constexpr, LINEAR_UP: tl.constexpr,
        GATHER_A: tl.constexpr, A_DIV: tl.constexpr, SCATTER_C: tl.constexpr, ROW_EXPERT: tl.constexpr,
        PTX: tl.constexpr,
    ):
        """C^T tiles [BN, BM] as in `_mxfp4_grouped_gemm_kernel`; a_ptr: E4M3 codes [Ra, K] (row stride
        stride_am), as_ptr: their scales [Ra, K/32] (contiguous). K is a multiple of BK, BK of 32."""
        # the program's rows as in `_mxfp4_grouped_gemm_kernel` (its helpers; the early returns stay in each kernel)
        pid = tl.program_id(0)
        num_n = tl.cdiv(N, BN)
        pid_m = pid // num_n
        pid_n = pid % num_n
        if ROW_EXPERT:
            e = tl.load(eid_ptr + pid_m)
            if e >= E:
                _zero_route_row(pid_m, pid_n, c_ptr, c_rows_ptr, stride_cm, N, BN, DUAL, ACT, SCATTER_C)
                return
            offs_m = pid_m + tl.arange(0, BM)
            m_mask = tl.arange(0, BM) < 1
        else:
            if pid_m >= tl.load(bcum_ptr + E):
                return
            e, offs_m, m_mask = _segment_rows(pid_m, lo_ptr, hi_ptr, bcum_ptr, E, BM, E_CHUNK, NUM_E_CHUNKS)
        rows, offs_n, n_mask = _rows_and_columns(a_rows_ptr, offs_m, m_mask, pid_n, N, BN, GATHER_A, A_DIV)
        e64 = e.to(tl.int64)
        # pointers of the first 32-column block, advanced by one K step per iteration (the loop adds offsets, it
        # does not recompute row addresses)
        a_ptrs = a_ptr + rows[:, None] * stride_am + tl.arange(0, 32)[None, :]  # [BM, 32], stored order
        as_ptrs = as_ptr + rows * (K // 32)
        w_off = e64 * stride_we + offs_n[:, None].to(tl.int64) * stride_wr + tl.arange(0, 16)[None, :]  # [BN, 16]
        s_off = e64 * stride_se + offs_n.to(tl.int64) * stride_sr
        w_ptrs, b_ptrs, ws_ptrs, bs_ptrs = w_ptr + w_off, b_ptr + w_off, ws_ptr + s_off, bs_ptr + s_off

        acc = tl.zeros((BN, BM), dtype=tl.float32)
        acc2 = tl.zeros((BN, BM), dtype=tl.float32)
        for _ in range(0, K, BK):
            for j in tl.static_range(BK // 32):
                at = _mma_order(tl.load(a_ptrs + 32 * j, mask=m_mask[:, None], other=0), BM)
                at = tl.trans(at).to(tl.float8e4nv, bitcast=True)  # [32, BM]
                sa = _e8m0_to_f32(tl.load(as_ptrs + j, mask=m_mask, other=127))
                w, sw = _weight_block(w_ptrs + 16 * j, ws_ptrs + j, n_mask, BN, PTX)
                acc += tl.dot(w, at) * sw[:, None] * sa[None, :]
                if DUAL != 0:
                    b, sb = _weight_block(b_ptrs + 16 * j, bs_ptrs + j, n_mask, BN, PTX)
                    acc2 += tl.dot(b, at) * sb[:, None] * sa[None, :]
            a_ptrs += BK
            as_ptrs += BK // 32
            w_ptrs += BK // 2
            b_ptrs += BK // 2
            ws_ptrs += BK // 32
            bs_ptrs += BK // 32

        _store_ct(acc, acc2, c_ptr, c_rows_ptr, stride_cm, offs_m, m_mask, offs_n, n_mask, N, beta1, beta2,
                  DUAL != 0, ACT, LINEAR_UP, SCATTER_C)


def fp8_capable(device):
    """Whether `device` runs the W4A8 kernel where the MXFP4 kernels run (`gemm.available`): PyTorch with
    float8_e4m3fn and an sm_89+ GPU (FP8 tensor cores), or any device under the interpreter."""
    device = torch.device(device)
    if FP8_E4M3 is None:
        return False
    if device.type != "cuda":
        return True
    from .decode import capability, device_index

    return capability(device_index(device)) >= (8, 9)


def quantize_mxfp8(x, name="activation"):
    """x [R, K] (float, K % 32 == 0) -> (E4M3 codes [R, K] float8_e4m3fn, E8M0 scales [R, K/32] uint8), bit for bit
    `transformers_kimi3.mxfp8.quantize_mxfp8`; three launches, no host synchronisation: a non-finite value fails
    `torch._assert_async` naming `name`."""
    if x.dim() != 2 or x.shape[1] % 32:
        raise ValueError(f"{name}: MXFP8 quantisation takes [rows, K] with K a multiple of 32, got {tuple(x.shape)}")
    if x.stride(1) != 1:
        x = x.contiguous()
    R, K = x.shape
    q = torch.empty(R, K, dtype=torch.uint8, device=x.device)
    s = torch.empty(R, K // 32, dtype=torch.uint8, device=x.device)
    if R == 0:
        return q.view(FP8_E4M3), s
    bad = torch.zeros(1, dtype=torch.int32, device=x.device)
    BR, BG = 4, 8
    _launch.launch(_mxfp8_quantize_kernel, (cdiv(R, BR), cdiv(K // 32, BG)), (x, q, s, bad, R, K, x.stride(0)),
                   BR=BR, BG=BG, num_warps=4)
    torch._assert_async(bad[0] == 0, f"{name}: cannot quantise to MXFP8: it holds NaN or infinite values")
    return q.view(FP8_E4M3), s


# W4A8 tiles by BM (rows of one expert per tile): (BN, BK, num_warps, num_stages), the same for gate+up (dual) and
# down. Chosen so that no tile spills registers on sm_90 (tests/mxfp4/test_w4a8_triton.py compiles them): a longer K
# step unrolls more 32-column blocks, each with its MMA result and scaled partial sums live (BM=32 at BK=128 and
# BM=64 at BK=64 spilled); not yet timed on a GPU.
A8_TILES = {
    16: (64, 128, 4, 4),
    32: (64, 64, 4, 3),
    64: (64, 32, 4, 3),
    128: (64, 32, 8, 3),
}


def a8_tile(BM, K):
    """The W4A8 tile of height BM for K columns: its table entry, with the K step shortened to the longest of 128,
    64, 32 that divides K."""
    BN, BK, warps, stages = A8_TILES[BM]
    while K % BK:
        BK //= 2
    return dict(BM=BM, BN=BN, BK=BK, num_warps=warps, num_stages=stages, A8=1, TAIL=())


def launcher(meta):
    """The W4A8 kernel's launcher for a plan's meta (the constexprs of `_GemmLaunch`)."""
    keep = ("BM", "BN", "BK", "E_CHUNK", "NUM_E_CHUNKS", "DUAL", "ACT", "LINEAR_UP", "GATHER_A", "A_DIV", "SCATTER_C",
            "ROW_EXPERT", "PTX", "num_warps", "num_stages")
    return _launch.Launcher(_w4a8_grouped_gemm_kernel, **{k: meta[k] for k in keep})
