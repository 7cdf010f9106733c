"""``flash_attn.__path__`` is extended as upstream's (``pkgutil.extend_path``), so FlashAttention-4's
package ``flash_attn.cute``, installed by another distribution into another ``flash_attn/`` folder,
imports beside this package."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from support import REPO


def test_a_cute_subpackage_elsewhere_on_sys_path_imports(tmp_path):
    # FA4's layout: site-packages/flash_attn/cute/__init__.py, no flash_attn/__init__.py of its own
    cute = tmp_path / "flash_attn" / "cute"
    cute.mkdir(parents=True)
    (cute / "__init__.py").write_text("MARK = 'fa4 stand-in'\n")
    code = ("import json, flash_attn, flash_attn.cute as cute\n"
            "from flash_attn.aot import library\n"
            "print(json.dumps([flash_attn.__file__, cute.__file__, cute.MARK, hasattr(flash_attn, 'flash_attn_func'),\n"
            "                  [str(f) for f in library.package_folders()]]))\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(tmp_path)])}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path.parent)
    assert result.returncode == 0, result.stderr[-3000:]
    ours, theirs, mark, api, folders = json.loads(result.stdout.strip().splitlines()[-1])
    assert ours == str(REPO / "flash_attn" / "__init__.py")
    assert theirs == str(cute / "__init__.py") and mark == "fa4 stand-in" and api
    # the op library and kernel images are looked up in this distribution's folders only
    assert str(REPO / "flash_attn") in folders and str(tmp_path / "flash_attn") not in folders

