"""Builds cockpit_fast._C: the CPU kernels always, the CUDA kernels when CUDA can be built.

The package's metadata is in pyproject.toml. The extension is compiled against the installed
torch, which must be importable here: build with `pip install --no-build-isolation .`.
CUDA is built when the installed torch has CUDA and nvcc is found (CUDA_HOME, else
/usr/local/cuda), or when FORCE_CUDA=1; FORCE_ONLY_CPU=1 builds the CPU kernels only.
TORCH_CUDA_ARCH_LIST defaults to Ampere and Hopper ("8.0;9.0").
"""

import glob
import os
import runpy
import shutil
import sys

from setuptools import setup

if "CUDA_HOME" not in os.environ and os.path.exists("/usr/local/cuda/bin/nvcc"):
    os.environ["CUDA_HOME"] = "/usr/local/cuda"
os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "8.0;9.0")


def stop(problem, fix):
    """End the build with one message (pip shows it in its error output)."""
    sys.exit(f"\ncockpit_fast cannot be built: {problem}.\n{fix}\n")


try:
    import torch  # noqa: E402  (CUDA_HOME must be set before cpp_extension looks for it)
except ImportError:
    stop(
        "torch is not installed in this build environment (pip builds in an isolated one by default)",
        "Install torch first, then build against it: pip install --no-build-isolation .",
    )
if shutil.which(os.environ.get("CXX", "c++")) is None:
    stop(
        f"no C++ compiler ({os.environ.get('CXX', 'c++')}) is on the PATH",
        "Install one (Debian/Ubuntu: apt-get install g++; or set CXX), then: pip install --no-build-isolation .",
    )

from torch.utils.cpp_extension import (  # noqa: E402
    CUDA_HOME,
    BuildExtension,
    CppExtension,
    CUDAExtension,
)

ROOT = os.path.dirname(os.path.abspath(__file__))


def build_with_cuda():
    if os.environ.get("FORCE_ONLY_CPU", "0") == "1":
        return False
    if os.environ.get("FORCE_CUDA", "0") == "1":
        return True
    return torch.version.cuda is not None and CUDA_HOME is not None


def extension():
    sources = [os.path.join("csrc", "ops.cpp")] + sorted(glob.glob(os.path.join("csrc", "cpu", "*.cpp")))
    # No FMA contraction: the histogram bin arithmetic must round exactly as torch's does.
    # No trapping math / errno: lets selects on floats vectorise; results are unchanged.
    cxx = ["-O3", "-fopenmp", "-ffp-contract=off", "-fno-trapping-math", "-fno-math-errno"]
    # The argument limits, written once in Python (read without importing the package).
    limits = runpy.run_path(os.path.join(ROOT, "cockpit_fast", "_limits.py"))
    macros = [(f"COCKPIT_FAST_{name}", str(limits[name])) for name in ("MAX_P_VALUES", "MAX_BINS")]
    kwargs = dict(
        name="cockpit_fast._C",
        include_dirs=[os.path.join(ROOT, "csrc", "include")],
        extra_link_args=["-fopenmp"],
        define_macros=macros,
    )
    if build_with_cuda():
        sources += sorted(glob.glob(os.path.join("csrc", "cuda", "*.cu")))
        nvcc = ["-O3", "--fmad=false", "-lineinfo"]
        return CUDAExtension(sources=sources, extra_compile_args={"cxx": cxx, "nvcc": nvcc}, **kwargs)
    return CppExtension(sources=sources, extra_compile_args={"cxx": cxx}, **kwargs)


setup(ext_modules=[extension()], cmdclass={"build_ext": BuildExtension})
