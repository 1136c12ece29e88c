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
  It also seals and unseals index values, and makes the ``bytes`` of a scan's records
  (``record_bytes``) for ``SegmentLog.scan``.
- ``mwpstore._apply_c``: the AgentStore's in-order apply runs and their full validation
  (``csrc/agent_apply.c``), limited API; ``agent_store`` keeps the Python definitions.

After editing C, ``python setup.py build_ext --inplace`` rebuilds what changed (sources and the
headers they include); ``--force`` rebuilds everything.
"""

import os
import runpy

from setuptools import Extension, setup

# The compiler and linker flags of every extension, from one place (csrc/build_segment_log.py);
# MWPSTORE_SANITIZE=1 makes them a sanitizer build (docs/reliability.md, "Sanitizers").
_FLAGS = runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc", "build_segment_log.py"))


def limited_api_extension(name: str, source: str) -> Extension:
    """A CPython extension built against the limited API (one abi3 binary for Python >= 3.11)."""
    return Extension(
        name,
        sources=[source],
        extra_compile_args=list(_FLAGS["COMPILE_ARGS"]),
        extra_link_args=list(_FLAGS["LINK_ARGS"]),
        define_macros=[("Py_LIMITED_API", "0x030B0000")],
        py_limited_api=True,
    )


setup(
    cffi_modules=["csrc/build_segment_log.py:ffibuilder", "csrc/build_lmdb_check.py:ffibuilder"],
    ext_modules=[
        limited_api_extension("mwpstore._canonical_c", "csrc/canonical_check.c"),
        limited_api_extension("mwpstore._index_c", "csrc/index_records.c"),
        limited_api_extension("mwpstore._apply_c", "csrc/agent_apply.c"),
    ],
)
