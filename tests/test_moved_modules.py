"""The modules that moved into packages (issue 24) keep their old import paths for one release:
the same module object, with a DeprecationWarning naming the new path.  The library itself
imports only the new paths.

(move_modules: keep old paths — scripts/move_modules.py leaves this file alone.)"""

from __future__ import annotations

import ast
import importlib
import pathlib
import subprocess
import sys

import pytest

import credit_parallel
from credit_parallel import MOVED_MODULES
from test_architecture import PKG, _imported, _module_name

OLD_PATHS = sorted(old for old in MOVED_MODULES if old != "layout")  # layout/ is a package now


@pytest.mark.parametrize("old", OLD_PATHS)
def test_an_old_path_is_the_moved_module_with_a_warning(old):
    new = f"{PKG}.{MOVED_MODULES[old]}"
    module = importlib.import_module(new)
    sys.modules.pop(f"{PKG}.{old}", None)
    with pytest.warns(DeprecationWarning, match=new.replace(".", r"\.")):
        alias = importlib.import_module(f"{PKG}.{old}")
    assert alias is module
    assert module.__spec__.name == new  # the module keeps its own spec
    assert module.__name__ == new


def test_the_paths_users_and_docs_imported_still_work_in_a_fresh_interpreter():
    code = (
        "import warnings\n"
        "warnings.simplefilter('error')\n"
        "from credit_parallel.layout import RankLayout\n"  # the module became the package
        "from credit_parallel.domain.manager import DomainParallelManager\n"
        "warnings.simplefilter('ignore')\n"
        "from credit_parallel.mesh import build_device_mesh\n"
        "from credit_parallel.collectives import sync_domain_gradients\n"
        "from credit_parallel.tensor_parallel import apply_tensor_parallel\n"
        "from credit_parallel.config import ParallelDims\n"
        "import credit_parallel as cp\n"
        "assert build_device_mesh is cp.build_device_mesh\n"
        "assert sync_domain_gradients is cp.sync_domain_gradients\n"
        "assert apply_tensor_parallel is cp.apply_tensor_parallel\n"
        "assert ParallelDims is cp.ParallelDims and RankLayout is cp.RankLayout\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_a_new_import_path_gives_no_warning():
    code = (
        "import warnings\n"
        "warnings.simplefilter('error')\n"
        "import credit_parallel.cli, credit_parallel.tools.verify, credit_parallel.train.trainer\n"
        "import credit_parallel.parallel.composition, credit_parallel.layout.mesh\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr


def test_the_library_never_imports_an_old_path():
    root = pathlib.Path(credit_parallel.__file__).parent
    old = {f"{PKG}.{name}" for name in MOVED_MODULES if name != "layout"}
    found = []
    for path in sorted(root.rglob("*.py")):
        module = _module_name(path, root)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for target in _imported(module, path.name == "__init__.py", node):
                    if target in old:
                        found.append(f"{module}: {target}")
    assert not found, found
