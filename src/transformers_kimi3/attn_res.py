"""Block Attention Residuals: a softmax over earlier block summaries replaces the residual stream.

Each aggregation point owns a pseudo-query (`*_res_proj`, Linear d->1, checkpoint shape [1, d]) and an RMSNorm
(`*_res_norm`) whose gain multiplies the query; sources are RMS-normalised for the scores only and mixed raw, in
fp32 (SPEC 0.6 and 4). The modules keep the checkpoint's names on the layers; this is the math.
"""

import torch


def attn_res_mix(bank, partial, proj, norm):
    """bank [B,T,n,d] (n >= 1 completed blocks), partial [B,T,d] or None -> mix [B,T,d] in bank's dtype."""
    sources = bank if partial is None else torch.cat([bank, partial[:, :, None].to(bank.dtype)], dim=2)
    v = sources.float()
    keys = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    query = norm.weight.float() * proj.weight[0].float()
    weights = torch.softmax(keys @ query, dim=-1)
    return (weights[..., None] * v).sum(2).to(bank.dtype)
