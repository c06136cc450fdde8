"""The Gluon MXFP4 grouped GEMM with asynchronous wgmma (`kimi3_kernels.mxfp4.wgmma`).

Gluon has no interpreter, so on the CPU the kernel is compiled for sm_90 (no GPU needed) and its SASS checked for
what makes it fast and correct: every MMA asynchronous with one left in flight, no spills, no shared-memory round
trip of the decoded tile. On an sm_90 GPU the outputs are compared with the Triton kernel's (same decode, same K
order: bit-identical) and with the PyTorch reference; `bench/moe.py` checks the module at K3 shapes.
"""

import re
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
from kimi3_testing import run_decode_ptx

ROOT = Path(__file__).resolve().parents[2]
for p in (ROOT / "src", ROOT / "kernels"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

triton = pytest.importorskip("triton")
from kimi3_kernels import mxfp4 as G  # noqa: E402
from kimi3_kernels.mxfp4 import decode, tiles  # noqa: E402
from kimi3_kernels.mxfp4 import reference as R  # noqa: E402
from kimi3_kernels.mxfp4 import wgmma as W  # noqa: E402

needs_gluon = pytest.mark.skipif(not W.HAS_GLUON, reason="this Triton has no Gluon")
on_h100_class = pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)), reason="needs an sm_90 GPU")


def _compile(BM, BK, STAGES, DUAL, PAIR, act=2, NIB=0, ROW=False, PF=0):
    """The kernel for sm_90; gate+up (DUAL) writes its output in the down GEMM's K order (C_PERM), as the module
    runs it."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    kern = W.mxfp4_wgmma_kernel
    consts = dict(BM=BM, BN=64, BK=BK, STAGES=STAGES, E_CHUNK=1024, NUM_E_CHUNKS=1, DUAL=DUAL, PAIR=PAIR,
                  TWO=int(bool(DUAL or PAIR)), ACT=act if DUAL else 0, LINEAR_UP=False,
                  GATHER_A=bool(DUAL) and not ROW, A_DIV=16 if ROW else 1, SCATTER_C=not (DUAL or ROW),
                  P_LAYOUT=W.byte_layout(64, BK, 4), NIB=NIB, ROW_EXPERT=ROW, C_PERM=bool(DUAL), PF=PF, num_warps=4)
    sig, attrs = {}, {}
    for i, a in enumerate(kern.arg_names):
        if a in consts:
            sig[a] = "constexpr"
            continue
        if a.startswith("beta"):
            sig[a] = "fp32"
            continue
        sig[a] = ("*bf16" if a == "a_ptr" else ("*bf16" if DUAL else "*fp32") if a == "c_ptr"
                  else "*u8" if a[:2] in ("w_", "ws", "b_", "bs") else "*i32" if a.endswith("_ptr") else "i32")
        attrs[(i,)] = [["tt.divisibility", 16]]
    src = GluonASTSource(fn=kern, signature=sig, constexprs=consts, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))


def _main_loop(sass):
    ins = [(int(a, 16), t.strip()) for a, t in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    body = []
    for a, t in ins:  # the longest backward branch
        m = re.search(r"BRA[^0-9]*0x([0-9a-f]+)", t)
        if m and int(m.group(1), 16) < a:
            cand = [t2 for a2, t2 in ins if int(m.group(1), 16) <= a2 <= a]
            body = cand if len(cand) > len(body) else body
    return body


@needs_gluon
@pytest.mark.parametrize("BM,STAGES,DUAL,PAIR,NIB,ROW", [(16, 4, 1, 0, 0, 0), (32, 4, 1, 0, 0, 0), (16, 4, 0, 1, 0, 0),
                                                         (32, 4, 0, 1, 0, 0), (16, 4, 0, 0, 0, 0), (32, 4, 1, 0, 1, 0),
                                                         (32, 4, 0, 1, 1, 0), (16, 4, 1, 0, 1, 0), (16, 4, 1, 0, 1, 1),
                                                         (16, 4, 0, 1, 1, 1), (16, 4, 0, 0, 1, 1)])
def test_compiles_for_sm90_with_asynchronous_register_operand_wgmma(BM, STAGES, DUAL, PAIR, NIB, ROW):
    """The default tiles (gate+up with SiTU fused; down with two row tiles per program) and the single-tile GEMM
    stepping two K tiles at a time, with the table decode and the table-free one (NIB), also with one route per
    program (ROW, decode): the MMAs read the decoded tile from registers, each wait leaves one MMA in flight (a
    synchronous MMA would wait for 0), nothing spills, and the table-free decode issues no byte permutes (the table
    decode: ~10 per 4 words) and fewer ALU-pipe instructions."""
    try:
        cuobjdump = triton.knobs.nvidia.cuobjdump.path
        ck = _compile(BM, 128, STAGES, DUAL, PAIR, NIB=NIB, ROW=bool(ROW), PF=128)
    except (AttributeError, FileNotFoundError, RuntimeError) as ex:  # no CUDA backend tools in this install
        pytest.skip(f"cannot compile for sm_90 here: {ex!r}")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(ck.asm["cubin"])
        f.flush()
        res = subprocess.check_output([cuobjdump, "-res-usage", f.name]).decode()
        sass = subprocess.check_output([cuobjdump, "-sass", f.name]).decode()
    assert int(re.search(r"STACK:(\d+)", res).group(1)) == 0, res
    loop = _main_loop(sass)
    mmas = [t for t in loop if t.startswith("HGMMA")]
    waits = [t for t in loop if "WARPGROUP.DEPBAR" in t]
    assert len(mmas) == 16, loop  # two weight tiles of K 128 per loop (gate and up, two row or K tiles): 8 MMAs each
    assert all(re.match(r"HGMMA\.64x%dx16\.F32\.BF16 R\d+, R\d+, gdesc" % BM, t) for t in mmas), mmas
    assert waits == ["WARPGROUP.DEPBAR.LE gsb0, 0x1"] * 2, waits
    # the decoded tile goes from the decode to the MMA in registers: no shared-memory stores in the loop
    assert not [t for t in loop if t.startswith("STS")], loop
    # the next 128-byte line of each weight row into L2 (`prefetch_bytes`): one line-prefetch per thread
    assert len([t for t in loop if "CCTL.E.PF2" in t]) == 1, loop
    prmt = [t for t in loop if t.startswith("PRMT")]
    words = 64  # decoded bf16 pairs per thread per loop: two 64x128 tiles over 128 threads
    if NIB:  # a few PRMTs move scale bytes; none decode
        assert len(prmt) <= 8, prmt
        assert len([t for t in loop if t.startswith("LOP3")]) <= 2 * words + 8, loop
    else:
        assert len(prmt) >= 2 * words, len(prmt)


def test_default_tiles_and_dispatch(monkeypatch):
    """Where the kernel runs: the forward tiles of one and two rows per expert on an sm_90 GPU; not BM >= 64,
    the backward layouts; one row per program (decode) with tiles of its own; `variant(wgmma=False)` turns it off."""
    monkeypatch.setattr(tiles, "wgmma_enabled", lambda device=None: True)
    E, D, I = 896, 3584, 3072
    up = G.default_config(64 * 16, E, I, D, "out")
    assert (up["WG"], up["PERM"], up["AK"], up["BM"], up["BN"], up["BK"], up["PAIR"]) == (1, 1, 1, 16, 64, 128, 0)
    down = G.default_config(1024 * 16, E, D, I)
    assert (down["WG"], down["BM"], down["PAIR"], down["num_stages"]) == (1, 32, 1, 4)
    assert G.kperm_bk(64 * 16, E, I, D, "out") == 128  # the module then permutes x for it
    assert "WG" not in G.default_config(16384 * 16, E, I, D, "out")
    assert "WG" not in G.default_config(1024 * 16, E, D, I, trans_w=True)
    row_up = G.default_config(16, 16, I, D, "out", row_expert=True)
    row_dn = G.default_config(16, 16, D, I, row_expert=True)
    assert (row_up["WG"], row_up["num_stages"], row_dn["WG"], row_dn["PAIR"]) == (1, 5, 1, 0)
    monkeypatch.undo()
    with G.variant(wgmma=False):
        assert not G.wgmma_enabled()
        assert "WG" not in G.default_config(64 * 16, E, I, D, "out")
    if not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)):
        assert not G.wgmma_enabled()


def test_gluon_tail_tiles(monkeypatch):
    """The BM=32 Gluon tiles hand each expert's last block of at most 16 rows to a launch of the BM=16 Gluon tiles
    (`tiles._TAILS["wg"]`), with the same BK (the activations are permuted for it); never for one route per
    program."""
    monkeypatch.setattr(tiles, "wgmma_enabled", lambda device=None: True)
    E, D, I = 896, 3584, 3072
    with monkeypatch.context() as mp:
        mp.setitem(tiles._TAILS, "wg", ())
        assert G.default_config(1024 * 16, E, I, D, "out")["TAIL"] == ()
    up, dn = G.default_config(1024 * 16, E, I, D, "out"), G.default_config(1024 * 16, E, D, I)
    assert up["TAIL"] == dn["TAIL"] == (16,) and up["BM"] == dn["BM"] == 32
    t_up, t_dn = tiles.tail_config(up, 16, "out", False, None), tiles.tail_config(dn, 16, None, False, None)
    assert (t_up["BM"], t_up["WG"], t_up["BN"], t_up["BK"], t_up["num_warps"], t_up["PAIR"]) == (16, 1, 64, 128, 4, 0)
    assert (t_dn["BM"], t_dn["WG"], t_dn["BN"], t_dn["BK"], t_dn["num_warps"], t_dn["PAIR"]) == (16, 1, 64, 128, 4, 1)
    assert G.default_config(64 * 16, E, I, D, "out")["TAIL"] == ()  # BM=16 has nothing smaller
    assert G.default_config(16, 16, I, D, "out", row_expert=True)["TAIL"] == ()


def test_l2_prefetch_bytes():
    """The weight rows' L2 prefetch: 128 bytes by default, where that is a whole number of K steps (BK/2 bytes) and
    lines of a row (K/2 bytes); `variant(l2_prefetch=...)` sets it for benchmarks (0: off)."""
    assert W.prefetch_bytes(3584, 128) == W.prefetch_bytes(3072, 128) == W.prefetch_bytes(256, 64) == 128
    assert W.prefetch_bytes(3584 + 128, 128) == 0  # a row of 1,856 bytes: no whole lines
    assert W.prefetch_bytes(3584, 512) == 0  # a K step of 256 bytes: longer than a run
    with G.variant(l2_prefetch=0):
        assert W.prefetch_bytes(3584, 128) == 0
    with G.variant(l2_prefetch=256):
        assert W.prefetch_bytes(3584, 128) == 256
    assert W.prefetch_bytes(3584, 128) == 128
    for bad in (100, -128, "1k"):
        with pytest.raises(ValueError, match="l2_prefetch"):
            with G.variant(l2_prefetch=bad):
                pass
    with pytest.raises(ValueError, match="unknown"):
        with G.variant(split=True):
            pass


def test_table_free_decode_ptx_gives_the_e2m1_values():
    """`decode.e2m1_shift_ptx` run instruction by instruction (`kimi3_testing.run_decode_ptx`): bf16 pair p of a 4-byte
    word holds nibbles p and p + 4, each code times its scale 2^(e-127) exactly, -0 for the code of negative zero, at
    every scale exponent it accepts (0..128); 129 would overflow the multiplier, which is why callers check."""
    import struct

    from transformers_kimi3.mxfp4 import E2M1_VALUES

    rng = np.random.default_rng(0)
    words = [0x88888888, 0, 0xFFFFFFFF, 0x77777777] + [int(w) for w in rng.integers(0, 2 ** 32, size=508)]
    exps = [0, 1, 127, 128] + [int(e) for e in rng.integers(0, 129, size=508)]
    ptx = decode.e2m1_shift_ptx()
    for x, e in zip(words, exps):
        mult = ((e + 126) << 7) * 0x10001  # the kernel's multiplier word
        out = run_decode_ptx(ptx, x, [mult] * 4)
        for p in range(4):
            for half, j in ((0, p), (16, p + 4)):
                code = (x >> (4 * j)) & 15
                want = E2M1_VALUES[code] * 2.0 ** (e - 127)
                bits = (out[p] >> half) & 0xFFFF
                got = struct.unpack("<f", struct.pack("<I", bits << 16))[0]
                assert got == want and (bits >> 15) == (code >> 3), (hex(x), e, p, j, got, want)


def test_table_free_order_puts_each_pair_where_the_mma_reads_it():
    """kperm_index(nib=True), derived independently: lane t of a quad holds bytes 16t..16t+15 of a 128-wide row
    tile as four words; pair p of word g (nibbles p, p + 4: stored columns 2(16t + 4g) + p + 4e) sits at byte slot
    4g + p, which the A fragment feeds to MMA column 16 (slot // 2) + 8 (slot % 2) + 2t + e."""
    BK = 128
    want = torch.empty(BK, dtype=torch.long)
    for t in range(4):
        for g in range(4):
            for p in range(4):
                for e in range(2):
                    slot = 4 * g + p
                    want[16 * (slot // 2) + 8 * (slot % 2) + 2 * t + e] = 2 * (16 * t + 4 * g) + p + 4 * e
    got = G.kperm_index(2 * BK, BK, nib=True)
    assert torch.equal(got[:BK], want) and torch.equal(got[BK:], want + BK)
    # the table decode's order, by the same derivation (pair = the two nibbles of byte slot 16t + slot)
    plain = torch.empty(BK, dtype=torch.long)
    for t in range(4):
        for slot in range(16):
            for e in range(2):
                plain[16 * (slot // 2) + 8 * (slot % 2) + 2 * t + e] = 2 * (16 * t + slot) + e
    assert torch.equal(G.kperm_index(BK, BK), plain)


def test_table_free_dispatch(monkeypatch):
    """Where the activations may come in the table-free order: the Gluon tiles only (not BM >= 64), one row per
    program included, scales up to exponent 128; a_nib elsewhere is an error, not the wrong products."""
    monkeypatch.setattr(tiles, "wgmma_enabled", lambda device=None: True)
    E, D, I = 896, 3584, 3072
    assert G.kperm_tile(64 * 16, E, I, D, "out") == (128, True) and G.kperm_tile(1024 * 16, E, D, I) == (128, True)
    assert not G.kperm_tile(16384 * 16, E, I, D, "out")[1]
    # one row per program (1-2 tokens): Gluon tiles too (x and h copied into their K order)
    assert G.kperm_tile(16, 16, I, D, "out", row_expert=True) == (128, True)
    assert G.kperm_tile(16, 16, D, I, row_expert=True) == (128, True)
    monkeypatch.undo()
    s = torch.full((2, 4, 8), 128, dtype=torch.uint8)
    assert G.scales_fit_table_free(s, s[:, :2])
    s[1, 3, 7] = 129
    assert not G.scales_fit_table_free(s)
    a = torch.randn(4, 256).bfloat16()
    wp = torch.randint(0, 256, (2, 128, 128), dtype=torch.uint8)
    ws = torch.full((2, 128, 8), 127, dtype=torch.uint8)
    offs = torch.tensor([0, 2, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match="a_nib|wgmma kernel does not compute"):  # the latter on an sm_90 GPU
        G.mxfp4_grouped_gemm(G.permute_k(a, 128, nib=True), wp, ws, offs, a_kperm=128, a_nib=True,
                             config=dict(BM=16, BN=32, BK=128, num_warps=4, num_stages=2))


def test_output_in_k_order_needs_a_gluon_tile_with_the_glu():
    """c_kperm (gate+up writing h in the down GEMM's K order) only where the Gluon kernel runs with the GLU fused;
    kperm_position inverts kperm_index."""
    for nib in (False, True):
        idx, pos = G.kperm_index(256, 128, nib=nib), G.kperm_position(256, 128, nib=nib)
        assert torch.equal(idx[pos.long()], torch.arange(256))
    a = torch.randn(4, 256).bfloat16()
    wp = torch.randint(0, 256, (2, 128, 128), dtype=torch.uint8)
    ws = torch.full((2, 128, 8), 127, dtype=torch.uint8)
    offs = torch.tensor([0, 2, 4], dtype=torch.int32)
    kw = dict(dual="out", b_packed=wp, b_scale=ws, c_kperm=128)
    with pytest.raises(ValueError, match="c_kperm"):
        G.mxfp4_grouped_gemm(a, wp, ws, offs, **kw)  # no GLU
    with pytest.raises(ValueError, match="c_kperm|wgmma kernel does not compute"):  # the latter on an sm_90 GPU
        G.mxfp4_grouped_gemm(a, wp, ws, offs, act="silu", config=dict(BM=16, BN=32, BK=128, num_warps=4,
                                                                         num_stages=2), **kw)


def test_explicit_tile_refused_where_the_kernel_cannot_run():
    """A caller asking for the wgmma kernel where it cannot run (here: CPU tensors) gets an error, not the Triton
    kernel silently (raised before anything launches, so no interpreter is needed)."""
    E, N, K = 2, 128, 256
    a = torch.randn(4, K).bfloat16()
    wp = torch.randint(0, 256, (E, N, K // 2), dtype=torch.uint8)
    ws = torch.full((E, N, K // 32), 127, dtype=torch.uint8)
    offs = torch.tensor([0, 2, 4], dtype=torch.int32)
    cfg = dict(BM=16, BN=64, BK=128, num_warps=4, num_stages=4, PERM=1, WG=1)
    with pytest.raises(ValueError, match="wgmma kernel does not compute this launch"):
        G.mxfp4_grouped_gemm(G.permute_k(a, 128), wp, ws, offs, config=cfg, a_kperm=128)


def _case(E, N, K, counts, seed):
    gen = torch.Generator().manual_seed(seed)
    wp = torch.randint(0, 256, (E, N, K // 2), dtype=torch.uint8, generator=gen)
    ws = torch.randint(112, 132, (E, N, K // 32), dtype=torch.uint8, generator=gen)
    offs = torch.zeros(E + 1, dtype=torch.int32)
    offs[1:] = torch.cumsum(torch.tensor(counts), 0)
    return wp.cuda(), ws.cuda(), offs.cuda()


@on_h100_class
@needs_gluon
@pytest.mark.parametrize("BN,BK,warps", [(64, 128, 4), (64, 64, 4), (128, 64, 8)])
@pytest.mark.parametrize("rows", [[0, 1, 17, 3, 40, 0, 9], [2, 2, 2, 2, 2, 2, 2]])
def test_matches_triton_kernel_and_reference_on_gpu(rows, BN, BK, warps, monkeypatch):
    """gate+up (GLU fused and not) and down (scattered rows; two tiles per program, and one stepping K two tiles
    at a time) against the Triton kernel (bit-identical expected) and dequantise-then-matmul (fp32), for each
    weight tile shape of the default tables or timed against them."""
    E, D, I = len(rows), 256, 512
    M = sum(rows)
    wp, ws, offs = _case(E, I, D, rows, 0)
    bp, bs, _ = _case(E, I, D, rows, 1)
    w2p, w2s, _ = _case(E, D, I, rows, 2)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(11, D, generator=gen).bfloat16().cuda()
    a_rows = torch.randint(0, 11, (M,), generator=gen, dtype=torch.int32).cuda()
    h = torch.randn(M, I, generator=gen).bfloat16().cuda()
    c_rows = torch.randperm(M, generator=gen).to(torch.int32).cuda()
    for BM in (16, 32):
        for stages, pair in ((4, 1), (3, 0), (5, 1)):
            wg = dict(BM=BM, BN=BN, BK=BK, num_warps=warps, num_stages=stages, PERM=1, WG=1, PAIR=pair)
            tri = dict(BM=BM, BN=64, BK=BK, num_warps=4, num_stages=3, PERM=1)
            for act in (None, "situ", "silu"):
                kw = dict(a_rows=a_rows, dual="out", b_packed=bp, b_scale=bs, act=act, out_dtype=torch.bfloat16,
                          a_kperm=BK)
                got = G.mxfp4_grouped_gemm(G.permute_k(x, BK), wp, ws, offs, config=wg, **kw)
                want = G.mxfp4_grouped_gemm(G.permute_k(x, BK), wp, ws, offs, config=tri, **kw)
                assert torch.equal(got, want), (BM, stages, act)
                if act:  # h written straight in the down GEMM's K order (both orders)
                    for nib in (False, True):
                        hk = G.mxfp4_grouped_gemm(G.permute_k(x, BK), wp, ws, offs, config=wg, c_kperm=BK,
                                                  c_nib=nib, **kw)
                        assert torch.equal(hk, G.permute_k(got, BK, nib=nib)), (BM, stages, act, nib)
            kw = dict(c_rows=c_rows, num_c_rows=M, a_kperm=BK)
            got = G.mxfp4_grouped_gemm(G.permute_k(h, BK), w2p, w2s, offs, config=wg, **kw)
            want = G.mxfp4_grouped_gemm(G.permute_k(h, BK), w2p, w2s, offs, config=tri, **kw)
            assert torch.equal(got, want), (BM, stages, pair)
            ref = R.mxfp4_grouped_gemm_ref(h, w2p, w2s, offs, c_rows=c_rows, num_c_rows=M)
            err = ((got.double() - ref.double()).norm() / ref.double().norm()).item()
            assert err < 1e-5, err  # bf16 operands, fp32 accumulation in another order
            # the table-free decode (scale exponents up to 128, its range): the same products, summed in another K
            # order
            w2s_, ws_, bs_ = (t.clamp(max=128) for t in (w2s, ws, bs))
            ref = R.mxfp4_grouped_gemm_ref(h, w2p, w2s_, offs, c_rows=c_rows, num_c_rows=M)
            nib = G.mxfp4_grouped_gemm(G.permute_k(h, BK, nib=True), w2p, w2s_, offs, config=wg, a_nib=True, **kw)
            err = ((nib.double() - ref.double()).norm() / ref.double().norm()).item()
            assert err < 1e-5, err
            for act in (None, "situ"):
                kw_up = dict(a_rows=a_rows, dual="out", b_packed=bp, b_scale=bs_, act=act, out_dtype=torch.float32,
                             a_kperm=BK)
                tab = G.mxfp4_grouped_gemm(G.permute_k(x, BK), wp, ws_, offs, config=wg, **kw_up)
                nib = G.mxfp4_grouped_gemm(G.permute_k(x, BK, nib=True), wp, ws_, offs, config=wg, a_nib=True,
                                           **kw_up)
                err = ((nib.double() - tab.double()).norm() / tab.double().norm()).item()
                assert err < 1e-5, (BM, stages, act, err)


@on_h100_class
@needs_gluon
def test_one_route_per_program_on_gpu():
    """Decode (expert_ids, one route per program): gate+up with the GLU fused and down, with the table decode and
    the table-free one, against the Triton kernel's one-row tiles (stored K order: the same products summed in
    another order); a route to another rank's expert (id E) gets zeros."""
    E, D, I, T, k = 6, 256, 512, 3, 4
    wp, ws, _ = _case(E, I, D, [1] * E, 0)
    bp, bs, _ = _case(E, I, D, [1] * E, 1)
    w2p, w2s, _ = _case(E, D, I, [1] * E, 2)
    ws, bs, w2s = (t.clamp(max=128) for t in (ws, bs, w2s))  # the table-free decode's range
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(T, D, generator=gen).bfloat16().cuda()
    ids = torch.randint(0, E, (T * k,), generator=gen, dtype=torch.int32).cuda()
    ids[5] = E
    h = torch.randn(T * k, I, generator=gen).bfloat16().cuda()
    tri = dict(BM=16, BN=64, BK=128, num_warps=4, num_stages=3)
    for nib in (False, True):
        for act in ("silu", None):
            kw = dict(expert_ids=ids, a_row_div=k, dual="out", b_packed=bp, b_scale=bs, act=act,
                      out_dtype=torch.float32)
            wg = dict(tri, num_stages=4, PERM=1, WG=1)
            got = G.mxfp4_grouped_gemm(G.permute_k(x, 128, nib=nib), wp, ws, None, config=wg, a_kperm=128,
                                       a_nib=nib, **kw)
            want = G.mxfp4_grouped_gemm(x, wp, ws, None, config=tri, **kw)
            err = ((got.double() - want.double()).norm() / want.double().norm()).item()
            assert err < 1e-5 and torch.equal(got[5], torch.zeros_like(got[5])), (nib, act, err)
            if act:  # h in the down GEMM's K order, the zeros of route 5 included
                hk = G.mxfp4_grouped_gemm(G.permute_k(x, 128, nib=nib), wp, ws, None, config=wg, a_kperm=128,
                                          a_nib=nib, c_kperm=128, c_nib=nib, **kw)
                assert torch.equal(hk, G.permute_k(got, 128, nib=nib)), nib
        for pair in (0, 1):
            wg = dict(tri, num_stages=4, PERM=1, WG=1, PAIR=pair)
            got = G.mxfp4_grouped_gemm(G.permute_k(h, 128, nib=nib), w2p, w2s, None, expert_ids=ids, config=wg,
                                       a_kperm=128, a_nib=nib)
            want = G.mxfp4_grouped_gemm(h, w2p, w2s, None, expert_ids=ids, config=tri)
            err = ((got.double() - want.double()).norm() / want.double().norm()).item()
            assert err < 1e-5 and torch.equal(got[5], torch.zeros_like(got[5])), (nib, pair, err)


@on_h100_class
@needs_gluon
def test_tail_launch_matches_one_launch_on_gpu(monkeypatch):
    """The default tiles at ~17 rows per expert (BM=32, 16-row tails): experts of at most 16 rows (and the last 16
    of 33-48) in a second launch of BM=16 tiles give the same bits as one launch (no tails): each row's sums run
    over K in the same order whatever the tile height; so does turning the L2 prefetch off.
    gate+up with the GLU fused writing h in the down GEMM's K order, and down, both with the table-free decode, as
    the module runs them."""
    rows = [0, 1, 17, 3, 40, 0, 9, 33, 16, 32, 48]
    E, D, I = len(rows), 256, 512
    M = sum(rows)
    wp, ws, offs = _case(E, I, D, rows, 0)
    bp, bs, _ = _case(E, I, D, rows, 1)
    w2p, w2s, _ = _case(E, D, I, rows, 2)
    ws, bs, w2s = (t.clamp(max=128) for t in (ws, bs, w2s))
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(40, D, generator=gen).bfloat16().cuda()
    a_rows = torch.randint(0, 40, (M,), generator=gen, dtype=torch.int32).cuda()
    c_rows = torch.randperm(M, generator=gen).to(torch.int32).cuda()
    assert G.default_config(M, E, I, D, "out")["BM"] == 32

    def run():
        bk = G.kperm_bk(M, E, I, D, "out")
        h = G.mxfp4_grouped_gemm(G.permute_k(x, bk, nib=True), wp, ws, offs, a_rows=a_rows, dual="out", b_packed=bp,
                                 b_scale=bs, act="silu", out_dtype=torch.bfloat16, a_kperm=bk, a_nib=True,
                                 c_kperm=bk, c_nib=True)
        return h, G.mxfp4_grouped_gemm(h, w2p, w2s, offs, c_rows=c_rows, num_c_rows=M, a_kperm=bk, a_nib=True)

    with monkeypatch.context() as mp:
        mp.setitem(tiles._TAILS, "wg", ())
        h1, y1 = run()
    assert G.default_config(M, E, I, D, "out")["TAIL"] == (16,)
    h2, y2 = run()
    assert torch.equal(h1, h2) and torch.equal(y1, y2)
    with G.variant(l2_prefetch=0):  # the weight rows' L2 prefetch moves no result bit
        h3, y3 = run()
    assert torch.equal(h1, h3) and torch.equal(y1, y3)
    h = torch.empty_like(h1)
    h[:, G.kperm_index(I, 128, h1.device, nib=True)] = h1  # back in stored order
    ref = R.mxfp4_grouped_gemm_ref(h, w2p, w2s, offs, c_rows=c_rows, num_c_rows=M)
    assert ((y2.double() - ref.double()).norm() / ref.double().norm()).item() < 1e-5



@on_h100_class
@needs_gluon
@pytest.mark.parametrize("tokens", [1, 8, 12, 40])
def test_direct_launches_match_triton_launches_on_gpu(tokens, monkeypatch):
    """`kimi3_kernels._launch` hands later launches straight to the compiled kernels: the packed experts' forward
    (1 and 8 tokens at top-4: one route per program; 12 and 40: sorted, BM=16 and BM=32 Gluon tiles with tails) and
    the backward (the Triton kernel's layouts) give the same bits with direct launches as through Triton's launch
    path (`_launch.direct_launch(False)`), the direct path really runs, and a CUDA graph captured from it replays
    the same."""
    from kimi3_kernels import _launch
    from transformers_kimi3.mxfp4_experts import PackedMXFP4Experts

    E, D, I, k = 16, 256, 512, 4
    gen = torch.Generator().manual_seed(tokens)
    mod = PackedMXFP4Experts.from_float(*(torch.randn(E, *s, generator=gen) * 0.05 for s in ((I, D), (I, D), (D, I))))
    mod = mod.cuda()
    x = torch.randn(tokens, D, generator=gen).bfloat16().cuda()
    idx = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(tokens)]).cuda()
    w = torch.rand(tokens, k, generator=gen).cuda()
    dy = torch.randn(tokens, D, generator=gen).bfloat16().cuda()

    def run():
        with torch.no_grad():
            y = mod(x, idx, w)
        xg = x.clone().requires_grad_()
        y_sorted = mod(xg, idx, w)
        y_sorted.backward(dy)
        # without autograd 1 and 8 tokens take the decode path (route ids and K-permuted x from one launch, one
        # route per program); with it the routes are sorted: the same products summed in another order
        d = y.float() - y_sorted.detach().float()
        assert (d.norm() / y_sorted.detach().float().norm()).item() < 1e-2  # bf16 outputs: ~1e-3 apart
        return y, xg.grad

    with _launch.direct_launch(False):
        ref = run()
    assert _launch.enabled()
    before = _launch._DIRECT[0]
    outs = [run() for _ in range(3)]  # the first through Triton where a specialisation is new, then direct
    torch.cuda.synchronize()
    assert _launch._DIRECT[0] > before and not _launch._FAILED
    for y, dx in outs:
        assert torch.equal(y, ref[0]) and torch.equal(dx, ref[1])
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph):
        captured = mod(x, idx, w)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, ref[0])


@pytest.mark.parametrize("row_expert", [False, True])
def test_default_tiles_are_tiles_the_kernel_computes(monkeypatch, row_expert):
    """Small models (kimi-k3-mini: latent 128, expert width 128) have K of one 128-wide tile, which the single-weight
    Gluon tile cannot step through two at a time: the default tile must then be a Triton one, never a Gluon tile
    that the launch refuses."""
    monkeypatch.setattr(tiles, "wgmma_enabled", lambda device=None: True)
    seen = set()
    for D, I in ((128, 128), (256, 128), (128, 384), (3584, 3072), (2304, 1408)):
        for M, E in ((1, 8), (4, 32), (16, 16), (64 * 16, 896), (40, 32), (1024 * 16, 896)):
            for N, K, dual in ((I, D, "out"), (D, I, None)):
                cfg = G.default_config(M, E, N, K, dual, row_expert=row_expert)
                if cfg.get("WG"):
                    pair = int(bool(cfg.get("PAIR")) and dual is None)
                    assert W.shape_supported(N, K, cfg["BN"], cfg["BK"], dual is not None, pair), (M, E, N, K, cfg)
                    seen.add((N, K))
    if row_expert:  # down of one route per program (no pairing) with K of one tile: a Triton tile
        assert not G.default_config(4, 32, 128, 128, row_expert=True).get("WG")
    assert (3072, 3584) in seen and (3584, 3072) in seen  # K3's gate+up and down still take the Gluon tiles
