"""Build script: compiles the C parts of the package.

- ``mwpstore._segment_log_c``: the C segment log (csrc/), in cffi out-of-line API mode:
  ``csrc/build_segment_log.py`` defines the FFI builder and imports nothing from the package.
- ``mwpstore._canonical_c``: fast yes/no checks of canonical content and IDs
  (``csrc/canonical_check.c``), a small CPython extension (limited API) because it walks Python
  objects; ``mwpstore/canonical.py`` calls it and keeps the precise, typed errors in Python.
- ``mwpstore._lmdb_check_c``: the structural check of LMDB files (``csrc/lmdb_check.c``), cffi.
- ``mwpstore._index_c``: index entries of Event records for redo and rebuild
  (``csrc/index_records.c``), a CPython extension (limited API) because it builds the bytes,
  tuples and dict entries the LMDB writes take; ``authority._index_record`` is its reference.
"""

from setuptools import Extension, setup

setup(
    cffi_modules=["csrc/build_segment_log.py:ffibuilder", "csrc/build_lmdb_check.py:ffibuilder"],
    ext_modules=[
        Extension(
            "mwpstore._canonical_c",
            sources=["csrc/canonical_check.c"],
            extra_compile_args=["-std=c11", "-Wall", "-Wextra", "-Werror", "-O2"],
            define_macros=[("Py_LIMITED_API", "0x030B0000")],
            py_limited_api=True,
        ),
        Extension(
            "mwpstore._index_c",
            sources=["csrc/index_records.c"],
            extra_compile_args=["-std=c11", "-Wall", "-Wextra", "-Werror", "-O2"],
            define_macros=[("Py_LIMITED_API", "0x030B0000")],
            py_limited_api=True,
        ),
    ],
)
