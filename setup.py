"""Builds cockpit_fast._C: the CPU kernels always, the CUDA kernels when CUDA can be built.

CUDA is built when the installed torch has CUDA and nvcc is found (CUDA_HOME, else
/usr/local/cuda), or when FORCE_CUDA=1; FORCE_ONLY_CPU=1 builds the CPU kernels only.
TORCH_CUDA_ARCH_LIST defaults to Ampere and Hopper ("8.0;9.0").
"""

import glob
import os
import runpy

from setuptools import find_packages, setup

if "CUDA_HOME" not in os.environ and os.path.exists("/usr/local/cuda/bin/nvcc"):
    os.environ["CUDA_HOME"] = "/usr/local/cuda"
os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "8.0;9.0")

import torch  # noqa: E402  (CUDA_HOME must be set before cpp_extension looks for it)
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


setup(
    name="cockpit_fast",
    version="0.1.0",
    description="Fused per-sample gradient statistics for Cockpit and gradient-metrics users",
    packages=find_packages(include=["cockpit_fast", "cockpit_fast.*"]),
    python_requires=">=3.9",
    # backpack-for-pytorch is needed too, but its pin on torchvision drags in a CUDA torch: the
    # set-up script installs it with --no-deps (see README).
    install_requires=["torch>=2.4", "numpy", "einops", "unfoldNd"],
    ext_modules=[extension()],
    cmdclass={"build_ext": BuildExtension},
)
