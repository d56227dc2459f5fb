"""No hard-coded CPU device or gloo backend in the trainer, the benchmarks or the TP code.

The device and the process-group backend are chosen in one place,
``boost_compiler/device.py``, so the same code runs on a GPU (issue 28, item 5). This
walks the source of ``train/``, ``bench/`` and ``tp/`` (the syntax tree, so docstring
examples, comparisons like ``t.device.type != "cpu"`` and words matched in error
messages are not hits) and refuses ``"cpu"`` or ``"gloo"`` passed to a call
(positionally, or as ``device=``, ``map_location=``, ``backend=``). It is tested on a
module that breaks the rule.
"""

from __future__ import annotations

import ast
from pathlib import Path

import boost_compiler

PACKAGE = Path(boost_compiler.__file__).parent
FOLDERS = ("train", "bench", "tp")
KEYWORDS = ("device", "map_location", "backend")


def hard_coded(source: str, where: str = "<source>") -> list[str]:
    """Every literal CPU device or gloo backend handed to a call, with its line."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        args = list(node.args) + [k.value for k in node.keywords if k.arg in KEYWORDS]
        for arg in args:
            if isinstance(arg, ast.Constant) and arg.value in ("cpu", "gloo"):
                found.append((arg.lineno, f"{where}:{arg.lineno}: {arg.value!r} passed to a call"))
    return [text for _, text in sorted(found)]


def test_no_hard_coded_cpu_or_gloo() -> None:
    files = [f for folder in FOLDERS for f in sorted((PACKAGE / folder).rglob("*.py"))]
    assert len(files) > 30, files  # the walk found the package
    found = [hit for f in files for hit in hard_coded(f.read_text(), str(f.relative_to(PACKAGE)))]
    assert found == [], "choose the device in boost_compiler/device.py:\n" + "\n".join(found)


def test_the_check_finds_what_it_refuses() -> None:
    bad = '''
def f(x):
    """dist.init_process_group("gloo") in a docstring is fine."""
    dist.init_process_group(backend="gloo")
    mesh = init_device_mesh("cpu", (2,))
    y = x.to(device="cpu")
    return torch.load(p, map_location="cpu") if x.device.type != "cpu" else y
'''
    hits = hard_coded(bad)
    assert [h.split(": ", 1)[0] for h in hits] == ["<source>:4", "<source>:5", "<source>:6",
                                                   "<source>:7"], hits  # fmt: skip
