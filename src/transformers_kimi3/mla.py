"""Gated Multi-head Latent Attention with NoPE (K3) / plain MLA (Kimi Linear).

No rotary anywhere: the `qk_rope_head_dim` slice of `kv_a_proj_with_mqa` is a key part shared by all heads.
The cache keeps only the latent [normalised c_kv | k_pe]; keys and values are expanded from it when attending.
"""

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.bias import CausalBias, causal_lower_right

from .norms import Kimi3RMSNorm

# Moonshot's MLA builds q_a_layernorm / kv_a_layernorm without an eps argument (SPEC 0.3)
MLA_LATENT_NORM_EPS = 1e-6


class Kimi3KVBProj(nn.Linear):
    """kv_b_proj [H*(nope+v), r]. Besides expanding latents, its forward folds the weight into queries
    (`fold="k"`: q_nope -> latent space) and outputs (`fold="v"`: latent -> v), so that every use of the weight
    goes through this module's forward (offloading hooks)."""

    def __init__(self, rank, num_heads, nope, v_dim):
        super().__init__(rank, num_heads * (nope + v_dim), bias=False)
        self.num_heads, self.nope, self.v_dim = num_heads, nope, v_dim

    def forward(self, x, fold=None):
        if fold is None:
            return super().forward(x)
        w = self.weight.view(self.num_heads, self.nope + self.v_dim, -1)
        if fold == "k":
            return torch.einsum("bhtn,hnr->bhtr", x, w[:, : self.nope])
        return torch.einsum("bhtr,hvr->bhtv", x, w[:, self.nope:])


class Kimi3MLAAttention(nn.Module):
    # decode and speculative verification (up to 15 candidates + 1) read the cache; longer calls expand it
    ABSORB_MAX_QUERIES = 16
    KEY_BLOCK = 131072  # cached positions expanded at once by a prefill chunk over a long cache

    def __init__(self, config, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = H = config.num_attention_heads
        self.nope, self.rope, self.v_dim = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        self.kv_lora_rank = config.kv_lora_rank
        self.scaling = (self.nope + self.rope) ** -0.5
        d = config.hidden_size
        if config.q_lora_rank is None:
            self.q_proj = nn.Linear(d, H * (self.nope + self.rope), bias=False)
        else:
            self.q_a_proj = nn.Linear(d, config.q_lora_rank, bias=False)
            self.q_a_layernorm = Kimi3RMSNorm(config.q_lora_rank, eps=MLA_LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(config.q_lora_rank, H * (self.nope + self.rope), bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(d, self.kv_lora_rank + self.rope, bias=False)
        self.kv_a_layernorm = Kimi3RMSNorm(self.kv_lora_rank, eps=MLA_LATENT_NORM_EPS)
        self.kv_b_proj = Kimi3KVBProj(self.kv_lora_rank, H, self.nope, self.v_dim)
        if config.mla_use_output_gate:
            self.g_proj = nn.Linear(d, H * self.v_dim, bias=False)
        self.o_proj = nn.Linear(H * self.v_dim, d, bias=False)

    def forward(self, x, mask=None, cache=None, output_attentions=False, context_parallel=None):
        """x [B,T,d]; mask: bool [B,1,T,T_total] (True = attend) or None for causal attention over the cache;
        context_parallel: the forward's `context_parallel.Pieces` when x is one piece of the sequence (no mask, no
        cache): the latents of every earlier piece are gathered, and the queries attend causally with their offset.
        Returns the output [B,T,d]; with output_attentions, (output, probabilities [B,H,T,T_total] in x's dtype)."""
        B, T, _ = x.shape
        H = self.num_heads
        q = self.q_proj(x) if hasattr(self, "q_proj") else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(B, T, H, self.nope + self.rope).transpose(1, 2)
        c_kv, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope], dim=-1)
        latent = torch.cat([self.kv_a_layernorm(c_kv), k_pe], dim=-1)
        if cache is not None:
            latent = cache.update_latent(latent, self.layer_idx)
        elif context_parallel is not None:
            latent = context_parallel.gather_keys(latent)
        Tk = latent.shape[1]
        probs = None
        if output_attentions:
            o, probs = self._with_probs(q, latent, mask, T)
        # an adapter-wrapped kv_b_proj (PEFT) cannot be folded: it decodes in the expanded form
        elif cache is not None and T <= self.ABSORB_MAX_QUERIES and Tk > T and type(self.kv_b_proj) is Kimi3KVBProj:
            o = self._absorbed(q, latent, mask)
        else:
            o = self._expanded(q, latent, mask, T)
        o = o.transpose(1, 2).reshape(B, T, H * self.v_dim)
        if hasattr(self, "g_proj"):
            o = o * torch.sigmoid(self.g_proj(x))
        return self.o_proj(o) if probs is None else (self.o_proj(o), probs.to(x.dtype))

    def _with_probs(self, q, latent, mask, T):
        """(output, probabilities [B,H,T,Tk]) for output_attentions: keys and values expanded over the whole cache,
        scores and softmax in fp32, so masked keys get exactly 0 and the output is the probabilities times v."""
        k, v = self._expand(latent)
        scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * self.scaling
        mask = _causal(mask, T, latent.shape[1])
        if isinstance(mask, CausalBias):
            mask = mask._materialize(q.device)
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        probs = scores.softmax(-1)
        return torch.matmul(probs, v.float()).to(v.dtype), probs

    def _expanded(self, q, latent, mask, T):
        """Keys and values expanded per head from the latent (prefill: every position is queried). A long cache
        is expanded KEY_BLOCK positions at a time (bounded memory, 32-bit indexing inside the attention kernel)."""
        Tk = latent.shape[1]
        if mask is None and Tk - T > self.KEY_BLOCK and not torch.is_grad_enabled():
            return self._blockwise(q, latent, T)
        k, v = self._expand(latent)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=_causal(mask, T, Tk), scale=self.scaling)

    def _expand(self, latent):
        B, Tk, H = latent.shape[0], latent.shape[1], self.num_heads
        c_kv, k_pe = latent.split([self.kv_lora_rank, self.rope], dim=-1)
        kv = self.kv_b_proj(c_kv).view(B, Tk, H, self.nope + self.v_dim).transpose(1, 2)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        return torch.cat([k_nope, k_pe[:, None].expand(B, H, Tk, self.rope)], dim=-1), v

    def _blockwise(self, q, latent, T):
        """Causal attention of the last T positions over a long unpadded cache: the cached prefix in blocks that
        every query sees whole, then the chunk itself (causal), merged by their log-sum-exp."""
        Tk = latent.shape[1]
        bounds = list(range(0, Tk - T, self.KEY_BLOCK)) + [Tk - T, Tk]
        out = lse = None
        for s, e in zip(bounds[:-1], bounds[1:]):
            k, v = self._expand(latent[:, s:e])
            o_b, l_b = _attention_lse(q, k, v, e == Tk, self.scaling)
            if out is None:
                out, lse = o_b, l_b
            else:
                new = torch.logaddexp(lse, l_b)
                out = out * torch.exp(lse - new) + o_b * torch.exp(l_b - new)
                lse = new
        return out.to(q.dtype)

    def _absorbed(self, q, latent, mask):
        """Decode: kv_b_proj folded into the query and the output, so attention runs over the cached latent
        itself (one shared 576-wide key and 512-wide value) instead of re-expanding every cached position.
        Two batched matmuls over all heads' queries read the latent once; an attention kernel would treat each
        head as its own 576-wide problem and read the cache once per head."""
        B, H, T, _ = q.shape
        r = self.kv_lora_rank
        q_nope, q_pe = q.split([self.nope, self.rope], dim=-1)
        q_lat = torch.cat([self.kv_b_proj(q_nope, fold="k"), q_pe], dim=-1)  # [B, H, T, r + rope]
        scores = torch.matmul(q_lat.reshape(B, H * T, -1), latent.transpose(1, 2)).float() * self.scaling
        scores = scores.view(B, H, T, -1)
        mask = _causal(mask, T, latent.shape[1])
        if mask is not None:
            if isinstance(mask, CausalBias):  # lower-right causal (speculative verification)
                mask = mask._materialize(q.device)
            scores = scores.masked_fill(~mask, float("-inf"))
        probs = scores.softmax(-1).to(latent.dtype).view(B, H * T, -1)
        o_lat = torch.matmul(probs, latent[..., :r]).view(B, H, T, r)
        return self.kv_b_proj(o_lat, fold="v")


def _attention_lse(q, k, v, causal, scale):
    """Attention output (fp32) and its log-sum-exp [..., T, 1]; `causal` for a square block."""
    T = q.shape[2]
    if q.is_cuda:
        o, lse = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal,
                                                                          scale=scale)[:2]
        return o.float(), lse[..., :T, None].float()
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if causal:
        s = s.masked_fill(torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    lse = s.logsumexp(-1, keepdim=True)
    return torch.matmul(torch.exp(s - lse), v.float()), lse


def _causal(mask, T, Tk):
    """No explicit mask means causal over the cache: the T queries are the last T of the Tk keys. A lower-right
    causal bias is never materialised, so a chunk of a long prompt does not build a [T, Tk] mask."""
    if mask is not None or T == 1:
        return mask
    return causal_lower_right(T, Tk)


def mla_mask(attention_mask, query_length, past_length, device, seq_idx=None):
    """Causal + padding mask [B,1,T,past+T] as booleans, or None when plain causal attention suffices.
    `seq_idx` [B,T] (packed documents, no cache) keeps attention inside each document.
    Every query may attend itself, so padded query rows never turn into NaN (their outputs are unused)."""
    total = past_length + query_length
    if seq_idx is not None:
        pos = torch.arange(query_length, device=device)
        allowed = (pos[None, :, None] >= pos[None, None, :]) & (seq_idx[:, :, None] == seq_idx[:, None, :])
        if attention_mask is not None:
            allowed = allowed & attention_mask.bool()[:, None, :]
        return (allowed | torch.eye(query_length, dtype=torch.bool, device=device))[:, None]
    if attention_mask is None:  # no padding: causal attention, applied without a mask tensor
        return None
    if attention_mask.shape[-1] != total:
        raise ValueError(f"attention_mask covers {attention_mask.shape[-1]} positions, but the cache holds "
                         f"{past_length} and this call adds {query_length}")
    qpos = torch.arange(past_length, total, device=device)[:, None]
    kpos = torch.arange(total, device=device)[None, :]
    allowed = (kpos <= qpos)[None] & attention_mask.bool()[:, None, :]
    allowed = allowed | (kpos == qpos)[None]
    return allowed[:, None]


def custom_mla_mask(attention_mask, query_length, past_length, device):
    """A caller's 4-D mask [B,1,T,past+T] as MLA's boolean mask (True = attend). Boolean masks are read as they are;
    float masks are additive, as Transformers' mask functions make them: 0 attends, a large negative value (the
    dtype's minimum, -inf, -1e4 or below) blocks. A query row that attends nothing attends itself, so it never turns
    into NaN (its output has no valid keys and means nothing)."""
    total = past_length + query_length
    B = attention_mask.shape[0]
    if attention_mask.shape[1:] != (1, query_length, total):
        raise ValueError(f"attention_mask is 4-D with shape {list(attention_mask.shape)}; a 4-D mask must be "
                         f"[batch, 1, query_length, key_length] = [{B}, 1, {query_length}, {total}] (the cache holds "
                         f"{past_length} positions and this call adds {query_length})")
    if attention_mask.dtype == torch.bool:
        allowed = attention_mask
    elif attention_mask.is_floating_point():
        allowed = attention_mask == 0
        if not bool((allowed | (attention_mask <= -1e4)).all()):
            raise ValueError("attention_mask is a 4-D float mask holding values other than 0 (attend) and a large "
                             "negative value (block): additive biases are not supported; pass a boolean mask "
                             "(True = attend) or 0 / dtype-minimum values")
    else:
        raise ValueError(f"attention_mask is a 4-D {attention_mask.dtype} mask: pass booleans (True = attend) or "
                         "an additive float mask (0 = attend, the dtype's minimum = blocked)")
    allowed = allowed.to(device)
    qpos = torch.arange(past_length, total, device=device)[:, None]
    diag = torch.arange(total, device=device)[None, :] == qpos
    return allowed | (diag & ~allowed.any(-1, keepdim=True))
