"""The conversion plan: every output tensor (name, dtype, shape, and how to compute it from named source tensors),
grouped into output shards, and the `Producer` that computes them one at a time.

A plan is complete before anything is written, so that names, shapes and dtypes are checked up front, a resumed
run can tell whether its earlier output still belongs to the same plan (`Job.fingerprint`), and verification can
recompute any tensor.
"""

import hashlib
import json
import math
from dataclasses import dataclass, field

from transformers_kimi3.checkpoint import CheckpointError
from transformers_kimi3.mxfp4 import check_mxfp4, dequantize_mxfp4, quantize_mxfp4

from kimi3_conversion.tensor_io import ST_ITEMSIZE, torch_dtype

# the largest shard when re-sharding without a size limit, as `save_pretrained` writes
DEFAULT_MAX_SHARD_SIZE = 50 * 10**9


@dataclass
class OutTensor:
    """One output tensor. `op` says how it is computed from `sources` (source tensor names):
    copy | cast (to `dtype`) | dequant (MXFP4 packed + scale -> `dtype`) | quant_packed / quant_scale (one half of
    the MXFP4 quantisation of a float tensor) | group (one output of `group_fn` applied to all tensors of `group`).
    """
    name: str
    dtype: str
    shape: tuple
    op: str
    sources: tuple
    group: str = None

    @property
    def nbytes(self):
        return math.prod(self.shape) * ST_ITEMSIZE[self.dtype]

    def key(self):
        return [self.name, self.dtype, list(self.shape), self.op, list(self.sources)]


@dataclass
class Job:
    """A planned conversion and what the tool writes besides the shards."""
    tool: str
    source: object  # tensor_io.Source
    output: str
    shards: list  # [(file name, [OutTensor])]
    producer: object  # Producer
    write_extras: object  # fn(folder) -> files written (other than config.json and the index)
    write_config: object  # fn(folder): writes config.json, the last file before the folder is renamed into place
    forward_check: object = None  # fn(shard paths, max_gb) -> summary line; raises on a mismatch
    options: dict = field(default_factory=dict)  # the options that change the output (part of the fingerprint)
    notes: list = field(default_factory=list)  # lines for the final summary

    @property
    def total_bytes(self):
        return sum(t.nbytes for _, specs in self.shards for t in specs)

    @property
    def num_tensors(self):
        return sum(len(specs) for _, specs in self.shards)

    def wants_index(self):
        """A single `model.safetensors` gets no index unless the source had one."""
        return not (len(self.shards) == 1 and self.shards[0][0] == "model.safetensors"
                    and not self.options.get("index"))

    def fingerprint(self):
        """Identifies the source files, the options and the plan: a partial output is resumed only when it matches."""
        data = {"tool": self.tool, "source": self.source.stats(), "options": self.options,
                "shards": [[name, [t.key() for t in specs]] for name, specs in self.shards]}
        return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


def shard_plan(tensors, max_shard_size, keep_files):
    """[OutTensor] (in write order) -> [(file name, [OutTensor])]. Without `max_shard_size`, `keep_files`
    ({output name: source file name}) keeps the source's sharding; otherwise tensors are packed greedily into
    shards of at most `max_shard_size` bytes (a larger tensor gets a shard of its own), named as
    `save_pretrained` names them."""
    if max_shard_size is None and keep_files is not None:
        shards = {}
        for t in tensors:
            shards.setdefault(keep_files[t.name], []).append(t)
        return list(shards.items())
    limit = max_shard_size or DEFAULT_MAX_SHARD_SIZE
    groups, cur, size = [], [], 0
    for t in tensors:
        if cur and size + t.nbytes > limit:
            groups.append(cur)
            cur, size = [], 0
        cur.append(t)
        size += t.nbytes
    if cur or not groups:
        groups.append(cur)
    if len(groups) == 1:
        return [("model.safetensors", groups[0])]
    n = len(groups)
    return [(f"model-{i + 1:05d}-of-{n:05d}.safetensors", g) for i, g in enumerate(groups)]


def unpacked_params(shards):
    """Parameters of the model the plan describes, MXFP4 experts counted as unpacked."""
    n = 0
    for _, specs in shards:
        for t in specs:
            n += math.prod(t.shape) * (2 if t.name.endswith(".weight_packed") else
                                       0 if t.name.endswith(".weight_scale") else 1)
    return n


class Producer:
    """Computes each OutTensor from the source, reading one source tensor (or one layer group) at a time.
    Called in plan order: the two halves of a quantised expert, and the outputs of a group, are computed once and
    handed out one by one."""

    def __init__(self, source, group_fn=None):
        self.source = source
        self.group_fn = group_fn  # fn(group key, {source name: tensor}) -> {output name: tensor}
        self._pending = {}
        self._groups = {}

    def fresh(self):
        """A producer with no state, for a second pass over the plan (dry run, verification)."""
        return Producer(self.source, self.group_fn)

    def __call__(self, t):
        if t.op == "copy":
            return self.source.read(t.sources[0])
        if t.op == "cast":
            return self.source.read(t.sources[0]).to(torch_dtype(t.dtype))
        if t.op == "dequant":
            return self._dequant(t)
        if t.op in ("quant_packed", "quant_scale"):
            return self._quant_half(t)
        if t.op == "group":
            if t.group not in self._groups:
                self._groups = {t.group: self.group_fn(t.group, {n: self.source.read(n) for n in t.sources})}
            return self._groups[t.group].pop(t.name).to(torch_dtype(t.dtype))
        raise AssertionError(t.op)

    def _where(self, name):
        return self.source.tensors[name].file

    def _dequant(self, t):
        packed, scale = self.source.read(t.sources[0]), self.source.read(t.sources[1])
        base = t.sources[0].rsplit(".", 1)[0]
        try:
            check_mxfp4(packed, scale, name=base)
        except ValueError as e:
            raise CheckpointError(f"{e} (in {self._where(t.sources[0])})") from e
        return dequantize_mxfp4(packed, scale, torch_dtype(t.dtype), name=base)

    def _quant_half(self, t):
        src = t.sources[0]
        if src not in self._pending:
            try:
                self._pending[src] = list(quantize_mxfp4(self.source.read(src).float(), name=src))
            except ValueError as e:
                raise CheckpointError(f"{e} (in {self._where(src)})") from e
        pair = self._pending[src]
        i = 0 if t.op == "quant_packed" else 1
        out, pair[i] = pair[i], None
        if pair[0] is None and pair[1] is None:
            del self._pending[src]
        return out
