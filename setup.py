"""Build script: the package list and the C++ core `memopd._C`, compiled with CMake (see
CMakeLists.txt).

Metadata and dependencies live in pyproject.toml. `kernels/` and `trainer/` at the
repository root are installed as `memopd.kernels` and `memopd.trainer` through the
package mapping below (trainer/configs/*.json, the DeepSpeed examples, as package data);
a source checkout imports them the same way through memopd's import hook
(memopd/__init__.py).
"""
import os
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
# packages whose sources sit at the repository root instead of under memopd/: kernels/
# and trainer/ stay at the root because that is the project's required layout, so they
# are mapped here rather than moved under memopd/
ROOT_PACKAGES = {"memopd.kernels": "kernels", "memopd.trainer": "trainer"}


def package_list() -> list[str]:
    """memopd and its subpackages, plus each root package and its own subpackages."""
    packages = find_packages(where=str(ROOT), include=["memopd", "memopd.*"])
    for name, folder in ROOT_PACKAGES.items():
        packages += [name] + [f"{name}.{sub}" for sub in find_packages(where=str(ROOT / folder))]
    return packages


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
    packages=package_list(),
    package_dir=ROOT_PACKAGES,
    package_data={"memopd.trainer": ["configs/*.json"]},
    ext_modules=[CMakeExtension("memopd._C")],
    cmdclass={"build_ext": CMakeBuild},
)
