"""What the Triton kernels share: the optional import, launch-size helpers, device helpers, and
the header and control columns as constexprs.

Triton is optional: without it the names here still exist (``jit`` leaves a kernel a plain
function that is never launched, the constexprs are ints) so every op file imports, and
``ops.py`` resolves every op to its torch twin. Every Triton file of the package (the ops here,
the experts' GEMMs in ``experts/gemm/``) takes ``triton``, ``tl`` and Triton's other names from
this module, never from ``import triton`` itself, so each imports on an install without Triton;
a backend that needs the kernels refuses at selection time (``HAS_TRITON``).

Under ``TRITON_INTERPRET=1`` (the CPU tests) the kernels run on CPU tensors; the interpreter
truncates fp32 → bf16, so there the rounding is done on the bits (``_rounded``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from ep_runtime.kernels.layout import ChunkLayout
from ep_runtime.kernels.wire import HEADER_BYTES, HEADER_INTS, Control, Field

try:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice
    from triton.runtime.driver import driver as _driver
    from triton.runtime.jit import compute_cache_key as _cache_key
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # the torch twins run without it
    triton = tl = libdevice = _driver = _cache_key = None  # type: ignore[assignment]
    TensorDescriptor = None  # type: ignore[assignment,misc]

HAS_TRITON = triton is not None
_INTERPRETING = bool(HAS_TRITON and triton.knobs.runtime.interpret)


def jit(fn: Callable[..., Any]) -> Any:
    """``triton.jit``, or ``fn`` itself where Triton is missing (then it is never launched)."""
    return triton.jit(fn) if HAS_TRITON else fn


# the fast path reads JITFunction internals as of Triton 3.6 (checked on the H200): other
# versions take JITFunction.run
_FAST_LAUNCH = HAS_TRITON and not _INTERPRETING and triton.__version__.startswith("3.6.")


def _hooked(hook: Any) -> bool:
    """Whether a launch hook would do anything: Triton 3.6 holds an always-present
    ``HookChain`` (empty unless a profiler added a call); a plain callable counts as set."""
    return hook is not None and bool(getattr(hook, "calls", True))


class LaunchedKernel:
    """A Triton kernel launched without most of ``JITFunction.run``'s per-call Python.

    ``kernel[grid](*args, **constexprs)`` as with ``triton.jit``. Triton's own binder still
    specializes the arguments (so a call compiles, or reuses, exactly the variant
    ``JITFunction.run`` would pick, under the same cache key); a known variant is then launched
    straight through its compiled launcher, skipping what our kernels never need per call: the
    check of changed globals (ours are constants), the launch hooks' metadata, grid callables.
    On the H200 that saved 7–19 µs of a 35–60 µs launch (BENCHMARKS.md, ``profile_forward
    --launch-split``). The first call of a variant, and every call under the interpreter, with
    launch hooks set (a profiler) or pre-run hooks, goes through ``JITFunction.run`` itself."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn  # the JITFunction (or, without Triton, the plain function)

    def __getitem__(self, grid: Sequence[int]) -> Callable[..., Any]:
        return lambda *args, **kwargs: self.launch(grid, args, kwargs)

    def launch(self, grid: Sequence[int], args: tuple, kwargs: dict) -> Any:
        fn = self.fn
        runtime = triton.knobs.runtime
        if (
            not _FAST_LAUNCH
            or fn.pre_run_hooks
            or _hooked(runtime.launch_enter_hook)
            or _hooked(runtime.launch_exit_hook)
        ):
            return fn[grid](*args, **kwargs)
        kwargs["debug"] = kwargs.get("debug", fn.debug) or runtime.debug
        kwargs["instrumentation_mode"] = triton.knobs.compilation.instrumentation_mode
        device = _driver.active.get_current_device()
        kernel_cache, key_cache, _, _, binder = fn.device_caches[device]
        bound, specialization, options = binder(*args, **kwargs)
        kernel = kernel_cache.get(_cache_key(key_cache, specialization, options))
        if kernel is None or hasattr(kernel, "result"):  # compile (or await it) the usual way
            return fn.run(*args, grid=grid, warmup=False, **kwargs)
        size = len(grid)
        kernel.run(
            grid[0],
            grid[1] if size > 1 else 1,
            grid[2] if size > 2 else 1,
            _driver.active.get_current_stream(device),
            kernel.function,
            kernel.packed_metadata,
            None,  # launch metadata: only launch hooks read it, and none is set
            None,  # the (empty) enter and exit hooks: the launcher calls nothing
            None,
            *bound.values(),
        )
        return kernel


def kernel(fn: Callable[..., Any] | None = None, *, do_not_specialize: Sequence[str] = ()) -> Any:
    """``@kernel`` (or ``@kernel(do_not_specialize=[...])``) for a launched kernel: ``triton.jit``
    wrapped in a ``LaunchedKernel``; the plain function where Triton is missing. Device helpers
    called from kernels keep ``@jit``."""

    def wrap(f: Callable[..., Any]) -> Any:
        if not HAS_TRITON:
            return f
        return LaunchedKernel(triton.jit(f, do_not_specialize=list(do_not_specialize)))

    return wrap if fn is None else wrap(fn)


def _constexpr(value: int) -> Any:
    return tl.constexpr(value) if HAS_TRITON else value


INTERPRET = _constexpr(_INTERPRETING)

# header columns and control entries, as constexprs the kernels can read
F_STATUS = _constexpr(int(Field.STATUS))
F_SEQ = _constexpr(int(Field.SEQ))
F_FINGERPRINT = _constexpr(int(Field.FINGERPRINT))
F_LAYER = _constexpr(int(Field.LAYER))
F_PHASE = _constexpr(int(Field.PHASE))
F_TOP_K = _constexpr(int(Field.TOP_K))
F_NUM_CHUNKS = _constexpr(int(Field.NUM_CHUNKS))
F_NUM_ROWS = _constexpr(int(Field.NUM_ROWS))
F_NUM_SLOTS = _constexpr(int(Field.NUM_SLOTS))
C_SEQ = _constexpr(int(Control.SEQ))
C_BAD_IDS = _constexpr(int(Control.BAD_IDS))
C_FAILED_STATUS = _constexpr(int(Control.FAILED_STATUS))
C_FAILED_RANK = _constexpr(int(Control.FAILED_RANK))
C_FAILED_SEQ = _constexpr(int(Control.FAILED_SEQ))
C_FORWARD_FAILED = _constexpr(int(Control.FORWARD_FAILED))
C_ROUTE_TICKET = _constexpr(int(Control.ROUTE_TICKET))
C_ROUTE_DONE = _constexpr(int(Control.ROUTE_DONE))
HINTS = _constexpr(HEADER_INTS)
HBYTES = _constexpr(HEADER_BYTES)

MAX_ROW_BLOCK = 2048  # elements of a row one program copies per step
TILE_ELEMENTS = 4096  # bound on the elements of the 2-D/3-D index tiles (registers)


def _fix_interpreter_scalars() -> None:
    """Triton 3.6's interpreter holds a scalar argument as a 1-element array and converts it with
    ``int(array)``, which NumPy ≥ 2.4 refuses: every loop bounded by a kernel argument fails.
    Under the interpreter only, convert its one element instead."""
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor
    if getattr(original, "ep_runtime_fixed", False):
        return

    def patched(tensor, scope) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched.ep_runtime_fixed = True  # type: ignore[attr-defined]
    interpreter._patch_lang_tensor = patched


if INTERPRET:
    _fix_interpreter_scalars()


# --------------------------------------------------------------------------- launch helpers
def pow2(n: int) -> int:
    """Smallest power of two ≥ max(n, 1) (plain Python: Triton's ``next_power_of_2`` is a
    constexpr function, several microseconds a call, and launches call this ~16 times)."""
    return 1 << (max(int(n), 1) - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for launch grids (plain Python, as ``pow2``)."""
    return -(-a // b)


def row_block(length: int, element_size: int) -> tuple[int, int]:
    """(BLOCK, num_warps) for programs that each copy BLOCK elements of a row (16 bytes per
    thread per access); above ``MAX_ROW_BLOCK``, the power of two (≥ 512) wasting least."""
    if length <= MAX_ROW_BLOCK:
        block = pow2(length)
    else:
        candidates = (MAX_ROW_BLOCK, MAX_ROW_BLOCK // 2, MAX_ROW_BLOCK // 4)
        block = min(candidates, key=lambda b: (-(-length // b) * b - length, -b))
    warps = max(1, min(8, block * element_size // 512))
    return block, warps


def stride_units(stride: int, element_size: int) -> tuple[int, int]:
    """``(stride // unit, unit)`` for the largest unit of at most 16 bytes dividing ``stride``.
    A kernel computing ``row · units · UNIT`` (``UNIT`` a constexpr) knows rows start 16-byte
    aligned and vectorises; Triton only marks integer arguments divisible by 16 elements."""
    unit = max(1, 16 // element_size)
    while stride % unit:
        unit //= 2
    return stride // unit, unit


def capacity_arg(chunks: ChunkLayout) -> int:
    """The chunk layout for a kernel: capacity, or -1 for exact sizes."""
    return -1 if chunks.capacity is None else chunks.capacity


# --------------------------------------------------------------------------- device helpers
@jit
def rounded(x, dtype: tl.constexpr):
    """fp32 ``x`` → ``dtype``, rounded to nearest even. The interpreter truncates fp32 → bf16,
    so there the rounding is done on the bits (NaN → 0x7FC0, as torch on CPU)."""
    if INTERPRET:
        if dtype == tl.bfloat16:
            bits = x.to(tl.uint32, bitcast=True)
            bits = (bits + (0x7FFF + ((bits >> 16) & 1))) >> 16
            bits = tl.where(x != x, 0x7FC0, bits)
            y = bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)
        else:
            y = x.to(dtype)
    else:
        y = x.to(dtype)
    return y


@jit
def exp_fp32(x):
    """Full-precision fp32 exp (libdevice), as torch's; numpy's under the interpreter."""
    return tl.exp(x) if INTERPRET else libdevice.exp(x)


@jit
def device_chunk_starts(
    counts,
    counts_stride,
    world,
    WP: tl.constexpr,
    header_rows,
    capacity,
):
    """``[WP]`` int64 first row of each chunk (entries ≥ world meaningless) and ``[WP]`` token
    rows per chunk, from the per-chunk counts on the device (exact) or the stride (capacity)."""
    w = tl.arange(0, WP)
    rows = tl.load(counts + w * counts_stride, mask=w < world, other=0).to(tl.int64)
    if capacity >= 0:
        starts = w.to(tl.int64) * (header_rows + capacity)
    else:
        sizes = tl.where(w < world, rows + header_rows, 0)
        starts = tl.cumsum(sizes, 0) - sizes
    return starts, rows
