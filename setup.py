"""Build step beyond pyproject.toml: compile csrc/*.cu to fatbins with nvcc.

The fatbins ship as package data under gradcomp/ and are loaded at run time
with CuPy. Without nvcc (or without any .cu source) the build prints why and
goes on: the CUDA backend then compiles from source with NVRTC, or stays off.
``GRADCOMP_CUDA_ARCHS`` (e.g. ``"80;90"``) overrides the target architectures.
"""

import os
import shutil
import subprocess
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).parent
DEFAULT_ARCHS = "80;90"


def nvcc_flags(archs: str) -> list[str]:
    numbers = [a.strip() for a in archs.split(";") if a.strip()]
    flags = [f"-gencode=arch=compute_{n},code=sm_{n}" for n in numbers]
    # PTX of the newest listed architecture lets newer GPUs JIT-compile it.
    flags.append(f"-gencode=arch=compute_{numbers[-1]},code=compute_{numbers[-1]}")
    return flags


class BuildWithFatbins(build_py):
    def run(self):
        super().run()
        sources = sorted((ROOT / "csrc").glob("*.cu"))
        nvcc = shutil.which("nvcc")
        if not sources:
            return
        if nvcc is None:
            print("gradcomp: nvcc not found; skipping the CUDA fatbins (NVRTC or torch/Triton will be used)")
            return
        archs = os.environ.get("GRADCOMP_CUDA_ARCHS", DEFAULT_ARCHS)
        # Compiled once into the source tree (what an editable install loads),
        # then copied into the build folder (what a wheel ships).
        package = ROOT / "gradcomp"
        built = Path(self.build_lib) / "gradcomp"
        built.mkdir(parents=True, exist_ok=True)
        for source in sources:
            target = package / (source.stem + ".fatbin")
            command = [nvcc, "--fatbin", "-O3", "-I", str(ROOT / "csrc"), *nvcc_flags(archs)]
            command += ["-o", str(target), str(source)]
            print("gradcomp:", " ".join(command))
            subprocess.run(command, check=True)
            if built.resolve() != package.resolve():
                shutil.copy2(target, built / target.name)


setup(cmdclass={"build_py": BuildWithFatbins})
