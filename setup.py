"""Install hook: compile the native kernels (edgellm/kernels/build.py) as part of ``pip install``.

Everything else is declared in pyproject.toml. A missing compiler or a failed compile prints one
warning and the install goes on: edgellm then runs on its torch kernels.
"""

import importlib.util
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent


def _kernel_builder():
    spec = importlib.util.spec_from_file_location("_edgellm_kernel_build", HERE / "edgellm/kernels/build.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


class BuildPyWithKernels(build_py):
    """build_py, then the kernel libraries: into the source tree for an editable install, else build_lib."""

    def run(self) -> None:
        super().run()
        lib_dir = Path("edgellm/kernels/_lib")
        target = HERE / lib_dir if self.editable_mode else Path(self.build_lib) / lib_dir
        try:
            builder = _kernel_builder()
        except Exception as e:  # noqa: BLE001 - the install must not fail because of the kernels
            print(f"edgellm: warning: native kernels not built ({e}); edgellm will use its torch kernels")
            return
        builder.build_quietly(target)


setup(cmdclass={"build_py": BuildPyWithKernels})
