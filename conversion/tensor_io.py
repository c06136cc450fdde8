"""Reading source checkpoints and writing output shards.

Sources are read through `safetensors.safe_open` (read-only memory maps, never pickle): the library checks each
header (truncated files, invalid JSON, overlapping or missing byte ranges, a shape that does not match its byte
range) and its errors are re-raised naming the file, or the tensor and the file. Output shards are streamed to disk
one tensor at a time (see `write_shard`), then read back by `safe_open` for verification.
"""

import contextlib
import errno
import hashlib
import json
import math
import os
import sys
from dataclasses import dataclass

import torch
from safetensors import SafetensorError, safe_open

from transformers_kimi3.checkpoint import CheckpointError, weight_files

INDEX = "model.safetensors.index.json"
# safetensors dtype -> bytes per element, for the dtypes this tool reads and writes
ST_ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1, "I16": 2, "U16": 2, "F16": 2,
               "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}
FLOATS = ("BF16", "F16", "F32")
_TORCH_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
                 "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "I32": torch.int32, "I64": torch.int64,
                 "BOOL": torch.bool}
_ST_DTYPES = {v: k for k, v in _TORCH_DTYPES.items()}


def torch_dtype(st):
    if st not in _TORCH_DTYPES:
        raise CheckpointError(f"safetensors dtype {st} is not supported here")
    return _TORCH_DTYPES[st]


def st_dtype(dtype):
    return _ST_DTYPES[dtype]


def open_safetensors(path):
    """`safe_open` of one file; a file the library refuses raises an error naming it."""
    try:
        return safe_open(path, framework="pt")
    except SafetensorError as e:
        raise CheckpointError(f"{path}: not a readable safetensors file (truncated or corrupt): {e}") from None


def dump_json(path, data):
    with open(path, "w") as f:
        json.dump(data, f, indent=2, sort_keys=True, ensure_ascii=False)
        f.write("\n")


# ------------------------------------------------------------------------------------------------ reading
@dataclass(frozen=True)
class SrcTensor:
    name: str
    file: str
    dtype: str
    shape: tuple
    position: int  # rank of its data in its file

    @property
    def nbytes(self):
        return math.prod(self.shape) * ST_ITEMSIZE[self.dtype]


def file_tensors(path):
    """name -> SrcTensor of one file, without reading data."""
    out = {}
    with open_safetensors(path) as f:
        # `offset_keys` (the storage order) exists in newer safetensors releases; name order otherwise
        names = f.offset_keys() if hasattr(f, "offset_keys") else f.keys()
        for i, name in enumerate(names):
            view = f.get_slice(name)
            dtype, shape = view.get_dtype(), tuple(view.get_shape())
            if dtype not in ST_ITEMSIZE:
                raise CheckpointError(f"{name} in {path}: dtype {dtype} is not supported by this tool")
            out[name] = SrcTensor(name, path, dtype, shape, i)
    return out


class Source:
    """A checkpoint folder: the header of every shard, the index checked against them, and read access to one
    tensor at a time, each passed through `value_checks(name, tensor, path)` when given."""

    def __init__(self, folder, value_checks=None):
        self.folder = os.path.abspath(folder)
        if not os.path.isdir(self.folder):
            raise CheckpointError(f"{folder} is not a folder")
        self.files = weight_files(self.folder)
        self.has_index = os.path.exists(os.path.join(self.folder, INDEX))
        self.tensors = {}
        for path in self.files:
            for name, t in file_tensors(path).items():
                if name in self.tensors:
                    raise CheckpointError(f"tensor {name} appears in both {self.tensors[name].file} and {path}")
                self.tensors[name] = t
        if self.has_index:
            self._check_index(json.load(open(os.path.join(self.folder, INDEX)))["weight_map"])
        self.value_checks = value_checks
        self._handles = {}

    def _check_index(self, weight_map):
        for name, fname in weight_map.items():
            t = self.tensors.get(name)
            if t is None or os.path.basename(t.file) != fname:
                raise CheckpointError(f"{name}: the index {INDEX} places it in {fname}, but "
                                      f"{'it is not in ' + fname if t is None else 'it is in ' + t.file}")
        extra = sorted(set(self.tensors) - set(weight_map))
        if extra:
            raise CheckpointError(f"{extra[0]} in {self.tensors[extra[0]].file}: not listed in {INDEX}"
                                  + (f" ({len(extra)} such tensors)" if len(extra) > 1 else ""))

    def order(self):
        """Source tensors in storage order: file by file, in each file by position."""
        rank = {f: i for i, f in enumerate(self.files)}
        return sorted(self.tensors.values(), key=lambda t: (rank[t.file], t.position))

    def stats(self):
        """What identifies the source's files for a resumed run: name, size, modification time."""
        return [(os.path.basename(f), os.path.getsize(f), os.stat(f).st_mtime_ns) for f in self.files]

    def _handle(self, path):
        if path not in self._handles:
            if len(self._handles) >= 2:  # never keep more than two shards mapped
                self._handles.pop(next(iter(self._handles)))
            self._handles[path] = open_safetensors(path)
        return self._handles[path]

    def read(self, name):
        info = self.tensors[name]
        try:
            t = self._handle(info.file).get_tensor(name)
        except SafetensorError as e:
            raise CheckpointError(f"{name} in {info.file}: unreadable ({e})") from e
        if self.value_checks is not None:
            self.value_checks(name, t, info.file)
        return t

    def close(self):
        self._handles.clear()


# ------------------------------------------------------------------------------------------------ writing
def _header(specs):
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for t in specs:
        header[t.name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-(8 + len(blob)) % 8)  # the data section starts 8-byte aligned, padded with spaces
    return len(blob).to_bytes(8, "little") + blob


def shard_file_size(specs):
    """Bytes of the safetensors file holding the planned tensors `specs`: header and data."""
    return len(_header(specs)) + sum(t.nbytes for t in specs)


def _tensor_bytes(t):
    t = t.detach().contiguous().reshape(-1)
    return t.view(torch.uint8).numpy() if t.numel() else b""


def write_shard(path, specs, produce, progress):
    """Write the planned tensors `specs` (each with name, dtype, shape, nbytes) into the safetensors file `path`,
    computing each with `produce(spec)`. Returns the file's sha256.

    safetensors' `save_file` needs every tensor of a file in memory at once, and an output shard can be tens of
    GB; this writer takes the header from the plan and streams one tensor at a time. The file appears at `path`
    only when complete (`path + ".tmp"` until then); a write that fails removes its `.tmp` file, whose space a
    full disk needs back (a resumed run writes the whole shard again)."""
    if sys.byteorder != "little":
        raise RuntimeError("safetensors is little-endian; this machine is not")
    tmp = path + ".tmp"
    try:
        digest = _stream(tmp, specs, produce, progress)
        if sha256_file(tmp) != digest:
            raise OSError(errno.EIO, "the bytes on disk differ from the bytes written", tmp)
    except Exception:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
    os.replace(tmp, path)
    return digest


def _stream(tmp, specs, produce, progress):
    """The header and each tensor of `specs` written to `tmp`, synced to disk. Returns the sha256 written."""
    h = hashlib.sha256()
    with open(tmp, "wb") as f:
        head = _header(specs)
        f.write(head)
        h.update(head)
        for t in specs:
            value = produce(t)
            if st_dtype(value.dtype) != t.dtype or tuple(value.shape) != tuple(t.shape):
                raise AssertionError(f"{t.name}: produced {value.dtype} {tuple(value.shape)}, planned {t.dtype} "
                                     f"{list(t.shape)}")
            data = _tensor_bytes(value)
            f.write(data)
            h.update(data)
            progress.update(t.nbytes)
        f.flush()
        os.fsync(f.fileno())
    return h.hexdigest()


def sha256_file(path, bufsize=1 << 24):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(bufsize):
            h.update(chunk)
    return h.hexdigest()


def write_index(folder, shards):
    """The safetensors index of `shards` [(file name, [planned tensors])]."""
    dump_json(os.path.join(folder, INDEX),
              {"metadata": {"total_size": sum(t.nbytes for _, specs in shards for t in specs)},
               "weight_map": {t.name: fname for fname, specs in shards for t in specs}})
