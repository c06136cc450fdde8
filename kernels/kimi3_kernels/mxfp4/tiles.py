"""Tile choice of the MXFP4 grouped GEMM: the measured tile tables and `default_config`, which picks a tile from a
call's shape. The tables were measured with `bench/moe.py` on an H200 (results: bench/results/moe_h200.json; K3
shapes: 896 experts, top-16, latent 3584, expert width 3072, against the bf16 grouped GEMM in the same process).

BM is the rows of one expert per tile (the MMA's N side: the kernels compute C^T = W A^T), chosen so that a typical
expert's rows fit one block and its weights are decoded about once per output tile.
"""

import functools

import torch

from .._host import interpreter_enabled, next_pow2
from . import options, wgmma
from .decode import capability, device_index

# Triton tiles, by BM: (BN, BK, num_warps, num_stages). The backward layouts (trans_w, dual="in") and the forward
# tiles without a K-permuted entry use them. These kernels are bound by L1/shared-memory traffic, so a long K step
# (fewer per-row scale loads) wins.
_TILES = {
    16: (64, 128, 4, 4),
    32: (64, 128, 4, 3),
    64: (64, 128, 4, 3),
    128: (64, 64, 8, 4),
}
# Forward Triton tiles that take the K-permuted operand order (PERM, `decode._perm_k`), by (BM, dual): (BN, BK,
# num_warps, num_stages, AK). AK: the activations come pre-permuted (`decode.permute_k`, contiguous loads), else
# they are gathered in pairs. Each beats the plain tile of its BM (e.g. 16,384 tokens: gate+up ~30% faster).
# BM=16 down keeps gathered pairs: pre-permuted was slower at one token.
_PERM_TILES = {
    (16, "out"): (64, 128, 4, 4, 0),
    (16, None): (128, 128, 8, 4, 0),
    (32, "out"): (64, 128, 4, 2, 1),
    (32, None): (128, 128, 8, 3, 1),
    (64, "out"): (64, 128, 4, 3, 1),
    (64, None): (128, 128, 8, 3, 1),
    (128, "out"): (64, 128, 4, 3, 1),
    (128, None): (128, 64, 8, 3, 1),
}
# Forward tiles of the Gluon kernel (`wgmma.py`, sm_90), by (BM, dual): (BN, BK, num_warps, num_stages, PAIR).
# Always K-permuted with pre-permuted activations. PAIR: a down program takes two adjacent 64-row tiles. 5-15%
# faster than the Triton tiles at 64 and 1,024 tokens; 3 stages time the same as 4 but make ptxas serialise the
# MMAs, 5-6 are no faster. BM >= 64 keeps the Triton tiles.
_WGMMA_TILES = {
    (16, "out"): (64, 128, 4, 4, 0),
    (16, None): (64, 128, 4, 4, 1),
    (32, "out"): (64, 128, 4, 4, 0),
    (32, None): (64, 128, 4, 4, 1),
}
# ... and for one route per program (`expert_ids`: decode, 1-2 tokens of K3): 15-30% faster than the Triton
# one-row tiles, which hold 255 registers (2 CTAs per SM) where these hold 128 (4 CTAs per SM).
_WGMMA_ROW_TILES = {
    (16, "out"): (64, 128, 4, 5, 0),
    (16, None): (64, 128, 4, 4, 0),
}
# Tail heights: each expert's last block of at most t rows runs in a launch of t-row tiles (`gemm.tail_split`),
# which multiply fewer padded rows. "out" (gate+up) and None (down): the BM=128 forward tiles, 2-7% faster at 4K-16K
# tokens; "bwd": the BM=128 backward layouts, 5-10% faster forward+backward at 4K-16K tokens; "wg": the BM=32 Gluon
# tiles (~18 rows per expert, 1,024 tokens), ~4% faster.
_TAILS = {"out": (64, 32), None: (64,), "bwd": (64, 32), "wg": (16,)}


@functools.lru_cache(maxsize=None)
def _cuda_available():
    return torch.cuda.is_available()


@functools.lru_cache(maxsize=None)
def _wgmma_hardware(index):
    # asked at every GEMM's tile choice: the device query once per GPU
    return wgmma.HAS_GLUON and capability(index) == (9, 0)


def wgmma_enabled(device=None):
    """Whether the forward tiles of one and two rows per expert (BM 16 / 32: up to ~1,000 tokens of K3) run the Gluon
    kernel: an sm_90 GPU (the current one unless `device` is given), a Triton with Gluon, not the interpreter (and
    the `wgmma` option on)."""
    if not options.get("wgmma") or interpreter_enabled() or not _cuda_available():
        return False
    device = torch.device(device if device is not None else "cuda")
    return device.type == "cuda" and _wgmma_hardware(device_index(device))


def default_config(M, E, N, K, dual=None, trans_w=False, row_expert=False):
    """The tile of a GEMM of M rows over E experts (C [M, N] from K): BM from the mean rows per active expert, then
    the Gluon tile (forward, BM 16 / 32, sm_90), the K-permuted Triton tile (forward) or the plain one. Forward
    BM=128 tiles and the backward layouts' BM=128 tiles take tail launches, the BM=32 Gluon tiles 16-row ones
    (`_TAILS`). row_expert: the tile of the one-row-per-program launch (`expert_ids`): the Gluon tiles of
    `_WGMMA_ROW_TILES` on Hopper, else Triton tiles where down keeps the plain tile (BN=128 would halve the
    programs of a 16-route layer)."""
    avg = M / max(1, min(E, M))
    BM = min(128, max(16, next_pow2(int(avg + 8))))  # 1 row/expert: 16; ~18 (1k tokens of K3): 32
    fwd = not trans_w and dual != "in"
    tail = _TAILS[dual if fwd else "bwd"] if BM == 128 else ()
    wg_tiles = _WGMMA_ROW_TILES if row_expert else _WGMMA_TILES
    wg = wg_tiles.get((BM, dual)) if fwd else None
    if wg and wgmma.shape_supported(N, K, wg[0], wg[1], dual is not None, wg[4] and dual is None) and wgmma_enabled():
        BN, BK, warps, stages, pair = wg
        if BM == 32 and not row_expert:
            tail = _TAILS["wg"]
        return dict(BM=BM, BN=BN, BK=BK, num_warps=warps, num_stages=stages, PERM=1, AK=1, TAIL=tail, WG=1,
                    PAIR=pair)
    if fwd and (BM, dual) in _PERM_TILES and not (row_expert and dual is None):
        BN, BK, warps, stages, ak = _PERM_TILES[BM, dual]
        if not (ak and K % BK):  # pre-permuted activations need whole K tiles; else the plain tile
            return dict(BM=BM, BN=BN, BK=BK, num_warps=warps, num_stages=stages, PERM=1, AK=ak, TAIL=tail)
    BN, BK, warps, stages = _TILES[BM]
    return dict(BM=BM, BN=BN, BK=BK, num_warps=warps, num_stages=stages, TAIL=tail)


def tail_config(cfg, BM, dual, trans_w, config):
    """The tile of a tail launch: the caller's tile at this BM, or the default tile of that height with the main
    tile's BK and K order (the activations were permuted for that BK)."""
    if config and {"BM", "BN", "BK"} & set(config):
        return dict(cfg, BM=BM)
    if cfg.get("WG") and (BM, dual) in _WGMMA_TILES:  # the Gluon tile of that height, same BK
        BN, _, warps, stages, pair = _WGMMA_TILES[BM, dual]
        return dict(cfg, BM=BM, BN=BN, num_warps=warps, num_stages=stages, PAIR=pair)
    table = _PERM_TILES if cfg.get("PERM") and not trans_w else {}
    BN, _, warps, stages = table.get((BM, dual), _TILES[BM])[:4]
    return dict(cfg, BM=BM, BN=BN, num_warps=warps, num_stages=stages)


def tails(v):
    """TAIL of a config: an int, a sequence of ints, or '64,32' -> tuple of tail heights (0 / empty: none)."""
    if isinstance(v, str):
        v = [int(x) for x in v.replace(" ", "").split(",") if x]
    elif isinstance(v, int):
        v = [v]
    return tuple(int(x) for x in v if int(x))


def kperm_tile(M, E, N, K, dual=None, row_expert=False):
    """(BK, gluon) of the default tile of this forward GEMM: BK if it reads pre-permuted activations (AK), else 0
    (the `a_kperm` to give it after `permute_k(a, BK)`); gluon: it is the Gluon kernel, which can take them in the
    order of its table-free decode instead (`permute_k(a, BK, nib=True)`, `a_nib=True`) where every scale exponent
    is <= 128 (the caller checks: `gemm.scales_fit_table_free`). row_expert as for `default_config`."""
    cfg = default_config(M, E, N, K, dual, row_expert=row_expert)
    return (cfg["BK"] if cfg.get("AK") else 0), bool(cfg.get("WG"))


def kperm_bk(M, E, N, K, dual=None, row_expert=False):
    """BK of `kperm_tile`."""
    return kperm_tile(M, E, N, K, dual, row_expert)[0]


def _tables():
    return _TILES, _PERM_TILES, _WGMMA_TILES, _WGMMA_ROW_TILES, _TAILS


_TABLES_SEEN = [None, 0]  # a copy of the tile tables as last seen, and how many times they have changed


def tile_state(device):
    """A value that changes whenever something the tile choice for tensors on `device` reads changes: the tile
    tables (tests and bench/moe.py variants change them in place), the options (`options.variant`), the
    interpreter and `wgmma_enabled` (tests replace it). Launch plans, and callers that cache what `kperm_tile` says,
    key on it. Its GPU queries are per device and fixed (the current device is the tensors': Triton launches
    there)."""
    tables = _tables()
    if tables != _TABLES_SEEN[0]:
        _TABLES_SEEN[:] = [tuple(dict(t) for t in tables), _TABLES_SEEN[1] + 1]
    return _TABLES_SEEN[1], options.state(), interpreter_enabled(), wgmma_enabled, device
