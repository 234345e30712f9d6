"""A safetensors checkpoint's tensor names, shapes and files, and a reader that reads tensors (or
rows of them) one name at a time, counting what it read.

``CheckpointIndex.open`` reads only metadata: the index file (``model.safetensors.index.json``)
and each shard's header (``safe_open`` + ``get_slice(name).get_shape()``), never tensor data.
``TensorReader`` reads a tensor with ``get_tensor`` or rows of it with ``get_slice`` and keeps
at most one shard open, so a rank touches only the bytes of the tensors it asks for. It checks
every tensor as loaded (after the cast) with one reduction, ``torch.aminmax`` (NaN propagates to
both ends, an Inf is one of them), and lists those holding NaN or Inf as ``NonFinite``.

Needs the ``safetensors`` package (a dependency of the ``hf`` extra's ``transformers``).
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ep_runtime.types import EPInputError

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

# safetensors dtype names → (bytes per element, torch dtype)
DTYPES: dict[str, tuple[int, torch.dtype]] = {
    "F64": (8, torch.float64),
    "F32": (4, torch.float32),
    "F16": (2, torch.float16),
    "BF16": (2, torch.bfloat16),
    "F8_E4M3": (1, torch.float8_e4m3fn),
    "F8_E5M2": (1, torch.float8_e5m2),
    "I64": (8, torch.int64),
    "I32": (4, torch.int32),
    "I16": (2, torch.int16),
    "I8": (1, torch.int8),
    "U8": (1, torch.uint8),
    "BOOL": (1, torch.bool),
}
FP8_DTYPES = frozenset({"F8_E4M3", "F8_E5M2"})
FLOAT_DTYPES = frozenset({"F64", "F32", "F16", "BF16"} | FP8_DTYPES)


def _safetensors() -> Any:
    try:
        import safetensors
    except ImportError:  # pragma: no cover - exercised only where the package is missing
        raise ImportError(
            "reading checkpoints needs safetensors: pip install 'ep_runtime[hf]'"
        ) from None
    return safetensors


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of the checkpoint, from its shard's header."""

    name: str
    file: Path
    shape: tuple[int, ...]
    dtype: str  # safetensors' name: "BF16", "F32", "F8_E4M3", ...

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPES[self.dtype][0]

    @property
    def is_fp8(self) -> bool:
        return self.dtype in FP8_DTYPES

    @property
    def is_float(self) -> bool:
        return self.dtype in FLOAT_DTYPES


@dataclass(frozen=True)
class CheckpointIndex:
    """Every tensor of a checkpoint (a directory with an index or one file): name → file, shape,
    dtype. ``source`` is the index file, or the single file, that errors name."""

    source: Path
    tensors: dict[str, TensorInfo]

    @staticmethod
    def open(path: str | Path) -> CheckpointIndex:
        """Read the metadata of the checkpoint at ``path``: a directory holding
        ``model.safetensors.index.json`` (or a single ``model.safetensors``), or one
        ``.safetensors`` file. Every file the index names must exist and hold its tensors."""
        path = Path(path)
        if path.is_dir() and (path / INDEX_FILE).is_file():
            source = path / INDEX_FILE
            weight_map = _read_weight_map(source)
            files = {name: path / file for name, file in weight_map.items()}
        elif path.is_dir() and (path / SINGLE_FILE).is_file():
            source, files = path / SINGLE_FILE, None
        elif path.is_file() and path.suffix == ".safetensors":
            source, files = path, None
        else:
            raise EPInputError(
                "checkpoint",
                f"a directory with {INDEX_FILE} or {SINGLE_FILE}, or a .safetensors file",
                str(path),
            )
        if files is None:
            headers = {source: _read_header(source)}
            files = {name: source for name in headers[source]}
        else:
            headers = {}
            for file in sorted(set(files.values())):
                if not file.is_file():
                    raise EPInputError(
                        f"checkpoint file {file.name}", f"a file named in {source}", "missing"
                    )
                headers[file] = _read_header(file)
        tensors: dict[str, TensorInfo] = {}
        for name, file in files.items():
            entry = headers[file].get(name)
            if entry is None:
                raise EPInputError(
                    f"checkpoint tensor {name}", f"in {file} (as {source.name} says)", "missing"
                )
            shape, dtype = entry
            tensors[name] = TensorInfo(name, file, shape, dtype)
        return CheckpointIndex(source, tensors)

    def get(self, name: str) -> TensorInfo | None:
        return self.tensors.get(name)

    def require(
        self, name: str, shape: tuple[int, ...], what: str, floating: bool = True
    ) -> TensorInfo:
        """The tensor ``name`` with ``shape``, in a floating-point dtype where ``floating`` (the
        model's tensor is: an integer cast to it would pass for weights), or the error naming the
        tensor and its file (``what``: the tensor's role in words, e.g. "expert 3 of 64")."""
        info = self.tensors.get(name)
        if info is None:
            raise EPInputError(
                f"checkpoint tensor {name}",
                f"{what} of shape {list(shape)} in {self.source}",
                "missing",
            )
        if info.shape != tuple(shape):
            raise EPInputError(
                f"checkpoint tensor {name} in {info.file}",
                f"{what} of shape {list(shape)}",
                f"shape {list(info.shape)}",
            )
        if info.dtype not in DTYPES:
            raise EPInputError(
                f"checkpoint tensor {name} in {info.file}",
                f"one of the dtypes {', '.join(DTYPES)}",
                info.dtype,
            )
        if floating and not info.is_float:
            raise EPInputError(
                f"checkpoint tensor {name} in {info.file}",
                f"{what} in a floating-point dtype ({', '.join(sorted(FLOAT_DTYPES))})",
                info.dtype,
            )
        return info

    @property
    def nbytes(self) -> int:
        return sum(info.nbytes for info in self.tensors.values())


def _read_weight_map(index_file: Path) -> dict[str, str]:
    try:
        weight_map = json.loads(index_file.read_text())["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise EPInputError(
            f"checkpoint index {index_file}", "JSON with a 'weight_map' object", repr(error)
        ) from None
    if not isinstance(weight_map, dict):
        raise EPInputError(f"checkpoint index {index_file}", "'weight_map' an object", weight_map)
    return weight_map


def _read_header(file: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """name → (shape, dtype) from one shard's header (no tensor data is read)."""
    safetensors = _safetensors()
    try:
        with safetensors.safe_open(str(file), framework="pt") as handle:
            header = {}
            for name in handle.keys():  # noqa: SIM118 (a safe_open handle is not a dict)
                tensor = handle.get_slice(name)
                header[name] = (tuple(tensor.get_shape()), tensor.get_dtype())
            return header
    except (OSError, safetensors.SafetensorError) as error:
        raise EPInputError(f"checkpoint file {file}", "a safetensors file", repr(error)) from None


# values -----------------------------------------------------------------------------------------
def all_finite(tensor: torch.Tensor) -> bool:
    """Whether every value of ``tensor`` is finite, in one reduction: its min and max are both
    finite exactly then (``aminmax`` propagates NaN; an Inf is the max or the min)."""
    if tensor.numel() == 0 or not tensor.is_floating_point():
        return True
    return bool(torch.isfinite(torch.stack(torch.aminmax(tensor))).all())


@dataclass(frozen=True)
class NonFinite:
    """A tensor read with NaN or Inf values, counted as loaded (after the cast)."""

    name: str
    file: str
    nan: int
    inf: int
    numel: int
    dtype: str  # as loaded: "bfloat16", "float32", ...
    rows: tuple[int, ...]  # the rows (experts of a fused expert tensor) holding them, if rows read

    @staticmethod
    def count(info: TensorInfo, loaded: torch.Tensor, rows: range | None) -> NonFinite:
        """Where ``loaded`` (``info``, or rows ``rows`` of it) is not finite (the error path)."""
        bad_rows = ()
        if rows is not None:
            bad = (~torch.isfinite(loaded)).flatten(1).any(1).nonzero().flatten()
            bad_rows = tuple(rows.start + int(i) for i in bad)
        return NonFinite(
            name=info.name,
            file=str(info.file),
            nan=int(torch.isnan(loaded).sum()),
            inf=int(torch.isinf(loaded).sum()),
            numel=loaded.numel(),
            dtype=str(loaded.dtype).removeprefix("torch."),
            rows=bad_rows,
        )

    def error(self, others: Sequence[NonFinite] = ()) -> EPInputError:
        """The refusal naming the tensor and its file, then ``others`` (further such tensors:
        their count, the first three by name)."""
        given = f"{self.nan} NaN and {self.inf} Inf among its {self.numel} values"
        if self.rows:
            given += f" (in experts {list(self.rows)})"
        if others:
            names = ", ".join(other.name for other in others[:3])
            given += f"; NaN or Inf in {len(others)} more: {names}" + (
                ", ..." if len(others) > 3 else ""
            )
        return EPInputError(
            f"checkpoint tensor {self.name} in {self.file}",
            f"finite values (as loaded in {self.dtype})",
            given,
        )


# reading ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TensorRead:
    """One read: a whole tensor (``rows`` None) or rows ``[start, stop)`` of its first dim."""

    name: str
    rows: tuple[int, int] | None
    nbytes: int


@dataclass(frozen=True)
class LoadProgress:
    """Where one rank's load stands."""

    rank: int
    bytes_read: int
    bytes_total: int  # what this rank reads in all
    tensors_read: int
    tensors_total: int
    elapsed_s: float
    done: bool


ProgressCallback = Callable[[LoadProgress], None]


class ProgressPrinter:
    """The default progress callback: one line on stderr at most every ``interval_s`` seconds,
    and a last line when the load took longer than that (short loads print nothing)."""

    def __init__(self, interval_s: float = 5.0) -> None:
        self.interval_s = interval_s
        self._last = 0.0

    def __call__(self, progress: LoadProgress) -> None:
        due = progress.elapsed_s - self._last >= self.interval_s
        if not due and not (progress.done and self._last > 0):
            return
        self._last = progress.elapsed_s
        rate = progress.bytes_read / max(progress.elapsed_s, 1e-9) / 1e6
        print(
            f"[rank {progress.rank}] checkpoint: {progress.bytes_read / 1e9:.2f} of "
            f"{progress.bytes_total / 1e9:.2f} GB, {progress.tensors_read}/"
            f"{progress.tensors_total} tensors, {progress.elapsed_s:.0f} s ({rate:.0f} MB/s)"
            + (", done" if progress.done else ""),
            file=sys.stderr,
            flush=True,
        )


@dataclass
class TensorReader:
    """Reads tensors of ``index`` by name, one shard open at a time; records every read, the
    time spent reading, and each tensor that holds NaN or Inf as loaded (``nonfinite``)."""

    index: CheckpointIndex
    rank: int
    bytes_total: int
    tensors_total: int
    progress: ProgressCallback
    reads: list[TensorRead] = field(default_factory=list)
    bytes_read: int = 0
    read_s: float = 0.0  # inside the reads: opening shards, reading, casting, checking, copying
    nonfinite: list[NonFinite] = field(default_factory=list)
    _started: float = field(default_factory=time.perf_counter)
    _file: Path | None = None
    _handle: Any = None

    def read(self, info: TensorInfo, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """The whole tensor, copied to ``device`` in ``dtype`` (the caller owns the memory:
        what ``get_tensor`` returns maps the file)."""
        started = time.perf_counter()
        value = self._open(info.file).get_tensor(info.name).to(device, dtype, copy=True)
        self._check(info, value, None)
        self._record(TensorRead(info.name, None, info.nbytes), started)
        return value

    def read_into(self, info: TensorInfo, out: torch.Tensor, rows: range | None = None) -> None:
        """The tensor, or rows ``rows`` of its first dimension (only those bytes are read),
        copied into ``out`` (cast to its dtype, moved to its device)."""
        started = time.perf_counter()
        handle = self._open(info.file)
        if rows is None:
            out.copy_(handle.get_tensor(info.name))
            read = TensorRead(info.name, None, info.nbytes)
        else:
            out.copy_(handle.get_slice(info.name)[rows.start : rows.stop])
            row_bytes = info.nbytes // info.shape[0]
            read = TensorRead(info.name, (rows.start, rows.stop), row_bytes * len(rows))
        self._check(info, out, rows)
        self._record(read, started)

    def close(self) -> None:
        """Close the open shard and report the end of the load."""
        self._close_file()
        self.progress(self._progress(done=True))

    def _open(self, file: Path) -> Any:
        if file != self._file:
            self._close_file()
            self._handle = _safetensors().safe_open(str(file), framework="pt").__enter__()
            self._file = file
        return self._handle

    def _close_file(self) -> None:
        if self._handle is not None:
            self._handle.__exit__(None, None, None)
        self._handle, self._file = None, None

    def _check(self, info: TensorInfo, loaded: torch.Tensor, rows: range | None) -> None:
        if not all_finite(loaded):
            self.nonfinite.append(NonFinite.count(info, loaded, rows))

    def _record(self, read: TensorRead, started: float) -> None:
        self.reads.append(read)
        self.bytes_read += read.nbytes
        self.read_s += time.perf_counter() - started
        self.progress(self._progress(done=False))

    def _progress(self, done: bool) -> LoadProgress:
        return LoadProgress(
            rank=self.rank,
            bytes_read=self.bytes_read,
            bytes_total=self.bytes_total,
            tensors_read=len(self.reads),
            tensors_total=self.tensors_total,
            elapsed_s=time.perf_counter() - self._started,
            done=done,
        )
