"""A command's start: loading a shipped model and generating never imports torch's compiler (torch._dynamo takes
~1 s to import, most of a CLI call on a small model). Meta-device arithmetic and `torch.compiler.disable` are what
import it; the compiled blocks (`--compile`) import it when asked for."""

import subprocess
import sys

SCRIPT = """
import sys
import blockpress
lm = blockpress.load("blockpress/assets/assistant", device="cpu", progress=False)
out = lm.generate_text("What is 2 + 3?", seed=0)
assert "5" in out, out
print("torch._dynamo" in sys.modules)
"""


def test_loading_and_generating_do_not_import_the_compiler():
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[1]
    got = subprocess.run([sys.executable, "-c", SCRIPT], cwd=root, capture_output=True, text=True, timeout=300)
    assert got.returncode == 0, got.stderr[-2000:]
    assert got.stdout.strip().splitlines()[-1] == "False", "torch._dynamo was imported by loading or generating"
