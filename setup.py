"""Build script: compiles the C segment log (csrc/) into ``mwpstore._segment_log_c``.

cffi out-of-line API mode: ``csrc/build_segment_log.py`` defines the FFI builder and imports
nothing from the package.
"""

from setuptools import setup

setup(cffi_modules=["csrc/build_segment_log.py:ffibuilder"])
