"""The package as a user gets it: a wheel in a fresh virtual environment, used outside the repo.

One module-scoped fixture builds the wheel from a copy of the package's sources (nothing is
written into the checkout), creates a fresh virtual environment, makes the local torch
visible in it and installs the wheel with its runtime dependencies only (no extras: no
matplotlib, no transformers, no safetensors). Then, from an empty folder outside the repository:

- ``test_commands_from_the_wheel``: ``boost train --steps 2 --no-compile``, ``boost explain
  cola-llama:tiny --tp 2``, ``boost cost --config 7b --tp 4``, ``boost bench`` at its
  smallest size, and ``torch.compile(model, backend="boost")`` in a program that never
  imports ``boost_compiler`` (the ``torch_dynamo_backends`` entry point);
- ``test_readme_python_examples``: every ```` ```python ```` block of README.md and of the
  docs/*.md pages it links to, exactly as written, unless the line before it says
  ``<!-- readme-test: skip <reason> -->``.

How torch gets into the fresh environment without a download: the distributions torch needs
(torch and its requirements, recursively, as this interpreter has them installed) are
symlinked into one folder, and a ``.pth`` file in the new environment's site-packages adds
that folder to ``sys.path``. pip sees them there as installed, so it only fetches what the
wheel adds (rich, numpy and their dependencies, from pip's configured indexes); nothing else
of the project's environment (matplotlib, transformers, the editable install) is visible.
"""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.extras import need

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = [README, *sorted((ROOT / "docs").glob("*.md"))]  # where examples live
ALL_SYSTEMS = ("boost", "dtensor-lowrank", "dtensor-dense", "eager", "inductor")
SKIP_MARK = re.compile(r"<!--\s*readme-test:\s*skip\s+(?P<reason>.+?)\s*-->")


@dataclass(frozen=True)
class Installed:
    python: Path  # the fresh environment's interpreter
    bin: Path  # its scripts folder (``boost``)
    work: Path  # an empty folder outside the repository, the commands' cwd
    env: dict[str, str]


def _dist_closure(name: str) -> list[md.Distribution]:
    """``name`` and every distribution it requires (no extras), as installed here."""
    seen: dict[str, md.Distribution] = {}
    todo = [name]
    while todo:
        key = re.sub(r"[-_.]+", "-", todo.pop()).lower()
        if key in seen:
            continue
        try:
            dist = md.distribution(key)
        except md.PackageNotFoundError:  # a marker-excluded requirement (other platform)
            continue
        seen[key] = dist
        for req in dist.requires or []:
            if "extra ==" in req.replace("'", '"') or "extra==" in req:
                continue
            todo.append(re.match(r"[A-Za-z0-9._-]+", req).group(0))  # type: ignore[union-attr]
    return list(seen.values())


def _link_torch(dest: Path) -> list[str]:
    """Symlink torch and its requirements' top-level files into ``dest``; their names."""
    dest.mkdir()
    names: set[str] = set()
    for dist in _dist_closure("torch"):
        base = Path(dist.locate_file(""))
        for f in dist.files or []:
            top = f.parts[0]
            if top == ".." or top in names or top == "__pycache__":
                continue
            if (base / top).exists():
                names.add(top)
                (dest / top).symlink_to(base / top)
    return sorted(names)


def _run(inst: Installed, args: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        args, cwd=inst.work, env=inst.env, capture_output=True, text=True, timeout=timeout,
        check=False,
    )  # fmt: skip
    assert proc.returncode == 0, (
        f"{' '.join(map(str, args))} exited {proc.returncode}\n"
        f"--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-4000:]}"
    )
    return proc


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Installed:
    tmp = tmp_path_factory.mktemp("wheel")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    # 1. The wheel, from a copy of what a source distribution holds (the build writes
    #    build/ and *.egg-info next to its sources: not into the checkout).
    src = tmp / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    shutil.copytree(
        ROOT / "boost_compiler", src / "boost_compiler",
        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"),
    )  # fmt: skip
    dist = tmp / "dist"
    pip = [sys.executable, "-m", "pip"]
    subprocess.run(
        [*pip, "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(dist), str(src)],
        check=True, env=env, capture_output=True, timeout=300,
    )  # fmt: skip
    (wheel,) = dist.glob("boost_compiler-*.whl")
    # 2. A fresh environment (the base interpreter, not this venv), torch made visible.
    venv = tmp / "venv"
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True, env=env,
    ).stdout.strip()  # fmt: skip
    linked = _link_torch(tmp / "torch-site")
    assert "torch" in linked and "numpy" not in linked, linked
    Path(site, "local_torch.pth").write_text(str(tmp / "torch-site") + "\n")
    # 3. The wheel with its runtime dependencies only; pip runs from this environment.
    proc = subprocess.run(
        [*pip, "--python", str(python), "install", "-q", str(wheel)],
        env=env, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    work = tmp / "work"
    work.mkdir()
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    return Installed(python, venv / "bin", work, env)


def test_wheel_contents_and_isolation(installed: Installed) -> None:
    """The environment has the wheel's boost_compiler (not the checkout's), no extras."""
    code = textwrap.dedent("""
        import importlib.metadata as md, importlib.util, json, boost_compiler
        eps = md.entry_points()
        print(json.dumps({
            "file": boost_compiler.__file__,
            "numpy": importlib.util.find_spec("numpy") is not None,
            "matplotlib": importlib.util.find_spec("matplotlib") is not None,
            "backends": [e.value for e in eps.select(group="torch_dynamo_backends", name="boost")],
            "scripts": [e.value for e in eps.select(group="console_scripts", name="boost")],
            "extras": md.metadata("boost-compiler").get_all("Provides-Extra"),
            "typed": importlib.util.find_spec("boost_compiler").submodule_search_locations[0],
        }))
    """)  # fmt: skip
    out = json.loads(_run(installed, [str(installed.python), "-c", code], 120).stdout)
    assert not out["file"].startswith(str(ROOT)), out["file"]
    assert "site-packages" in out["file"]
    assert out["numpy"] is True  # a runtime dependency: torch's object collectives need it
    assert out["matplotlib"] is False  # an extra
    assert out["backends"] == ["boost_compiler.backend:boost_backend"]
    assert out["scripts"] == ["boost_compiler.cli:main"]
    assert {"train", "bench", "hf", "test"} <= set(out["extras"])
    assert Path(out["typed"], "py.typed").is_file()


def test_commands_from_the_wheel(installed: Installed) -> None:
    """Each command a new user runs: exit status 0 and its output written."""
    boost = str(installed.bin / "boost")
    work = installed.work
    out = _run(
        installed,
        [boost, "train", "--steps", "2", "--no-compile", "--metrics", "run/metrics.jsonl"],
        300,
    )
    lines = [json.loads(x) for x in (work / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [x for x in lines if "loss" in x]
    assert [x["step"] for x in steps] == [0, 1], lines
    assert "step 1: loss" in out.stdout
    _run(installed, [boost, "explain", "cola-llama:tiny", "--tp", "2", "--out", "report"], 300)
    assert "bottleneck" in (work / "report" / "report.html").read_text().lower()
    cost = _run(installed, [boost, "cost", "--config", "7b", "--tp", "4", "--json"], 120)
    assert json.loads(cost.stdout)["tp"] == 4
    # The smallest size; CI runs BOOST (compiled, 2 ranks) and eager (1 process), one spawned
    # group each; BOOST_FULL_TESTS=1 adds the compiled DTensor baselines and Inductor.
    systems = ALL_SYSTEMS if os.environ.get("BOOST_FULL_TESTS") else ("boost", "eager")
    _run(
        installed,
        [boost, "bench", "--sizes", "tiny", "--steps", "1", "--warmup", "1", "--gemm-scales",
         "tiny", "--systems", ",".join(systems), "--out", "bench", "--timeout", "400"],
        600,
    )  # fmt: skip
    (results,) = (work / "bench").glob("*/results.json")
    record = json.loads(results.read_text())
    assert record["failures"] == [] and record["gemm"], record["failures"]
    assert set(record["summary"]["tiny"]) == set(systems)
    assert record["summary"]["tiny"]["boost"]["bytes_match"] is True
    # torch.compile(backend="boost") in a program that never imports boost_compiler
    program = textwrap.dedent("""
        import sys, torch
        from torch import nn
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 16, bias=False), nn.SiLU(), nn.Linear(16, 64, bias=False))
        x = torch.randn(4, 64)
        with torch.no_grad():  # an inference graph: one compile
            out = torch.compile(model, backend="boost")(x)
        torch.testing.assert_close(out, model(x))
        assert "boost_compiler" in sys.modules  # loaded through the entry point
        print("compiled ok")
    """)  # fmt: skip
    assert "compiled ok" in _run(installed, [str(installed.python), "-c", program], 300).stdout


def readme_python_blocks() -> list[tuple[str, str, str | None]]:
    """``(file:line, code, skip reason or None)`` of every ```` ```python ```` block of
    README.md and docs/*.md."""
    blocks: list[tuple[str, str, str | None]] = []
    for doc in DOCS:
        lines = doc.read_text().splitlines()
        i = 0
        while i < len(lines):
            if lines[i].strip() == "```python":
                start = i
                j = i + 1
                while lines[j].strip() != "```":
                    j += 1
                before = next((x for x in reversed(lines[:start]) if x.strip()), "")
                mark = SKIP_MARK.search(before)
                blocks.append((f"{doc.relative_to(ROOT)}:{start + 1}",
                               "\n".join(lines[start + 1 : j]) + "\n",
                               mark.group("reason") if mark else None))  # fmt: skip
                i = j
            i += 1
    return blocks


BLOCKS = readme_python_blocks()


def test_readme_has_runnable_examples() -> None:
    assert BLOCKS, "README.md has no ```python blocks"
    assert any(reason is None for _, _, reason in BLOCKS), "every README example is skipped"


@pytest.mark.parametrize(("where", "code", "reason"), BLOCKS, ids=[b[0] for b in BLOCKS])
def test_readme_python_examples(
    installed: Installed, where: str, code: str, reason: str | None
) -> None:
    """A README or docs/ example, exactly as written, in the wheel's environment, outside the
    repository."""
    if reason is not None:
        pytest.skip(f"{where}: {reason}")
    script = installed.work / f"example_{where.replace('/', '_').replace('.md:', '_')}.py"
    script.write_text(code)
    _run(installed, [str(installed.python), str(script)], 300)


# -- boost explain's model argument (in-process, fast) ----------------------------------------


def test_explain_resolves_presets_factories_and_hf_folders(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch

    from boost_compiler.errors import BoostError
    from boost_compiler.models.factories import resolve

    model, (ids,), kwargs = resolve("cola-llama:tiny")
    assert model.cfg.d_model == 64 and kwargs["labels"] is ids
    big, (big_ids,), _ = resolve("cola-llama:7b")
    assert big.lm_head.weight.is_meta and big_ids.is_meta
    with pytest.raises(BoostError, match="unknown CoLA-LLaMA preset 'nope'"):
        resolve("cola-llama:nope")
    (tmp_path / "myfactories.py").write_text(
        "import torch\n"
        "def make():\n"
        "    m = torch.nn.Sequential(torch.nn.Linear(8, 2), torch.nn.Linear(2, 8))\n"
        "    return m, [torch.randn(3, 8)]\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))  # the cwd entry load_factory adds
    user, inputs, kw = resolve("myfactories:make")
    sys.modules.pop("myfactories", None)
    assert isinstance(user, torch.nn.Sequential) and len(inputs) == 1 and kw == {}
    user, _, _ = resolve(f"{tmp_path / 'myfactories.py'}:make")
    assert isinstance(user, torch.nn.Sequential)
    with pytest.raises(BoostError, match="without a Hugging Face config.json"):
        resolve(str(tmp_path))
    with pytest.raises(BoostError, match="must look like"):
        resolve("no_colon_here")
    transformers = need("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
    )  # fmt: skip
    cfg.save_pretrained(tmp_path / "hf")
    hf, (hf_ids,), hf_kw = resolve(str(tmp_path / "hf"), rank_ratio=0.25)
    assert hf_ids.is_meta and hf_kw["use_cache"] is False
    assert type(hf).__name__ == "LlamaForCausalLM"
    assert hf.model.layers[0].self_attn.q_proj.down.weight.shape == (16, 64)
