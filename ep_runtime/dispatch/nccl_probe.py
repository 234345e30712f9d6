"""What NCCL this process runs, and whether its communicators offer GIN (GPU-Initiated Networking).

DeepEP V2 needs NCCL >= 2.30.4, the *same* libnccl as torch, and (across nodes) NCCL GIN. This
module answers those questions through ctypes on the libnccl torch loaded, without deep_ep:
``ncclGetVersion`` for the version, the ``ncclCommQueryProperties`` symbol (absent before 2.29,
so a deep_ep V2 build fails to import on such an NCCL), and ``ginType`` / ``railedGinType`` of a
warmed NCCL process group's communicator (docs/deepep.md, "GIN").

``python -m ep_runtime.dispatch.nccl_probe`` prints one line describing this machine.
"""

from __future__ import annotations

import ctypes
import os
import tempfile
from dataclasses import dataclass

import torch
import torch.distributed as dist

DEEPEP_MIN_NCCL = (2, 30, 4)  # DeepEP V2 README "Requirements"; vLLM DEEPEP_V2_MIN_NCCL_VERSION_RAW
QUERY_PROPERTIES_SYMBOL = "ncclCommQueryProperties"
NCCL_API_MAGIC = 0xCAFEBEEF  # nccl.h: "#define NCCL_API_MAGIC 0xcafebeef"
# The ncclCommProperties layout below is NCCL 2.31.2's; NCCL fills the struct for the version we
# declare (min(runtime, this)), so a newer runtime never writes a layout we did not declare.
PROPERTIES_LAYOUT_VERSION = 23102
PROPERTIES_SPARE_BYTES = 1024  # zeroed room after the struct, should a runtime write more
GIN_TYPE_NAMES = {0: "NONE", 2: "PROXY", 3: "GDAKI", 4: "GPI", 5: "EFA_GDA"}  # ncclGinType_t


class _CommProperties(ctypes.Structure):
    """``ncclCommProperties_t`` (nccl.h, NCCL 2.31.2); enums are C ``int``."""

    _fields_ = [
        ("size", ctypes.c_size_t),
        ("magic", ctypes.c_uint),
        ("version", ctypes.c_uint),
        ("rank", ctypes.c_int),
        ("nRanks", ctypes.c_int),
        ("cudaDev", ctypes.c_int),
        ("nvmlDev", ctypes.c_int),
        ("deviceApiSupport", ctypes.c_bool),
        ("multimemSupport", ctypes.c_bool),
        ("ginType", ctypes.c_int),
        ("nLsaTeams", ctypes.c_int),
        ("hostRmaSupport", ctypes.c_bool),
        ("railedGinType", ctypes.c_int),
        ("commHash", ctypes.c_uint64),
        ("ginMinStride", ctypes.c_int),
        ("ginConnectionType", ctypes.c_int),
        ("ginSupport", ctypes.c_bool * 64),
        ("devCommRuntimeVersionSize", ctypes.c_size_t),
    ]


def gin_type_name(gin_type: int | None) -> str:
    if gin_type is None:
        return "unknown"
    return GIN_TYPE_NAMES.get(gin_type, f"type {gin_type}")


def version_text(version: tuple[int, int, int] | None) -> str:
    return "none" if version is None else ".".join(map(str, version))


@dataclass(frozen=True)
class NcclLibrary:
    """The NCCL torch runs on: the files mapped into this process and the runtime version."""

    cuda: bool  # torch sees a CUDA device
    paths: tuple[str, ...]  # distinct libnccl files mapped in this process (resolved)
    version: tuple[int, int, int] | None  # ncclGetVersion (or torch's, if NCCL is static)
    has_query_properties: bool  # ncclCommQueryProperties exported
    problem: str | None = None  # why something above could not be read

    @property
    def meets_deepep_minimum(self) -> bool:
        return self.version is not None and self.version >= DEEPEP_MIN_NCCL

    def describe(self) -> str:
        """One line: the version, where it was loaded from, and what DeepEP V2 makes of it."""
        if not self.cuda:
            return (
                f"no CUDA device (torch {torch.__version__}): no NCCL in use; "
                "DeepEP V2 and GIN do not apply"
            )
        where = ", ".join(self.paths) if self.paths else "linked into torch"
        line = f"NCCL {version_text(self.version)} ({where})"
        if self.problem:
            line += f"; {self.problem}"
        if not self.has_query_properties:
            line += f"; no {QUERY_PROPERTIES_SYMBOL} (GIN cannot be queried)"
        if not self.meets_deepep_minimum:
            line += f"; DeepEP V2 needs NCCL >= {version_text(DEEPEP_MIN_NCCL)}"
        return line


@dataclass(frozen=True)
class GinQuery:
    """GIN types of one communicator, or why they could not be read."""

    gin_type: int | None
    railed_gin_type: int | None
    problem: str | None = None

    @property
    def available(self) -> bool:
        """Direct-mode GIN (``ginType``: what DeepEP checks with ``allow_hybrid_mode=False``)."""
        return self.gin_type is not None and self.gin_type != 0

    def describe(self) -> str:
        if self.problem:
            return f"GIN not queried: {self.problem}"
        return (
            f"GIN ginType={gin_type_name(self.gin_type)} "
            f"railedGinType={gin_type_name(self.railed_gin_type)}"
        )


def mapped_libnccl_paths() -> tuple[str, ...]:
    """Distinct ``libnccl*`` files mapped into this process (``/proc/self/maps``), resolved."""
    try:
        with open("/proc/self/maps") as maps:
            lines = maps.read().splitlines()
    except OSError:
        return ()
    paths = set()
    for line in lines:
        fields = line.split(maxsplit=5)  # address perms offset dev inode path
        if len(fields) == 6 and os.path.basename(fields[5]).startswith("libnccl"):
            paths.add(os.path.realpath(fields[5]))
    return tuple(sorted(paths))


def _torch_nccl_version() -> tuple[int, int, int] | None:
    try:
        major, minor, patch = torch.cuda.nccl.version()[:3]
    except (AttributeError, RuntimeError):  # CPU builds have no NCCL bindings
        return None
    return (major, minor, patch)


def _decode_version(code: int) -> tuple[int, int, int]:
    """``ncclGetVersion``'s code: ``major·10000 + minor·100 + patch`` since 2.9."""
    return (code // 10000, (code % 10000) // 100, code % 100)


def _open(path: str) -> ctypes.CDLL:
    """The already-loaded library (dlopen of a mapped file returns the same handle)."""
    return ctypes.CDLL(path)


def probe_library() -> NcclLibrary:
    """Which NCCL torch loaded, its version and whether it can be asked about GIN."""
    if not torch.cuda.is_available():
        return NcclLibrary(cuda=False, paths=(), version=None, has_query_properties=False)
    torch_version = _torch_nccl_version()  # also makes sure torch's libnccl is loaded
    paths = mapped_libnccl_paths()
    if not paths:
        return NcclLibrary(
            cuda=True,
            paths=(),
            version=torch_version,
            has_query_properties=False,
            problem="NCCL is linked statically into torch (DeepEP needs a shared libnccl)",
        )
    if len(paths) > 1:
        return NcclLibrary(
            cuda=True,
            paths=paths,
            version=torch_version,
            has_query_properties=False,
            problem="more than one libnccl is loaded",
        )
    library = _open(paths[0])
    code = ctypes.c_int()
    if library.ncclGetVersion(ctypes.byref(code)) != 0:
        return NcclLibrary(
            cuda=True,
            paths=paths,
            version=torch_version,
            has_query_properties=False,
            problem="ncclGetVersion failed",
        )
    return NcclLibrary(
        cuda=True,
        paths=paths,
        version=_decode_version(code.value),
        has_query_properties=hasattr(library, QUERY_PROPERTIES_SYMBOL),
    )


def query_gin(group: dist.ProcessGroup, library: NcclLibrary | None = None) -> GinQuery:
    """``ginType`` and ``railedGinType`` of ``group``'s NCCL communicator.

    The group must be NCCL and warmed by one collective (torch creates communicators lazily).
    """
    library = library or probe_library()
    if not library.has_query_properties or not library.meets_deepep_minimum:
        return GinQuery(None, None, library.describe())
    if "nccl" not in str(dist.get_backend(group)):
        return GinQuery(None, None, f"the group's backend is {dist.get_backend(group)}, not nccl")
    backend = group._get_backend(torch.device("cuda"))
    if not hasattr(backend, "_comm_ptr"):
        return GinQuery(None, None, f"torch {torch.__version__} does not expose _comm_ptr()")
    comm = backend._comm_ptr()
    if not comm:
        return GinQuery(None, None, "the NCCL communicator is not created yet (warm the group)")
    storage = (ctypes.c_ubyte * (ctypes.sizeof(_CommProperties) + PROPERTIES_SPARE_BYTES))()
    props = _CommProperties.from_buffer(storage)
    props.size = ctypes.sizeof(_CommProperties)
    props.magic = NCCL_API_MAGIC
    runtime_code = library.version[0] * 10000 + library.version[1] * 100 + library.version[2]
    props.version = min(runtime_code, PROPERTIES_LAYOUT_VERSION)
    query = getattr(_open(library.paths[0]), QUERY_PROPERTIES_SYMBOL)
    query.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    result = query(ctypes.c_void_p(comm), ctypes.byref(props))
    if result != 0:
        return GinQuery(None, None, f"{QUERY_PROPERTIES_SYMBOL} returned ncclResult {result}")
    return GinQuery(props.ginType, props.railedGinType)


def describe_machine() -> str:
    """The library line, plus the GIN types of a one-rank NCCL group when they can be queried."""
    library = probe_library()
    line = library.describe()
    if not (library.cuda and library.has_query_properties and library.meets_deepep_minimum):
        return line
    if dist.is_initialized():
        return f"{line}; {_warm_and_query(dist.group.WORLD, library).describe()} (default group)"
    with tempfile.NamedTemporaryFile() as rendezvous:
        dist.init_process_group(
            "nccl", init_method=f"file://{rendezvous.name}", rank=0, world_size=1
        )
        try:
            gin = _warm_and_query(dist.group.WORLD, library)
        finally:
            dist.destroy_process_group()
    return f"{line}; {gin.describe()} (one-rank group)"


def _warm_and_query(group: dist.ProcessGroup, library: NcclLibrary) -> GinQuery:
    dist.all_reduce(torch.zeros(1, device="cuda"), group=group)
    return query_gin(group, library)


if __name__ == "__main__":
    print(f"nccl_probe: {describe_machine()}")
