"""The backend: registration by entry point, options, the no-bottleneck path."""

from __future__ import annotations

import copy
import logging
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

from boost_compiler import BoostOptions
from boost_compiler.backend import boost_backend
from boost_compiler.errors import OptionTypeError, UnknownOptionError

from .conftest import ROOT


def _lowrank() -> nn.Module:
    return nn.Sequential(nn.Linear(32, 8, bias=False), nn.SiLU(), nn.Linear(8, 32))


def test_backend_found_by_name_in_fresh_interpreter() -> None:
    code = textwrap.dedent(
        """
        import sys, torch
        from torch import nn
        from torch._dynamo.utils import counters
        m = nn.Sequential(nn.Linear(32, 8, bias=False), nn.SiLU(), nn.Linear(8, 32))
        x = torch.randn(3, 32)
        assert "boost_compiler" not in sys.modules
        y = torch.compile(m, backend="boost", options={"lowering": "eager"})(x)
        torch.testing.assert_close(y, m(x))
        print("graphs", counters["boost"]["graphs"], "bottlenecks", counters["boost"]["bottlenecks"])
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd="/",
        timeout=300,
        env={**os.environ, "PYTHONPATH": ""},
    )
    assert out.returncode == 0, out.stderr
    assert "graphs 1 bottlenecks 1" in out.stdout


def test_unknown_option_names_it_and_lists_valid_ones() -> None:
    with pytest.raises(UnknownOptionError, match="'detect_bottleneck'.*detect_bottlenecks"):
        BoostOptions.parse({"detect_bottleneck": False})
    m = torch.compile(_lowrank(), backend="boost", options={"no_such_pass": True})
    with pytest.raises(Exception, match="no_such_pass"):
        m(torch.randn(2, 32))


def test_wrong_option_type_names_it() -> None:
    with pytest.raises(OptionTypeError, match="'detect_bottlenecks'.*'yes'"):
        BoostOptions.parse({"detect_bottlenecks": "yes"})
    with pytest.raises(OptionTypeError, match="'lowering'.*'tvm'"):
        BoostOptions.parse({"lowering": "tvm"})
    with pytest.raises(OptionTypeError, match="'inductor_config'"):
        BoostOptions.parse({"inductor_config": ["max_autotune"]})


def _compile_and_graph(options: dict) -> torch.fx.GraphModule:
    """Run the boost backend inside torch.compile and return the graph it rewrote."""
    seen: list[torch.fx.GraphModule] = []

    def spy(gm, inputs):
        boost_backend(gm, inputs, options=options)
        seen.append(gm)
        return gm.forward

    torch.compile(_lowrank(), backend=spy)(torch.randn(2, 32))
    return seen[0]


def test_pass_switched_off_by_name(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="boost_compiler"):
        gm = _compile_and_graph({"lowering": "eager"})
    assert "1 bottleneck" in caplog.text
    assert any(n.meta.get("boost", {}).get("role") == "down" for n in gm.graph.nodes)

    caplog.clear()
    with caplog.at_level(logging.INFO, logger="boost_compiler"):
        gm = _compile_and_graph({"lowering": "eager", "detect_bottlenecks": False})
    assert "bottleneck" not in caplog.text
    assert not any("boost" in n.meta for n in gm.graph.nodes)


def test_dense_model_compiles_as_plain_inductor(caplog: pytest.LogCaptureFixture) -> None:
    dense = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16))
    x = torch.randn(4, 16)
    with caplog.at_level(logging.INFO, logger="boost_compiler"):
        y = torch.compile(dense, backend="boost")(x)
    torch.testing.assert_close(y, dense(x), rtol=1e-5, atol=1e-6)
    lines = [r.getMessage() for r in caplog.records if "no bottleneck" in r.getMessage()]
    assert len(lines) == 1, caplog.text


def test_pass_uuid_covers_setting_and_analysis() -> None:
    from boost_compiler.passes import DetectBottlenecks, PassContext

    a = DetectBottlenecks(PassContext(), True).uuid()
    assert a == DetectBottlenecks(PassContext(), True).uuid()
    assert a != DetectBottlenecks(PassContext(param_names={"w": "0.weight"}), True).uuid()
    assert a != DetectBottlenecks(PassContext(), "other").uuid()


def test_readme_names_the_ci_command() -> None:
    """The README names each tier CI runs: `bash dev.sh test`, then `bash dev.sh compat`."""
    lines = (ROOT / ".ci" / "run").read_text().strip().splitlines()
    tiers = [line for line in lines if line.startswith("bash dev.sh")]
    assert tiers[:1] == ["bash dev.sh test"] and lines[-1] in tiers, lines
    readme = (ROOT / "README.md").read_text()
    assert all(t in readme for t in tiers), tiers


@pytest.mark.parametrize("rank", [0, 1])
def test_compile_in_turns_takes_every_barrier_when_the_compile_raises(
    rank: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Dynamo restarts analysis by raising from the backend: a rank that then skipped
    its remaining barriers paired them with its peers' collectives (a deadlock seen
    with ``dynamic=True``). Every rank must take ``p`` barriers per compile, then raise."""
    import torch.distributed as dist

    from boost_compiler.parallel.runtime import _in_turns
    from boost_compiler.tp.collectives import fake_process_group
    from boost_compiler.tp.groups import resolve_group

    class Restart(Exception):
        pass

    def compile_() -> None:
        raise Restart

    barriers = []
    with fake_process_group(2, rank=rank):
        monkeypatch.setattr(dist, "barrier", lambda group=None: barriers.append(group))
        with pytest.raises(Restart):
            _in_turns(resolve_group(dist.group.WORLD), compile_)
    assert len(barriers) == 2


class _WriteAcrossBreak(nn.Module):
    """``y = silu_(h)`` in one frame, ``y += h`` (y *is* h) in the next, then ``h + y``."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def inner(self, h: torch.Tensor) -> torch.Tensor:
        torch._dynamo.graph_break()
        return nn.functional.silu(h, inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        y = self.inner(h)
        y += h
        return h + y


@pytest.mark.parametrize("lowering", ["eager", "inductor"])
def test_output_of_an_inplace_op_still_aliases_the_written_input(lowering: str) -> None:
    """One device: the functionalized graph returns the written input itself, not a copy.

    Without that, ``y`` and ``h`` stop being one tensor after the graph break and the
    result is ``h + 2*silu(h)`` instead of ``4*silu(h)`` (the fuzzer's run 2027, #454).
    """
    torch._dynamo.reset()
    torch.manual_seed(0)
    model, x = _WriteAcrossBreak(), torch.randn(2, 8)
    ref = model(x)
    options = {"lowering": "eager"} if lowering == "eager" else {}
    out = torch.compile(model, backend="boost", options=options)(x)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    torch._dynamo.reset()


class _Region(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    @torch.compiler.nested_compile_region
    def block(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.lin(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(self.block(x)).sum()


def test_eager_lowering_inlines_nested_compile_regions() -> None:
    """torch runs invoke_subgraph's backward only under AOTAutograd: run as-is it failed
    in backward with a bare AssertionError. Eager lowering inlines the regions: exact."""
    torch._dynamo.reset()
    model = _Region()
    ref = copy.deepcopy(model)
    x = torch.randn(2, 8)
    run = torch.compile(model, backend="boost", options={"lowering": "eager"})
    run(x).backward()
    ref(x).backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=0, msg=name)
    torch._dynamo.reset()
