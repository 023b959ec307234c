"""How far Inductor's gradients are from eager torch's on one device, with no autosp: the
lengths benchmark's model (``small`` preset), lengths and checks (every ``CHECK_EVERY``-th of its
200 lognormal lengths), trained with AdamW on the compiled model's gradients, the eager copy
loaded with the same parameters at each check. It is the floor the lengths benchmark's
"gradients within" figure (autosp with Inductor on 2 ranks against eager on one device) is read
against.

    OMP_NUM_THREADS=1 python -m benchmarks.inductor_roundoff [--compiler aot_eager]

Prints each check (step, length, loss and worst gradient error, the parameter and its largest
gradient) and one JSON line with the worst of each.
"""

from __future__ import annotations

import argparse
import copy
import json

import torch

from benchmarks.lengths import CHECK_EVERY, _batch, _rel, draw_lengths
from benchmarks.run import PRESETS
from examples.models import Llama, LlamaConfig


def measure(compiler: str, steps: int = 200, preset: str = "small") -> dict:
    torch.manual_seed(0)  # benchmarks.run's model
    model = Llama(LlamaConfig(**PRESETS[preset]))
    ref = copy.deepcopy(model)
    step = torch.compile(lambda ids, labels: model(ids, labels), backend=compiler, dynamic=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    worst_loss, worst_grad = 0.0, 0.0
    for i, L in enumerate(draw_lengths(steps)):
        ids, labels = _batch(model.c.vocab, L, i, "cpu")
        loss = step(ids, labels)
        loss.backward()
        if i % CHECK_EVERY == 0:
            ref.load_state_dict(model.state_dict())
            ref.zero_grad()
            loss_ref = ref(ids, labels)
            loss_ref.backward()
            loss_err = abs(loss.item() - loss_ref.item()) / abs(loss_ref.item())
            err, name, top = max(
                (_rel(p.grad, q.grad), n, p.grad.abs().max().item())
                for (n, p), q in zip(model.named_parameters(), ref.parameters())
            )
            worst_loss, worst_grad = max(worst_loss, loss_err), max(worst_grad, err)
            print(f"step {i} length {L}: loss {loss_err:.2g}, gradient {err:.2g} ({name}, largest {top:.2g})")
        opt.step()
        opt.zero_grad()
    return {"compiler": compiler, "steps": steps, "loss_rel_err": worst_loss, "grad_rel_err": worst_grad}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--compiler", default="inductor")
    ap.add_argument("--steps", type=int, default=200)
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(json.dumps(measure(args.compiler, args.steps)))


if __name__ == "__main__":
    main()
