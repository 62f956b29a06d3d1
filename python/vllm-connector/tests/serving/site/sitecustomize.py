"""Test infrastructure only (on the real-server tests' PYTHONPATH): on a CPU with AMX, asks
Linux for the AMX tile state before vLLM's CPU attention runs AMX instructions, which it does
without asking (the worker dies with SIGILL otherwise). What ``torch._C._cpu._init_amx()``
does: ``arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)``."""

import ctypes

try:
    with open("/proc/cpuinfo") as f:
        amx = "amx_tile" in f.read()
except OSError:
    amx = False
if amx:
    SYS_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA = 158, 0x1023, 18
    ctypes.CDLL(None, use_errno=True).syscall(SYS_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)
