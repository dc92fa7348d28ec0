"""Compiling kvray's small C kernels at first use, with the system C compiler, into the user's
cache directory, keyed by the source, the flags and the CPU, so later processes load them at
once. A machine without a compiler raises ``OSError``; callers fall back to torch."""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

# -fno-math-errno lets expf vectorise (about 1.6x less compute); nothing reads errno. A call
# to a function the preprocessor left out for this CPU must fail the build, not load as an
# undefined symbol (GCC before 14 only warns).
BASE_FLAGS = (
    "-O3",
    "-fno-math-errno",
    "-fPIC",
    "-shared",
    "-std=c11",
    "-pthread",
    "-Werror=implicit-function-declaration",
)


def build_library(source: Path, extra_flags: tuple[str, ...] = ()) -> Path:
    """The shared library built from ``source``, compiled now or found in the cache."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise OSError("no C compiler (cc or $CC) on this machine")
    flags = [*BASE_FLAGS, *extra_flags]
    signature = source.read_bytes() + " ".join(flags).encode() + cpu_signature().encode()
    key = hashlib.sha256(signature).hexdigest()[:16]
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvray"
    library = cache / f"{source.stem}-{key}.so"
    if library.exists():
        return library
    cache.mkdir(parents=True, exist_ok=True)
    for arch in (["-march=native"], []):  # -march=native is not on every compiler
        with tempfile.NamedTemporaryFile(dir=cache, suffix=".so", delete=False) as partial:
            pass
        result = subprocess.run(
            [compiler, *flags, *arch, str(source), "-o", partial.name, "-lm"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        if result.returncode == 0:
            os.replace(partial.name, library)  # atomic: concurrent builders agree
            return library
        os.unlink(partial.name)
    raise OSError(f"compiling {source.name} failed: {result.stderr.strip()[-500:]}")


def cpu_signature() -> str:
    """What -march=native depends on: the machine and its CPU's feature flags."""
    flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                flags = line
                break
    except OSError:
        pass
    return f"{platform.machine()} {platform.system()} {flags}"
