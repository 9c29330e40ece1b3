"""Shared helpers of the Python client checks: they print one JSON object per line and exit
non-zero on the first unexpected result, so the Rust tests (test-containers/tests/integration/gpu_python.rs)
assert on what they print."""

import json
import sys


def emit(**fields):
    print(json.dumps(fields, sort_keys=True), flush=True)


def fail(msg, **fields):
    emit(error=msg, **fields)
    sys.exit(1)


def name(v):
    """An enum member's name (CUresult, CUprocessState), else the value itself."""
    return getattr(v, "name", v)


def ok(result, what):
    """Unpacks a cuda-bindings result tuple (CUresult, values...), failing on an error."""
    err, *rest = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        fail(f"{what}: {name(err)}", call=what, result=name(err))
    if not rest:
        return None
    return rest[0] if len(rest) == 1 else tuple(rest)


def uuid_str(raw):
    """A CUuuid's 16 bytes as NVML prints them: GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx."""
    h = bytes(raw).hex()
    return f"GPU-{h[0:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"
