"""Shared machinery of the conversion CLIs (`convert_k3_to_hf.py`, `quantize_mxfp4.py`, `convert_kimi_linear.py`).

Every conversion is a *plan* computed before anything is written: the list of output shards, each an ordered list
of output tensors (name, safetensors dtype, shape, and how to produce it from named source tensors). The plan is
checked against what the config implies (names, shapes, dtypes), then executed shard by shard:

* sources are read one tensor at a time through `safetensors.safe_open` (read-only memory maps; never pickle), after
  their headers were parsed and checked here (truncated files, corrupt headers, overlapping or missing byte ranges);
* every tensor read is checked (finite floats, no E8M0 0xFF scales, zero `A_log` padding) and an error names the
  tensor and the file;
* output shards are streamed to disk tensor by tensor (the header is known from the plan), into a hidden
  `.<name>.partial` folder next to the output, with a progress manifest holding each finished shard's sha256;
* `--resume` keeps the finished shards whose sha256 still matches; without it a stale partial folder is discarded;
* at the end every output tensor is read back and compared bit for bit with what the source gives (`--verify`),
  a forward pass on random tokens compares source and output models when they fit in memory, and only then are
  `config.json` and the index written and the folder renamed into place. An interrupted run therefore never
  leaves a folder that looks complete at the output path.

Test hook (not a user option): `KIMI3_CONVERT_TEST_PARK_AT=<k>` makes the run stop in the middle of writing its
k-th shard (0-based, counting only shards written by this run) and sleep until it is killed, so that a test can
kill the process at a known point.
"""

import argparse
import copy
import hashlib
import json
import math
import os
import re
import shutil
import struct
import sys
import time
from dataclasses import dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL_CARDS = os.path.join(ROOT, "model_cards")
MANIFEST = ".kimi3-conversion.json"
INDEX = "model.safetensors.index.json"

# safetensors dtype -> bytes per element
ST_ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1, "I16": 2, "U16": 2, "F16": 2,
               "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}
FLOATS = ("BF16", "F16", "F32")
CONFIG_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}
TOKENIZER_FILES = ("tiktoken.model", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "added_tokens.json", "chat_template.jinja", "chat_template.json", "generation_config.json")
PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json", "video_preprocessor_config.json")
LICENSE_FILES = ("LICENSE", "LICENSE.md", "LICENSE.txt", "LICENCE", "NOTICE", "NOTICE.md", "USE_POLICY.md")
_EXPERT_WEIGHT = re.compile(r"^(?P<base>.*\.experts\.\d+\.w[123])\.(?P<kind>weight|weight_packed|weight_scale)$")
_LAYER = re.compile(r"^(?:language_model\.)?model\.layers\.(\d+)\.")

# compressed-tensors description of K3's MXFP4 routed experts, as released (oracle A holds the same keys)
MXFP4_QUANTIZATION_CONFIG = {
    "config_groups": {"group_0": {
        "format": "mxfp4-pack-quantized", "input_activations": None, "output_activations": None,
        "targets": ["Linear"],
        "weights": {"actorder": None, "block_structure": None, "dynamic": False, "group_size": 32, "num_bits": 4,
                    "observer": "minmax", "observer_kwargs": {}, "scale_dtype": "torch.uint8", "strategy": "group",
                    "symmetric": True, "type": "float", "zp_dtype": None}}},
    "format": "mxfp4-pack-quantized", "global_compression_ratio": None,
    "ignore": ["re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
               "re:.*lm_head.*", "re:.*vision_tower.*", "re:.*mm_projector.*"],
    "kv_cache_scheme": None, "quant_method": "compressed-tensors", "quantization_status": "compressed",
}


# ------------------------------------------------------------------------------------------------ lazy imports
# `--help` must not pay for torch/transformers; every entry point below calls _heavy() first.
torch = None
CheckpointError = ValueError


def _heavy():
    global torch, CheckpointError
    if torch is not None:
        return
    try:
        import transformers_kimi3  # noqa: F401
    except ImportError:  # running from a checkout without `pip install -e .`
        sys.path.insert(0, os.path.join(ROOT, "src"))
        sys.path.insert(0, os.path.join(ROOT, "kernels"))
    import torch as _torch

    from transformers_kimi3.checkpoint import CheckpointError as _CE

    torch = _torch
    CheckpointError = _CE


def checkpoint_error(msg):
    _heavy()
    return CheckpointError(msg)


def torch_dtype(st):
    _heavy()
    table = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
             "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "I32": torch.int32, "I64": torch.int64,
             "BOOL": torch.bool}
    if st not in table:
        raise checkpoint_error(f"safetensors dtype {st} is not supported here")
    return table[st]


def st_dtype(dt):
    _heavy()
    table = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32", torch.float64: "F64",
             torch.uint8: "U8", torch.int8: "I8", torch.int16: "I16", torch.int32: "I32", torch.int64: "I64",
             torch.bool: "BOOL"}
    return table[dt]


# ------------------------------------------------------------------------------------------------ CLI helpers
def parse_size(text):
    """'5GB', '500MB', '2GiB', '123456' -> bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B?)?\s*", str(text), re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 5GB, 500MB, 2GiB, 1000000)")
    unit = (m.group(2) or "").upper().rstrip("B")
    mult = {"": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
            "KI": 2**10, "MI": 2**20, "GI": 2**30, "TI": 2**40}[unit]
    value = int(float(m.group(1)) * mult)
    if value <= 0:
        raise argparse.ArgumentTypeError("the size must be positive")
    return value


def add_common_args(ap, default_shard_size_help):
    ap.add_argument("source", help="source folder (read only: nothing in it is ever written, moved or touched)")
    ap.add_argument("output", help="output folder; must not exist unless --overwrite. Written as a hidden "
                    "'.<name>.partial' folder next to it and renamed into place once complete and verified")
    ap.add_argument("--max-shard-size", type=parse_size, default=None, metavar="SIZE",
                    help=f"re-shard the output into files of at most SIZE (e.g. 5GB, 500MB; a single tensor larger "
                         f"than SIZE gets a shard of its own). {default_shard_size_help}")
    ap.add_argument("--dry-run", action="store_true",
                    help="check the source completely (headers, names, shapes, dtypes, every tensor's values), "
                         "print the plan and write nothing at all")
    ap.add_argument("--resume", action="store_true",
                    help="continue an interrupted run: keep the shards of the partial folder that are recorded "
                         "as finished and whose sha256 still matches, write the rest. Without --resume a stale "
                         "partial folder of this tool is discarded and the conversion starts over")
    ap.add_argument("--verify", action=argparse.BooleanOptionalAction, default=True,
                    help="after writing, read every output tensor back and compare it bit for bit with what the "
                         "source gives, and compare logits of source and output models on random tokens when "
                         "they fit in memory (see --forward-check-max-gb). Default: on")
    ap.add_argument("--forward-check-max-gb", type=float, default=16.0, metavar="GB",
                    help="run the forward-pass comparison only when two fp32 copies of the model take at most "
                         "this many GB (8 bytes per parameter); 0 disables it. Default: 16")
    ap.add_argument("--overwrite", action="store_true",
                    help="replace an existing output folder (it is swapped out only after the new one is "
                         "complete)")
    ap.add_argument("--quiet", action="store_true", help="no progress bar, only the final summary and errors")


def cli_main(build_parser, build_job, argv=None):
    ap = build_parser()
    args = ap.parse_args(argv)
    _heavy()
    try:
        job = build_job(args)
        return run_job(job, args)
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


def say(args, msg):
    if not getattr(args, "quiet", False):
        print(msg, file=sys.stderr, flush=True)


class Progress:
    """tqdm over bytes when installed, else a line every ~5%."""

    def __init__(self, total, desc, quiet):
        self.total, self.done, self.desc, self.quiet, self._next = max(int(total), 1), 0, desc, quiet, 0.05
        self.bar = None
        if not quiet:
            try:
                from tqdm.auto import tqdm

                self.bar = tqdm(total=self.total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024,
                                file=sys.stderr)
            except ImportError:
                print(f"{desc}: {self.total / 1e9:.3f} GB", file=sys.stderr, flush=True)

    def update(self, n):
        self.done += n
        if self.bar is not None:
            self.bar.update(n)
        elif not self.quiet and self.done / self.total >= self._next:
            print(f"{self.desc}: {100 * self.done / self.total:5.1f}%", file=sys.stderr, flush=True)
            self._next = math.floor(self.done / self.total * 20 + 1) / 20

    def close(self):
        if self.bar is not None:
            self.bar.close()


def _test_park(shard_number):
    park = os.environ.get("KIMI3_CONVERT_TEST_PARK_AT")
    if park is not None and int(park) == shard_number:
        while True:  # until killed
            time.sleep(60)


# ------------------------------------------------------------------------------------------------ safetensors
@dataclass
class SrcTensor:
    name: str
    file: str
    dtype: str
    shape: tuple
    start: int  # data offsets relative to the data section
    end: int

    @property
    def nbytes(self):
        return self.end - self.start


def read_header(path):
    """Parse and check a safetensors header without loading data: name -> SrcTensor. Truncated files, corrupt or
    inconsistent headers raise an error naming the file (and the tensor where there is one)."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise checkpoint_error(f"{path}: {size} bytes, too short to be a safetensors file (truncated?)")
        (n,) = struct.unpack("<Q", raw)
        if n < 2 or n > 100_000_000 or 8 + n > size:
            raise checkpoint_error(f"{path}: header length field says {n} bytes but the file has {size} bytes "
                                   "(truncated, corrupt, or not a safetensors file)")
        blob = f.read(n)
    try:
        header = json.loads(blob.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise checkpoint_error(f"{path}: corrupt safetensors header, not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise checkpoint_error(f"{path}: corrupt safetensors header (not a JSON object)")
    header.pop("__metadata__", None)
    data_size = size - 8 - n
    out = {}
    for name, d in header.items():
        try:
            dtype, shape, (start, end) = d["dtype"], tuple(d["shape"]), d["data_offsets"]
            ok = (dtype in ST_ITEMSIZE and all(isinstance(s, int) and s >= 0 for s in shape)
                  and isinstance(start, int) and isinstance(end, int) and 0 <= start <= end)
        except (KeyError, TypeError, ValueError):
            ok = False
        if not ok:
            raise checkpoint_error(f"{name} in {path}: corrupt header entry {d!r}")
        if (end - start) != math.prod(shape) * ST_ITEMSIZE[dtype]:
            raise checkpoint_error(f"{name} in {path}: header says {dtype} {list(shape)} but a byte range of "
                                   f"{end - start} bytes (corrupt header)")
        out[name] = SrcTensor(name, path, dtype, shape, start, end)
    pos = 0
    for t in sorted(out.values(), key=lambda t: (t.start, t.end)):
        if t.start != pos:
            raise checkpoint_error(f"{t.name} in {path}: data starts at byte {t.start} of the data section, "
                                   f"expected {pos} (overlapping or gapped tensors: corrupt header)")
        pos = t.end
        if pos > data_size:
            raise checkpoint_error(f"{t.name} in {path}: its data ends at byte {8 + n + pos} but the file has "
                                   f"{size} bytes: the file is truncated")
    if pos != data_size:
        raise checkpoint_error(f"{path}: {data_size - pos} bytes after the last tensor (corrupt or not a "
                               "safetensors file)")
    return out


class Source:
    """A checkpoint folder: headers of every shard (checked), the index checked against them, and read access to
    one tensor at a time (with value checks)."""

    def __init__(self, folder, value_checks=None):
        _heavy()
        from transformers_kimi3.checkpoint import weight_files

        self.folder = os.path.abspath(folder)
        if not os.path.isdir(self.folder):
            raise checkpoint_error(f"{folder} is not a folder")
        self.files = weight_files(self.folder)
        self.has_index = os.path.exists(os.path.join(self.folder, INDEX))
        self.tensors = {}
        for path in self.files:
            for name, t in read_header(path).items():
                if name in self.tensors:
                    raise checkpoint_error(f"tensor {name} appears in both {self.tensors[name].file} and {path}")
                self.tensors[name] = t
        if self.has_index:
            weight_map = json.load(open(os.path.join(self.folder, INDEX)))["weight_map"]
            for name, fname in weight_map.items():
                t = self.tensors.get(name)
                if t is None or os.path.basename(t.file) != fname:
                    raise checkpoint_error(f"{name}: the index {INDEX} places it in {fname}, but "
                                           f"{'it is not in ' + fname if t is None else 'it is in ' + t.file}")
            extra = sorted(set(self.tensors) - set(weight_map))
            if extra:
                raise checkpoint_error(f"{extra[0]} in {self.tensors[extra[0]].file}: not listed in {INDEX}"
                                       + (f" ({len(extra)} such tensors)" if len(extra) > 1 else ""))
        self.value_checks = value_checks
        self._handles = {}

    def order(self):
        """Source tensors in storage order: file by file, by offset."""
        rank = {f: i for i, f in enumerate(self.files)}
        return sorted(self.tensors.values(), key=lambda t: (rank[t.file], t.start))

    def stats(self):
        return [(os.path.basename(f), os.path.getsize(f), os.stat(f).st_mtime_ns) for f in self.files]

    def _handle(self, path):
        from safetensors import safe_open

        if path not in self._handles:
            if len(self._handles) >= 2:  # never keep more than two shards mapped
                self._handles.pop(next(iter(self._handles)))
            self._handles[path] = safe_open(path, framework="pt")
        return self._handles[path]

    def read(self, name):
        from safetensors import SafetensorError

        info = self.tensors[name]
        try:
            t = self._handle(info.file).get_tensor(name)
        except SafetensorError as e:
            raise checkpoint_error(f"{name} in {info.file}: unreadable ({e})") from e
        if st_dtype(t.dtype) != info.dtype or tuple(t.shape) != info.shape:
            raise checkpoint_error(f"{name} in {info.file}: read {t.dtype} {tuple(t.shape)}, header says "
                                   f"{info.dtype} {list(info.shape)}")
        if self.value_checks is not None:
            self.value_checks(name, t, info.file)
        return t

    def close(self):
        self._handles.clear()


def value_checks_for(text_config):
    """Per-tensor value checks: finite floats, E8M0 scales that are not 0xFF (NaN), a zero `A_log` padding."""
    H = text_config.kda_num_heads

    def check(name, t, path):
        if t.is_floating_point():
            bad = ~torch.isfinite(t)
            if bool(bad.any()):
                idx = [int(i) for i in bad.nonzero()[0]]
                raise checkpoint_error(f"{name} in {path}: {int(bad.sum())} non-finite values (first at {idx}); "
                                       "corrupt data")
        if name.endswith(".weight_scale"):
            nan = t == 0xFF
            if bool(nan.any()):
                idx = [int(i) for i in nan.nonzero()[0]]
                raise checkpoint_error(f"{name} in {path}: E8M0 scale 0xFF (NaN) at {idx} "
                                       f"({int(nan.sum())} such scales)")
        if name.endswith("self_attn.A_log") and t.dim() == 1 and t.numel() > H:
            tail = t[H:]
            if bool((tail != 0).any()):
                raise checkpoint_error(f"{name} in {path}: stored [{t.numel()}] for {H} heads, but the padded tail "
                                       "holds non-zero values")

    return check


# ------------------------------------------------------------------------------------------------ plans
@dataclass
class OutTensor:
    name: str
    dtype: str
    shape: tuple
    op: str  # copy | cast | dequant | quant_packed | quant_scale | group
    sources: tuple
    group: str = None

    @property
    def nbytes(self):
        return math.prod(self.shape) * ST_ITEMSIZE[self.dtype]

    def key(self):
        return [self.name, self.dtype, list(self.shape), self.op, list(self.sources)]


@dataclass
class Job:
    tool: str
    source: Source
    output: str
    shards: list  # [(file name, [OutTensor])]
    producer: object
    write_extras: object  # fn(tmp_dir) -> list of files written (not config.json / index)
    write_config: object  # fn(tmp_dir): writes config.json (the last marker before the rename)
    forward_check: object = None  # fn(shard_paths) -> str summary, raises on mismatch
    options: dict = field(default_factory=dict)
    notes: list = field(default_factory=list)

    @property
    def total_bytes(self):
        return sum(t.nbytes for _, specs in self.shards for t in specs)

    def fingerprint(self):
        data = {"tool": self.tool, "source": self.source.stats(), "options": self.options,
                "shards": [[name, [t.key() for t in specs]] for name, specs in self.shards]}
        return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


def shard_plan(tensors, max_shard_size, keep_files):
    """[OutTensor] (in write order) -> [(file name, [OutTensor])]. keep_files: {name: source file basename} to keep
    the source sharding (max_shard_size None); else greedy packing, named as save_pretrained names shards."""
    if max_shard_size is None and keep_files is not None:
        shards = {}
        for t in tensors:
            shards.setdefault(keep_files[t.name], []).append(t)
        return list(shards.items())
    limit = max_shard_size or 50 * 10**9
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


class Producer:
    """Computes each OutTensor from the source, one tensor (or one layer group) at a time."""

    def __init__(self, source, group_fn=None):
        self.source = source
        self.group_fn = group_fn  # fn(group key, {name: tensor}) -> {out name: tensor}
        self._pending = {}
        self._groups = {}

    def __call__(self, t):
        _heavy()
        from transformers_kimi3.mxfp4 import check_mxfp4, dequantize_mxfp4, quantize_mxfp4

        if t.op == "copy":
            return self.source.read(t.sources[0])
        if t.op == "cast":
            return self.source.read(t.sources[0]).to(torch_dtype(t.dtype))
        if t.op == "dequant":
            p, s = self.source.read(t.sources[0]), self.source.read(t.sources[1])
            base = t.sources[0].rsplit(".", 1)[0]
            try:
                check_mxfp4(p, s, name=base)
            except ValueError as e:
                raise checkpoint_error(f"{e} (in {self.source.tensors[t.sources[0]].file})") from e
            return dequantize_mxfp4(p, s, torch_dtype(t.dtype), name=base)
        if t.op in ("quant_packed", "quant_scale"):
            src = t.sources[0]
            if src not in self._pending:
                w = self.source.read(src)
                try:
                    self._pending[src] = list(quantize_mxfp4(w.float(), name=src))
                except ValueError as e:
                    raise checkpoint_error(f"{e} (in {self.source.tensors[src].file})") from e
            pair = self._pending[src]
            i = 0 if t.op == "quant_packed" else 1
            out, pair[i] = pair[i], None
            if pair[0] is None and pair[1] is None:
                del self._pending[src]
            return out
        if t.op == "group":
            if t.group not in self._groups:
                self._groups = {t.group: self.group_fn(t.group, {n: self.source.read(n) for n in t.sources})}
            out = self._groups[t.group].pop(t.name)
            return out.to(torch_dtype(t.dtype))
        raise AssertionError(t.op)


# ------------------------------------------------------------------------------------------------ writing
def _tensor_bytes(t):
    t = t.detach().contiguous().reshape(-1)
    return t.view(torch.uint8).numpy() if t.numel() else b""


def write_shard(path, specs, producer, progress, number=-1):
    """Stream `specs` into a safetensors file: header from the plan, then each tensor's bytes. Returns sha256."""
    if sys.byteorder != "little":
        raise RuntimeError("safetensors is little-endian; this machine is not")
    header, off = {"__metadata__": {"format": "pt"}}, 0
    for t in specs:
        header[t.name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [off, off + t.nbytes]}
        off += t.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-(8 + len(blob)) % 8)
    h = hashlib.sha256()
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        for chunk in (struct.pack("<Q", len(blob)), blob):
            f.write(chunk)
            h.update(chunk)
        for i, t in enumerate(specs):
            value = producer(t)
            if st_dtype(value.dtype) != t.dtype or tuple(value.shape) != tuple(t.shape):
                raise AssertionError(f"{t.name}: produced {value.dtype} {tuple(value.shape)}, planned {t.dtype} "
                                     f"{list(t.shape)}")
            data = _tensor_bytes(value)
            f.write(data)
            h.update(data)
            progress.update(t.nbytes)
            if i == len(specs) // 2:
                f.flush()
                _test_park(number)
        f.flush()
        os.fsync(f.fileno())
    digest = h.hexdigest()
    if sha256_file(tmp) != digest:
        raise OSError(f"{tmp}: the bytes on disk differ from the bytes written")
    os.replace(tmp, path)
    return digest


def sha256_file(path, bufsize=1 << 24):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            b = f.read(bufsize)
            if not b:
                return h.hexdigest()
            h.update(b)


def verify_shards(job, tmp, progress):
    """Read every output tensor back (with safetensors' own reader) and compare it bit for bit with what the source
    gives. Returns the number of tensors compared."""
    from safetensors import safe_open

    producer = type(job.producer)(job.source, job.producer.group_fn)
    n = 0
    for fname, specs in job.shards:
        path = os.path.join(tmp, fname)
        with safe_open(path, framework="pt") as f:
            if sorted(f.keys()) != sorted(t.name for t in specs):
                raise checkpoint_error(f"{path}: holds other tensors than planned")
            for t in specs:
                got, want = f.get_tensor(t.name), producer(t)
                if got.dtype != want.dtype or got.shape != want.shape or not torch.equal(
                        got.reshape(-1).view(torch.uint8), want.contiguous().reshape(-1).view(torch.uint8)):
                    raise checkpoint_error(f"{t.name} in {path}: differs from the source after writing")
                n += 1
                progress.update(t.nbytes)
    return n


def write_index(tmp, job):
    if len(job.shards) == 1 and job.shards[0][0] == "model.safetensors" and not job.options.get("index"):
        return None
    index = {"metadata": {"total_size": job.total_bytes},
             "weight_map": {t.name: fname for fname, specs in job.shards for t in specs}}
    path = os.path.join(tmp, INDEX)
    with open(path, "w") as f:
        json.dump(index, f, indent=2, sort_keys=True)
        f.write("\n")
    return path


def _load_manifest(tmp):
    try:
        return json.load(open(os.path.join(tmp, MANIFEST)))
    except (OSError, ValueError):
        return None


def _save_manifest(tmp, manifest):
    path = os.path.join(tmp, MANIFEST)
    with open(path + ".tmp", "w") as f:
        json.dump(manifest, f, indent=1)
    os.replace(path + ".tmp", path)


def partial_dir(output):
    out = os.path.abspath(output)
    return os.path.join(os.path.dirname(out), f".{os.path.basename(out)}.partial")


def _check_paths(source, output, overwrite):
    src, out = os.path.realpath(source), os.path.realpath(output)
    if src == out or out.startswith(src + os.sep) or src.startswith(out + os.sep):
        raise checkpoint_error(f"output {output} and source {source} must not contain each other")
    if os.path.exists(out) and not overwrite:
        raise checkpoint_error(f"{output} exists; pass --overwrite to replace it")


def dry_run(job, args):
    """Every check of a real run (every tensor read and checked), nothing written."""
    progress = Progress(job.total_bytes, "checking", args.quiet)
    producer = type(job.producer)(job.source, job.producer.group_fn)
    for _, specs in job.shards:
        for t in specs:
            producer(t)
            progress.update(t.nbytes)
    progress.close()
    print(f"dry run: {job.tool} {job.source.folder} -> {os.path.abspath(job.output)}")
    print(f"  source: {len(job.source.files)} shard(s), {len(job.source.tensors)} tensors, "
          f"{sum(os.path.getsize(f) for f in job.source.files) / 1e9:.3f} GB; all checks passed")
    print(f"  output: {len(job.shards)} shard(s), {sum(len(s) for _, s in job.shards)} tensors, "
          f"{job.total_bytes / 1e9:.3f} GB")
    for fname, specs in job.shards:
        print(f"    {fname}: {len(specs)} tensors, {sum(t.nbytes for t in specs) / 1e9:.3f} GB")
    for note in job.notes:
        print(f"  note: {note}")
    print("  nothing was written")
    return 0


def run_job(job, args):
    _check_paths(job.source.folder, job.output, args.overwrite)
    if args.dry_run:
        return dry_run(job, args)
    out = os.path.abspath(job.output)
    tmp = partial_dir(out)
    fingerprint = job.fingerprint()
    manifest = _load_manifest(tmp) if os.path.isdir(tmp) else None
    if os.path.exists(tmp):
        if manifest is None:
            raise checkpoint_error(f"{tmp} exists and was not made by this tool; move it away")
        if not (args.resume and manifest.get("fingerprint") == fingerprint):
            say(args, f"discarding the partial output {tmp}" + (
                " (the source or the options changed)" if args.resume else " (pass --resume to continue it)"))
            shutil.rmtree(tmp)
            manifest = None
    if manifest is None:
        os.makedirs(tmp)
        manifest = {"tool": job.tool, "fingerprint": fingerprint, "shards": {}}
        _save_manifest(tmp, manifest)
    for f in os.listdir(tmp):  # half-written shards of a killed run; completeness markers of an earlier attempt
        if f.endswith(".tmp") or f in ("config.json", INDEX):
            os.remove(os.path.join(tmp, f))
    stats = {"written": 0, "resumed": 0}
    try:
        progress = Progress(job.total_bytes, "writing", args.quiet)
        for fname, specs in job.shards:
            path = os.path.join(tmp, fname)
            done = manifest["shards"].get(fname)
            if done and os.path.exists(path) and sha256_file(path) == done["sha256"]:
                stats["resumed"] += 1
                progress.update(sum(t.nbytes for t in specs))
                continue
            digest = write_shard(path, specs, job.producer, progress, stats["written"])
            manifest["shards"][fname] = {"sha256": digest, "bytes": os.path.getsize(path)}
            _save_manifest(tmp, manifest)
            stats["written"] += 1
        progress.close()
        extras = job.write_extras(tmp) or []
        summary = []
        if args.verify:
            progress = Progress(job.total_bytes, "verifying", args.quiet)
            n = verify_shards(job, tmp, progress)
            progress.close()
            summary.append(f"verified {n} tensors bit for bit against the source")
            if job.forward_check is not None:
                summary.append(job.forward_check([os.path.join(tmp, f) for f, _ in job.shards],
                                                 args.forward_check_max_gb))
        write_index(tmp, job)
        job.write_config(tmp)  # config.json last: the folder looks complete only from here on
    except CheckpointError:
        shutil.rmtree(tmp, ignore_errors=True)  # the source is bad: nothing worth resuming
        raise
    finally:
        job.source.close()
    os.remove(os.path.join(tmp, MANIFEST))
    if os.path.exists(out):
        old = f"{out}.old-{os.getpid()}"
        os.rename(out, old)
        os.rename(tmp, out)
        shutil.rmtree(old)
    else:
        os.rename(tmp, out)
    print(f"{job.tool}: wrote {out}: {len(job.shards)} shard(s) ({stats['written']} written, {stats['resumed']} "
          f"kept from an interrupted run), {sum(len(s) for _, s in job.shards)} tensors, "
          f"{job.total_bytes / 1e9:.3f} GB, {len(extras)} other files")
    for line in summary + job.notes:
        print(f"  {line}")
    job.stats = stats
    return 0


# ------------------------------------------------------------------------------------------------ configs
def text_config_of(config):
    return config.get_text_config() if hasattr(config, "text_config") else config


def load_config(folder):
    """Our config object for an official K3 folder (Kimi3Config) or a text-only one (Kimi3TextConfig)."""
    _heavy()
    from transformers_kimi3 import Kimi3Config, Kimi3TextConfig

    path = os.path.join(folder, "config.json")
    try:
        raw = json.load(open(path))
    except (OSError, ValueError) as e:
        raise checkpoint_error(f"{path}: cannot read the config ({e})") from e
    try:
        if raw.get("model_type") == "kimi_k3":
            return raw, Kimi3Config.from_pretrained(folder)
        return raw, Kimi3TextConfig.from_pretrained(folder)
    except (ValueError, TypeError, KeyError) as e:
        raise checkpoint_error(f"{path}: {e}") from e


def model_class(config):
    from transformers_kimi3 import Kimi3Config, Kimi3ForCausalLM, Kimi3ForConditionalGeneration

    return Kimi3ForConditionalGeneration if isinstance(config, Kimi3Config) else Kimi3ForCausalLM


def unquantized(config):
    cfg = copy.deepcopy(config)
    text_config_of(cfg).checkpoint_quantization_config = None
    return cfg


def expected_tensors(config):
    """Official tensor name -> shape, from the config alone: our model built on the meta device, its state dict
    mapped through `to_official_layout`. Routed experts appear unpacked (`experts.E.wN.weight` [out, in])."""
    _heavy()
    from transformers_kimi3.checkpoint import to_official_layout

    cfg = unquantized(config)
    cls = model_class(cfg)
    with torch.device("meta"):
        model = cls(cfg)
    sd = model.state_dict()
    prefix = "language_model." if any(k.startswith("language_model.") for k in sd) else ""
    text = {k[len(prefix):]: v for k, v in sd.items() if k.startswith(prefix)}
    out = {prefix + k: tuple(v.shape) for k, v in to_official_layout(text, text_config_of(cfg)).items()}
    out.update({k: tuple(v.shape) for k, v in sd.items() if not k.startswith(prefix)})
    unpacked = {}
    for name, shape in out.items():  # whatever the in-memory layout, describe experts as [out, in] weights
        m = _EXPERT_WEIGHT.match(name)
        if m and m.group("kind") == "weight_packed":
            unpacked[m.group("base") + ".weight"] = (shape[0], shape[1] * 2)
        elif not (m and m.group("kind") == "weight_scale"):
            unpacked[name] = shape
    return unpacked


def allowed_float_dtypes(raw_config, name, fallback=None):
    """What the config implies for a floating-point tensor: its `dtype` (or F32, which every tensor may keep). When
    the config names no dtype, the checkpoint's majority dtype (`fallback`) takes its place."""
    cfg = raw_config
    if not name.startswith(("vision_tower.", "mm_projector.")) and isinstance(raw_config.get("text_config"), dict):
        cfg = raw_config["text_config"] if (raw_config["text_config"].get("dtype")
                                            or raw_config["text_config"].get("torch_dtype")) else raw_config
    d = cfg.get("dtype") or cfg.get("torch_dtype") or raw_config.get("dtype") or raw_config.get("torch_dtype")
    if d in CONFIG_DTYPES:
        return tuple(dict.fromkeys((CONFIG_DTYPES[d], "F32")))
    if fallback is not None:
        return tuple(dict.fromkeys((fallback, "F32")))
    return FLOATS


def shard_names(source):
    names = [os.path.basename(f) for f in source.files]
    listed = ", ".join(names[:3]) + (f" or {len(names) - 3} more shards" if len(names) > 3 else "")
    return f"{listed} of {source.folder}"


def majority_float_dtype(source):
    """The dtype most tensors are stored in, F32 aside (for configs that do not say)."""
    counts = {}
    for t in source.tensors.values():
        if t.dtype in FLOATS and t.dtype != "F32":
            counts[t.dtype] = counts.get(t.dtype, 0) + 1
    return max(counts, key=counts.get) if counts else None


@dataclass
class Match:
    """Source tensors matched with the config's expectation."""
    plain: list  # source names of non-expert (or unpacked expert) tensors, storage order
    packed: dict  # expert base -> (packed name, scale name)
    unpacked: dict  # expert base -> weight name
    extra: list  # tensors passed through unchecked (multi-token-prediction layers)


def match_source(source, raw_config, config):
    """Check every source tensor's name, shape and dtype against the config; one error lists every problem (each
    naming the tensor and its file)."""
    text = text_config_of(config)
    expected = expected_tensors(config)
    H = text.kda_num_heads
    problems, plain, packed, unpacked, extra = [], [], {}, {}, []
    seen = set()
    L, nextn = text.num_hidden_layers, getattr(text, "num_nextn_predict_layers", 0) or 0
    majority = majority_float_dtype(source)
    expert_note = (f" (config: moe_intermediate_size={text.moe_intermediate_size}, routed_expert_hidden_size="
                   f"{text.routed_expert_hidden_size}, hidden_size={text.hidden_size})")

    def where(name):
        return f"{name} in {os.path.basename(source.tensors[name].file)}"

    def check_float(name, shape, note=""):
        info = source.tensors[name]
        if info.shape != tuple(shape):
            problems.append(f"{where(name)}: shape {list(info.shape)} but the config implies {list(shape)}{note}")
        allowed = allowed_float_dtypes(raw_config, name, majority)
        if info.dtype not in allowed:
            problems.append(f"{where(name)}: dtype {info.dtype} but the config implies {' or '.join(allowed)}")

    for name, shape in expected.items():
        m = _EXPERT_WEIGHT.match(name)
        if m:
            base = m.group("base")
            p, s = base + ".weight_packed", base + ".weight_scale"
            if p in source.tensors or s in source.tensors:
                seen.update((p, s))
                for n, want in ((p, (shape[0], shape[1] // 2)), (s, (shape[0], shape[1] // 32))):
                    if n not in source.tensors:
                        problems.append(f"{n}: missing (its MXFP4 partner is in "
                                        f"{os.path.basename(source.tensors[p if n == s else s].file)})")
                        continue
                    info = source.tensors[n]
                    if shape[1] % 32 or info.shape != want:
                        problems.append(f"{where(n)}: shape {list(info.shape)} but the config implies {list(want)}"
                                        f" for an MXFP4 [{shape[0]}, {shape[1]}] expert matrix{expert_note}")
                    if info.dtype != "U8":
                        problems.append(f"{where(n)}: dtype {info.dtype} but MXFP4 tensors are U8")
                packed[base] = (p, s)
                continue
            if name in source.tensors:
                seen.add(name)
                check_float(name, shape, expert_note)
                unpacked[base] = name
                continue
            problems.append(f"{name}: missing (the config implies a {list(shape)} expert matrix, stored as .weight "
                            f"or MXFP4 .weight_packed/.weight_scale; not in {shard_names(source)})")
            continue
        if name not in source.tensors:
            problems.append(f"{name}: missing (the config implies {list(shape)}; not in {shard_names(source)})")
            continue
        seen.add(name)
        if name.endswith("self_attn.A_log") and math.prod(source.tensors[name].shape) == H:
            shape = source.tensors[name].shape  # [H] or [1, 1, H, 1] instead of the padded [head_dim]: all read
        check_float(name, shape)
        plain.append(name)
    for name in sorted(set(source.tensors) - seen):
        layer = _LAYER.match(name)
        if layer and L <= int(layer.group(1)) < L + nextn:
            extra.append(name)  # multi-token-prediction layers: kept, not checked
            continue
        problems.append(f"{where(name)}: unexpected tensor (the config implies no such tensor)")
    if problems:
        raise checkpoint_error(f"{source.folder}: {len(problems)} problem(s) with the checkpoint:\n  "
                               + "\n  ".join(problems[:40]) + (f"\n  ... {len(problems) - 40} more"
                                                                if len(problems) > 40 else ""))
    return Match(plain, packed, unpacked, extra)


# ------------------------------------------------------------------------------------------------ extra files
def code_files(*modules):
    """The flat modules of transformers_kimi3 that `save_pretrained` copies for these modules: each module's file
    and its relative imports, recursively."""
    import importlib

    from transformers.dynamic_module_utils import get_relative_import_files

    files = []
    for name in modules:
        path = importlib.import_module(f"transformers_kimi3.{name}").__file__
        for f in [path] + list(get_relative_import_files(path)):
            if f not in files:
                files.append(f)
    return files


def copy_code(tmp, *modules):
    written = []
    for f in code_files(*modules):
        dst = os.path.join(tmp, os.path.basename(f))
        shutil.copyfile(f, dst)
        written.append(dst)
    return written


def copy_if_present(src, tmp, names):
    written = []
    for n in names:
        p = os.path.join(src, n)
        if os.path.isfile(p):
            shutil.copyfile(p, os.path.join(tmp, n))
            written.append(os.path.join(tmp, n))
    return written


def dump_json(path, data):
    with open(path, "w") as f:
        json.dump(data, f, indent=2, sort_keys=True, ensure_ascii=False)
        f.write("\n")


def auto_map_modules(data):
    """Module names referenced by every `auto_map` in a JSON document."""
    mods = set()

    def walk(d):
        if isinstance(d, dict):
            for k, v in d.items():
                if k == "auto_map" and isinstance(v, dict):
                    for ref in v.values():
                        for r in (ref if isinstance(ref, (list, tuple)) else [ref]):
                            if isinstance(r, str) and "." in r:
                                mods.add(r.split("--")[-1].rsplit(".", 1)[0])
                else:
                    walk(v)
        elif isinstance(d, list):
            for v in d:
                walk(v)

    walk(data)
    return mods


# ------------------------------------------------------------------------------------------------ forward check
def load_model_from_files(config, files, fix_state_dict=None):
    """Our model (fp32, experts dequantised) from shard files and a config object: what `from_pretrained` does,
    without needing config.json or the index on disk."""
    from transformers_kimi3.checkpoint import build_state_dict, read_tensors

    cfg = unquantized(config)
    cls = model_class(cfg)
    sd = build_state_dict(cls, cfg, read_tensors(files))
    if fix_state_dict is not None:
        sd = fix_state_dict(sd)
    return cls.from_pretrained(None, config=cfg, state_dict=sd, dtype=torch.float32).eval()


def make_forward_check(config, source_files, n_params, fix_source=None, tol=1e-6):
    def check(out_files, max_gb):
        need = n_params * 8 / 1e9
        if max_gb <= 0 or need > max_gb:
            return (f"forward check skipped: two fp32 copies need {need:.1f} GB (> --forward-check-max-gb "
                    f"{max_gb:g})")
        text = text_config_of(config)
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, text.vocab_size, (2, 24), generator=g)
        media = getattr(config, "media_placeholder_token_id", None)
        if media is not None:
            ids[ids == media] = (media + 1) % text.vocab_size
        logits = []
        for files, fix in ((source_files, fix_source), (out_files, None)):
            model = load_model_from_files(config, files, fix)
            with torch.no_grad():
                logits.append(model(input_ids=ids, use_cache=False).logits.float())
            del model
        ref, got = logits
        diff = float((got - ref).abs().max())
        rel = diff / max(float(ref.abs().max()), 1e-30)
        if not rel <= tol:
            raise checkpoint_error(f"forward check failed: output logits differ from the source's by {diff:.3g} "
                                   f"(relative {rel:.3g} > {tol:g})")
        return f"forward check: logits on random tokens {tuple(ids.shape)} equal (max abs diff {diff:.3g})"

    return check


def unpacked_params(shards):
    n = 0
    for _, specs in shards:
        for t in specs:
            n += math.prod(t.shape) * (2 if t.name.endswith(".weight_packed") else
                                       0 if t.name.endswith(".weight_scale") else 1)
    return n
