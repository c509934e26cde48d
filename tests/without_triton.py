"""Run pytest with `triton` unimportable, as on a machine Triton has no wheels for (macOS,
Windows), in the same environment: `python tests/without_triton.py [pytest arguments]`.

CI runs the PyTorch-backend tests this way after the main run (see .ci/run), which shows that
`import fastlm` and every op work without Triton installed.
"""

import importlib.abc
import sys


class _HideTriton(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "triton" or name.startswith("triton."):
            raise ModuleNotFoundError(f"No module named {name!r} (hidden by {__file__})", name=name)
        return None


sys.meta_path.insert(0, _HideTriton())

import pytest  # noqa: E402

sys.exit(pytest.main(sys.argv[1:]))
