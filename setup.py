"""The optional C extension raywds.loader._jpeg (region-of-interest JPEG decoding with libjpeg-turbo).

Everything else is in pyproject.toml. Without a C compiler or libjpeg's headers (Debian:
libjpeg62-turbo-dev) the extension is skipped and raywds decodes whole JPEGs instead.
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("raywds.loader._jpeg", ["raywds/loader/_jpeg.c"], libraries=["jpeg"], extra_compile_args=["-O2"], optional=True)])
