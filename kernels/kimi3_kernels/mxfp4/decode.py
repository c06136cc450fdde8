"""MXFP4 weight decoding shared by the Triton and the Gluon GEMM, and the K orders the decodes produce.

An MXFP4 weight matrix is kept as compressed-tensors stores it: `packed` uint8 [rows, cols/2] (low nibble = even
column, E2M1 codes sEEM) and `scale` uint8 [rows, cols/32] (E8M0 exponent e, value 2^(e-127); 0xFF is refused
before launch). Every decode here gives the exact products code * 2^(e-127), so the kernels differ only in the
order of their sums.

- `E2M1_PTX`: inline PTX, 4 packed bytes -> 8 bf16 (byte lookups, ~2.4 instructions per weight; CUDA sm_80+).
- `e2m1_shift_ptx()`: the Gluon kernel's decode without tables, for scale exponents <= 128 (checked by callers:
  `gemm.scales_fit_table_free`).
- `_dequant` (Triton): a packed tile to bf16 through the PTX, or through fp32 bit arithmetic (~7 instructions per
  weight) in Triton's interpreter and on GPUs older than sm_80 (`decode_mode`).
- `kperm_index` / `permute_k`: the K orders in which the decoded tiles feed the MMAs, which the activations must
  then be given in.
"""

import functools

import torch

from .._host import interpreter_enabled

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised on machines without triton
    triton = None
    tl = None
    HAS_TRITON = False


@functools.lru_cache(maxsize=None)
def capability(index):
    """The compute capability of CUDA device `index` (asked at every launch plan: one query per GPU)."""
    return torch.cuda.get_device_capability(index)


def device_index(device):
    return device.index if device.index is not None else torch.cuda.current_device()


def decode_mode(device):
    """"ptx" (inline-PTX byte lookups into bf16x2) on CUDA sm_80+, else "portable" (fp32 bit arithmetic: the only
    one Triton's interpreter runs). Both give the same bits (tests/test_mxfp4_triton.py emulates the PTX)."""
    device = torch.device(device)
    if device.type != "cuda" or interpreter_enabled() or capability(device_index(device)) < (8, 0):
        return "portable"
    return "ptx"


# ----------------------------------------------------------------------------------------------------------------
# The table decode, E2M1 -> bf16 for 4 packed bytes (8 weights): 15 integer instructions and 4 bf16x2 multiplies.
# prmt is a byte lookup: with the selector's bit 3 clear, each selector nibble picks one of the 8 bytes {a, b}, so a
# nibble's 3 magnitude bits index an 8-entry table of the bf16 high bytes (a = 0x3F3F3F00, b = 0x40404040: 0, .5, 1,
# 1.5 | 2, 3, 4, 6) and one of the low bytes (0xC0800000, 0xC0804000). With bit 3 set, prmt replicates the top bit of
# the byte it picks: that gives each nibble's sign as 0x00/0xFF (hi nibble: bit 7 of the byte; lo nibble: bit 7 of
# the byte shifted left by 4), or-ed into bit 7 of the high byte. A last prmt pairs (low, high) bytes into bf16x2
# words. The E8M0 scale is multiplied in bf16 as fma(w, scale, -0.0) (= w * scale, signed zeros included;
# fma.bf16x2 exists from sm_80): bf16 arithmetic has no .ftz, so s == 0 (2^-127, the bf16 subnormal 0x0040) and
# subnormal products are exact, as every product is (2 significant bits), and 6 * 2^127 overflows to inf as in
# fp32. Each element carries its own scale word, so any assignment of elements to the 4-element packs (which Triton
# leaves unspecified) stays exact. SASS PRMT takes one table word as an immediate and the other from a register:
# the first words (a) come in as operands ($9, $13: `_lut_words`), because as literals ptxas keeps them in uniform
# registers and copies one into an ordinary register before every lookup.
#
# Operands: $4 = 4 packed bytes, $5..$8 = their scales (bf16x2 words), $9 / $13 = the high / low bytes' first table
# words ($10..$12, $14..$16 are copies). Outputs $0..$3 = bytes 0..3 as bf16x2 (even column, odd column).
E2M1_PTX = "{" + "\n".join(ln.strip() for ln in """
    .reg .b32 m, m2, x4, sg0, sg1, h0, h1, l0, l1, t0, t1, t2, t3, nz;
    mov.b32 nz, 0x80008000;
    and.b32 m, $4, 0x77777777;
    shr.u32 m2, m, 16;
    shl.b32 x4, $4, 4;
    prmt.b32 h0, $9, 0x40404040, m;
    prmt.b32 h1, $9, 0x40404040, m2;
    prmt.b32 l0, $13, 0xC0804000, m;
    prmt.b32 l1, $13, 0xC0804000, m2;
    prmt.b32 sg0, $4, x4, 0x9D8C;
    prmt.b32 sg1, $4, x4, 0xBFAE;
    lop3.b32 h0, h0, sg0, 0x80808080, 0xF8;
    lop3.b32 h1, h1, sg1, 0x80808080, 0xF8;
    prmt.b32 t0, l0, h0, 0x5140;
    prmt.b32 t1, l0, h0, 0x7362;
    prmt.b32 t2, l1, h1, 0x5140;
    prmt.b32 t3, l1, h1, 0x7362;
    fma.rn.bf16x2 $0, t0, $5, nz;
    fma.rn.bf16x2 $1, t1, $6, nz;
    fma.rn.bf16x2 $2, t2, $7, nz;
    fma.rn.bf16x2 $3, t3, $8, nz;
""".strip().splitlines()) + "}"
E2M1_CONSTRAINTS = "=r,=r,=r,=r" + ",r" * 13
LUT_WORDS = (0x3F3F3F00, 0xC0800000)  # $9, $13 of E2M1_PTX
ZERO_PTX = "{.reg .b32 t;\nprmt.b32 t, $1, 0, 0x1032;\nxor.b32 $0, t, $1;}"  # $1 ^ ($1 with halves swapped)


def e2m1_shift_ptx():
    """The decode without tables ($4 = 4 packed bytes, $5..$8 their multipliers 2^(e-1) as bf16x2, e the E8M0
    exponent): word p = nibbles p and p + 4 of the register (one element each of bytes p/2 and p/2 + 2), each as
    bf16 bits sign << 15 | code << 6. A code's exponent bits land in the bf16 exponent's low two bits, so normal
    codes read 2^-126 times their value and code 1 (0.5) the subnormal 2^-127: one multiply by 2^126 2^(e-127)
    gives the exact product. Needs e <= 128 (the multiplier's exponent 126 + e must stay finite); the caller checks.
    The signs come from two words shared by the four pairs: the odd nibbles' signs (bit 7 of each byte) and the even
    ones' moved there. Shifted by 0 or 8, each puts pair p's two signs at bits 15 and 31 and its other set bits
    only at 7 and 23, which lie inside the code mask and are dropped by the select: one shift and one select per
    word, plus two shifts and two masks per register. It issues no byte permutes, which kept the ALU pipe of the
    table decode busy (Nsight Compute on an H200)."""
    body = ["mov.b32 nz, 0x80008000;",
            "and.b32 so, $4, 0x80808080;",  # odd nibbles' signs, at bit 7 of their byte
            "shl.b32 se, $4, 4;",
            "and.b32 se, se, 0x80808080;"]  # even nibbles' signs
    for p, (sa, sgn, sb) in enumerate(((6, "se", 8), (2, "so", 8), (-2, "se", 0), (-6, "so", 0))):
        # right shifts stay shifts (ALU): as multiplies (IMAD.HI) they would load the FMA pipe, which also runs
        # the products and ptxas's left shifts
        body.append(f"shl.b32 a, $4, {sa};" if sa >= 0 else f"shr.u32 a, $4, {-sa};")
        if sb:
            body.append(f"shl.b32 b, {sgn}, {sb};")
        body.append(f"lop3.b32 a, a, 0x01C001C0, {'b' if sb else sgn}, 0xE2;")  # (a & mask) | (signs & ~mask)
        body.append(f"fma.rn.bf16x2 ${p}, a, ${5 + p}, nz;")
    return "{.reg .b32 a, b, so, se, nz;\n" + "\n".join(body) + "}"


# ----------------------------------------------------------------------------------------------------------------
# K orders


_KPERM_INDEX = {}  # (K, BK, device, nib) -> index: one host-to-device copy per shape, none inside a graph capture
_KPERM_POSITION = {}


def kperm_index(K, BK, device=None, nib=False):
    """int64 [K]: the stored column at each position of a matrix whose columns are in the K order of the K-permuted
    (PERM) tiles with this BK, per block of BK columns; K must be a multiple of BK. In that order the bytes one
    thread of the MMA operand needs are contiguous (`_perm_k`). nib: the order of the Gluon kernel's table-free
    decode (`e2m1_shift_ptx`), whose bf16 pair p of a thread's 4-byte word g holds nibbles p and p + 4 of that word
    instead of the two nibbles of byte p."""
    if BK < 32 or BK & (BK - 1) or K % BK:
        raise ValueError(f"K-permuted columns need a power-of-two BK >= 32 that divides K, got K={K}, BK={BK}")
    key = (K, BK, torch.device(device) if device is not None else None, bool(nib))
    if key not in _KPERM_INDEX:
        kap = torch.arange(BK)
        L, e = kap // 2, kap % 2
        t, q = L % 4, 2 * (L // 8) + (L // 4) % 2  # the A fragment's lane (of 4) and its byte q of BK/8
        if nib:
            order = 2 * ((BK // 8) * t + 4 * (q // 4)) + q % 4 + 4 * e
        else:
            order = 2 * ((BK // 8) * t + q) + e
        _KPERM_INDEX[key] = (torch.arange(0, K, BK)[:, None] + order[None, :]).reshape(-1).to(device)
    return _KPERM_INDEX[key]


def kperm_position(K, BK, device=None, nib=False):
    """int32 [K]: the position of each stored column in the order of `kperm_index` (its inverse permutation)."""
    key = (K, BK, torch.device(device) if device is not None else None, bool(nib))
    if key not in _KPERM_POSITION:
        idx = kperm_index(K, BK, None, nib)
        pos = torch.empty_like(idx)
        pos[idx] = torch.arange(K)
        _KPERM_POSITION[key] = pos.to(torch.int32).to(device)
    return _KPERM_POSITION[key]


def permute_k(a, BK, nib=False):
    """a [..., K] with its columns in the K order of PERM tiles with this BK: the `a_kperm=BK` input of
    `mxfp4_grouped_gemm`, whose activation loads are then contiguous instead of gathered in pairs (nib: the order
    of the table-free decode, `kperm_index`)."""
    return a.index_select(-1, kperm_index(a.shape[-1], BK, a.device, nib))


# ----------------------------------------------------------------------------------------------------------------
# Triton decode functions

if HAS_TRITON:
    _E2M1_PTX = tl.constexpr(E2M1_PTX)
    _E2M1_CONSTRAINTS = tl.constexpr(E2M1_CONSTRAINTS)
    _LUT_A = tl.constexpr(LUT_WORDS[0])
    _LUT_B = tl.constexpr(LUT_WORDS[1] - (1 << 32))  # as int32
    _ZERO_PTX = tl.constexpr(ZERO_PTX)

    @triton.jit
    def _e8m0_to_f32(s):
        # 2^(s-127) exactly; s == 0 is the fp32 subnormal 2^-127. (0xFF is refused before launch.)
        si = s.to(tl.int32)
        bits = tl.where(si == 0, 0x00400000, si << 23)
        return bits.to(tl.float32, bitcast=True)

    @triton.jit
    def _e2m1_to_f32(c):
        # code sEEM -> fp32 with exponent bits EE and mantissa bit M placed low, then * 2^126 (exact for all 16 codes:
        # EE == 0 lands on the subnormal M * 2^-127).
        bits = ((c & 7) << 22) | ((c & 8) << 28)
        return bits.to(tl.float32, bitcast=True) * 8.507059173023462e37

    @triton.jit
    def _lut_words(sb):
        """The table words a of the decode's lookups (0x3F3F3F00, 0xC0800000) as values neither LLVM nor ptxas can
        fold to constants: z = sb ^ (sb with its halves swapped) is 0 because both halves of a scale word are the
        same, which neither compiler knows. (Made from a scalar or a loaded value instead, they changed the layouts
        of the decoded tile and cost more than they saved; computed in Triton, LLVM folded z.) ptxas computes z once
        per distinct scale word: ~7 instructions per K step in place of ~64 register copies."""
        z = tl.inline_asm_elementwise(_ZERO_PTX, "=r,r", [sb], dtype=tl.int32, is_pure=True, pack=1)
        return z | _LUT_A, z | _LUT_B

    @triton.jit
    def _e8m0_to_bf16x2(s):
        # bf16 bits of 2^(s-127) in both halves of an int32 (a bf16x2 operand); s == 0 is the subnormal 0x0040
        b = tl.maximum(s.to(tl.int32) << 7, 0x40)
        return b | (b << 16)

    @triton.jit
    def _bcast_scale(sf, R: tl.constexpr, C: tl.constexpr):
        """[R, C/32] -> [R, C/2]: one scale per packed byte (a scale covers 16 bytes)."""
        return tl.reshape(tl.broadcast_to(sf[:, :, None], (R, C // 32, 16)), (R, C // 2))

    @triton.jit
    def _perm_k(x, R: tl.constexpr, C: tl.constexpr):
        """[R, C/2] per-byte values of a weight tile (C = BK columns) from stored order P to the MMA's K order L:
        P = (C/8) t + 2 s + h  ->  L = 8 s + 4 h + t  (t < 4, s < C/16, h < 2). A thread of the wgmma / mma A
        operand holds bytes t and t + 4 of each 8-byte K step; after this relabelling the bytes one thread needs are
        C/8 contiguous stored bytes, so they leave shared memory in wide loads and need no shuffle after decoding.
        The activations are loaded in the same K order, so the products are unchanged."""
        return tl.reshape(tl.permute(tl.reshape(x, (R, 4, C // 16, 2)), (0, 2, 3, 1)), (R, C // 2))

    @triton.jit
    def _dequant(p, s, R: tl.constexpr, C: tl.constexpr, PTX: tl.constexpr, PERM: tl.constexpr = False):
        """p uint8 [R, C/2] (low nibble = even column), s uint8 [R, C/32] -> bf16 [R, C]. In the MMA operand layout
        a thread holds column pairs (2j, 2j+1), i.e. whole bytes, so the interleave costs no data movement. PERM:
        columns in _perm_k's K order instead of the stored one."""
        if PTX:
            sb = _bcast_scale(_e8m0_to_bf16x2(s), R, C)
            if PERM:
                p = _perm_k(p, R, C)
                sb = _perm_k(sb, R, C)
            ta, tb = _lut_words(sb)
            w = tl.inline_asm_elementwise(_E2M1_PTX, _E2M1_CONSTRAINTS, [p, sb, ta, tb], dtype=tl.int32,
                                          is_pure=True, pack=4)
            lo = w.to(tl.int16).to(tl.bfloat16, bitcast=True)
            hi = (w >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)
        else:
            sf = _bcast_scale(_e8m0_to_f32(s), R, C)
            if PERM:
                p = _perm_k(p, R, C)
                sf = _perm_k(sf, R, C)
            pi = p.to(tl.int32)
            lo = (_e2m1_to_f32(pi & 15) * sf).to(tl.bfloat16)
            hi = (_e2m1_to_f32(pi >> 4) * sf).to(tl.bfloat16)
        return tl.reshape(tl.join(lo, hi), (R, C))
