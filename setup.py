"""The optional C extensions raywds.loader._jpeg (region-of-interest JPEG decoding with
libjpeg-turbo) and raywds.data._restarts (restart markers added to JPEGs losslessly, which the
region decoder cuts at).

Everything else is in pyproject.toml. Without a C compiler or libjpeg's headers (Debian:
libjpeg62-turbo-dev) the extensions are skipped: raywds then decodes whole JPEGs, and convert
keeps the JPEGs' bytes as they are. With RAYWDS_REQUIRE_JPEG_EXT set (to anything but empty),
as .ci/run and benchmarks/gpu_run.sh set it, a failed build of either fails the install instead.
"""

import os

from setuptools import Extension, setup

required = bool(os.environ.get("RAYWDS_REQUIRE_JPEG_EXT"))


def extension(name: str, source: str) -> Extension:
    """A C extension over libjpeg; its errors and warnings are handled as jpeg_errors.h says."""
    return Extension(
        name,
        [source],
        depends=["raywds/data/jpeg_errors.h"],
        libraries=["jpeg"],
        extra_compile_args=["-O2"],
        optional=not required,
    )


setup(
    ext_modules=[
        extension("raywds.loader._jpeg", "raywds/loader/_jpeg.c"),
        extension("raywds.data._restarts", "raywds/data/_restarts.c"),
    ]
)
