"""`localdiff bench` section 4: memory of a load in fp32 / bf16 / int8, each in a fresh subprocess (clean peak).

The child (``python -m localdiff.bench.memory PATH DTYPE QUANT DEVICE``) reports, after importing torch, after
loading, and after one short generation: the peak RSS so far (VmHWM, or ru_maxrss off Linux — importing torch
alone sets a high-water mark of a few hundred MB, which a small model never exceeds) and the current RSS (psutil or
/proc) whose growth is the model's cost; plus the bytes of the loaded weights and, on a GPU, the CUDA peak
allocated; as one JSON line on stdout.
"""

from __future__ import annotations

import json
import subprocess
import sys


def _peak_rss_bytes() -> int:
    """Peak RSS of this process: VmHWM from /proc/self/status (Linux; reset by exec), else ru_maxrss (which on
    Linux keeps the parent's high-water mark across fork + exec, so it overstates a child's peak)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    import resource

    kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(kb) * (1 if sys.platform == "darwin" else 1024)


def _rss_bytes() -> int | None:
    """Current resident set size: psutil when installed, else /proc/self/statm (Linux), else None."""
    try:
        import psutil

        return int(psutil.Process().memory_info().rss)
    except ImportError:
        pass
    try:
        import os

        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def weight_bytes(net) -> int:
    """Bytes of every parameter and buffer of a module (int8 modules count their int8 weights and scales)."""
    seen, total = set(), 0
    for t in list(net.parameters()) + list(net.buffers()):
        if t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        total += t.numel() * t.element_size()
    return total


def child(path: str, dtype: str, quant: str, device: str) -> dict:
    """Measure in this (fresh) process; see the module docstring."""
    import torch

    torch.set_num_threads(2)
    import localdiff
    from localdiff import engine  # noqa: F401 — code imports are not the model's cost
    from localdiff import loader  # noqa: F401
    from localdiff import tokenizer  # noqa: F401

    out = {
        "dtype": dtype,
        "quant": quant,
        "device": device,
        "peak_rss_after_import": _peak_rss_bytes(),
        "rss_after_import": _rss_bytes(),
    }
    m = localdiff.load(path, device=device, dtype=dtype, quant=None if quant == "none" else quant)
    out["peak_rss_after_load"] = _peak_rss_bytes()
    out["rss_after_load"] = _rss_bytes()
    out["weight_bytes"] = weight_bytes(m.net)
    prompt = [3 + i % 50 for i in range(16)]
    m.generate(prompt, chat=False, seed=0, max_new_tokens=m.config.canvas_length, max_denoising_steps=4)
    out["peak_rss_after_generate"] = _peak_rss_bytes()
    out["rss_after_generate"] = _rss_bytes()
    if out["rss_after_import"] is not None:
        out["rss_growth_load"] = out["rss_after_load"] - out["rss_after_import"]
        out["rss_growth_total"] = out["rss_after_generate"] - out["rss_after_import"]
    if m.device.type == "cuda":
        out["cuda_peak_allocated"] = int(torch.cuda.max_memory_allocated(m.device))
    return out


def measure(path, dtype: str, quant: str = "none", device: str = "cpu", timeout: float = 300) -> dict:
    """Run :func:`child` in a subprocess; returns its dict, or {"skipped": reason} when it failed."""
    cmd = [sys.executable, "-m", "localdiff.bench.memory", str(path), dtype, quant, device]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"dtype": dtype, "quant": quant, "device": device, "skipped": f"timed out after {timeout:.0f} s"}
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    if p.returncode != 0 or not lines:
        err = (p.stderr.strip().splitlines() or ["no output"])[-1]
        return {"dtype": dtype, "quant": quant, "device": device, "skipped": err[:300]}
    return json.loads(lines[-1])


if __name__ == "__main__":
    try:
        res = child(*sys.argv[1:5])
    except Exception as e:  # reported to the parent as a skip reason, one line
        print(f"{type(e).__name__}: {e}".replace("\n", " "), file=sys.stderr)
        sys.exit(1)
    print(json.dumps(res))
