"""Per-Head Muon: Muon (momentum orthogonalised by a Newton-Schulz iteration) applied to each attention head's block
and to each routed expert on its own, AdamW for embeddings, the output head and everything that is not a matrix.
A head or an expert is a function of its own: orthogonalised alone, each gets an update of the same RMS, however
small its gradient is next to its neighbours' in the same stacked matrix.

`build_per_head_muon(model, lr)` sorts a model's trainable parameters (`muon_layouts`) and returns a `PerHeadMuon`.
Modules are recognised by their attributes, so the classes of a saved folder's remote code match too. A head's block
is the rows it owns in a projection's output or the columns it owns in o_proj's input; H heads, head size K (KDA),
nope / rope / v the MLA head's parts:

- Muon per head, output rows:
  KDA `q_proj`, `k_proj`, `v_proj`, `g_proj` (the output gate; `g_b_proj` when the gate is low-rank) [H*K, .]: K rows;
  MLA `q_b_proj` (`q_proj` without q LoRA) [H*(nope+rope), .]: nope+rope rows (the head's q_nope, then its q_pe);
  MLA `kv_b_proj` [H*(nope+v), r_kv]: nope+v rows (the head's k_nope, then its v: one block holds both);
  MLA `g_proj` (gated MLA's output gate) [H*v, d]: v rows.
- Muon per head, input columns: KDA `o_proj` [d, H*K]: K columns; MLA `o_proj` [d, H*v]: v columns.
- Muon per expert: stacked routed experts `w1`, `w3` [E, I, D] and `w2` [E, D, I]: each [I, D] / [D, I] matrix.
- Muon on the whole matrix: every other 2-D weight: the dense MLP, the shared experts, the latent projections
  `routed_expert_down_proj` / `routed_expert_up_proj`, the router `gate.weight`, the KDA forget gate `f_a_proj` /
  `f_b_proj`, `b_proj` and `g_a_proj`, MLA `q_a_proj` and `kv_a_proj_with_mqa`, the vision tower's and projector's
  matrices, LoRA's A and B.
- AdamW: the input embeddings, `lm_head`, the AttnRes pseudo-queries `*_res_proj` ([1, d]), and everything that is
  not 2-D: norm gains, biases, `A_log`, `dt_bias`, the KDA convs [D, 1, W], the vision conv and position embedding.

Parameters with `requires_grad=False` are left out (layer 0's unused AttnRes pair, LoRA base weights); packed MXFP4
experts are buffers, not parameters, and never reach an optimizer.

The Muon step of a parameter with momentum buffer B and gradient G:

    B <- momentum * B + G;   M = G + momentum * B (nesterov) or B
    each block M_i of M:     U_i = NS5(M_i) * 0.2 * sqrt(max(rows_i, cols_i))
    p <- p * (1 - lr * weight_decay) - lr * U

NS5 is the quintic Newton-Schulz iteration in bf16 (coefficients 3.4445, -4.7750, 2.0315; the block divided by its
Frobenius norm first and transposed when it has more rows than columns), which maps a block's singular values to
about 1. The factor 0.2 * sqrt(max(rows, cols)) gives the block an update RMS of about 0.2, that of AdamW's update
(Moonshot's rule, "Muon is Scalable for LLM Training"), so Muon and AdamW parameters share one learning rate and one
weight decay. AdamW is torch.optim.AdamW's arithmetic (decoupled decay, bias correction), with decay on the
embeddings, `lm_head`, convs and AttnRes queries and none on parameters of fewer than 2 dimensions.

State (a `momentum_buffer` per Muon parameter; `exp_avg`, `exp_avg_sq` and a CPU fp32 `step` per AdamW parameter)
is kept in the parameter's dtype, as torch's optimizers keep it; the Newton-Schulz step runs in bf16 whatever that dtype is. Each
group carries its layout (`algorithm`, `blocks`, `block_size`) and its parameters' names, so `state_dict()` /
`load_state_dict()` restore everything and the continuation is bit-identical.

Sharded parameters (FSDP2's `fully_shard`, any DTensor): the momentum stays sharded. When every rank's shard holds
whole blocks (the blocks split the sharded dim, and the shard size is a multiple of the block size: a routed expert
is one index of dim 0, so `w1` / `w2` / `w3` sharded on dim 0 always qualify; a `rows` head block does when
ceil(rows / world) is a multiple of its size), each rank orthogonalises its own blocks: no communication, and the
iteration's work is divided among the ranks. Otherwise (`whole` matrices, `cols` heads under FSDP2's dim-0 sharding,
head blocks cut by a shard boundary) the combined momentum M is gathered (`full_tensor()`), every rank
orthogonalises the whole matrix and keeps its own shard of the update (`distribute_tensor(..., src_data_rank=None)`:
no second communication): one all-gather per such parameter and step. The choice depends only on the global shape,
the layout and the mesh, so every rank takes the same path. AdamW runs on the shards as they are. Sharding
replaces the parameters: build the optimizer after `fully_shard` (Accelerate's FSDP2 preparation, which Trainer
uses, switches an optimizer built before to the sharded parameters itself).
"""

import math
from collections import namedtuple

import torch
from torch import nn

from .dtensors import full_tensor as _full  # a module name of its own: tests count the gathers through it
from .dtensors import is_dtensor, shard_like

__all__ = ["PerHeadMuon", "build_per_head_muon", "muon_layouts", "newton_schulz", "Layout"]

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_EPS = 1e-7
# An orthogonalised block times RMS_MATCH * sqrt(max(rows, cols)) has an RMS of about RMS_MATCH, AdamW's typical one
RMS_MATCH = 0.2

# algorithm: "muon" or "adamw"; blocks: "rows" / "cols" (heads of block_size output rows / input columns), "experts"
# (dim 0 of a stacked weight), "whole" (the matrix), or None (AdamW)
Layout = namedtuple("Layout", ["algorithm", "blocks", "block_size"])
ADAMW = Layout("adamw", None, None)
WHOLE = Layout("muon", "whole", None)
EXPERTS = Layout("muon", "experts", None)


# ----------------------------------------------------------------------------- Newton-Schulz and the blocks
def newton_schulz(m, steps=5):
    """Orthogonalise every matrix of m [..., rows, cols]: `steps` quintic Newton-Schulz steps in bf16. Returns bf16."""
    a, b, c = NS_COEFFICIENTS
    x = m.to(torch.bfloat16)
    tall = x.shape[-2] > x.shape[-1]
    if tall:
        x = x.mT
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + NS_EPS)
    for _ in range(steps):
        A = x @ x.mT
        B = b * A + c * (A @ A)
        x = a * x + B @ x
    return x.mT if tall else x


def to_blocks(t, layout):
    """t (the parameter's shape) -> [n, rows, cols]: the matrices Muon orthogonalises one by one."""
    if layout.blocks == "rows":
        return t.reshape(-1, layout.block_size, t.shape[-1])
    if layout.blocks == "cols":
        return t.reshape(t.shape[0], -1, layout.block_size).transpose(0, 1)
    if layout.blocks == "experts":
        return t
    return t[None]


def from_blocks(blocks, layout, shape):
    if layout.blocks == "cols":
        return blocks.transpose(0, 1).reshape(shape)
    return blocks.reshape(shape)


def muon_update(m, layout, ns_steps=5):
    """The fp32 update of a momentum m (a full tensor): NS5 of each block, scaled by 0.2 * sqrt(max(rows, cols))."""
    blocks = to_blocks(m, layout)
    scale = RMS_MATCH * math.sqrt(max(blocks.shape[-2:]))
    return from_blocks(newton_schulz(blocks, ns_steps).float() * scale, layout, m.shape)


# ----------------------------------------------------------------------------- sharded (DTensor) parameters
def _local_blocks(t, layout):
    """Whether each rank's shard of DTensor t holds whole blocks of `layout`, so the blocks can be orthogonalised
    where they are. Decided from the global shape, the placements and the mesh alone: the same on every rank."""
    from torch.distributed.tensor import Replicate, Shard

    block_dim, size = {"rows": (0, layout.block_size), "cols": (1, layout.block_size), "experts": (0, 1)}.get(
        layout.blocks, (None, None))
    if block_dim is None:
        return False
    sharded = [(mesh_dim, pl) for mesh_dim, pl in enumerate(t.placements) if not isinstance(pl, Replicate)]
    if len(sharded) != 1 or type(sharded[0][1]) is not Shard or sharded[0][1].dim != block_dim:
        return False
    mesh_dim = sharded[0][0]
    chunk = -(-t.shape[block_dim] // t.device_mesh.size(mesh_dim))  # torch.chunk's shard size (DTensor, FSDP2)
    return chunk % size == 0


def _update(m, layout, ns_steps, p):
    """The Muon update of momentum m laid out as parameter p: on each rank's own blocks when the shards hold whole
    blocks, else from the gathered matrix (module docstring)."""
    if is_dtensor(m) and _local_blocks(m, layout):
        local = muon_update(m.to_local(), layout, ns_steps).to(p.dtype)
        return type(m).from_local(local, m.device_mesh, m.placements, run_check=False, shape=m.shape,
                                  stride=m.stride())
    return shard_like(muon_update(_full(m), layout, ns_steps).to(p.dtype), p)


# ----------------------------------------------------------------------------- sorting a model's parameters
def _own_weight(module, name):
    """The `weight` Parameter that the child `name` holds itself (a LoRA wrapper holds none: its base layer does)."""
    child = getattr(module, name, None)
    return None if not isinstance(child, nn.Module) else child._parameters.get("weight")


def _attention_layouts(module):
    """{parameter: Layout} of one KDA or MLA module's per-head projections; {} for any other module."""
    if hasattr(module, "A_log") and hasattr(module, "head_dim"):  # KDA
        K = module.head_dim
        rows = {n: Layout("muon", "rows", K) for n in ("q_proj", "k_proj", "v_proj", "g_proj", "g_b_proj")}
        spec = {**rows, "o_proj": Layout("muon", "cols", K)}
    elif hasattr(module, "kv_b_proj") and hasattr(module, "v_dim"):  # MLA
        nope, rope, v = module.nope, module.rope, module.v_dim
        spec = {"q_proj": Layout("muon", "rows", nope + rope), "q_b_proj": Layout("muon", "rows", nope + rope),
                "kv_b_proj": Layout("muon", "rows", nope + v), "g_proj": Layout("muon", "rows", v),
                "o_proj": Layout("muon", "cols", v)}
    else:
        return {}
    weights = {n: _own_weight(module, n) for n in spec}
    return {w: spec[n] for n, w in weights.items() if w is not None}


def _expert_layouts(module):
    """Stacked routed experts (w1, w3 [E, I, D], w2 [E, D, I] Parameters): one block per expert."""
    ws = [module._parameters.get(n) for n in ("w1", "w2", "w3")]
    if all(w is not None and w.dim() == 3 for w in ws):
        return dict.fromkeys(ws, EXPERTS)
    return {}


def _adamw_matrices(model):
    """2-D parameters that take AdamW: embeddings, the output head, the AttnRes pseudo-queries."""
    found = set()
    for getter in ("get_input_embeddings", "get_output_embeddings"):
        module = getattr(model, getter, lambda: None)()
        if isinstance(module, nn.Module) and module._parameters.get("weight") is not None:
            found.add(module._parameters["weight"])
    for module in model.modules():
        if isinstance(module, nn.Embedding) or type(module).__name__ == "Kimi3AttnResProj":
            found.update(p for p in module._parameters.values() if p is not None)
    return found


def muon_layouts(model):
    """{name: Layout} for every trainable parameter of `model`, in `named_parameters()` order."""
    special = {}
    for module in model.modules():
        special.update(_attention_layouts(module))
        special.update(_expert_layouts(module))
    adamw = _adamw_matrices(model)
    out = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if p in special:
            out[name] = special[p]
        elif p in adamw or p.dim() != 2:
            out[name] = ADAMW
        else:
            out[name] = WHOLE
    return out


def build_per_head_muon(model, lr, weight_decay=0.1, momentum=0.95, nesterov=True, ns_steps=5, adamw_lr=None,
                        adamw_betas=(0.9, 0.95), adamw_eps=1e-8):
    """A `PerHeadMuon` over `model`'s trainable parameters, sorted by `muon_layouts` (see the module docstring).
    One group per (layout, weight decay); AdamW groups take `adamw_lr` (default: `lr`, which the RMS-matching scale
    makes right for both)."""
    params = dict(model.named_parameters())
    groups = {}
    for name, layout in muon_layouts(model).items():
        p = params[name]
        decay = weight_decay if layout.algorithm == "muon" or p.dim() >= 2 else 0.0
        group = groups.setdefault((layout, decay), dict(
            params=[], algorithm=layout.algorithm, blocks=layout.blocks, block_size=layout.block_size,
            weight_decay=decay, lr=lr if layout.algorithm == "muon" or adamw_lr is None else adamw_lr))
        group["params"].append((name, p))
    return PerHeadMuon(list(groups.values()), lr=lr, weight_decay=weight_decay, momentum=momentum,
                       nesterov=nesterov, ns_steps=ns_steps, betas=adamw_betas, eps=adamw_eps)


# ----------------------------------------------------------------------------- the optimizer
class PerHeadMuon(torch.optim.Optimizer):
    """Muon per block for the groups with `algorithm="muon"`, AdamW for those with `algorithm="adamw"` (see the module
    docstring). A group's `blocks` is "whole" (default), "rows" / "cols" (heads of `block_size` output rows / input
    columns) or "experts" (one block per index of dim 0 of a 3-D weight). `build_per_head_muon` makes the groups for
    a Kimi model; hand-made groups are checked here (shapes, divisibility), naming the parameter."""

    def __init__(self, params, lr=1e-3, weight_decay=0.1, momentum=0.95, nesterov=True, ns_steps=5,
                 betas=(0.9, 0.95), eps=1e-8):
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov, ns_steps=ns_steps,
                        betas=betas, eps=eps, algorithm="muon", blocks="whole", block_size=None)
        super().__init__(params, defaults)
        for group in self.param_groups:
            _check_group(group)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            update = self._muon if group["algorithm"] == "muon" else self._adamw
            for p in group["params"]:
                if p.grad is not None:
                    update(p, group)
        return loss

    def _muon(self, p, group):
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p)
        buf = state["momentum_buffer"]
        buf.mul_(group["momentum"]).add_(p.grad)
        m = p.grad.add(buf, alpha=group["momentum"]) if group["nesterov"] else buf
        layout = Layout("muon", group["blocks"], group["block_size"])
        update = _update(m, layout, group["ns_steps"], p)
        p.mul_(1 - group["lr"] * group["weight_decay"])
        p.add_(update, alpha=-group["lr"])

    def _adamw(self, p, group):
        """torch.optim.AdamW's single-tensor arithmetic, step for step."""
        state = self.state[p]
        if "step" not in state:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(p)
            state["exp_avg_sq"] = torch.zeros_like(p)
        beta1, beta2 = group["betas"]
        lr, g = group["lr"], p.grad
        state["step"] += 1
        step = state["step"].item()
        p.mul_(1 - lr * group["weight_decay"])
        state["exp_avg"].lerp_(g, 1 - beta1)
        state["exp_avg_sq"].mul_(beta2).addcmul_(g, g, value=1 - beta2)
        denom = (state["exp_avg_sq"].sqrt() / (1 - beta2 ** step) ** 0.5).add_(group["eps"])
        p.addcdiv_(state["exp_avg"], denom, value=-lr / (1 - beta1 ** step))


def _check_group(group):
    names = group.get("param_names") or [f"parameter {i}" for i in range(len(group["params"]))]
    if group["algorithm"] not in ("muon", "adamw"):
        raise ValueError(f"algorithm must be 'muon' or 'adamw', got {group['algorithm']!r}")
    if group["algorithm"] == "adamw":
        return
    for name, p in zip(names, group["params"]):
        _check_blocks(name, tuple(p.shape), group["blocks"], group["block_size"])


def _check_blocks(name, shape, blocks, size):
    want = {"whole": 2, "rows": 2, "cols": 2, "experts": 3}.get(blocks)
    if want is None:
        raise ValueError(f"{name}: blocks must be 'whole', 'rows', 'cols' or 'experts', got {blocks!r}")
    if len(shape) != want:
        raise ValueError(f"{name}: Muon with blocks={blocks!r} needs a {want}-D weight, got shape {list(shape)}; "
                         "put it in an AdamW group (algorithm='adamw')")
    dim = {"rows": 0, "cols": 1}.get(blocks)
    if dim is not None and (not size or shape[dim] % size):
        raise ValueError(f"{name}: dim {dim} of shape {list(shape)} does not split into heads of {size}")
