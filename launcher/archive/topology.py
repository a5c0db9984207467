"""What a node looks like, recorded once per node by its local rank 0: CPU, memory, GPUs (model,
memory, driver), the GPU interconnect matrix (`nvidia-smi topo -m`) and InfiniBand devices.

Gatherers are independent functions in GATHERERS; one that fails records its error instead of
failing the run."""
from __future__ import annotations

import os
import platform
import shutil
import socket
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

from launcher.runtime.env import scheduler_node_name


def _run(cmd: List[str], timeout: int = 30) -> str:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout).stdout


def cpu() -> Dict[str, Any]:
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"model": model or platform.processor(), "cores": os.cpu_count(),
            "affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None}


def memory() -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            key, _, rest = line.partition(":")
            if key in ("MemTotal", "MemAvailable"):
                out[key.lower() + "_bytes"] = int(rest.split()[0]) * 1024
    except OSError:
        pass
    return out


def gpus() -> Dict[str, Any]:
    if not shutil.which("nvidia-smi"):
        return {"count": 0}
    rows = _run(["nvidia-smi", "--query-gpu=index,name,memory.total,driver_version,pci.bus_id",
                 "--format=csv,noheader,nounits"]).strip().splitlines()
    devices = []
    for row in rows:
        idx, name, mem, driver, bus = [c.strip() for c in row.split(",")]
        devices.append({"index": int(idx), "name": name, "memory_mib": int(float(mem)), "driver": driver, "pci": bus})
    return {"count": len(devices), "devices": devices, "topo_matrix": _run(["nvidia-smi", "topo", "-m"])}


def _read(path: Path) -> Optional[str]:
    return path.read_text().strip() if path.exists() else None


def infiniband() -> Dict[str, Any]:
    root = Path("/sys/class/infiniband")
    if not root.is_dir():
        return {"devices": []}
    devs = []
    for dev in sorted(root.iterdir()):
        ports = []
        for port in sorted((dev / "ports").glob("*")):
            ports.append({"port": port.name, "state": _read(port / "state"), "rate": _read(port / "rate")})
        devs.append({"name": dev.name, "ports": ports})
    return {"devices": devs}


def host() -> Dict[str, Any]:
    return {"hostname": socket.gethostname(), "slurmd_nodename": scheduler_node_name(),
            "kernel": platform.release(), "os": platform.platform()}


GATHERERS: Dict[str, Callable[[], Dict[str, Any]]] = {
    "host": host, "cpu": cpu, "memory": memory, "gpus": gpus, "infiniband": infiniband,
}


def gather() -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    for name, fn in GATHERERS.items():
        try:
            out[name] = fn()
        except Exception as e:  # a missing tool must not fail the run
            out[name] = {"error": f"{type(e).__name__}: {e}"}
    return out


def runtime_software(import_torch: bool = True) -> Dict[str, Any]:
    """Versions only known on the node (after torch is imported). ``import_torch=False`` (a rank that runs
    a user's script as a process of its own, which imports what it uses): torch's installed version,
    unless this process imported it anyway; importing it only to record it would cost every rank of
    such a job ~1.5 s of CPU and torch's memory beside the script's own."""
    if not import_torch and "torch" not in sys.modules:
        try:
            installed = metadata.version("torch")
        except metadata.PackageNotFoundError:
            installed = None
        return {"python": platform.python_version(), "torch_installed": installed,
                "torch": "not imported by the launcher (the script's own process imports what it uses)"}
    import torch  # torch: only on the node

    out: Dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda,
                           "cuda_available": torch.cuda.is_available()}
    try:
        out["nccl"] = ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else None
    except Exception:
        out["nccl"] = None
    out["cudnn"] = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return out
