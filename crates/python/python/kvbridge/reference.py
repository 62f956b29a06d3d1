"""SGLang 0.5.23's own planner, for the differential tests and the benchmark.

    python -m kvbridge.reference [DEST]

downloads the release with pip (no dependencies, nothing installed) and unpacks only
``sglang/srt/disaggregation/`` into DEST (default: ``$KVBRIDGE_SGLANG_DIR``, else
``~/.cache/kvbridge/sglang-0.5.23``), then prints DEST. Nothing of SGLang ships with kvbridge:
``load_sglang_utils`` imports its planner module from DEST.
"""

import glob
import importlib.util
import os
import subprocess
import sys
import tarfile
import tempfile
import types
import zipfile

VERSION = "0.5.23"
UTILS = "sglang/srt/disaggregation/common/utils.py"
DEFAULT_DEST = os.environ.get("KVBRIDGE_SGLANG_DIR") or os.path.join(
    os.path.expanduser("~"), ".cache", "kvbridge", f"sglang-{VERSION}"
)


def fetch_sglang(dest=DEFAULT_DEST, timeout=300):
    """Unpacks SGLang's disaggregation package into `dest` unless it is there; returns `dest`."""
    if os.path.exists(os.path.join(dest, UTILS)):
        return dest
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
             f"sglang=={VERSION}", "-d", tmp],
            check=True, timeout=timeout,
        )
        (archive,) = glob.glob(os.path.join(tmp, "sglang-*"))
        prefix = "sglang/srt/disaggregation/"
        if archive.endswith(".whl"):
            with zipfile.ZipFile(archive) as z:
                z.extractall(dest, [n for n in z.namelist() if n.startswith(prefix)])
        else:  # an sdist: sglang-0.5.23/python/sglang/...
            with tarfile.open(archive) as t:
                for m in t.getmembers():
                    _, _, rest = m.name.partition("/python/")
                    if rest.startswith(prefix) and m.isfile():
                        m.name = rest
                        t.extract(m, dest)
    return dest


def load_sglang_utils(dest=DEFAULT_DEST):
    """SGLang's `sglang.srt.disaggregation.common.utils` module from `dest`.

    The module needs only numpy and SGLang's tracing context types, which are stubbed, so no
    torch and no SGLang installation is needed.
    """
    name = "sglang.srt.observability.trace"
    if name not in sys.modules:
        trace = types.ModuleType(name)
        trace.TraceNullContext = type("TraceNullContext", (), {})
        trace.TraceReqContext = type("TraceReqContext", (), {})
        sys.modules[name] = trace
    spec = importlib.util.spec_from_file_location("sglang_0_5_23_utils", os.path.join(dest, UTILS))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


if __name__ == "__main__":
    print(fetch_sglang(sys.argv[1] if len(sys.argv) > 1 else DEFAULT_DEST))
