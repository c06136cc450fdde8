"""Kernel launches that skip Triton's per-call argument binding.

`launch(fn, grid, args, **constexprs)` does what `fn[grid](*args, **constexprs)` does. The first call for each
specialisation goes through Triton, which compiles the kernel (or finds it in its cache) and returns it. Later calls
with the same specialisation hand the arguments straight to that compiled kernel's launcher.

Triton's own launch path binds the arguments and computes their specialisation. It then builds the cache key and
reads the stream and launch metadata: tens of microseconds of host time per launch, which is most of an eager
decode step's host time. Here the key holds:
- each tensor's dtype and 16-byte alignment;
- each integer's value (Triton specialises on it being 1, a multiple of 16, or wider than 32 bits);
- every constexpr and launch option, and the device.
This key is finer than Triton's, so a cached kernel is always the one Triton would pick.

`args` are the kernel's leading parameters, in order; the keywords give the ones after them (constexprs, or runtime
ones passed by name, like the recurrent kernel's H) and launch options. Direct launches are
off under the interpreter, while Triton's launch hooks are set (profilers), inside `direct_launch(False)`, and after
any direct launch has failed. A failure is logged once; from then on every launch goes through Triton. Triton
settings changed after a kernel's first launch (its debug knobs, say) do not reach the cached kernels: run such code
inside `direct_launch(False)`.
"""

import contextlib
import inspect
import itertools
import logging

import torch

from ._host import interpreter_enabled

logger = logging.getLogger(__name__)

_COMPILED = {}  # key -> (compiled kernel, values of the parameters after the runtime arguments)
_FAILED = []  # the error of a direct launch that failed: Triton's path from then on
_DIRECT = [0]  # direct launches so far (kernel_status, tests)
_ALLOWED = [True]  # direct_launch()
_MAX_ENTRIES = 4096
_OPTIONS = ("num_warps", "num_stages", "num_ctas", "maxnreg")  # launch options, not kernel parameters


try:
    from triton import knobs as _knobs
except ImportError:  # no Triton, or one without knobs (< 3.4, its launch hooks live elsewhere): Triton's path
    _knobs = None


def _switched_on():
    # what launch() checks at each call; the interpreter runs on CPU tensors, which never take the direct path
    return (not _FAILED and _knobs is not None and not _hook_set(_knobs.runtime.launch_enter_hook)
            and not _hook_set(_knobs.runtime.launch_exit_hook) and _ALLOWED[0])


@contextlib.contextmanager
def direct_launch(allowed: bool):
    """Allow or forbid direct launches inside the block (forbid: every launch through Triton, e.g. to time Triton's
    own launch path, or after changing Triton settings that cached kernels would not see)."""
    saved = _ALLOWED[0]
    _ALLOWED[0] = bool(allowed)
    try:
        yield
    finally:
        _ALLOWED[0] = saved


def _hook_set(hook):
    # None in older Triton versions; a HookChain (never None) with its list of calls in newer ones
    return hook is not None and bool(getattr(hook, "calls", True))


def enabled():
    """Whether launches may go straight to the compiled kernel (see the module docstring)."""
    return _switched_on() and not interpreter_enabled()


def _constexpr_key(fn, constexprs):
    """A number for fn with these constexprs and options, the same for the same values: plain values as they are;
    fn and the others (Gluon layouts) by identity, since their hashes are Python code (~1 us; microseconds for a
    layout). The table keeps those objects alive, so an identity is never reused while its entry exists. A plan's
    launcher keeps the number and hashes only that at each launch."""
    key = (id(fn), tuple(constexprs),
           *[v if v.__class__ in _PLAIN else ("bool", v) if v.__class__ is bool else id(v)
             for v in constexprs.values()])
    number = _CKEYS.get(key)
    if number is None:
        if len(_CKEYS) >= _MAX_ENTRIES:  # numbers are never reused: a launcher made before still has its own
            _CKEYS.clear()
        number = _CKEYS[key] = (next(_NUMBERS), fn, constexprs)
    return number[0]


_CKEYS = {}  # constexpr key -> (its number, the kernel and constexprs, kept alive for the identities in the key)
_NUMBERS = itertools.count()


def _args_key(args):
    """The arguments' part: each tensor's dtype and 16-byte alignment, each integer's value (shapes and strides: a
    handful of values per kernel), floats by type only."""
    return tuple([(a.dtype, a.data_ptr() & 15) if isinstance(a, torch.Tensor) else float if a.__class__ is float
                  else ("bool", a) if a.__class__ is bool else a for a in args])


_PLAIN = (int, float, str, type(None))  # bools apart: True == 1, but Triton compiles them as different types


def _trailing(fn, n_args, constexprs):
    """Values of fn's parameters after the n_args runtime arguments, in signature order, or None where the
    signature does not have that shape (a runtime parameter after a constexpr, an unknown keyword)."""
    params = fn.params
    names = {p.name for p in params}
    given = {k: v for k, v in constexprs.items() if k in names}  # num_warps: a Gluon kernel's parameter too
    if any(p.name in given for p in params[:n_args]) or not set(constexprs) - names <= set(_OPTIONS):
        return None
    tail = []
    for p in params[n_args:]:
        if p.name in given:
            tail.append(given[p.name])
        elif p.is_constexpr and p.default is not inspect.Parameter.empty:
            tail.append(p.default)
        else:
            return None
    return tuple(tail)


def _on_gpu(args):
    a = args[0]  # every kernel here takes a tensor first
    return isinstance(a, torch.Tensor) and a.is_cuda


def _device():
    return torch.cuda.current_device()


_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # what Triton's own launch path reads


def _stream(device):
    return _RAW_STREAM(device) if _RAW_STREAM is not None else torch.cuda.current_stream(device).cuda_stream


class Launcher:
    """fn with its constexprs and launch options bound: `Launcher(fn, **constexprs)(grid, args)` is
    `launch(fn, grid, args, **constexprs)` with the constexprs' part of the key built once (callers that keep a
    launch plan: ~20 constexprs of the packed GEMM are a few microseconds of host time per launch)."""

    __slots__ = ("fn", "constexprs", "_ckey")

    def __init__(self, fn, **constexprs):
        self.fn, self.constexprs = fn, constexprs
        self._ckey = _constexpr_key(fn, constexprs)

    def __call__(self, grid, args):
        fn, constexprs = self.fn, self.constexprs
        if not (_on_gpu(args) and _switched_on()):
            fn[grid](*args, **constexprs)
            return
        device = _device()
        key = (self._ckey, device, _args_key(args))
        entry = _COMPILED.get(key)
        if entry is None:
            kernel = fn[grid](*args, **constexprs)
            tail = _trailing(fn, len(args), constexprs) if kernel is not None else None
            if tail is not None and hasattr(kernel, "packed_metadata"):
                if len(_COMPILED) >= _MAX_ENTRIES:  # integers that keep changing: start over rather than grow
                    _COMPILED.clear()
                _COMPILED[key] = (kernel, tail)
            return
        kernel, tail = entry
        g = tuple(grid) + (1, 1)
        try:
            kernel.run(g[0], g[1], g[2], _stream(device), kernel.function, kernel.packed_metadata, None, None, None,
                       *args, *tail)
            _DIRECT[0] += 1
        except Exception as ex:  # noqa: BLE001 - a launcher of another Triton version: its own path from now on
            _FAILED.append(repr(ex))
            _COMPILED.clear()
            logger.warning("kimi3_kernels: direct kernel launches failed (%r); launching through Triton from now on",
                           ex)
            fn[grid](*args, **constexprs)


def launch(fn, grid, args, **constexprs):
    """fn[grid](*args, **constexprs), straight to the compiled kernel once Triton has returned it for this
    specialisation. grid: a tuple of one to three ints."""
    Launcher(fn, **constexprs)(grid, args)


def status():
    """What kernel_status() reports: whether direct launches are on, how many specialisations they cover, how many
    launches went direct, and a failure if one happened."""
    return {"direct_launch": enabled(), "direct_launch_kernels": len(_COMPILED), "direct_launches": _DIRECT[0],
            "direct_launch_error": _FAILED[0] if _FAILED else None}
