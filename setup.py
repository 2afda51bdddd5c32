"""Build script: compiles the C++ core `memopd._C` with CMake (see CMakeLists.txt).

Package metadata lives in pyproject.toml. `kernels/` and `trainer/` at the repository
root are installed as `memopd.kernels` and `memopd.trainer` (memopd/kernels and
memopd/trainer are symbolic links to them, so the source tree imports the same way).
"""
import os
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


class CMakeExtension(Extension):
    def __init__(self, name: str):
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    def build_extension(self, ext: Extension) -> None:
        import pybind11

        out_dir = Path(self.get_ext_fullpath(ext.name)).parent.resolve()
        build_dir = Path(self.build_temp).resolve() / ext.name
        build_dir.mkdir(parents=True, exist_ok=True)
        cfg = "Debug" if self.debug else "Release"
        configure = [
            "cmake",
            "-S",
            str(ROOT),
            "-B",
            str(build_dir),
            f"-DCMAKE_BUILD_TYPE={cfg}",
            f"-DMEMOPD_OUTPUT_DIR={out_dir}",
            f"-DPython3_EXECUTABLE={sys.executable}",
            f"-Dpybind11_DIR={pybind11.get_cmake_dir()}",
        ]
        subprocess.run(configure, check=True)
        jobs = str(os.cpu_count() or 1)
        subprocess.run(["cmake", "--build", str(build_dir), "--config", cfg, "-j", jobs], check=True)


setup(
    ext_modules=[CMakeExtension("memopd._C")],
    cmdclass={"build_ext": CMakeBuild},
)
