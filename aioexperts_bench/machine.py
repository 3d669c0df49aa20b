"""Facts about the machine a bench ran on, for the results file and the rendered tables."""

from __future__ import annotations

import os
import platform
import subprocess
from importlib import metadata
from typing import Any

__all__ = ("cpu_vector_isa", "isa_limits", "kernel_facts", "machine_facts", "machine_label")


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read().strip()
    except OSError:
        return None


def _cpu_model() -> str | None:
    text = _read("/proc/cpuinfo") or ""
    for line in text.splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or None


def cpu_vector_isa(flags: list[str] | None = None) -> str | None:
    """The widest x86 vector ISA the kernels can use: ``"AVX-512 VNNI"``, ``"AVX-512"``, ``"AVX2"``, else None.

    ``flags`` default to ``/proc/cpuinfo``'s; VNNI counts only with AVX-512 (``vpdpbusd`` on zmm).
    """
    if flags is None:
        text = _read("/proc/cpuinfo") or ""
        flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    have = set(flags)
    if "avx512bw" in have:
        return "AVX-512 VNNI" if "avx512_vnni" in have else "AVX-512"
    return "AVX2" if "avx2" in have else None


def _llama_cpp_system_info() -> str | None:
    """llama.cpp's ``llama_print_system_info()`` (the ISA it was built for), from a child process
    (this process does not load the library); None without ``llama-cpp-python``."""
    import importlib.util
    import sys

    if importlib.util.find_spec("llama_cpp") is None:
        return None
    code = "import llama_cpp; print(llama_cpp.llama_print_system_info().decode())"
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def isa_limits(llama_cpp_info: str | None) -> dict[str, str | None]:
    """The vector ISA each engine was limited to below the CPU's (None: the CPU's own).

    ``kernels``: what ``NUMBA_CPU_FEATURES`` lets numba compile for (``+avx512bw`` and so on, as
    LLVM names them); ``llama.cpp``: what its build uses, from its system info (``AVX512 = 1``,
    ``AVX512_VNNI = 1``, ``AVX2 = 1``). An AVX2-only run on an AVX-512 machine (README's "AVX2
    proxy") sets both.
    """
    cpu = cpu_vector_isa()
    out: dict[str, str | None] = {"kernels": None, "llama.cpp": None}
    features = os.environ.get("NUMBA_CPU_FEATURES")
    if features:
        flags = [f[1:].replace("avx512vnni", "avx512_vnni") for f in features.split(",") if f.startswith("+")]
        ours = cpu_vector_isa(flags)
        out["kernels"] = ours if ours != cpu else None
    if llama_cpp_info:
        have = {
            part.split("=")[0].strip().lower() for part in llama_cpp_info.split("|") if part.strip().endswith("= 1")
        }
        flags = ["avx512bw" if "avx512" in have else "", "avx512_vnni" if "avx512_vnni" in have else ""]
        theirs = cpu_vector_isa([*flags, "avx2" if "avx2" in have else ""])
        out["llama.cpp"] = theirs if theirs != cpu else None
    return out


def _mount_of(path: str) -> tuple[str | None, str | None]:
    """``(source device, filesystem type)`` of the mount holding ``path``."""
    try:
        out = subprocess.run(
            ["findmnt", "-no", "SOURCE,FSTYPE", "-T", path], capture_output=True, text=True, timeout=10, check=False
        ).stdout.split()
        if len(out) >= 2:
            return out[0], out[1]
    except OSError:
        pass
    best: tuple[str, str, str] | None = None
    for line in (_read("/proc/mounts") or "").splitlines():
        parts = line.split()
        if len(parts) >= 3 and (path == parts[1] or path.startswith(parts[1].rstrip("/") + "/")):
            if best is None or len(parts[1]) > len(best[1]):
                best = (parts[0], parts[1], parts[2])
    return (best[0], best[2]) if best else (None, None)


def _device_facts(source: str | None) -> dict[str, Any]:
    if not source or not source.startswith("/dev/"):
        return {}
    name = os.path.basename(os.path.realpath(source))
    base = f"/sys/class/block/{name}"
    if os.path.exists(f"{base}/partition"):
        name = os.path.basename(os.path.dirname(os.path.realpath(base)))
        base = f"/sys/class/block/{name}"
    vendor = _read(f"{base}/device/vendor")
    return {
        "name": name,
        "model": _read(f"{base}/device/model"),
        "vendor": vendor,
        "virtio": vendor == "0x1af4",
        "rotational": _read(f"{base}/queue/rotational") == "1",
        "scheduler": _read(f"{base}/queue/scheduler"),
        "size_bytes": int(_read(f"{base}/size") or 0) * 512,
    }


def _version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def source_commit() -> str | None:
    """The git commit of the aioexperts checkout running (``+dirty`` with local changes); None outside git."""
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        head = subprocess.run(
            ["git", "-C", here, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", here, "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return f"{head}+dirty" if dirty else head or None


def machine_facts(model_path: str) -> dict[str, Any]:
    """Kernel, CPU, memory, the filesystem and device holding ``model_path``, library versions."""
    source, fstype = _mount_of(os.path.dirname(os.path.abspath(model_path)))
    pages = os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else 0
    llama_info = _llama_cpp_system_info()
    return {
        "hostname": platform.node(),
        "kernel": platform.release(),
        "os": platform.platform(),
        "cpu_model": _cpu_model(),
        "cpu_vector_isa": cpu_vector_isa(),
        "isa_limits": isa_limits(llama_info),
        "llama_cpp_system_info": llama_info,
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)),
        "memory_bytes": pages * os.sysconf("SC_PAGE_SIZE"),
        "filesystem": fstype,
        "device_source": source,
        "device": _device_facts(source),
        "python": platform.python_version(),
        "numpy": _version("numpy"),
        "liburing": _version("liburing"),
        "uvloop": _version("uvloop"),
        "gguf": _version("gguf"),
        "llama_cpp_python": _version("llama-cpp-python"),
        "aioexperts_commit": source_commit(),
        "load_average_at_start": list(os.getloadavg()),
        "openblas_coretype": os.environ.get("OPENBLAS_CORETYPE"),
        "numpy_disabled_cpu_features": os.environ.get("NPY_DISABLE_CPU_FEATURES"),
        "numba_cpu": os.environ.get("NUMBA_CPU_NAME"),
    }


def machine_label(facts: dict[str, Any]) -> str:
    """One line naming the machine: ``"2 vCPU AMD EPYC (AVX2), 24 GiB, ext4 on virtio vda, Linux 6.18"``.

    Results files written before ``cpu_vector_isa`` was recorded name the CPU alone.
    """
    dev = facts.get("device") or {}
    isa = facts.get("cpu_vector_isa")
    limits = facts.get("isa_limits") or {}
    limited = "; ".join(f"{who} limited to {to}" for who, to in limits.items() if to)
    isa_text = "; ".join(part for part in (isa, limited) if part)
    cpu = f"{facts.get('cpu_model') or '?'}{f' ({isa_text})' if isa_text else ''}"
    disk = f"{'virtio ' if dev.get('virtio') else ''}{dev.get('name') or facts.get('device_source') or '?'}"
    mem = facts.get("memory_bytes") or 0
    return (
        f"{facts.get('cpu_count')} vCPU {cpu}, {mem / (1 << 30):.0f} GiB, "
        f"{facts.get('filesystem') or '?'} on {disk}, Linux {facts.get('kernel')}"
    )


def kernel_facts() -> dict[str, Any]:
    """Which kernels the MoE maths runs (numba, or the numpy fallback and why) and their precision."""
    from aioexperts._compute import fused  # which kernels serve, at which precision

    served = fused.backend()
    return {"backend": served.name, "reason": served.reason, "precision": fused.precision()}
