"""Kimi Delta Attention: q/k/v projections -> short causal convs + SiLU -> gated delta rule -> per-head gated
RMSNorm -> o_proj. The delta rule runs on the backend `kernels.resolve_kda_backend` picks (config `kda_backend`)."""

import torch
import torch.nn.functional as F
from torch import nn

from . import kernels
from .kernels import resolve_kda_backend  # also what Transformers' remote-code scan follows to copy kernels.py
from .norms import Kimi3GatedRMSNorm

_LAST_PACKING = ()


def packing(mask, seq_idx):
    """(idx, cu_seqlens) that pack a [B, T] batch into one row: idx = the flat positions of its valid tokens (None when
    every token is valid), cu_seqlens = the bounds of the sequences they form. Without seq_idx every row is one
    sequence (empty ones included, so initial states keep one row each); with it every (row, document) run is one.

    Every KDA layer of a forward gets the same mask / seq_idx tensors, and building the plan reads them on the host
    (nonzero waits for the stream), so the last plan is reused while the same, unchanged tensors come back (identity
    and version counter; the reference kept here stops their ids from being reused). The kernels then also find the
    same cu_seqlens tensor and reuse their chunk tables."""
    global _LAST_PACKING
    # inference-mode tensors keep no version counter, so in-place changes would go unseen: no reuse for them
    cacheable = not any(t is not None and t.is_inference() for t in (mask, seq_idx))
    key = tuple(None if t is None else t._version for t in (mask, seq_idx)) if cacheable else None
    last = _LAST_PACKING
    if cacheable and last and last[0] is mask and last[1] is seq_idx and last[2] == key:
        return last[3]
    if seq_idx is None:
        flat = mask.reshape(-1).bool()
        idx = flat.nonzero().squeeze(1)
        cu = F.pad(mask.bool().sum(-1).cumsum(0), (1, 0)).to(torch.int32)
    else:
        B, T = seq_idx.shape
        valid = None if mask is None else mask.reshape(-1).bool()
        doc = (seq_idx - seq_idx.amin(1, keepdim=True)) + torch.arange(B, device=seq_idx.device)[:, None] * (T + 1)
        doc = doc.reshape(-1) if valid is None else doc.reshape(-1)[valid]
        starts = torch.ones_like(doc, dtype=torch.bool)
        starts[1:] = doc[1:] != doc[:-1]
        cu = F.pad(starts.nonzero().flatten(), (0, 1), value=doc.numel()).to(torch.int32)
        idx = None if valid is None else valid.nonzero().squeeze(1)
    plan = (idx, cu)
    _LAST_PACKING = (mask, seq_idx, key, plan) if cacheable else ()
    return plan


def causal_conv(x, weight, state=None, seq_idx=None):
    """Depthwise causal conv + SiLU. x [B,T,D], weight [D,1,W], state [B,D,W] (last W inputs) or None.
    `seq_idx` [B,T] (packed documents): taps never reach into another document.
    Returns (y [B,T,D], new state [B,D,W])."""
    B, T, D = x.shape
    W = weight.shape[-1]
    if seq_idx is not None:
        w = weight[:, 0].to(x.dtype)  # [D, W]; tap W-1 is the current token
        y = x * w[:, W - 1]
        for s in range(1, min(W, T)):
            same = (seq_idx[:, s:] == seq_idx[:, :-s])[..., None]
            y = y + F.pad((x[:, :-s] * same) * w[:, W - 1 - s], (0, 0, s, 0))
        return F.silu(y.float()).to(x.dtype), None
    xt = x.transpose(1, 2)
    prev = xt.new_zeros(B, D, W) if state is None else state.to(xt.dtype)
    full = torch.cat([prev, xt], dim=-1)  # [B, D, W+T]: the state's last W inputs, then this call's
    # y_t = sum_j w_j full_{t+1+j}: the taps summed in fp32 and rounded once to the weight's dtype, as a conv in that
    # dtype would; the same on every device (cuDNN would round fp32 inputs to TF32 on the GPU)
    f, w = full.to(weight.dtype).float(), weight[:, 0, :, None].float()
    y = f[:, :, 1:T + 1] * w[:, 0]
    for j in range(1, W):
        y = y + f[:, :, 1 + j:T + 1 + j] * w[:, j]
    return F.silu(y.to(weight.dtype)).to(x.dtype).transpose(1, 2), full[..., -W:].contiguous()


def kda_state_after(gate, state, k, v, g, beta, out=None):
    """The recurrent state [B, H, K, V] (fp32) after the gated delta rule runs from `state` over k, v, g [B, T, H, K]
    and beta [B, T, H] (the recurrence inputs a KDA layer computed; `gate` = its A_log, dt_bias, lower_bound and
    backend): the state a layer reaches after those T tokens, for `Kimi3Cache.crop` and `Kimi3Cache.keep_rows`. The
    outputs depend on q, which the state does not: k stands in for it. A position whose raw gate g is -inf and whose
    raw beta is -inf leaves the state exactly as it is (decay exp(0) = 1, update 0): that is how a row skips the
    positions it does not keep. `out` (contiguous fp32, the shape of `state`): the result is written there in place
    (it may be `state` itself), so a recorded CUDA graph can hold the call."""
    A_log, dt_bias, lower_bound, backend = gate
    if backend == "fla":  # our recurrent kernel (the same math) is the one whose -inf handling is known
        backend = "triton" if kernels.kda_ops is not None and k.is_cuda else "torch"
    if out is None:
        out = state.clone().float().contiguous()
    elif out is not state:
        out.copy_(state)
    _, final = kernels.kda_recurrent(k, k, v, g, beta, backend, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound,
                                     initial_state=out, output_final_state=True, use_qk_l2norm_in_kernel=True,
                                     inplace_final_state=True)
    if final is not out:
        out.copy_(final)
    return out


class Kimi3ShortConv(nn.Conv1d):
    """Depthwise causal conv (checkpoint shape [D, 1, W]); its weight is read only in its own forward, so
    Accelerate's offload hooks see every use."""

    def __init__(self, channels, kernel_size):
        super().__init__(channels, channels, kernel_size, groups=channels, padding=kernel_size - 1, bias=False)

    def forward(self, x, state=None, seq_idx=None, kernel=False):
        if kernel:  # inference with our Triton kernels: one launch, the same math
            with kernels.on_device(x):
                return kernels.kda_ops.short_conv(x, self.weight, state)
        return causal_conv(x, self.weight, state, seq_idx)


def _plain_weights(mods, x, rows):
    """The weights of these modules, if one `kernels.linear_ops` launch may stand in for their calls: each a plain
    bias-free nn.Linear (not a subclass: quantised or LoRA layers compute something else) with no hooks and no
    replaced forward (Accelerate's offloading), its weight an ordinary contiguous tensor in x's dtype on x's device;
    few rows; on CUDA only while a CUDA graph is captured: there launches cost nothing and one fused kernel beats the
    separate GEMMs, while in an eager step its many launch arguments cost more host time than the cuBLAS calls.
    Else None."""
    linears = kernels.linear_ops
    if (linears is None or rows > linears.MAX_ROWS or not kernels.inference_kernels_enabled()
            or (x.is_cuda and not torch.cuda.is_current_stream_capturing())
            or nn.modules.module._global_forward_hooks or nn.modules.module._global_forward_pre_hooks):
        return None
    ws = []
    for m in mods:
        w = m._parameters.get("weight")
        if (type(m) is not nn.Linear or w is None or m._parameters.get("bias") is not None or m._forward_hooks
                or m._forward_pre_hooks or "forward" in m.__dict__ or type(w) is not nn.Parameter
                or w.dtype != x.dtype or w.device != x.device or not w.is_contiguous()):
            return None
        ws.append(w)
    return ws


class Kimi3DeltaAttention(nn.Module):
    """KDA: q/k/v projections -> short causal convs + SiLU -> gated delta rule -> per-head gated RMSNorm -> o_proj.
    Tensor names are the checkpoint's (separate q/k/v convs, f_a/f_b gate, b_proj, g_proj or g_a/g_b)."""

    def __init__(self, config, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = H = config.kda_num_heads
        self.head_dim = K = config.kda_head_dim
        self.lower_bound = config.gate_lower_bound
        self.requested_backend = config.kda_backend
        D, W, d = H * K, config.conv_kernel_size, config.hidden_size
        self.q_proj = nn.Linear(d, D, bias=False)
        self.k_proj = nn.Linear(d, D, bias=False)
        self.v_proj = nn.Linear(d, D, bias=False)
        self.q_conv1d = Kimi3ShortConv(D, W)
        self.k_conv1d = Kimi3ShortConv(D, W)
        self.v_conv1d = Kimi3ShortConv(D, W)
        self.f_a_proj = nn.Linear(d, K, bias=False)
        self.f_b_proj = nn.Linear(K, D, bias=False)
        self.b_proj = nn.Linear(d, H, bias=False)
        self.A_log = nn.Parameter(torch.empty(H, dtype=torch.float32))  # per head (SPEC 0.1)
        self.dt_bias = nn.Parameter(torch.empty(D, dtype=torch.float32))
        if config.use_full_rank_gate:
            self.g_proj = nn.Linear(d, D, bias=False)
        else:
            self.g_a_proj = nn.Linear(d, K, bias=False)
            self.g_b_proj = nn.Linear(K, D, bias=False)
        self.o_norm = Kimi3GatedRMSNorm(K, eps=config.rms_norm_eps)
        self.o_proj = nn.Linear(D, d, bias=False)

    def forward(self, x, attention_mask=None, cache=None, seq_idx=None, context_parallel=None):
        """x [B,T,d]; attention_mask [B,T] (1 = token) for this call's positions, or None when every one is a token
        (the model decides that once per forward: checking here would wait for the GPU in every layer); seq_idx
        [B,T] document ids of packed sequences (training; no cache) or None; context_parallel: the forward's
        `context_parallel.Pieces` when x is one piece of the sequence (no mask, no cache), else None."""
        B, T, _ = x.shape
        H, K = self.num_heads, self.head_dim
        if attention_mask is not None:  # padding never enters the convs (zero input = the convs' own padding)
            x = x * attention_mask[..., None].to(x.dtype)
        if seq_idx is not None and cache is not None:
            raise ValueError("Packed sequences (position_ids restarting inside a row) are for training; "
                             "they cannot be combined with a cache")
        states = cache.conv_states[self.layer_idx] if cache is not None else None
        h0 = cache.recurrent_states[self.layer_idx] if cache is not None else None
        record = cache is not None and cache.record_past  # keep what a rollback (cache.crop) needs
        # a speculation round (Kimi3Cache.begin_round): the inputs of every position go to the round's record, so
        # that keep_rows can keep a different number of them per row; the tokens run through the recurrent kernel,
        # as single decode steps do
        in_round = cache is not None and cache.in_round
        backend = resolve_kda_backend(x.device, self.requested_backend)
        ours = backend in ("triton", "fla_chunk") and not torch.is_grad_enabled() and kernels.inference_kernels_enabled()
        if (ours and not record and not in_round and states is not None and h0 is not None and T <= 4
                and attention_mask is None and all(s.is_contiguous() for s in states)):  # updated in place by the conv kernel
            return self._fused_decode(x, states, h0)
        states = states or (None, None, None)
        kernel = ours and seq_idx is None
        xq, xk, xv = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        g = self.f_b_proj(self.f_a_proj(x)).view(B, T, H, K)
        beta = self.b_proj(x)
        if context_parallel is not None:  # the previous rank's conv inputs and final state
            states, h0, tracked = self._receive(context_parallel, (xq, xk, xv), g, beta)
        q, sq = self.q_conv1d(xq, states[0], seq_idx, kernel)
        k, sk = self.k_conv1d(xk, states[1], seq_idx, kernel)
        v, sv = self.v_conv1d(xv, states[2], seq_idx, kernel)
        q, k, v = (t.view(B, T, H, K) for t in (q, k, v))
        if record:
            W = self.q_conv1d.weight.shape[-1]
            before = tuple(s if s is not None else t.new_zeros(B, H * K, W) for s, t in zip(states, (xq, xk, xv)))
            h_before = h0 if h0 is not None else torch.zeros(B, H, K, K, dtype=torch.float32, device=x.device)
            cache.record_kda(self.layer_idx, (self.A_log, self.dt_bias, self.lower_bound, backend), before, h_before,
                             (xq, xk, xv), (k, v, g, beta), padded=attention_mask is not None)
        if in_round:
            cache.record_round(self.layer_idx, (self.A_log, self.dt_bias, self.lower_bound, backend), (xq, xk, xv),
                               (k, v, g, beta), self.q_conv1d.weight.shape[-1], attention_mask)

        kw = dict(A_log=self.A_log, dt_bias=self.dt_bias, lower_bound=self.lower_bound,
                  initial_state=h0, output_final_state=cache is not None or context_parallel is not None,
                  use_qk_l2norm_in_kernel=True)
        if seq_idx is not None or attention_mask is not None:
            o, ht = self._packed(q, k, v, g, beta, attention_mask, seq_idx, backend, kw)
        elif h0 is not None and cache is not None and (T <= 4 or in_round):  # decode / speculative verification
            o, ht = kernels.kda_recurrent(q, k, v, g, beta, backend, **kw)
        else:
            o, ht = kernels.kda_chunk(q, k, v, g, beta, backend, **kw)
        if context_parallel is not None:  # to the next rank: the state after this piece and its last conv inputs
            o = context_parallel.send(o, (ht, sq[..., 1:], sk[..., 1:], sv[..., 1:]), tracked)
        if cache is not None:
            cache.update_kda_state(self.layer_idx, (sq, sk, sv), ht.float())

        gate = self.g_proj(x) if hasattr(self, "g_proj") else self.g_b_proj(self.g_a_proj(x))
        o = self.o_norm(o, gate.view(B, T, H, K)).reshape(B, T, H * K)
        return self.o_proj(o)

    def _receive(self, pieces, xs, g, beta):
        """Context parallel: (conv states, h0, tracked) to continue the previous rank's piece: its last W - 1 inputs
        of each conv (as a [B, D, W] conv state) and its final state [B, H, K, V] fp32; zeros (None) on the first
        rank. `tracked` are the tensors this rank's message depends on besides the previous rank's message (the
        three convs' inputs, the k / v conv weights, the gate, beta, A_log, dt_bias): alike on every rank, they
        decide whether the message's gradient is sent back (`context_parallel._anchor`)."""
        B, _, D = xs[0].shape
        H, K, W = self.num_heads, self.head_dim, self.q_conv1d.weight.shape[-1]
        tracked = (*xs, g, beta, self.A_log, self.dt_bias, self.k_conv1d.weight, self.v_conv1d.weight)
        got = pieces.receive([(B, H, K, K)] + [(B, D, W - 1)] * 3, xs[0], tracked)
        if got is None:
            return (None, None, None), None, tracked
        h0, *halo = got
        return tuple(F.pad(t, (1, 0)).to(xs[0].dtype) for t in halo), h0, tracked

    def _fused_decode(self, x, states, h0):
        """Decode / verification with a cache (inference): the three convs in one launch and the output norm in
        one, conv and recurrent states updated in place. Same math as the general path (tests/kernels_kda_cases.py);
        it only saves launches, which dominate a graph-replayed decode step at small batch."""
        B, T, _ = x.shape
        H, K = self.num_heads, self.head_dim
        ops = kernels.kda_ops
        with kernels.on_device(x):
            q, k, v, beta, g, gate = self._decode_projections(x)
            q, k, v = ops.short_conv_update(
                (q, k, v), states, (self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight))
            inplace = h0.dtype == torch.float32 and h0.is_contiguous()
            o, ht = ops.fused_recurrent_kda(
                q.view(B, T, H, K), k.view(B, T, H, K), v.view(B, T, H, K), g.view(B, T, H, K), beta,
                A_log=self.A_log, dt_bias=self.dt_bias, lower_bound=self.lower_bound, initial_state=h0,
                output_final_state=True, use_qk_l2norm_in_kernel=True, inplace_final_state=inplace)
            if not inplace:
                h0.copy_(ht)
            o = ops.gated_rms_norm(o, gate.view(B, T, H, K), self.o_norm.weight,
                                           self.o_norm.variance_epsilon)
        return self.o_proj(o.reshape(B, T, H * K))

    def _decode_projections(self, x):
        """q, k, v [B, T, H*K], beta [B, T, H] and the gates' pre-activations of a decode step. Where
        `_plain_weights` allows (plain nn.Linear modules; on CUDA inside a graph capture), two launches of
        `kernels.linear_ops`: the six that read x, then the gates' second halves; else the modules' own calls
        (seven or eight launches)."""
        B, T, _ = x.shape
        full = hasattr(self, "g_proj")
        first = (self.q_proj, self.k_proj, self.v_proj, self.b_proj, self.f_a_proj,
                 self.g_proj if full else self.g_a_proj)
        second = (self.f_b_proj,) if full else (self.f_b_proj, self.g_b_proj)
        ws = _plain_weights(first + second, x, B * T)
        if ws is None:
            gate = self.g_proj(x) if full else self.g_b_proj(self.g_a_proj(x))
            return (self.q_proj(x), self.k_proj(x), self.v_proj(x), self.b_proj(x), self.f_b_proj(self.f_a_proj(x)),
                    gate)
        linears = kernels.linear_ops.linears
        q, k, v, beta, fa, ga = linears((x,) * 6, ws[:6], check=False)  # _plain_weights checked them
        if full:
            (g,), gate = linears((fa,), ws[6:], check=False), ga
        else:
            g, gate = linears((fa, ga), ws[6:], check=False)
        return q, k, v, beta, g, gate

    @staticmethod
    def _packed(q, k, v, g, beta, mask, seq_idx, backend, kw):
        """Documents packed in rows (seq_idx), or padded rows (mask only): every (row, document) run of valid tokens
        becomes its own sequence of one packed row with cu_seqlens, so pads and neighbours never touch its state."""
        B, T = (seq_idx if seq_idx is not None else mask).shape
        idx, cu = packing(mask, seq_idx)
        pack = lambda t: (t.reshape(B * T, *t.shape[2:]) if idx is None  # noqa: E731
                          else t.reshape(B * T, *t.shape[2:]).index_select(0, idx))[None]
        o, ht = kernels.kda_chunk(pack(q), pack(k), pack(v), pack(g), pack(beta), backend, cu_seqlens=cu, **kw)
        if idx is None:
            return o.view(B, T, *o.shape[2:]), ht
        out = o.new_zeros(B * T, *o.shape[2:]).index_copy(0, idx, o[0])
        return out.view(B, T, *o.shape[2:]), ht
