"""Device, dtype and thread settings shared by the real engines."""

from __future__ import annotations

import os

DTYPES = ("float32", "float16", "bfloat16")

# Measured on 2 cores: two intra-op threads collapse to a third of their speed when
# anything else (the HTTP loop, a load generator) competes for a core; one thread
# degrades gracefully. So the default is one thread, and OMP threads spin passively.
DEFAULT_TORCH_THREADS = 1


def configure_threads(n: int | None) -> None:
    import torch

    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    n = n or DEFAULT_TORCH_THREADS
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)


def resolve_device(device: str | None) -> str:
    import torch

    if device in (None, "", "auto"):
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {device}: CUDA is not available on this machine")
    return device


def resolve_dtype(dtype: str | None, device: str):
    import torch

    if dtype in (None, "", "auto"):
        return torch.float16 if device.startswith("cuda") else torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    return getattr(torch, dtype)


def is_oom(exc: BaseException) -> bool:
    """Out-of-memory as raised by torch on CUDA (OutOfMemoryError) or by allocators on CPU."""
    if type(exc).__name__ in ("OutOfMemoryError", "FakeOOM") or isinstance(exc, MemoryError):
        return True
    return "out of memory" in str(exc).lower()
