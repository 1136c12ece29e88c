"""The package as the README's first command installs it: a wheel built by the package's own
build, installed (not editable), runs ``mwpstore demo`` on its default data directory.

CI installs the package editable, which reads the modules from the source tree: a module or a
data file the wheel leaves out, or a C extension it does not build, would pass there and break
``pip install .``. This test builds the wheel from a copy of the source tree (so the checkout is
not written to), installs it into a directory of its own, and runs the installed command.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXTENSIONS = ("_segment_log_c", "_canonical_c", "_index_c", "_apply_c", "_lmdb_check_c")
LEFT_OUT = (".git", ".venv", "build", "dist", "__pycache__", "*.egg-info", "*.so", "*.o", ".pytest_cache",
            ".hypothesis", ".mypy_cache", "mwpstore-demo", "mwpstore-data", "results")


def test_the_wheel_holds_the_whole_package_and_its_installed_command_runs_the_demo(tmp_path):
    source = tmp_path / "source"
    shutil.copytree(REPO, source, ignore=shutil.ignore_patterns(*LEFT_OUT))
    wheels, site = tmp_path / "wheels", tmp_path / "site"
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input"]
    # No build isolation: the build requirements are the test extra's, so nothing is downloaded.
    subprocess.run([*pip, "wheel", "--quiet", "--no-deps", "--no-build-isolation", "-w", str(wheels), str(source)],
                   check=True, capture_output=True, timeout=600)
    [wheel] = list(wheels.glob("mwpstore-*.whl"))
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
    modules = {f"mwpstore/{name}" for name in os.listdir(os.path.join(REPO, "mwpstore"))
               if name.endswith((".py", ".pyi")) or name == "py.typed"}
    assert modules - names == set()
    for extension in EXTENSIONS:
        assert any(name.startswith(f"mwpstore/{extension}.") and name.endswith(".so") for name in names), extension

    subprocess.run([*pip, "install", "--quiet", "--no-deps", "--no-build-isolation", "--target", str(site), str(wheel)],
                   check=True, capture_output=True, timeout=600)
    run = tmp_path / "run"
    run.mkdir()
    # The installed package, with the dependencies of the interpreter running the tests.
    env = dict(os.environ, PYTHONPATH=str(site))
    where = subprocess.run([sys.executable, "-c", "import mwpstore; print(mwpstore.__file__)"], cwd=run, env=env,
                           check=True, capture_output=True, text=True, timeout=60)
    assert where.stdout.strip().startswith(str(site))
    demo = subprocess.run([str(site / "bin" / "mwpstore"), "demo", "--json", "--workitems", "20", "--agents", "2"],
                          cwd=run, env=env, capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL)
    assert demo.returncode == 0, demo.stderr[-2000:]
    document = json.loads(demo.stdout)
    assert document["ok"] is True and all(check["ok"] for check in document["checks"])
    assert (run / "mwpstore-demo").is_dir()  # its default data directory, in the working directory
