"""Fine-tuning helpers: Quantile Balancing (SPEC 6) as a Trainer callback, expert-load statistics, the padding-free
collator settings.

Quantile Balancing keeps the routed experts balanced without an auxiliary loss. Each MoE layer's router selects its
top-k experts on `sigmoid(logits) + e_score_correction_bias`; after every optimizer step the bias moves so that, on
the tokens of that step, every expert would receive exactly its share q = m*k/n:

    mu_ij   = s_ij + b_j - alpha_ij                     (margin; > 0 exactly when j is in token i's top-k)
    c_j     = (q+1)-th largest of mu_.j                 (the expert's quantile)
    b_j    <- b_j - rate * c_j                           (rate 1 is SPEC's update)

The token cutoff alpha_ij is the k-th largest s_il + b_l over the *other* experts l != j: the (k+1)-th largest
overall for the experts in the token's top-k (SPEC 6's alpha_i, so overloaded experts move exactly as SPEC says) and
the k-th largest for the others, i.e. how far an expert is from entering the top-k. SPEC's literal alpha_i = (k+1)-th
largest gives every token's (k+1)-th expert a margin of exactly 0, so an underloaded expert's quantile is often 0
and its bias does not move: on the skewed test problem of tests/test_quantile_balancing.py max/mean load is still
1.15-1.2 after 20 steps with it, against < 1.1 from step 3 with the per-expert cutoff (`margin="spec"` keeps the
literal form). With the per-expert cutoff the update is exact coordinate descent: each expert, taken alone, would
receive exactly q of the step's tokens.

The bias is a buffer: it is never a parameter, never requires grad and is only changed in place under `no_grad`
between steps, so it never enters the autograd graph. The router's weights see ordinary gradients from the LM loss.

Two ways to get the quantiles:
- exact (default): margins of the step are kept (m x n fp32 per MoE layer) and `kthvalue` gives c_j. Under
  torch.distributed each rank computes its c_j and the shifts are averaged (one all-reduce of n floats per layer).
- histogram (`num_bins=B`): each micro-batch adds its margins to per-expert histograms over a range known from the
  bias alone, [b_j - max(b) - 1, b_j - min(b) + 1]; under torch.distributed the n x B counts are summed across ranks
  (SPEC 6, App. D), so every rank applies the same global quantile; error at most one bin width.

Tokens masked out by a 2-D `attention_mask` (padding) are left out of the statistics. Router calls made while
gradient checkpointing recomputes a layer in the backward pass are ignored, so nothing is counted twice.
"""

import logging
import re

import torch
from transformers import TrainerCallback

logger = logging.getLogger("transformers_kimi3")

__all__ = ["QuantileBalancingCallback", "quantile_balancing_shift", "router_margins", "expert_load",
           "load_imbalance", "expert_load_stats", "find_routers", "packed_collator"]


# ----------------------------------------------------------------------------- the math
def router_margins(scores, bias, top_k, margin="boundary"):
    """scores [m, n] (sigmoid, fp32), bias [n] -> margins [m, n], > 0 exactly on each token's top-k.

    "boundary": s + b minus the k-th largest s + b of the other experts (the (k+1)-th largest overall for the
    top-k members, the k-th for the rest). "spec": minus the (k+1)-th largest overall for every expert (SPEC 6)."""
    choice = scores.float() + bias.float()
    top = choice.topk(top_k + 1, dim=-1)
    below = top.values[:, top_k:top_k + 1]  # (k+1)-th largest
    if margin == "spec":
        return choice - below
    if margin != "boundary":
        raise ValueError(f"margin must be 'boundary' or 'spec', got {margin!r}")
    member = torch.zeros_like(choice, dtype=torch.bool).scatter_(1, top.indices[:, :top_k], True)
    return choice - torch.where(member, below, top.values[:, top_k - 1:top_k])


def _target_load(tokens, top_k, num_experts):
    return int(round(tokens * top_k / num_experts))


def quantile_balancing_shift(margins, top_k):
    """Exact c_j = the (q+1)-th largest margin of expert j over the m tokens, q = round(m k / n). Returns [n]."""
    m, n = margins.shape
    q = min(max(_target_load(m, top_k, n), 0), m - 1)
    return margins.kthvalue(m - q, dim=0).values  # (q+1)-th largest = (m-q)-th smallest


def _histogram_range(bias):
    """Per-expert margin range [lo_j, lo_j + width]: every margin of expert j lies inside it (scores in (0, 1))."""
    b = bias.float()
    return b - b.max() - 1.0, float(b.max() - b.min()) + 2.0


def margin_histogram(margins, bias, num_bins):
    """[n, num_bins] int64 counts of each expert's margins over `_histogram_range(bias)`."""
    m, n = margins.shape
    lo, width = _histogram_range(bias)
    pos = ((margins - lo) * (num_bins / width)).floor().long().clamp_(0, num_bins - 1)
    flat = pos + torch.arange(n, device=margins.device) * num_bins
    return torch.bincount(flat.reshape(-1), minlength=n * num_bins).view(n, num_bins)


def shift_from_histogram(counts, bias, tokens, top_k):
    """The (q+1)-th largest margin per expert from its histogram, interpolated inside the bin. Returns [n]."""
    n, num_bins = counts.shape
    q = min(max(_target_load(tokens, top_k, n), 0), max(tokens - 1, 0))
    lo, width = _histogram_range(bias)
    w = width / num_bins
    counts = counts.to(torch.float64)
    at_or_above = counts.flip(-1).cumsum(-1).flip(-1)  # [n, B]: tokens in bins >= b
    b_star = ((at_or_above >= q + 1).sum(-1) - 1).clamp_(0, num_bins - 1)  # the bin holding the (q+1)-th largest
    in_bin = counts.gather(1, b_star[:, None])[:, 0]
    above = at_or_above.gather(1, b_star[:, None])[:, 0] - in_bin
    frac = ((q + 1 - above) / in_bin.clamp_min(1)).clamp_(0, 1)
    return (lo.double() + (b_star.double() + 1 - frac) * w).float()


def expert_load(topk_idx, num_experts):
    """Tokens routed to each expert: [n] int64."""
    return torch.bincount(topk_idx.reshape(-1), minlength=num_experts)


def load_imbalance(load):
    """max / mean of an expert-load vector (1.0 = perfectly balanced)."""
    load = load.float()
    mean = load.mean()
    return float(load.max() / mean) if float(mean) > 0 else float("nan")


# ----------------------------------------------------------------------------- finding routers
def _is_router(module):
    # duck-typed so that the classes of a saved folder's remote code (trust_remote_code) match too
    return (hasattr(module, "e_score_correction_bias") and hasattr(module, "top_k")
            and hasattr(module, "num_experts") and isinstance(module, torch.nn.Module))


def find_routers(model):
    """[(layer_index, name, router)] for every MoE router (`Kimi3TopkRouter`) of the model, in layer order."""
    out = []
    for name, module in model.named_modules():
        if _is_router(module):
            found = re.findall(r"layers\.(\d+)\.", name + ".")
            out.append((int(found[-1]) if found else len(out), name, module))
    return out


def expert_load_stats(model, router_logits, attention_mask=None):
    """Per MoE layer, max/mean expert load of one forward, from `output_router_logits=True` outputs.

    `router_logits` is the model output's tuple ([tokens, n] per MoE layer); selections are recomputed with each
    router's current bias and top-k, as the model routed them. Returns {layer_index: max/mean}."""
    routers = find_routers(model)
    if len(routers) != len(router_logits):
        raise ValueError(f"{len(router_logits)} router logits for {len(routers)} MoE layers")
    keep = None if attention_mask is None else attention_mask.reshape(-1).bool()
    stats = {}
    with torch.no_grad():
        for (layer, _, router), logits in zip(routers, router_logits):
            scores = logits.float().sigmoid()
            if keep is not None and keep.numel() == scores.shape[0]:
                scores = scores[keep.to(scores.device)]
            choice = scores + router.e_score_correction_bias.float().to(scores.device)
            idx = choice.topk(router.top_k, dim=-1).indices
            stats[layer] = load_imbalance(expert_load(idx, router.num_experts))
    return stats


def packed_collator(**kwargs):
    """Transformers' padding-free collator set up for Kimi3: one row per batch, `position_ids` restarting at 0 for
    every document (the model reads the document boundaries from them: per-document KDA state and convs,
    block-diagonal MLA, nothing crosses documents) and -100 on each document's first label, so no loss term
    predicts across a boundary."""
    from transformers import DataCollatorWithFlattening

    kwargs.setdefault("return_position_ids", True)
    kwargs.setdefault("separator_id", -100)
    return DataCollatorWithFlattening(**kwargs)


# ----------------------------------------------------------------------------- the callback
def _in_backward():
    """True while autograd runs a backward pass (gradient checkpointing recomputes layers there)."""
    task = getattr(torch._C, "_current_graph_task_id", None)
    return task is not None and task() != -1


def _distributed():
    return torch.distributed.is_available() and torch.distributed.is_initialized() and \
        torch.distributed.get_world_size() > 1


class _LayerState:
    def __init__(self, layer, name, router):
        self.layer, self.name, self.router = layer, name, router
        self.reset_step()
        self.window_load = None

    def reset_step(self):
        self.margins, self.hist, self.tokens, self.load = [], None, 0, None


class QuantileBalancingCallback(TrainerCallback):
    """Quantile Balancing for every MoE router (SPEC 6) plus expert-load statistics in the Trainer's logs.

    Args:
        update: move `e_score_correction_bias` after every optimizer step (False: statistics only).
        rate: step size on SPEC's shift (1.0 = `b <- b - c`). Smaller values smooth the bias over steps.
        num_bins: None for exact quantiles; an int for the histogram (distributed) form.
        margin: "boundary" (default; per-expert cutoff, see the module docstring) or "spec" (SPEC 6's literal cutoff).
        log_per_layer: also log `moe/load_max_over_mean/layer_{i}` for every MoE layer.

    Logged (averaged over the logging window, loads counted under the bias in use at each step):
    `moe/load_max_over_mean` (mean over MoE layers), `moe/load_max_over_mean_worst` (worst layer) and
    `moe/bias_abs_max`. `history` keeps, per optimizer step, {"step", "max_over_mean": {layer: value}}.

    Use `Trainer(..., callbacks=[QuantileBalancingCallback()])`; `QuantileBalancingCallback.attach(trainer)` puts it
    first among the trainer's callbacks so that reporting integrations (TensorBoard, W&B) also see the statistics.
    Outside the Trainer: `cb.start(model)`, then `cb.step()` after each optimizer step, `cb.stop()` at the end.
    """

    def __init__(self, update=True, rate=1.0, num_bins=None, margin="boundary", log_per_layer=False):
        if num_bins is not None and num_bins < 2:
            raise ValueError(f"num_bins must be >= 2 (or None for exact quantiles), got {num_bins}")
        if margin not in ("boundary", "spec"):
            raise ValueError(f"margin must be 'boundary' or 'spec', got {margin!r}")
        self.update, self.rate, self.num_bins, self.log_per_layer = update, float(rate), num_bins, log_per_layer
        self.margin = margin
        self.history = []
        self._layers, self._handles, self._mask, self._step = [], [], None, 0

    @classmethod
    def attach(cls, trainer, **kwargs):
        cb = cls(**kwargs)
        trainer.callback_handler.callbacks.insert(0, cb)
        return cb

    # ---- lifecycle
    def start(self, model):
        self.stop()
        routers = find_routers(model)
        if not routers:
            logger.warning("QuantileBalancingCallback: the model has no MoE router; nothing to balance")
        self._layers = [_LayerState(*r) for r in routers]
        for st in self._layers:
            bias = st.router.e_score_correction_bias
            if bias.requires_grad:
                raise ValueError(f"{st.name}.e_score_correction_bias requires grad; it must stay out of autograd")
            self._handles.append(st.router.register_forward_hook(self._router_hook(st)))
        self._handles.append(model.register_forward_pre_hook(self._capture_mask, with_kwargs=True))
        return self

    def stop(self):
        for h in self._handles:
            h.remove()
        self._handles, self._mask = [], None

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if model is None:
            raise ValueError("QuantileBalancingCallback needs the model (Trainer passes it to callbacks)")
        self.start(model)
        self._step = state.global_step

    def on_step_end(self, args, state, control, **kwargs):
        self.step(global_step=state.global_step)

    def on_train_end(self, args, state, control, **kwargs):
        self.stop()

    def on_log(self, args, state, control, logs=None, **kwargs):
        stats = self.window_stats(reset=True)
        if stats and logs is not None:
            logs.update(stats)
            if state.log_history and state.log_history[-1].get("step") == state.global_step:
                state.log_history[-1].update(stats)

    # ---- collection
    def _capture_mask(self, module, args, kwargs):
        mask = kwargs.get("attention_mask")
        self._mask = mask.reshape(-1).bool() if torch.is_tensor(mask) and mask.dim() == 2 else None

    def _router_hook(self, st):
        def hook(module, args, output):
            if not module.training or _in_backward() or not torch.is_tensor(output[0]):
                return
            logits, idx = output[0], output[2]
            with torch.no_grad():
                scores = logits.detach().float().sigmoid()
                idx = idx.detach()
                keep = self._mask
                if keep is not None and keep.numel() == scores.shape[0] and not bool(keep.all()):
                    keep = keep.to(scores.device)
                    scores, idx = scores[keep], idx[keep]
                load = expert_load(idx, module.num_experts)
                st.load = load if st.load is None else st.load + load
                st.tokens += scores.shape[0]
                if self.update and scores.shape[0]:
                    bias = module.e_score_correction_bias.detach().float()
                    margins = router_margins(scores, bias, module.top_k, self.margin)
                    if self.num_bins is None:
                        st.margins.append(margins)
                    else:
                        h = margin_histogram(margins, bias, self.num_bins)
                        st.hist = h if st.hist is None else st.hist + h
        return hook

    # ---- the update
    @torch.no_grad()
    def step(self, global_step=None):
        """Apply one Quantile Balancing update from what the routers saw since the last call, record the loads."""
        self._step = self._step + 1 if global_step is None else global_step
        dist = _distributed()
        record = {}
        for st in self._layers:
            router = st.router
            n = router.num_experts
            bias = router.e_score_correction_bias
            load = st.load if st.load is not None else torch.zeros(n, dtype=torch.long, device=bias.device)
            tokens = torch.tensor([st.tokens], dtype=torch.long, device=load.device)
            if dist:
                torch.distributed.all_reduce(load)
                torch.distributed.all_reduce(tokens)
            if int(tokens) == 0:
                st.reset_step()
                continue
            record[st.layer] = load_imbalance(load)
            st.window_load = load.clone() if st.window_load is None else st.window_load + load.to(st.window_load)
            if self.update:
                shift = self._shift(st, bias, int(tokens), router.top_k, dist)
                if shift is not None:
                    bias.sub_((self.rate * shift).to(bias.device, bias.dtype))
            st.reset_step()
        if record:
            self.history.append({"step": self._step, "max_over_mean": record})

    def _shift(self, st, bias, tokens, top_k, dist):
        if self.num_bins is None:
            if not st.margins:
                shift = torch.zeros_like(bias, dtype=torch.float32)  # keeps collectives in step across ranks
            else:
                shift = quantile_balancing_shift(torch.cat(st.margins), top_k)
            if dist:  # each rank's quantile, averaged: one all-reduce of n floats
                torch.distributed.all_reduce(shift)
                shift /= torch.distributed.get_world_size()
            return shift
        counts = st.hist if st.hist is not None else torch.zeros(
            bias.numel(), self.num_bins, dtype=torch.long, device=bias.device)
        if dist:  # global histograms: every rank applies the same shift
            torch.distributed.all_reduce(counts)
        return shift_from_histogram(counts, bias.float(), tokens, top_k)

    # ---- statistics
    def window_stats(self, reset=True):
        values = {st.layer: load_imbalance(st.window_load) for st in self._layers if st.window_load is not None}
        if not values:
            return {}
        out = {"moe/load_max_over_mean": sum(values.values()) / len(values),
               "moe/load_max_over_mean_worst": max(values.values()),
               "moe/bias_abs_max": max(float(st.router.e_score_correction_bias.abs().max()) for st in self._layers)}
        if self.log_per_layer:
            out.update({f"moe/load_max_over_mean/layer_{k}": v for k, v in sorted(values.items())})
        if reset:
            for st in self._layers:
                st.window_load = None
        return out
