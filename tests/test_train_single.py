"""Single process: training through backend="boost" equals eager training (fp32)."""

from __future__ import annotations

import copy

import torch

from examples.cola_llama import build, example_inputs


def _train(model, step_fn, batches, lr=0.05):
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for tokens in batches:
        loss = step_fn(tokens, labels=tokens)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return torch.stack(losses)


def test_boost_training_matches_eager() -> None:
    model = build("tiny", seed=0)
    ref = copy.deepcopy(model)
    batches = [example_inputs(model.cfg, batch=2, seq=16, seed=s)[0] for s in range(4)]
    compiled = torch.compile(model, backend="boost")
    got = _train(model, compiled, batches)
    want = _train(ref, ref, batches)
    print("eager", want.tolist(), "boost", got.tolist())
    torch.testing.assert_close(got, want, rtol=1e-5, atol=0)
    assert not torch.equal(want[0], want[-1])  # it trained
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)
