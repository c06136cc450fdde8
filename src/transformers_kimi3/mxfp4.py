"""MXFP4 (OCP Microscaling, E2M1 elements + E8M0 scale per 32 values) as compressed-tensors packs it.

Layout of one weight [out, in]: `weight_packed` uint8 [out, in/2] holding two E2M1 codes per byte, the LOW
nibble being the even column (compressed-tensors `pack_fp4_to_uint8`), and `weight_scale` uint8 [out, in/32]
holding the E8M0 exponent e (value 2^(e-127); 0xFF is NaN).

This module has:
- `check_mxfp4`, `dequantize_mxfp4`: validation and exact dequantisation (used by the loader).
- `quantize_mxfp4`, `pack_fp4_codes`, `unpack_fp4_codes`: the OCP MX v1.0 quantiser and the packing.
- `PackedMXFP4Experts`: routed experts kept packed in memory, forward and backward w.r.t. the activations and the
  routing weights (the packed weights are frozen buffers). On CUDA with Triton it runs the grouped GEMM of
  `kimi3_kernels.mxfp4_gemm` (one launch per projection for all experts, MXFP4 dequantised in registers); elsewhere
  it dequantises one expert at a time.
"""

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from .kernel_switch import env, inference_kernels_enabled

GROUP_SIZE = 32
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
E2M1_EMAX = 2  # exponent of the largest E2M1 value (6 = 1.5 * 2^2)
E8M0_BIAS = 127
E8M0_MIN_EXP, E8M0_MAX_EXP = -127, 127  # 0x00 .. 0xFE; 0xFF is NaN
ZERO_BLOCK_SCALE = 0  # E8M0 byte written for an all-zero block: the smallest scale, 2^-127


def check_mxfp4(packed, scale, name="weight"):
    """Shape/dtype/NaN checks that turn a corrupt tensor into a clear error naming it."""
    if packed.dtype != torch.uint8 or scale.dtype != torch.uint8:
        raise ValueError(f"{name}: MXFP4 tensors must be uint8, got weight_packed {packed.dtype} and "
                         f"weight_scale {scale.dtype}")
    if packed.dim() < 2 or scale.shape[:-1] != packed.shape[:-1] or packed.shape[-1] * 2 != scale.shape[-1] * GROUP_SIZE:
        raise ValueError(f"{name}: weight_packed {tuple(packed.shape)} and weight_scale {tuple(scale.shape)} do not "
                         f"describe one [out, in] matrix (expected in/2 packed bytes and in/{GROUP_SIZE} scales)")
    if bool((scale == 0xFF).any()):
        raise ValueError(f"{name}: weight_scale holds 0xFF (the E8M0 NaN encoding)")


def unpack_fp4_codes(packed):
    """uint8 [..., n/2] -> uint8 codes [..., n] (0..15, sign in bit 3); the low nibble is the even element."""
    if packed.dtype != torch.uint8:
        raise ValueError(f"packed FP4 must be uint8, got {packed.dtype}")
    return torch.stack((packed & 0x0F, packed >> 4), dim=-1).flatten(-2)


def pack_fp4_codes(codes):
    """uint8 codes [..., n] (n even, each 0..15) -> uint8 [..., n/2] as `idx0 | idx1 << 4` (compressed-tensors)."""
    if codes.shape[-1] % 2:
        raise ValueError(f"cannot pack an odd number ({codes.shape[-1]}) of FP4 codes per row")
    codes = codes.to(torch.uint8)
    if bool((codes > 15).any()):
        raise ValueError("FP4 codes must lie in 0..15")
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def dequantize_mxfp4(packed, scale, dtype=torch.bfloat16, name="weight"):
    """[..., out, in/2] uint8 + [..., out, in/32] uint8 -> [..., out, in] `dtype`, exact (every MXFP4 value is
    representable in bf16 and fp32)."""
    check_mxfp4(packed, scale, name)
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=packed.device)
    values = lut[unpack_fp4_codes(packed).long()]
    exp = scale.to(torch.int32) - E8M0_BIAS
    values = values.unflatten(-1, (scale.shape[-1], GROUP_SIZE)) * torch.exp2(exp.float())[..., None]
    return values.flatten(-2).to(dtype)


def _e2m1_codes(v):
    """fp32 values already divided by the block scale -> E2M1 codes: round to nearest, ties to even (the code
    whose mantissa bit is 0), saturating at 6; the sign goes to bit 3 (so -0.0 and negatives that round to zero
    give code 8, negative zero)."""
    a = v.abs()
    # thresholds are the midpoints between neighbours; '>' where the lower neighbour is even, '>=' where the upper is
    code = ((a > 0.25).to(torch.uint8) + (a >= 0.75).to(torch.uint8) + (a > 1.25).to(torch.uint8)
            + (a >= 1.75).to(torch.uint8) + (a > 2.5).to(torch.uint8) + (a >= 3.5).to(torch.uint8)
            + (a > 5.0).to(torch.uint8))
    return code | (torch.signbit(v).to(torch.uint8) << 3)


def quantize_mxfp4(w, name="weight"):
    """OCP MX v1.0 MXFP4 quantisation of `w` [..., out, in] (in % 32 == 0, finite) ->
    (packed uint8 [..., out, in/2], scale uint8 [..., out, in/32]).

    Per block of 32 values along `in`: X = 2^(floor(log2(amax)) - 2) with the exponent clamped to E8M0's range
    [-127, 127]; an all-zero block gets the smallest scale 2^-127 (byte 0x00). Elements are v / X rounded to the
    nearest E2M1 value, ties to even, saturating at +-6; the sign of v is kept (negative zero included). The input is
    first rounded to fp32. floor(log2) comes from frexp, so it is exact (also for fp32 subnormals).
    """
    if w.shape[-1] % GROUP_SIZE:
        raise ValueError(f"{name}: the last dimension ({w.shape[-1]}) must be a multiple of {GROUP_SIZE}")
    wf = w.detach().float()
    if not bool(torch.isfinite(wf).all()):
        raise ValueError(f"{name}: cannot quantise non-finite values to MXFP4")
    blocks = wf.unflatten(-1, (-1, GROUP_SIZE))
    amax = blocks.abs().amax(-1)
    _, e = torch.frexp(amax)  # amax = m * 2^e with m in [0.5, 1): floor(log2 amax) = e - 1
    exp = (e.to(torch.int32) - 1 - E2M1_EMAX).clamp(E8M0_MIN_EXP, E8M0_MAX_EXP)
    exp = torch.where(amax == 0, torch.full_like(exp, ZERO_BLOCK_SCALE - E8M0_BIAS), exp)
    scaled = torch.ldexp(blocks, (-exp).to(torch.float32)[..., None])  # exact: multiplies by a power of two
    codes = _e2m1_codes(scaled).flatten(-2)
    return pack_fp4_codes(codes), (exp + E8M0_BIAS).to(torch.uint8)


# ----------------------------------------------------------------------------------------------------------------
# GLU activations. `glu_act(gate, up)` gets fp32 tensors and returns fp32. The Triton path fuses SiLU-GLU and
# SiTU-GLU into the gate/up kernel when it recognises the callable (see `fused_act_spec`); anything else runs in
# PyTorch between the two launches.


def silu_glu(gate, up):
    """Kimi Linear: SiLU(gate) * up."""
    return F.silu(gate) * up


silu_glu.mxfp4_fused_act = ("silu",)


def _situ_glu(gate, up, beta1, beta2):
    if beta2 is not None:
        up = beta2 * torch.tanh(up / beta2)
    return beta1 * torch.tanh(gate / beta1) * torch.sigmoid(gate) * up


class SiTUGLU:
    """K3: SiTU_b1(gate) * b2 tanh(up / b2) with SiTU_b(g) = b tanh(g / b) sigmoid(g); beta2=None: linear up."""

    def __init__(self, beta1=4.0, beta2=25.0):
        self.beta1, self.beta2 = float(beta1), (None if beta2 is None else float(beta2))
        self.mxfp4_fused_act = ("situ", self.beta1, self.beta2)

    def __call__(self, gate, up):
        return _situ_glu(gate, up, self.beta1, self.beta2)

    def __repr__(self):
        return f"SiTUGLU(beta1={self.beta1}, beta2={self.beta2})"


def _spec_torch(spec, gate, up):
    return F.silu(gate) * up if spec[0] == "silu" else _situ_glu(gate, up, spec[1], spec[2])


def fused_act_spec(glu_act):
    """("silu",) or ("situ", beta1, beta2|None) when `glu_act` is a GLU the kernel can fuse, else None.

    Recognised: callables carrying `mxfp4_fused_act` (silu_glu, SiTUGLU) and modules shaped like
    transformers_kimi3.moe.GLUActivation (`kind`, `beta`, `linear_beta`). The guess is then checked numerically
    against the callable on a fixed probe; a mismatch disables fusion (correct, slower).
    """
    spec = getattr(glu_act, "mxfp4_fused_act", None)
    if spec is None and hasattr(glu_act, "kind"):
        kind = getattr(glu_act, "kind")
        if kind == "silu":
            spec = ("silu",)
        elif kind == "situ" and getattr(glu_act, "beta", None) is not None:
            lb = getattr(glu_act, "linear_beta", None)
            spec = ("situ", float(glu_act.beta), None if lb is None else float(lb))
    if spec is None:
        return None
    # an explicit CPU probe: models are often built under a `torch.device("meta")` context
    # (and fp32 explicitly: they may also run under a bf16 default dtype)
    f32 = dict(device=torch.device("cpu"), dtype=torch.float32)
    gen = torch.Generator(device=f32["device"]).manual_seed(0)
    g = torch.randn(4096, generator=gen, **f32) * torch.logspace(-3, 2.5, 4096, **f32)
    u = torch.randn(4096, generator=gen, **f32) * torch.logspace(2.5, -3, 4096, **f32)
    try:
        with torch.no_grad():
            got = glu_act(g, u).float()
    except Exception:
        return None
    want = _spec_torch(spec, g, u)
    if got.shape != want.shape or not torch.allclose(got, want, rtol=1e-5, atol=1e-6):
        return None
    return tuple(spec)


# ----------------------------------------------------------------------------------------------------------------
# Kernels (optional). Imported lazily: `kimi3_kernels` may be absent (remote code on the Hub) or Triton missing.

_GEMM = []


def _gemm_module():
    if not _GEMM:
        try:
            from kimi3_kernels import mxfp4_gemm  # noqa: PLC0415
        except Exception:  # ImportError, or a kernels package that fails to import: use the PyTorch path
            mxfp4_gemm = None
        _GEMM.append(mxfp4_gemm)
    return _GEMM[0]


_DECODE = []


def _decode_module():
    """kimi3_kernels.moe_decode when it has what the unsorted decode path needs (an older kernels package may not)."""
    if not _DECODE:
        try:
            from kimi3_kernels import moe_decode  # noqa: PLC0415
            if not (hasattr(moe_decode, "combine_routes") and hasattr(_gemm_module(), "route_expert_ids")):
                moe_decode = None
        except Exception:  # noqa: BLE001
            moe_decode = None
        _DECODE.append(moe_decode)
    return _DECODE[0]


def unsorted_max_routes():
    """Routes (token, slot) up to which the forward without autograd skips sorting them by expert: the packed GEMM
    runs one route per program with its expert read from topk_idx (KIMI3_MXFP4_UNSORTED_MAX_ROUTES overrides; 0
    turns it off). Default 32 routes (2 tokens at K3's top-16): bench/moe.py on the H200 (e2a41d4, CUDA-graph full
    forward at K3 shapes, top-16 of 896 experts), unsorted vs sorted: 1 token 0.1873 vs 0.2235 ms, 2 tokens 0.3166
    vs 0.3572, but 8 tokens 1.1265 vs 1.0956 and 16 tokens 2.1984 vs 2.0417; outputs within 1.5e-5 relative."""
    return int(env("KIMI3_MXFP4_UNSORTED_MAX_ROUTES", "32"))


def kernel_path(device):
    """'triton' when the packed grouped GEMM runs on `device` (CUDA, or CPU under TRITON_INTERPRET=1), else
    'torch-per-expert'."""
    g = _gemm_module()
    if g is not None and g.available(device):
        return "triton"
    return "torch-per-expert"


DEQUANT_ON_CPU = False  # tests: the dequantise + grouped-GEMM prefill path on CPU tensors (TRITON_INTERPRET=1)


def kernel_status(device="cuda" if torch.cuda.is_available() else "cpu"):
    g = _gemm_module()
    path = kernel_path(device)
    return {
        "mxfp4_experts": path,
        "kimi3_kernels.mxfp4_gemm": g is not None,
        "triton": bool(g is not None and g.HAS_TRITON),
        "device": str(torch.device(device)),
        "weight_decode": g.decode_mode(device) if path == "triton" and hasattr(g, "decode_mode") else None,
        # up to ~1,000 tokens (one or two rows per expert): the Gluon kernel with asynchronous wgmma (Hopper)
        "async_wgmma_small_batches": bool(path == "triton" and hasattr(g, "wgmma_enabled")
                                          and g.wgmma_enabled(device)),
        # ... decoding without tables, for experts whose scale exponents are all <= 128 (checked per module)
        "table_free_decode": bool(path == "triton" and hasattr(g, "wgmma_enabled") and g.wgmma_enabled(device)
                                  and env("KIMI3_MXFP4_TABLE_FREE", "1").strip() not in ("0", "")),
        # ... reading each weight row's next 128-byte line into L2 ahead of its copies (bytes; 0: off)
        "l2_prefetch_bytes": _l2_prefetch_bytes()
        if path == "triton" and hasattr(g, "wgmma_enabled") and g.wgmma_enabled(device) else None,
        "unsorted_max_routes": unsorted_max_routes() if path == "triton" else None,
        # prefill above this many routed rows per expert: experts decoded to bf16 in chunks + torch._grouped_mm
        "dequantized_grouped_mm_min_rows_per_expert": PackedMXFP4Experts.DEQUANT_MIN_ROWS_PER_EXPERT
        if path == "triton" and hasattr(torch, "_grouped_mm") else None,
        # later launches of a kernel straight to its compiled form, past Triton's argument binding (host time)
        **(_launch_status() if path == "triton" else {}),
    }


def _l2_prefetch_bytes():
    try:
        from kimi3_kernels.mxfp4_wgmma import prefetch_setting  # noqa: PLC0415
    except ImportError:  # an older kernels package
        return 0
    return prefetch_setting()


def _launch_status():
    try:
        from kimi3_kernels import _launch  # noqa: PLC0415
    except ImportError:  # an older kernels package: every launch through Triton
        return {"direct_launch": False}
    return _launch.status()


# ----------------------------------------------------------------------------------------------------------------
# Packed experts


def _route(topk_idx, num_experts, sync_ok):
    """Sort (token, slot) pairs by expert: (order [M] pair index per sorted row, expert_offsets int32 [E+1])."""
    flat = topk_idx.reshape(-1)
    if sync_ok:
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= num_experts):
            raise ValueError(f"topk_idx holds expert indices outside [0, {num_experts})")
    else:
        torch._assert_async(((flat >= 0) & (flat < num_experts)).all(), "topk_idx holds out-of-range experts")
    sorted_e, order = torch.sort(flat, stable=True)
    grid = torch.arange(num_experts + 1, device=flat.device, dtype=sorted_e.dtype)
    offsets = torch.searchsorted(sorted_e, grid).to(torch.int32)
    return order, offsets


def _combine(pairs_out, topk_w, T, k, dtype):
    """sum_k w[t, k] * out[t, k] in fp32 -> dtype."""
    D = pairs_out.shape[-1]
    return torch.bmm(topk_w.float().reshape(T, 1, k), pairs_out.view(T, k, D)).view(T, D).to(dtype)


def _on_device(t):
    """Triton launches on the current CUDA device; under a device_map the layer may live on another GPU."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


class _PackedExpertsFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, topk_w, topk_idx, mod):
        T, k = topk_idx.shape
        triton_path = mod._uses_triton(x)
        order, offsets = _route(topk_idx, mod.num_experts, sync_ok=not triton_path)
        if triton_path:
            with _on_device(x):
                o = mod._forward_triton(x, order, offsets, k)
        else:
            o = mod._forward_torch(x, order, offsets, k)
        ctx.mod, ctx.k, ctx.triton_path = mod, k, triton_path
        ctx.save_for_backward(x, topk_w, order, offsets)
        return _combine(o, topk_w, T, k, x.dtype)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        x, topk_w, order, offsets = ctx.saved_tensors
        mod, k = ctx.mod, ctx.k
        run = mod._backward_triton if ctx.triton_path else mod._backward_torch
        with _on_device(x):
            dx_pairs, dw_pairs = run(x, topk_w, dy.contiguous(), order, offsets, k, ctx.needs_input_grad[0])
        T = topk_w.shape[0]
        dx = dx_pairs.view(T, k, -1).sum(1).to(x.dtype) if dx_pairs is not None else None
        dw = dw_pairs.view(T, k).to(topk_w.dtype) if ctx.needs_input_grad[1] else None
        return dx, dw, None, None


class PackedMXFP4Experts(nn.Module):
    """E routed experts y = sum_k w_k W2_e act(W1_e x, W3_e x), weights kept as MXFP4 exactly as on disk.

    Buffers (stacked over experts, compressed-tensors layout): w1_packed [E, I, D/2], w1_scale [E, I, D/32] (gate),
    w3_packed / w3_scale (up, same shapes), w2_packed [E, D, I/2], w2_scale [E, D, I/32] (down).
    `glu_act(gate, up)` receives fp32 and returns fp32 (K3: SiTU-GLU, Kimi Linear: SiLU * up). The GLU output is
    rounded to x's dtype before the down projection; expert outputs and the weighted sum are fp32; the result has
    x's dtype. Gradients flow to x and to the routing weights; the packed weights are frozen (no weight grads).
    """

    def __init__(self, num_experts, hidden_size, intermediate_size, glu_act=silu_glu, device=None):
        super().__init__()
        E, D, I = num_experts, hidden_size, intermediate_size
        if D % GROUP_SIZE or I % GROUP_SIZE:
            raise ValueError(f"MXFP4 experts need hidden ({D}) and intermediate ({I}) sizes divisible by {GROUP_SIZE}")
        self.num_experts, self.hidden_size, self.intermediate_size = E, D, I
        self.glu_act = glu_act
        self._fused = fused_act_spec(glu_act)
        self._table_free_key, self._table_free = None, False  # `_table_free_ok`'s answer and the buffers it is for
        self._tiles = {}  # `_mlp_tiles`
        u8 = dict(dtype=torch.uint8, device=device)
        for name, (rows, cols) in (("w1", (I, D)), ("w3", (I, D)), ("w2", (D, I))):
            self.register_buffer(f"{name}_packed", torch.zeros(E, rows, cols // 2, **u8))
            self.register_buffer(f"{name}_scale", torch.full((E, rows, cols // GROUP_SIZE), E8M0_BIAS, **u8))

    def extra_repr(self):
        return (f"num_experts={self.num_experts}, hidden_size={self.hidden_size}, "
                f"intermediate_size={self.intermediate_size}, glu_act={self.glu_act!r}, fused_act={self._fused}")

    # ---- construction / conversion
    @classmethod
    def from_float(cls, w1, w3, w2, glu_act=silu_glu):
        """Quantise stacked float weights w1, w3 [E, I, D] and w2 [E, D, I] (one expert at a time)."""
        E, I, D = w1.shape
        if w3.shape != (E, I, D) or w2.shape != (E, D, I):
            raise ValueError(f"expected w1, w3 [E, I, D] and w2 [E, D, I], got {tuple(w1.shape)}, "
                             f"{tuple(w3.shape)}, {tuple(w2.shape)}")
        mod = cls(E, D, I, glu_act, device=w1.device)
        with torch.no_grad():
            for name, w in (("w1", w1), ("w3", w3), ("w2", w2)):
                packed, scale = getattr(mod, f"{name}_packed"), getattr(mod, f"{name}_scale")
                for e in range(E):
                    packed[e], scale[e] = quantize_mxfp4(w[e], name=f"{name}[{e}]")
        return mod

    @classmethod
    def from_experts(cls, experts, glu_act=None):
        """From a float experts module holding stacked `w1`, `w3` [E, I, D] and `w2` [E, D, I]
        (transformers_kimi3.moe.Kimi3Experts); `glu_act` defaults to its `act_fn`."""
        act = glu_act if glu_act is not None else getattr(experts, "act_fn", silu_glu)
        return cls.from_float(experts.w1.detach(), experts.w3.detach(), experts.w2.detach(), act)

    def dequantize(self, dtype=torch.bfloat16):
        """(w1 [E, I, D], w3 [E, I, D], w2 [E, D, I]) in `dtype` (whole layer: for export / debugging)."""
        return tuple(dequantize_mxfp4(getattr(self, f"{n}_packed"), getattr(self, f"{n}_scale"), dtype, n)
                     for n in ("w1", "w3", "w2"))

    def check(self, prefix=""):
        """Validate every packed tensor (dtype, shapes, no 0xFF scale), naming the offending one."""
        for n in ("w1", "w3", "w2"):
            check_mxfp4(getattr(self, f"{n}_packed"), getattr(self, f"{n}_scale"), f"{prefix}{n}")

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        for n in ("w1", "w3", "w2"):  # refuse corrupt tensors (wrong dtype/shape, NaN scales) by name
            p, s = state_dict.get(f"{prefix}{n}_packed"), state_dict.get(f"{prefix}{n}_scale")
            if p is not None and s is not None:
                check_mxfp4(p, s, f"{prefix}{n}_packed/{prefix}{n}_scale")
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)

    @property
    def weight_bytes(self):
        return sum(b.numel() * b.element_size() for b in self.buffers())

    # ---- path selection
    @property
    def kernel_path(self):
        """Which implementation forward/backward run on the buffers' device: 'triton' or 'torch-per-expert'."""
        return kernel_path(self.w1_packed.device)

    def _uses_triton(self, x):
        return x.device == self.w1_packed.device and kernel_path(x.device) == "triton"

    # ---- forward
    def forward(self, x, topk_idx, topk_w):
        """x [T, D], topk_idx [T, k] long, topk_w [T, k] float -> [T, D] in x's dtype."""
        if x.dim() != 2 or x.shape[-1] != self.hidden_size:
            raise ValueError(f"x must be [T, {self.hidden_size}], got {tuple(x.shape)}")
        if topk_idx.shape != topk_w.shape or topk_idx.shape[0] != x.shape[0]:
            raise ValueError(f"topk_idx {tuple(topk_idx.shape)} / topk_w {tuple(topk_w.shape)} do not match x")
        if x.shape[0] == 0:
            return x.new_zeros(x.shape)
        T, k = topk_idx.shape
        grad = torch.is_grad_enabled() and (x.requires_grad or topk_w.requires_grad)
        if (not grad and T * k <= unsorted_max_routes() and self._uses_triton(x)
                and _decode_module() is not None):
            # decode sizes without autograd: one launch per projection straight from topk_idx, nothing sorted
            with _on_device(x):
                return _decode_module().combine_routes(self._forward_unsorted(x, topk_idx), topk_w, x.dtype)
        return _PackedExpertsFunction.apply(x, topk_w, topk_idx, self)

    def _act(self, g, u):
        return self.glu_act(g, u).float()

    def _expert(self, e, name, dtype=torch.float32):
        return dequantize_mxfp4(getattr(self, f"{name}_packed")[e], getattr(self, f"{name}_scale")[e], dtype,
                                f"{name}[{e}]")

    def _segments(self, order, offsets):
        bounds = offsets.tolist()
        for e in range(self.num_experts):
            if bounds[e + 1] > bounds[e]:
                yield e, order[bounds[e]:bounds[e + 1]]

    def _forward_torch(self, x, order, offsets, k):
        o = torch.empty(order.numel(), self.hidden_size, dtype=torch.float32, device=x.device)
        for e, pairs in self._segments(order, offsets):
            xe = x[pairs // k].float()
            h = self._act(xe @ self._expert(e, "w1").T, xe @ self._expert(e, "w3").T).to(x.dtype).float()
            o[pairs] = h @ self._expert(e, "w2").T
        return o

    def _backward_torch(self, x, topk_w, dy, order, offsets, k, need_dx=True):
        M = order.numel()
        dx = torch.zeros(M, self.hidden_size, dtype=torch.float32, device=x.device)
        dw = torch.zeros(M, dtype=torch.float32, device=x.device)
        w_flat = topk_w.reshape(-1).float()
        for e, pairs in self._segments(order, offsets):
            tok = pairs // k
            xe = x[tok].float()
            w1, w3, w2 = self._expert(e, "w1"), self._expert(e, "w3"), self._expert(e, "w2")
            with torch.enable_grad():
                g = (xe @ w1.T).requires_grad_()
                u = (xe @ w3.T).requires_grad_()
                h = self._act(g, u)
            dh_unw = dy[tok].float() @ w2  # d out_pair / d h, before the routing weight
            dw[pairs] = (dh_unw * h.detach().to(x.dtype).float()).sum(-1)
            if need_dx:
                dg, du = torch.autograd.grad(h, (g, u), dh_unw * w_flat[pairs, None])
                dx[pairs] = dg @ w1 + du @ w3
        return (dx if need_dx else None), dw

    # Prefill: at this many routed rows per expert (mean) and above, an expert's weights serve enough rows that
    # decoding them once to bf16 and running torch._grouped_mm (tensor cores at bf16 rate) beats decoding them
    # again in every tile of the packed GEMM (~240-270 TFLOP/s at K3 shapes). Estimate per weight: decode + write +
    # read ~2.5 bytes at ~3.5 TB/s against 2 FLOPs per row at ~250 vs ~600 TFLOP/s: ~300 rows. Measured on the H200
    # (2ac0c97, bench/results/moe_h200.md): at 292 rows (K3's 896 experts, 16K tokens) the decoded path took
    # 82.8 ms vs ~78 packed; at 512 rows (K3-shaped e2e config, 2K tokens) it cut the prefill from 119 to 102 ms.
    DEQUANT_MIN_ROWS_PER_EXPERT = 384
    DEQUANT_CHUNK_BYTES = 2 << 30  # bf16 weights decoded at a time (a chunk of experts)

    def _dequantized_path(self, x, rows):
        return (x.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm") and (x.is_cuda or DEQUANT_ON_CPU)
                and rows >= self.DEQUANT_MIN_ROWS_PER_EXPERT * self.num_experts
                and not (x.is_cuda and torch.cuda.is_current_stream_capturing())  # it reads the bounds on the host
                and inference_kernels_enabled())

    def _forward_dequantized(self, x, order, offsets, k):
        """Same result layout as the packed GEMMs (fp32, row order[m] for sorted row m). Gate/up and down outputs
        are rounded to bf16 (torch._grouped_mm's output dtype) where the packed path keeps fp32: bf16-level
        differences. One host synchronisation (the chunk bounds): prefill only, never inside a decode graph."""
        G = _gemm_module()
        E, I, D = self.num_experts, self.intermediate_size, self.hidden_size
        out = torch.empty(order.numel(), D, device=x.device, dtype=torch.float32)
        bounds = offsets.tolist()
        per = max(1, self.DEQUANT_CHUNK_BYTES // (3 * I * D * 2))
        for e0 in range(0, E, per):
            e1 = min(E, e0 + per)
            r0, r1 = bounds[e0], bounds[e1]
            if r1 == r0:
                continue
            w1, w3, w2 = (G.dequantize_bf16(getattr(self, f"{n}_packed")[e0:e1], getattr(self, f"{n}_scale")[e0:e1])
                          for n in ("w1", "w3", "w2"))
            offs = offsets[e0 + 1:e1 + 1] - r0
            rows = order[r0:r1]
            xa = x[rows // k]
            h = self._act(torch._grouped_mm(xa, w1.transpose(1, 2), offs=offs),
                          torch._grouped_mm(xa, w3.transpose(1, 2), offs=offs)).to(x.dtype)
            out[rows] = torch._grouped_mm(h, w2.transpose(1, 2), offs=offs).float()
        return out

    def _forward_unsorted(self, x, topk_idx):
        """[T*k, D] fp32 outputs of the routes in topk_idx's order: row m = (token m // k, slot m % k). The kernels
        read each route's expert themselves, so nothing is sorted, gathered or scattered: the packed GEMM one route
        per program."""
        G = _gemm_module()
        M = topk_idx.numel()
        # one route per program: the mxfp4_grouped_gemm tiles of one row per expert, whatever the expert count
        tiles = self._mlp_tiles(G, M, M, True, x.device)
        bk_up, nib_up = tiles[:2]
        if bk_up and hasattr(G, "tile_state"):  # the ids and x in the gate+up tile's K order from one launch
            eids, ok, x = G.route_expert_ids(topk_idx, self.num_experts, x, bk_up, nib_up)
        else:
            eids, ok = G.route_expert_ids(topk_idx, self.num_experts)
            x = G.permute_k(x, bk_up, nib=nib_up) if bk_up else x.contiguous()
        torch._assert_async(ok, "topk_idx holds out-of-range experts")
        return self._expert_mlp(x, None, tiles, dict(expert_ids=eids, a_row_div=topk_idx.shape[1]),
                                dict(expert_ids=eids))

    def _forward_triton(self, x, order, offsets, k):
        x = x.contiguous()
        if self._dequantized_path(x, order.numel()):
            return self._forward_dequantized(x, order, offsets, k)
        G = _gemm_module()
        M = order.numel()
        tiles = self._mlp_tiles(G, M, self.num_experts, False, x.device)
        x = G.permute_k(x, tiles[0], nib=tiles[1]) if tiles[0] else x
        return self._expert_mlp(x, offsets, tiles, dict(a_rows=(order // k).to(torch.int32)),
                                dict(c_rows=order.to(torch.int32), num_c_rows=M))

    def _mlp_tiles(self, G, M, E, one_row, device):
        """(bk_up, nib_up, bk_dn, nib_dn, h_direct) for M routed rows over E experts (one_row: one row per program,
        `expert_ids`): the K order each default tile reads (`kperm_tile`: its BK if it takes pre-permuted
        activations, else 0; nib: the order of the Gluon kernel's table-free decode) and whether gate+up writes h
        straight in the down tile's order. The tile choice is cached per call shape and `tile_state` (a decode step
        asks once); the table-free check has its own cache (`_table_free_ok`)."""
        state = G.tile_state(device) if hasattr(G, "tile_state") else None
        key = (M, E, one_row, state)
        tiles = self._tiles.get(key) if state is not None else None
        if tiles is None:
            I, D = self.intermediate_size, self.hidden_size
            tiles = G.kperm_tile(M, E, I, D, "out", row_expert=one_row), G.kperm_tile(M, E, D, I, row_expert=one_row)
            if state is not None:
                if len(self._tiles) >= 256:  # row counts that keep changing (prefill lengths): start over
                    self._tiles.clear()
                self._tiles[key] = tiles
        (bk_up, wg_up), (bk_dn, wg_dn) = tiles
        # the table-free decode is the Gluon tiles' (where every scale exponent is <= 128: checked where one runs)
        free = (wg_up or wg_dn) and self._table_free_ok()
        nib_up, nib_dn = bool(bk_up) and wg_up and free, bool(bk_dn) and wg_dn and free
        # where both GEMMs are Gluon tiles, gate+up writes h straight in the down tile's K order (no copy)
        h_direct = self._fused is not None and bool(bk_dn) and wg_dn and wg_up and hasattr(G, "kperm_position")
        return bk_up, nib_up, bk_dn, nib_dn, h_direct

    def _expert_mlp(self, x, offsets, tiles, up_rows, down_rows):
        """down(GLU(gate, up)) of the routed rows through the packed GEMMs; x in the K order of `tiles`
        (`_mlp_tiles`), whose activations (x, then h) the K-permuted tiles load contiguously instead of gathering
        pairs of columns in every n-tile; `up_rows` / `down_rows` say how rows map to experts, inputs and outputs
        (the kernels' keyword arguments)."""
        G = _gemm_module()
        bk_up, nib_up, bk_dn, nib_dn, h_direct = tiles
        # the GLU runs in the gate+up epilogue whenever the kernel knows it: K3's SiTU too, at every tile height
        # since the K-permuted BM=128 tiles (H200, 19b363b: 16,384 tokens 63.2 ms fused vs 83.2 ms unfused)
        up = dict(b_packed=self.w3_packed, b_scale=self.w3_scale, dual="out", a_kperm=bk_up, a_nib=nib_up,
                  **up_rows)
        if self._fused is not None:
            h = G.mxfp4_grouped_gemm(x, self.w1_packed, self.w1_scale, offsets, act=self._fused[0],
                                     act_params=self._fused[1:] or (1.0, 1.0), out_dtype=x.dtype,
                                     c_kperm=bk_dn if h_direct else 0, c_nib=nib_dn, **up)
        else:
            gu = G.mxfp4_grouped_gemm(x, self.w1_packed, self.w1_scale, offsets, **up)
            I = self.intermediate_size
            h = self._act(gu[:, :I], gu[:, I:]).to(x.dtype)
        if bk_dn and not h_direct:
            h = G.permute_k(h, bk_dn, nib=nib_dn)
        return G.mxfp4_grouped_gemm(h, self.w2_packed, self.w2_scale, offsets, a_kperm=bk_dn, a_nib=nib_dn,
                                    **down_rows)

    def _up_input(self, G, x, M, E, one_row=False):
        """(x, a_kperm, a_nib) for the gate+up GEMM of M rows: x copied into the K order of its default tile
        where it takes pre-permuted activations (`_mlp_tiles`), else x as given (a_kperm = 0)."""
        bk, nib = self._mlp_tiles(G, M, E, one_row, x.device)[:2]
        return (G.permute_k(x, bk, nib=nib) if bk else x), bk, nib

    def _table_free_ok(self):
        """Whether every scale exponent is <= 128, the range of the Gluon kernel's table-free decode (K3's
        checkpoint: about 2^-8, exponent ~119). Checked once per version of the scale buffers (a host sync); while
        a CUDA graph is being captured an unchecked version gets the table decode instead. KIMI3_MXFP4_TABLE_FREE=0
        (read at every call, for A/B timing) keeps the table decode."""
        if env("KIMI3_MXFP4_TABLE_FREE", "1").strip() in ("0", ""):
            return False
        b = self._buffers  # not through Module.__getattr__: this runs at every decode step
        scales = (b["w1_scale"], b["w3_scale"], b["w2_scale"])
        key = [(s.data_ptr(), s._version) for s in scales]
        if self._table_free_key != key:
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                return False
            self._table_free = _gemm_module().scales_fit_table_free(*scales)
            self._table_free_key = key
        return self._table_free

    def _backward_triton(self, x, topk_w, dy, order, offsets, k, need_dx=True):
        G = _gemm_module()
        I = self.intermediate_size
        order32 = order.to(torch.int32)
        tok = (order // k).to(torch.int32)
        # d out_pair / d h (unweighted): dy_tok @ W2_e, W2 stored [D, I] and used untransposed
        dh_unw = G.mxfp4_grouped_gemm(dy, self.w2_packed, self.w2_scale, offsets, trans_w=True, a_rows=tok)
        # recompute the pre-activations instead of keeping [M, 2I] fp32 alive between forward and backward, with x
        # in the K order of the forward's tiles where they take it (as _expert_mlp does)
        xk, bk_up, nib_up = self._up_input(G, x.contiguous(), order.numel(), self.num_experts)
        gu = G.mxfp4_grouped_gemm(xk, self.w1_packed, self.w1_scale, offsets, a_rows=tok, dual="out",
                                  b_packed=self.w3_packed, b_scale=self.w3_scale, a_kperm=bk_up, a_nib=nib_up)
        with torch.enable_grad():
            g = gu[:, :I].detach().requires_grad_()
            u = gu[:, I:].detach().requires_grad_()
            h = self._act(g, u)
        dw_sorted = (dh_unw * h.detach().to(x.dtype).float()).sum(-1)
        w_sorted = topk_w.reshape(-1).float()[order]
        dw = torch.empty_like(dw_sorted).index_copy_(0, order, dw_sorted)
        if not need_dx:
            return None, dw
        dg, du = torch.autograd.grad(h, (g, u), dh_unw * w_sorted[:, None])
        dx = G.mxfp4_grouped_gemm(dg, self.w1_packed, self.w1_scale, offsets, trans_w=True, dual="in", a2=du,
                                  b_packed=self.w3_packed, b_scale=self.w3_scale, c_rows=order32,
                                  num_c_rows=order.numel())
        return dx, dw


def weight_memory_bytes(num_experts, hidden_size, intermediate_size, dtype=None):
    """Bytes of one layer's routed expert weights: packed MXFP4 (dtype=None) or dense `dtype`."""
    n = 3 * num_experts * hidden_size * intermediate_size
    if dtype is None:
        return n // 2 + n // GROUP_SIZE
    return n * torch.tensor([], dtype=dtype).element_size()


__all__ = [
    "GROUP_SIZE", "E2M1_VALUES", "check_mxfp4", "dequantize_mxfp4", "quantize_mxfp4", "pack_fp4_codes",
    "unpack_fp4_codes", "silu_glu", "SiTUGLU", "fused_act_spec", "PackedMXFP4Experts", "kernel_path",
    "kernel_status", "weight_memory_bytes",
]
