"""The runner imports the step types (batchprompt.steps), never the engine, so that each of
these modules loads first in a fresh interpreter. An import cycle fails only when one side is
imported before the other; batchprompt/__init__ always loads the engine first and would hide
one, so the package's own __init__ is left out here, as when the runner is used on its own."""
from __future__ import annotations

import subprocess
import sys

import pytest

SKIP_PACKAGE_INIT = """
import importlib.util, sys
spec = importlib.util.find_spec("batchprompt")
sys.modules["batchprompt"] = importlib.util.module_from_spec(spec)  # not executed
import {module}
"""


@pytest.mark.parametrize("module", ["batchprompt.runner.model_runner", "batchprompt.runner.inputs",
                                    "batchprompt.steps", "batchprompt.engine.scheduler"])
def test_module_imports_first_in_a_fresh_interpreter(module):
    for code in (f"import {module}", SKIP_PACKAGE_INIT.format(module=module)):
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
