"""Package list for setuptools; all other metadata is in pyproject.toml.

The Metal kernel sources live in the top-level metal/ directory (next to their Linux
checker) and ship inside the wheel as the package data of ``mlxserve._metal``. pyproject.toml
cannot combine package discovery with such a mapping, so the list is built here.
"""

from setuptools import find_packages, setup

setup(
    packages=[*find_packages(include=["mlxserve", "mlxserve.*"]), "mlxserve._metal"],
    package_dir={"mlxserve._metal": "metal"},
    package_data={
        "mlxserve._metal": ["*.metal"],
        "mlxserve": ["csrc/*.c", "csrc/*.h", "csrc/*.cpp"],
        # the chat page at / (mlxserve/server/webui.py): plain HTML, CSS and JS modules
        "mlxserve.server": ["ui/*.html", "ui/*.css", "ui/*.js", "ui/*.svg"],
    },
)
