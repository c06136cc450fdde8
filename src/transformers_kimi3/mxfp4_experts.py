"""Routed experts kept as packed MXFP4 in memory (`mxfp4.py` has the format), forward and backward with respect to
the activations and the routing weights; the packed weights are frozen buffers.

    y[t] = sum_j w[t, j] * W2_e down(GLU(W1_e x[t], W3_e x[t])),   e = topk_idx[t, j]

Which code computes it:
- bf16 / fp16 activations on CUDA with Triton: the grouped GEMM of `kimi3_kernels.mxfp4` (one launch per projection
  for all experts, MXFP4 decoded in registers, bf16 operands, fp32 sums), reached through
  `kernels.mxfp4_ops()`; up to `UNSORTED_MAX_ROUTES` routes without autograd straight from topk_idx, one route per
  program; from `DEQUANT_MIN_ROWS_PER_EXPERT` rows per expert (prefill) the experts decoded to bf16 in chunks for
  `torch._grouped_mm`.
- fp32 activations (the kernels' operands are bf16), or no kernels: exact fp32 arithmetic on the exactly decoded
  weights, one expert at a time over the routes sorted by expert; on CUDA without autograd, up to
  `GATHER_MAX_ROUTES` routes (and any number inside a CUDA graph capture) read each route's expert instead, which
  needs no host synchronisation.
"""

import torch
from torch import nn

from . import kernels
from .activations import GLUActivation
from .mxfp4 import E8M0_BIAS, GROUP_SIZE, check_mxfp4, decode_mxfp4, quantize_mxfp4
from .mxfp8 import check_activation_format, fake_quantize_mxfp8, mxfp8_values

_PROJECTIONS = ("w1", "w3", "w2")  # gate, up, down


def _route(topk_idx, num_experts, sync_ok):
    """Sort (token, slot) pairs by expert: (order [M] pair index per sorted row, expert_offsets int32 [E+1])."""
    flat = topk_idx.reshape(-1)
    _check_routes(flat, num_experts, sync_ok)
    sorted_e, order = torch.sort(flat, stable=True)
    grid = torch.arange(num_experts + 1, device=flat.device, dtype=sorted_e.dtype)
    offsets = torch.searchsorted(sorted_e, grid).to(torch.int32)
    return order, offsets


def _check_routes(flat, num_experts, sync_ok):
    if sync_ok:
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= num_experts):
            raise ValueError(f"topk_idx holds expert indices outside [0, {num_experts})")
    else:
        torch._assert_async(((flat >= 0) & (flat < num_experts)).all(), "topk_idx holds out-of-range experts")


def _combine(pairs_out, topk_w, T, k, dtype):
    """sum_k w[t, k] * out[t, k] in fp32 -> dtype."""
    D = pairs_out.shape[-1]
    return torch.bmm(topk_w.float().reshape(T, 1, k), pairs_out.view(T, k, D)).view(T, D).to(dtype)


def _capturing(x):
    return x.is_cuda and torch.cuda.is_current_stream_capturing()


class _PackedExpertsFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, topk_w, topk_idx, mod, ops):
        T, k = topk_idx.shape
        order, offsets = _route(topk_idx, mod.num_experts, sync_ok=ops is None)
        with kernels.on_device(x):
            if ops is not None:
                o = mod._forward_kernels(ops, x, order, offsets, k)
            else:
                o = mod._forward_torch(x, order, offsets, k)
        ctx.mod, ctx.k, ctx.ops = mod, k, ops
        ctx.save_for_backward(x, topk_w, order, offsets)
        return _combine(o, topk_w, T, k, x.dtype)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        x, topk_w, order, offsets = ctx.saved_tensors
        mod, k, ops = ctx.mod, ctx.k, ctx.ops
        with kernels.on_device(x):
            if ops is not None:
                dx_pairs, dw_pairs = mod._backward_kernels(ops, x, topk_w, dy.contiguous(), order, offsets, k,
                                                           ctx.needs_input_grad[0])
            else:
                dx_pairs, dw_pairs = mod._backward_torch(x, topk_w, dy.contiguous(), order, offsets, k,
                                                         ctx.needs_input_grad[0])
        T = topk_w.shape[0]
        dx = dx_pairs.view(T, k, -1).sum(1).to(x.dtype) if dx_pairs is not None else None
        dw = dw_pairs.view(T, k).to(topk_w.dtype) if ctx.needs_input_grad[1] else None
        return dx, dw, None, None, None



def _own_precision(fn):
    """The PyTorch expert paths compute in fp32 from the decoded weights (h rounded to x's dtype) whatever autocast
    is active: under bf16 autocast their matmuls would otherwise return bf16 into the fp32 buffers."""
    def wrapped(self, x, *args, **kwargs):
        with torch.autocast(x.device.type, enabled=False):
            return fn(self, x, *args, **kwargs)
    wrapped.__name__, wrapped.__doc__ = fn.__name__, fn.__doc__
    return wrapped

class PackedMXFP4Experts(nn.Module):
    """E routed experts y = sum_k w_k W2_e act(W1_e x, W3_e x), weights kept as MXFP4 exactly as on disk.

    Buffers (stacked over experts, compressed-tensors layout): w1_packed [E, I, D/2], w1_scale [E, I, D/32] (gate),
    w3_packed / w3_scale (up, same shapes), w2_packed [E, D, I/2], w2_scale [E, D, I/32] (down).
    `glu_act(gate, up)` receives fp32 and returns fp32: a `GLUActivation` (default SiLU-GLU), which the kernels fuse
    into the gate+up GEMM from its `spec`, or any other callable, which runs in PyTorch between the GEMMs. The GLU
    output is rounded to x's dtype before the down projection; expert outputs and the weighted sum are fp32; the
    result has x's dtype. Gradients flow to x and to the routing weights; the packed weights are frozen.
    With `activation_format` "mxfp8" (W4A8) the GEMMs read x and the rounded GLU output quantised to MXFP8
    (`mxfp8.py`): without autograd on the kernels' device (FP8-capable GPUs), bf16 activations are quantised by the
    kernel quantiser and their MXFP8 values, exact in bf16, go through the bf16-activation kernels (`_MXFP8_GEMM`);
    fp16 activations run the FP8 x FP8 kernels (`w4a8.py`); either way the same codes and scales as the emulation,
    fp32 sums of exact products in another order. fp32 activations and training (gradients straight through the
    quantiser) take the exact fp32 paths on the fake-quantised values.
    """

    # Without autograd, up to this many routes (2 tokens at K3's top-16) skip sorting: the packed GEMM runs one route
    # per program with its expert read from topk_idx (1 token: 0.19 vs 0.22 ms sorted; from 8 tokens slower).
    UNSORTED_MAX_ROUTES = 32
    # Without the kernels (fp32, or no Triton) on CUDA and without autograd, up to this many routes decode each
    # route's expert (no host synchronisation; inside a graph capture always), in chunks of decoded fp32 weights.
    GATHER_MAX_ROUTES = 32
    GATHER_CHUNK_BYTES = 1 << 30
    # Prefill: at this many routed rows per expert (mean) and above, an expert's weights serve enough rows that
    # decoding them once to bf16 for torch._grouped_mm (tensor cores at bf16 rate) beats decoding them again in every
    # tile of the packed GEMM: ~300 rows by bandwidth and FLOP rates; at 512 rows per expert a K3-shaped prefill is
    # ~15% faster, at 292 the packed GEMMs still win (`bench/moe.py` on an H200).
    DEQUANT_MIN_ROWS_PER_EXPERT = 384
    DEQUANT_CHUNK_BYTES = 2 << 30  # bf16 weights decoded at a time (a chunk of experts)
    # How bf16 activations in MXFP8 meet the packed weights on the kernels. "values": the MXFP8 values in bf16 (exact)
    # through the bf16-activation kernels; "fp8": FP8 x FP8 tensor-core MMAs (`kimi3_kernels/mxfp4/w4a8.py`), which
    # fp16 activations always take (fp16's range cannot hold every MXFP8 value). On an H100 at K3's expert shapes the
    # FP8 kernels took 2.1x / 2.5x / 3.5x the bf16-activation kernels' time at 64 / 1,024 / 16,384 tokens (bench/moe.py
    # --w4a8, which sets this to time both).
    _MXFP8_GEMM = "values"

    def __init__(self, num_experts, hidden_size, intermediate_size, glu_act=None, device=None,
                 activation_format="bf16"):
        super().__init__()
        E, D, I = num_experts, hidden_size, intermediate_size
        if D % GROUP_SIZE or I % GROUP_SIZE:
            raise ValueError(f"MXFP4 experts need hidden ({D}) and intermediate ({I}) sizes divisible by {GROUP_SIZE}")
        self.num_experts, self.hidden_size, self.intermediate_size = E, D, I
        self.glu_act = glu_act if glu_act is not None else GLUActivation("silu")
        self.activation_format = check_activation_format(activation_format)
        self._fused = self.glu_act.spec if isinstance(self.glu_act, GLUActivation) else None
        self._table_free_key, self._table_free = None, False  # `_table_free_ok`'s answer and the buffers it is for
        self._tiles = {}  # `_mlp_tiles`
        self.merge_error = None  # the requantisation error of a LoRA merge (`expert_lora.merge_into_packed`)
        u8 = dict(dtype=torch.uint8, device=device)
        for name, (rows, cols) in (("w1", (I, D)), ("w3", (I, D)), ("w2", (D, I))):
            self.register_buffer(f"{name}_packed", torch.zeros(E, rows, cols // 2, **u8))
            self.register_buffer(f"{name}_scale", torch.full((E, rows, cols // GROUP_SIZE), E8M0_BIAS, **u8))

    def extra_repr(self):
        return (f"num_experts={self.num_experts}, hidden_size={self.hidden_size}, "
                f"intermediate_size={self.intermediate_size}, fused_glu={self._fused}")

    # ---- construction / conversion
    @classmethod
    def from_float(cls, w1, w3, w2, glu_act=None):
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
        act = glu_act if glu_act is not None else getattr(experts, "act_fn", None)
        return cls.from_float(experts.w1.detach(), experts.w3.detach(), experts.w2.detach(), act)

    def dequantize(self, dtype=torch.bfloat16):
        """(w1 [E, I, D], w3 [E, I, D], w2 [E, D, I]) in `dtype` (whole layer: for export / debugging)."""
        self.check()
        return tuple(decode_mxfp4(getattr(self, f"{n}_packed"), getattr(self, f"{n}_scale"), dtype)
                     for n in _PROJECTIONS)

    def check(self, prefix=""):
        """Validate every packed tensor (dtype, shapes, no 0xFF scale), naming the offending one."""
        for n in _PROJECTIONS:
            check_mxfp4(getattr(self, f"{n}_packed"), getattr(self, f"{n}_scale"), f"{prefix}{n}")

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        for n in _PROJECTIONS:  # refuse corrupt tensors (wrong dtype/shape, NaN scales) by name
            p, s = state_dict.get(f"{prefix}{n}_packed"), state_dict.get(f"{prefix}{n}_scale")
            for key, t in ((f"{prefix}{n}_packed", p), (f"{prefix}{n}_scale", s)):
                want = tuple(self._buffers[key[len(prefix):]].shape)
                if t is not None and tuple(t.shape) != want:
                    raise ValueError(f"{key}: shape {list(t.shape)} but these experts hold {list(want)} "
                                     f"({self.num_experts} experts, hidden {self.hidden_size}, intermediate "
                                     f"{self.intermediate_size})")
            if p is not None and s is not None:
                check_mxfp4(p, s, f"{prefix}{n}_packed/{prefix}{n}_scale")
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)

    @property
    def weight_bytes(self):
        return sum(b.numel() * b.element_size() for b in self.buffers())

    @property
    def qweight(self):
        """The gate projection's packed bytes (`w1_packed`): PEFT reads a quantised layer's device from its `qweight`
        when it places adapters (`expert_lora.PackedExpertsLoraLayer`); the module has no parameter to read it from."""
        return self.w1_packed

    # ---- path selection
    @property
    def kernel_path(self):
        """Which implementation bf16 activations run on the buffers' device: 'triton' or 'torch-per-expert'."""
        ops = kernels.mxfp4_ops()
        on = kernels.kernel_device(self.w1_packed) and ops is not None and ops.available(self.w1_packed.device)
        return "triton" if on else "torch-per-expert"

    def _kernels(self, x, grad=False):
        """The MXFP4 kernels (`kernels.mxfp4_ops()`) where they compute x's experts, else None: bf16 / fp16
        activations on a kernel device that holds the buffers. fp32 takes the exact paths: the GEMMs' operands
        are bf16. MXFP8 activations: forward only, on GPUs with FP8 tensor cores (`grad`: the exact paths)."""
        if (x.dtype not in (torch.bfloat16, torch.float16) or x.device != self.w1_packed.device
                or not kernels.kernel_device(x)):
            return None
        ops = kernels.mxfp4_ops()
        if ops is None or not ops.available(x.device):
            return None
        if self.activation_format == "mxfp8" and (grad or not ops.w4a8_available(x.device)):
            return None
        return ops

    # ---- forward
    def check_inputs(self, x, topk_idx, topk_w):
        """The routed inputs' shapes, checked before any kernel sees them (here and in expert_lora's forward)."""
        if x.dim() != 2 or x.shape[-1] != self.hidden_size:
            raise ValueError(f"x must be [T, {self.hidden_size}], got {tuple(x.shape)}")
        if topk_idx.shape != topk_w.shape or topk_idx.shape[0] != x.shape[0]:
            raise ValueError(f"topk_idx {tuple(topk_idx.shape)} / topk_w {tuple(topk_w.shape)} do not match x")

    def forward(self, x, topk_idx, topk_w):
        """x [T, D], topk_idx [T, k] long, topk_w [T, k] float -> [T, D] in x's dtype."""
        self.check_inputs(x, topk_idx, topk_w)
        if x.shape[0] == 0:
            return x.new_zeros(x.shape)
        T, k = topk_idx.shape
        grad = torch.is_grad_enabled() and (x.requires_grad or topk_w.requires_grad)
        ops = self._kernels(x, grad)
        if not grad and ops is not None and T * k <= self.UNSORTED_MAX_ROUTES and kernels.moe_ops is not None:
            # decode sizes: one launch per projection straight from topk_idx, nothing sorted
            with kernels.on_device(x):
                return kernels.moe_ops.combine_routes(self._forward_unsorted(ops, x, topk_idx), topk_w, x.dtype)
        if (not grad and ops is None and kernels.kernel_device(x)
                and (T * k <= self.GATHER_MAX_ROUTES or _capturing(x))):
            return self._forward_gathered(x, topk_idx, topk_w)
        return _PackedExpertsFunction.apply(x, topk_w, topk_idx, self, ops)

    def _act(self, g, u):
        return self.glu_act(g, u).float()

    def _gemm_input(self, a):
        """An activation as the GEMMs read it, in fp32: as given, or its MXFP8 values (`activation_format`)."""
        if self.activation_format == "mxfp8":
            a = fake_quantize_mxfp8(a, "routed expert activations")
        return a.float()

    def _fp8_gemm(self, dtype):
        """Whether the kernels read this dtype's activations as MXFP8 codes and scales (the FP8 x FP8 GEMMs)."""
        return self.activation_format == "mxfp8" and (dtype != torch.bfloat16 or self._MXFP8_GEMM == "fp8")

    def _mxfp8_in_bf16(self, ops, a, what):
        """`a` (bf16) replaced by its MXFP8 values where the bf16-activation kernels compute MXFP8 activations, else
        `a` as given. The quantiser works on the stored K order: call before any K permutation."""
        if self.activation_format != "mxfp8" or self._fp8_gemm(a.dtype):
            return a
        return mxfp8_values(*ops.quantize_mxfp8(a, what), a.dtype)

    def _expert(self, e, name, dtype=torch.float32):
        return decode_mxfp4(getattr(self, f"{name}_packed")[e], getattr(self, f"{name}_scale")[e], dtype)

    # ---- exact paths (fp32 arithmetic on the decoded weights)
    def _segments(self, order, offsets):
        bounds = offsets.tolist()
        for e in range(self.num_experts):
            if bounds[e + 1] > bounds[e]:
                yield e, order[bounds[e]:bounds[e + 1]]

    @_own_precision
    def _forward_torch(self, x, order, offsets, k):
        o = torch.empty(order.numel(), self.hidden_size, dtype=torch.float32, device=x.device)
        for e, pairs in self._segments(order, offsets):
            xe = self._gemm_input(x[pairs // k])
            h = self._gemm_input(self._act(xe @ self._expert(e, "w1").T, xe @ self._expert(e, "w3").T).to(x.dtype))
            o[pairs] = h @ self._expert(e, "w2").T
        return o

    @_own_precision
    def _forward_gathered(self, x, topk_idx, topk_w):
        """The routes in topk_idx's order, each with its expert decoded to fp32 (chunks of GATHER_CHUNK_BYTES):
        the arithmetic of `_forward_torch` without reading the expert bounds on the host."""
        T, k = topk_idx.shape
        flat = topk_idx.reshape(-1)
        _check_routes(flat, self.num_experts, sync_ok=not x.is_cuda)
        flat = flat.clamp(0, self.num_experts - 1)  # the check above reports a bad id; no index fault before it
        xs = self._gemm_input(x)[:, None].expand(T, k, self.hidden_size).reshape(T * k, self.hidden_size)
        out = torch.empty(flat.numel(), self.hidden_size, dtype=torch.float32, device=x.device)
        per = max(1, self.GATHER_CHUNK_BYTES // (3 * self.intermediate_size * self.hidden_size * 4))
        for m0 in range(0, flat.numel(), per):
            e, xe = flat[m0:m0 + per], xs[m0:m0 + per, :, None]
            w1, w3, w2 = (decode_mxfp4(getattr(self, f"{n}_packed")[e], getattr(self, f"{n}_scale")[e])
                          for n in _PROJECTIONS)
            h = self._gemm_input(self._act(torch.bmm(w1, xe)[..., 0], torch.bmm(w3, xe)[..., 0]).to(x.dtype))
            out[m0:m0 + per] = torch.bmm(w2, h[:, :, None])[..., 0]
        return _combine(out, topk_w, T, k, x.dtype)

    @_own_precision
    def _backward_torch(self, x, topk_w, dy, order, offsets, k, need_dx=True):
        M = order.numel()
        dx = torch.zeros(M, self.hidden_size, dtype=torch.float32, device=x.device)
        dw = torch.zeros(M, dtype=torch.float32, device=x.device)
        w_flat = topk_w.reshape(-1).float()
        for e, pairs in self._segments(order, offsets):
            tok = pairs // k
            xe = self._gemm_input(x[tok])
            w1, w3, w2 = self._expert(e, "w1"), self._expert(e, "w3"), self._expert(e, "w2")
            with torch.enable_grad():
                g = (xe @ w1.T).requires_grad_()
                u = (xe @ w3.T).requires_grad_()
                h = self._act(g, u)
            dh_unw = dy[tok].float() @ w2  # d out_pair / d h, before the routing weight
            dw[pairs] = (dh_unw * self._gemm_input(h.detach().to(x.dtype))).sum(-1)
            if need_dx:
                dg, du = torch.autograd.grad(h, (g, u), dh_unw * w_flat[pairs, None])
                dx[pairs] = dg @ w1 + du @ w3
        return (dx if need_dx else None), dw

    # ---- kernel paths (`ops` = kimi3_kernels.mxfp4)
    def _dequantized_path(self, x, rows):
        return (x.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm") and self.activation_format == "bf16"
                and rows >= self.DEQUANT_MIN_ROWS_PER_EXPERT * self.num_experts
                and not _capturing(x)  # it reads the chunk bounds on the host
                and kernels.inference_kernels_enabled())

    def _forward_dequantized(self, ops, x, order, offsets, k):
        """Same result layout as the packed GEMMs (fp32, row order[m] for sorted row m). Gate/up and down outputs
        are rounded to bf16 (torch._grouped_mm's output dtype) where the packed path keeps fp32: bf16-level
        differences. One host synchronisation (the chunk bounds): prefill only, never inside a decode graph."""
        E, I, D = self.num_experts, self.intermediate_size, self.hidden_size
        out = torch.empty(order.numel(), D, device=x.device, dtype=torch.float32)
        bounds = offsets.tolist()
        per = max(1, self.DEQUANT_CHUNK_BYTES // (3 * I * D * 2))
        for e0 in range(0, E, per):
            e1 = min(E, e0 + per)
            r0, r1 = bounds[e0], bounds[e1]
            if r1 == r0:
                continue
            w1, w3, w2 = (ops.dequantize_bf16(getattr(self, f"{n}_packed")[e0:e1],
                                              getattr(self, f"{n}_scale")[e0:e1]) for n in _PROJECTIONS)
            offs = offsets[e0 + 1:e1 + 1] - r0
            rows = order[r0:r1]
            xa = x[rows // k]
            h = self._act(torch._grouped_mm(xa, w1.transpose(1, 2), offs=offs),
                          torch._grouped_mm(xa, w3.transpose(1, 2), offs=offs)).to(x.dtype)
            out[rows] = torch._grouped_mm(h, w2.transpose(1, 2), offs=offs).float()
        return out

    def _forward_unsorted(self, ops, x, topk_idx):
        """[T*k, D] fp32 outputs of the routes in topk_idx's order: row m = (token m // k, slot m % k). The kernels
        read each route's expert themselves, so nothing is sorted, gathered or scattered: the packed GEMM one route
        per program, with the tiles of one row per expert whatever the expert count."""
        M = topk_idx.numel()
        x = self._mxfp8_in_bf16(ops, x, "routed expert activations")
        tiles = self._mlp_tiles(ops, M, M, True, x.device, x.dtype)
        bk_up, nib_up = tiles[:2]
        if bk_up:  # the ids and x in the gate+up tile's K order from one launch
            eids, ok, x = ops.route_expert_ids(topk_idx, self.num_experts, x, bk_up, nib_up)
        else:
            eids, ok = ops.route_expert_ids(topk_idx, self.num_experts)
            x = x.contiguous()
        torch._assert_async(ok, "topk_idx holds out-of-range experts")
        return self._expert_mlp(ops, x, None, tiles, dict(expert_ids=eids, a_row_div=topk_idx.shape[1]),
                                dict(expert_ids=eids))

    def _forward_kernels(self, ops, x, order, offsets, k):
        x = x.contiguous()
        if self._dequantized_path(x, order.numel()):
            return self._forward_dequantized(ops, x, order, offsets, k)
        M = order.numel()
        x = self._mxfp8_in_bf16(ops, x, "routed expert activations")
        tiles = self._mlp_tiles(ops, M, self.num_experts, False, x.device, x.dtype)
        x = ops.permute_k(x, tiles[0], nib=tiles[1]) if tiles[0] else x
        return self._expert_mlp(ops, x, offsets, tiles, dict(a_rows=(order // k).to(torch.int32)),
                                dict(c_rows=order.to(torch.int32), num_c_rows=M))

    def _mlp_tiles(self, ops, M, E, one_row, device, dtype):
        """(bk_up, nib_up, bk_dn, nib_dn, h_direct) for M routed rows over E experts (one_row: one row per program,
        `expert_ids`): the K order each default tile reads (`kperm_tile`: its BK if it takes pre-permuted
        activations, else 0; nib: the order of the Gluon kernel's table-free decode) and whether gate+up writes h
        straight in the down tile's order. The tile choice is cached per call shape and `tile_state` (a decode step
        asks once); the table-free check has its own cache (`_table_free_ok`)."""
        if self._fp8_gemm(dtype):  # the W4A8 kernel reads activations in stored K order
            return 0, False, 0, False, False
        key = (M, E, one_row, ops.tile_state(device))
        tiles = self._tiles.get(key)
        if tiles is None:
            I, D = self.intermediate_size, self.hidden_size
            tiles = (ops.kperm_tile(M, E, I, D, "out", row_expert=one_row),
                     ops.kperm_tile(M, E, D, I, row_expert=one_row))
            if len(self._tiles) >= 256:  # row counts that keep changing (prefill lengths): start over
                self._tiles.clear()
            self._tiles[key] = tiles
        (bk_up, wg_up), (bk_dn, wg_dn) = tiles
        # the table-free decode is the Gluon tiles' (where every scale exponent is <= 128: checked where one runs)
        free = (wg_up or wg_dn) and self._table_free_ok(ops)
        nib_up, nib_dn = bool(bk_up) and wg_up and free, bool(bk_dn) and wg_dn and free
        # where both GEMMs are Gluon tiles, gate+up writes h straight in the down tile's K order (no copy); not when
        # h is quantised to MXFP8 first (its 32-value blocks are in the stored order)
        h_direct = (self._fused is not None and bool(bk_dn) and wg_dn and wg_up
                    and self.activation_format != "mxfp8")
        return bk_up, nib_up, bk_dn, nib_dn, h_direct

    def _expert_mlp(self, ops, x, offsets, tiles, up_rows, down_rows):
        """down(GLU(gate, up)) of the routed rows through the packed GEMMs; x in the K order of `tiles`
        (`_mlp_tiles`), whose activations (x, then h) the K-permuted tiles load contiguously instead of gathering
        pairs of columns in every n-tile; `up_rows` / `down_rows` say how rows map to experts, inputs and outputs
        (the kernels' keyword arguments). A GLUActivation runs in the gate+up epilogue at every tile height."""
        bk_up, nib_up, bk_dn, nib_dn, h_direct = tiles
        dtype, a8 = x.dtype, {}
        if self._fp8_gemm(dtype):  # W4A8: both GEMMs read MXFP8 codes and scales (stored K order)
            x, scale = ops.quantize_mxfp8(x, "routed expert activations")
            a8 = dict(a_scale=scale)
        up = dict(b_packed=self.w3_packed, b_scale=self.w3_scale, dual="out", a_kperm=bk_up, a_nib=nib_up,
                  **up_rows, **a8)
        if self._fused is not None:
            h = ops.mxfp4_grouped_gemm(x, self.w1_packed, self.w1_scale, offsets, act=self._fused[0],
                                       act_params=self._fused[1:], out_dtype=dtype,
                                       c_kperm=bk_dn if h_direct else 0, c_nib=nib_dn, **up)
        else:
            gu = ops.mxfp4_grouped_gemm(x, self.w1_packed, self.w1_scale, offsets, **up)
            I = self.intermediate_size
            h = self._act(gu[:, :I], gu[:, I:]).to(dtype)
        h = self._mxfp8_in_bf16(ops, h, "routed expert activations (GLU output)")
        if bk_dn and not h_direct:
            h = ops.permute_k(h, bk_dn, nib=nib_dn)
        if a8:
            h, scale = ops.quantize_mxfp8(h, "routed expert activations (GLU output)")
            a8 = dict(a_scale=scale)
        return ops.mxfp4_grouped_gemm(h, self.w2_packed, self.w2_scale, offsets, a_kperm=bk_dn, a_nib=nib_dn,
                                      **down_rows, **a8)

    def _up_input(self, ops, x, M, E, one_row=False):
        """(x, a_kperm, a_nib) for the gate+up GEMM of M rows: x copied into the K order of its default tile
        where it takes pre-permuted activations (`_mlp_tiles`), else x as given (a_kperm = 0)."""
        bk, nib = self._mlp_tiles(ops, M, E, one_row, x.device, x.dtype)[:2]
        return (ops.permute_k(x, bk, nib=nib) if bk else x), bk, nib

    def _table_free_ok(self, ops):
        """Whether every scale exponent is <= 128, the range of the Gluon kernel's table-free decode (K3's
        checkpoint: about 2^-8, exponent ~119). Checked once per version of the scale buffers (a host sync); while
        a CUDA graph is being captured an unchecked version gets the table decode instead."""
        if not ops.table_free_enabled():
            return False
        b = self._buffers  # not through Module.__getattr__: this runs at every decode step
        scales = (b["w1_scale"], b["w3_scale"], b["w2_scale"])
        key = [(s.data_ptr(), s._version) for s in scales]
        if self._table_free_key != key:
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                return False
            self._table_free = ops.scales_fit_table_free(*scales)
            self._table_free_key = key
        return self._table_free

    def _backward_kernels(self, ops, x, topk_w, dy, order, offsets, k, need_dx=True):
        I = self.intermediate_size
        order32 = order.to(torch.int32)
        tok = (order // k).to(torch.int32)
        # d out_pair / d h (unweighted): dy_tok @ W2_e, W2 stored [D, I] and used untransposed
        dh_unw = ops.mxfp4_grouped_gemm(dy, self.w2_packed, self.w2_scale, offsets, trans_w=True, a_rows=tok)
        # recompute the pre-activations instead of keeping [M, 2I] fp32 alive between forward and backward, with x
        # in the K order of the forward's tiles where they take it (as _expert_mlp does)
        xk, bk_up, nib_up = self._up_input(ops, x.contiguous(), order.numel(), self.num_experts)
        gu = ops.mxfp4_grouped_gemm(xk, self.w1_packed, self.w1_scale, offsets, a_rows=tok, dual="out",
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
        dx = ops.mxfp4_grouped_gemm(dg, self.w1_packed, self.w1_scale, offsets, trans_w=True, dual="in", a2=du,
                                    b_packed=self.w3_packed, b_scale=self.w3_scale, c_rows=order32,
                                    num_c_rows=order.numel())
        return dx, dw


__all__ = ["PackedMXFP4Experts"]
