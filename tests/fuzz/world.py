"""A persistent 2-rank gloo world that runs fuzz specs and classifies them.

``World`` spawns the ranks once (``torch.multiprocessing`` spawn context, one pipe
per rank, ``OMP_NUM_THREADS=1``); ``World.run(spec, mode)`` sends the spec to both
ranks, each builds it, runs the single-device reference itself, parallelizes a
deep copy and compares the forward output and every gathered gradient. The
parent merges the two ranks' reports into one outcome:

    exact        output and every gradient within RTOL (max relative error), or,
                 for an ill-conditioned quantity, within 10x what a 1e-7 relative
                 perturbation of the single-device program changes it by, or (numbers
                 off in fp32) all within RTOL when the program runs in float64
    named error  a BoostError from parallelize (parameters untouched) or from the
                 first forward, on both ranks alike
    wrong        anything else: numbers off, another exception, ranks that
                 disagree, a hang (no answer within ``timeout`` s: the world is
                 killed and restarted for the next spec)
    invalid      the reference itself cannot run (in-place on a tensor autograd
                 saved, a loss without gradient): the program is not a test

``mode``: ``eager`` (``model(x)``), ``compile_eager`` (``torch.compile(model,
backend="boost", options={"lowering": "eager"})``), ``inductor`` (Inductor lowering,
ranks compiling in turns).
"""

from __future__ import annotations

import copy
import datetime
import os
import tempfile
import time
import traceback
from multiprocessing.connection import Connection, wait
from typing import Any

import torch

RTOL = 1e-5
PERTURB = 1e-7  # relative perturbation of the twin that measures rounding noise
NOISE_MARGIN = 10.0
MODES = ("eager", "compile_eager", "inductor")
EXACT, NAMED, WRONG, INVALID = "exact", "named error", "wrong", "invalid"


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    if a.shape != b.shape:
        return float("inf")
    if not torch.isfinite(a).all() or not torch.isfinite(b).all():
        return (
            0.0
            if torch.equal(a.isnan(), b.isnan())
            and torch.equal(torch.nan_to_num(a), torch.nan_to_num(b))
            else float("inf")
        )
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item() if b.numel() else 0.0


def _short(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]


# --------------------------------------------------------------------------------------
# One program on one rank
# --------------------------------------------------------------------------------------


def _build(spec: dict[str, Any], dtype: str) -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
    """The spec's model and inputs, in float64 when asked (the ill-conditioning check)."""
    from tests.fuzz.grammar import build

    model, inputs = build(spec)
    if dtype == "float64":
        model = model.double()
        inputs = tuple(x.double() if x.is_floating_point() else x for x in inputs)
    return model, inputs


def run_program(
    spec: dict[str, Any], mode: str, mesh: Any, world: int, dtype: str = "float32"
) -> dict[str, Any]:
    """Reference on this rank, then the parallelized copy; a report for this rank.

    ``dtype="float64"``: the same program with float64 parameters and input (the
    second opinion on an ill-conditioned program whose fp32 numbers were off).
    """
    import torch.distributed as dist

    import boost_compiler
    from boost_compiler.errors import BoostError
    from tests.fuzz.grammar import loss_weights

    model, inputs = _build(spec, dtype)
    par = copy.deepcopy(model)  # before anything runs: the same parameters, unmodified
    try:
        out_ref = model(*(x.clone() for x in inputs))
        weights = loss_weights(spec, out_ref)
        (out_ref * weights).sum().backward()
    except Exception as exc:
        return {"outcome": INVALID, "stage": "reference", "error": _short(exc)}
    ref_grads = {n: p.grad for n, p in model.named_parameters()}
    noise = _rounding_noise(spec, par, inputs, out_ref, ref_grads)

    before = {n: p.detach().clone() for n, p in par.named_parameters()}
    try:
        boost_compiler.parallelize(par, mesh, inputs)
    except BoostError as exc:
        after = dict(par.named_parameters())
        untouched = after.keys() == before.keys() and all(
            after[n].shape == t.shape and torch.equal(after[n].detach(), t)
            for n, t in before.items()
        )
        if not untouched:
            return {"outcome": WRONG, "stage": "parallelize", "error": "parameters modified "
                    "before the named error: " + _short(exc)}  # fmt: skip
        return {"outcome": NAMED, "stage": "parallelize", "error": _short(exc)}
    except Exception as exc:
        return {"outcome": WRONG, "stage": "parallelize", "error": _short(exc),
                "trace": traceback.format_exc()[-3000:]}  # fmt: skip
    plan = par.boost_plan
    if mode == "eager":
        run = par
    else:
        options: dict[str, Any] = {"lowering": "eager"} if mode == "compile_eager" else {
            "compile_in_turns": True}  # fmt: skip
        run = torch.compile(par, backend="boost", options=options)
    try:
        out = run(*(x.clone() for x in inputs))
    except BoostError as exc:
        return {"outcome": NAMED, "stage": "forward", "error": _short(exc)}
    except Exception as exc:
        return _torch_rejects(spec, mode, dtype) or {"outcome": WRONG, "stage": "forward",
                "error": _short(exc), "trace": traceback.format_exc()[-3000:]}  # fmt: skip
    errs: dict[str, float] = {}
    try:
        errs["<output>"] = _rel(out, out_ref) if out.dtype == out_ref.dtype else float("inf")
        (out * weights).sum().backward()
        for name, prm in par.named_parameters():
            pl = plan.params[name]
            g = prm.grad if prm.grad is not None else torch.zeros_like(prm)
            if pl.is_shard:
                parts = [torch.empty_like(g) for _ in range(world)]
                dist.all_gather(parts, g.contiguous())
                g = pl.unshard(parts)
            ref = ref_grads[name]
            errs[name] = _rel(g, ref if ref is not None else torch.zeros_like(g))
    except Exception as exc:
        return _torch_rejects(spec, mode, dtype) or {"outcome": WRONG, "stage": "backward",
                "error": _short(exc), "trace": traceback.format_exc()[-3000:]}  # fmt: skip
    # How far each quantity is over its tolerance: RTOL, or NOISE_MARGIN times what a
    # rounding-level perturbation of the single-device program does to it (an
    # ill-conditioned output, e.g. the sum over the hidden dim of a LayerNorm's output).
    tol = {k: max(RTOL, NOISE_MARGIN * noise.get(k, 0.0)) for k in errs}
    worst = max(errs, key=lambda k: errs[k] / tol[k])
    report = {"worst": worst, "err": errs[worst], "tol": tol[worst],
              "noisy": sorted(k for k, t in tol.items() if t > RTOL),
              "fallbacks": len(plan.fallbacks)}  # fmt: skip
    if errs[worst] <= tol[worst]:
        return {"outcome": EXACT, **report}
    bad = sorted(k for k, v in errs.items() if v > tol[k])
    return {"outcome": WRONG, "stage": "numbers", "error": f"max rel err {errs[worst]:.3g} at "
            f"{worst}; off: {', '.join(bad[:6])}", **report}  # fmt: skip


def _torch_rejects(spec: dict[str, Any], mode: str, dtype: str) -> dict[str, Any] | None:
    """INVALID when plain ``torch.compile`` of the single-device program fails too.

    Asked only after the parallelized compiled run failed: a program torch's own
    compiler cannot run on one device (e.g. Inductor's backward over an in-place
    activation after a graph break) says nothing about the rewrite.
    """
    from tests.fuzz.grammar import loss_weights

    if mode == "eager":
        return None
    model, inputs = _build(spec, dtype)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="inductor" if mode == "inductor" else "aot_eager")
    try:
        out = compiled(*(x.clone() for x in inputs))
        (out * loss_weights(spec, out)).sum().backward()
    except Exception as exc:
        return {"outcome": INVALID, "stage": "reference",
                "error": "plain torch.compile on one device fails too: " + _short(exc)}  # fmt: skip
    return None


def _rounding_noise(
    spec: dict[str, Any], model: torch.nn.Module, inputs: tuple[torch.Tensor, ...],
    out_ref: torch.Tensor, ref_grads: dict[str, torch.Tensor | None],
) -> dict[str, float]:  # fmt: skip
    """Relative change of the output and each gradient when the single-device program's
    parameters and inputs move by ~1 ulp (fp32 rounding alone can do as much)."""
    from tests.fuzz.grammar import loss_weights

    twin = copy.deepcopy(model)
    g = torch.Generator().manual_seed(spec["seed"] + 3)
    with torch.no_grad():
        for prm in twin.parameters():
            prm.mul_(1 + PERTURB * torch.randn(prm.shape, generator=g))
    xs = [(x * (1 + PERTURB * torch.randn(x.shape, generator=g))) if x.is_floating_point()
          else x.clone() for x in inputs]  # fmt: skip
    try:
        out = twin(*xs)
        (out * loss_weights(spec, out)).sum().backward()
    except Exception:  # noqa: BLE001 - then no allowance
        return {}
    noise = {"<output>": _rel(out, out_ref)}
    for name, prm in twin.named_parameters():
        ref = ref_grads[name]
        if ref is not None and prm.grad is not None:
            noise[name] = _rel(prm.grad, ref)
    return noise


def _rank_main(rank: int, world: int, store: str, conn: Connection) -> None:
    torch.set_num_threads(1)
    # torch.fx prints every failing graph's code to stderr: keep it in a per-rank log
    # beside the store (World.logs) instead of the fuzzer's output.
    log_fd = os.open(f"{store}.rank{rank}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(log_fd, 2)
    import logging

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    logging.getLogger("boost_compiler").setLevel(logging.ERROR)
    logging.getLogger("torch._dynamo").setLevel(logging.ERROR)
    # A mismatched collective then fails on its own; the parent's timeout is shorter.
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=300),
    )  # fmt: skip
    mesh = init_device_mesh("cpu", (world,))
    pg = dist.group.WORLD
    conn.send({"ready": rank})
    while True:
        msg = conn.recv()
        if msg is None:
            break
        if msg["kind"] == "sync":
            t = torch.tensor([float(msg["token"])])
            dist.all_reduce(t, group=pg)
            conn.send({"sync": t.item()})
            continue
        torch._dynamo.reset()
        torch.manual_seed(0)
        start = time.perf_counter()
        try:
            res = run_program(msg["spec"], msg["mode"], mesh, world, msg.get("dtype", "float32"))
        except Exception as exc:  # a bug of the fuzzer itself: report, do not die
            res = {"outcome": WRONG, "stage": "runner", "error": _short(exc),
                   "trace": traceback.format_exc()[-3000:]}  # fmt: skip
        res["seconds"] = time.perf_counter() - start
        conn.send(res)
    dist.destroy_process_group()


# --------------------------------------------------------------------------------------
# The parent's side
# --------------------------------------------------------------------------------------


class World:
    """Two persistent ranks; ``run(spec, mode)`` returns the merged outcome."""

    def __init__(self, world: int = 2, timeout: float = 120.0, start_timeout: float = 120.0):
        self.world, self.timeout, self.start_timeout = world, timeout, start_timeout
        self.procs: list[Any] = []
        self.conns: list[Connection] = []
        self.restarts = 0
        self.logs: list[str] = []  # the ranks' stderr
        self._token = 0

    # lifecycle ---------------------------------------------------------------------
    def start(self) -> None:
        import torch.multiprocessing as mp

        ctx = mp.get_context("spawn")
        store = os.path.join(tempfile.mkdtemp(prefix="boost-fuzz-"), "store")
        self.logs = [f"{store}.rank{r}.log" for r in range(self.world)]
        os.environ["OMP_NUM_THREADS"] = "1"  # inherited by the ranks before torch loads
        self.procs, self.conns = [], []
        for rank in range(self.world):
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=_rank_main, args=(rank, self.world, store, child), daemon=True
            )
            proc.start()
            child.close()
            self.procs.append(proc)
            self.conns.append(parent)
        replies = self._gather(self.start_timeout)
        if replies is None:
            self.kill()
            raise RuntimeError("fuzz world: the ranks did not start")

    def kill(self) -> None:
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
        for proc in self.procs:
            proc.join(10)
        for conn in self.conns:
            conn.close()
        self.procs, self.conns = [], []

    def close(self) -> None:
        for conn in self.conns:
            try:
                conn.send(None)
            except OSError:
                pass
        for proc in self.procs:
            proc.join(20)
        self.kill()

    def __enter__(self) -> World:
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # messages ------------------------------------------------------------------------
    def _gather(self, timeout: float) -> list[Any] | None:
        """One reply from every rank, or None when one did not answer in time (or died)."""
        deadline = time.monotonic() + timeout
        replies: dict[int, Any] = {}
        while len(replies) < self.world:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            pending = [c for i, c in enumerate(self.conns) if i not in replies]
            for conn in wait(pending, timeout=left):
                i = self.conns.index(conn)
                try:
                    replies[i] = conn.recv()
                except (EOFError, OSError):
                    return None
        return [replies[i] for i in range(self.world)]

    def _synced(self) -> bool:
        """The ranks still pair their collectives (after an exception on some rank)."""
        self._token += 1
        try:
            for conn in self.conns:
                conn.send({"kind": "sync", "token": self._token})
        except OSError:
            return False
        replies = self._gather(30.0)
        return replies is not None and all(r["sync"] == self._token * self.world for r in replies)

    def run(self, spec: dict[str, Any], mode: str = "eager") -> dict[str, Any]:
        """The spec's outcome; numbers off in fp32 get a second opinion in float64.

        fp32 rounding alone moves an ill-conditioned gradient (stacked LayerNorms over a
        small hidden dim, ...) by more than 1e-5 between two summation orders; in
        float64 the same program's rounding is ~1e-12, so a sharding bug still shows and
        noise does not.
        """
        res = self._run(spec, mode, "float32")
        if res["outcome"] == WRONG and res.get("stage") == "numbers" and "ranks" in res:
            second = self._run(spec, mode, "float64")
            res["float64"] = {k: second.get(k) for k in ("outcome", "stage", "error", "err")}
            if second["outcome"] == EXACT:
                res["outcome"] = EXACT
                res["noisy"] = res.get("noisy", []) + ["fp32 rounding: exact in float64"]
        return res

    def _run(self, spec: dict[str, Any], mode: str, dtype: str) -> dict[str, Any]:
        if not self.procs:
            self.start()
        start = time.perf_counter()
        try:
            for conn in self.conns:
                conn.send({"kind": "run", "spec": spec, "mode": mode, "dtype": dtype})
            replies = self._gather(self.timeout)
        except OSError:
            replies = None
        if replies is None:
            self.kill()
            self.restarts += 1
            return {"outcome": WRONG, "stage": "hang", "error": f"no answer from every rank "
                    f"within {self.timeout:.0f} s (world restarted)",
                    "seconds": time.perf_counter() - start}  # fmt: skip
        res = merge(replies)
        if any("error" in r for r in replies) and not self._synced():
            self.kill()
            self.restarts += 1
            res.setdefault("notes", []).append("ranks out of step afterwards: world restarted")
        return res


def merge(replies: list[dict[str, Any]]) -> dict[str, Any]:
    """One outcome from the ranks' reports: the worst, and disagreement is wrong."""
    outcomes = {r["outcome"] for r in replies}
    order = [WRONG, INVALID, NAMED, EXACT]
    res = dict(min(replies, key=lambda r: order.index(r["outcome"])))
    res["ranks"] = [r["outcome"] for r in replies]
    res["seconds"] = max(r.get("seconds", 0.0) for r in replies)
    if len(outcomes) > 1:
        res["outcome"] = WRONG
        res["stage"] = "ranks disagree"
        res["error"] = "; ".join(
            f"rank {i}: {r['outcome']}" + (f" ({r['error']})" if "error" in r else "")
            for i, r in enumerate(replies)
        )
    return res
