"""Real training runs on the CPU, for the drift tests (and the window's Run view): a tiny
transformer-shaped model trained for a dozen steps with AdamW, a checkpoint after every step --
torchtitan-style ``step-N`` DCP folders (``dcp.save`` of ``{"model", "optimizer", "train_state"}``,
the optimizer state keyed by parameter names as torchtitan's ``get_state_dict`` gives it) or Hugging
Face Trainer-style ``checkpoint-N`` folders (``model.safetensors`` + ``optimizer.pt`` +
``trainer_state.json``).

Faults are injected the way they happen: ``flip`` flips one mantissa bit of one element in what is
saved at one step (a corruption on the way to storage; training itself goes on clean), ``freeze``
stops a layer's parameters learning from a step on, ``resume`` restarts from an earlier step's saved
state at a later step (resuming from the wrong checkpoint).
"""

from __future__ import annotations

import copy
import json
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

DIM, HIDDEN, VOCAB, LAYERS = 32, 64, 48, 3


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention_norm = nn.LayerNorm(DIM)
        self.attention = nn.ModuleDict({n: nn.Linear(DIM, DIM, bias=False) for n in ("wq", "wk", "wv", "wo")})
        self.ffn_norm = nn.LayerNorm(DIM)
        self.feed_forward = nn.ModuleDict({"w1": nn.Linear(DIM, HIDDEN), "w2": nn.Linear(HIDDEN, DIM)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.attention
        h = self.attention_norm(x)
        q, k, v = a["wq"](h), a["wk"](h), a["wv"](h)
        att = torch.softmax(q @ k.transpose(-1, -2) / DIM**0.5, dim=-1)
        x = x + a["wo"](att @ v)
        f = self.feed_forward
        return x + f["w2"](torch.relu(f["w1"](self.ffn_norm(x))))


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleDict({str(i): Block() for i in range(LAYERS)})
        self.norm = nn.LayerNorm(DIM)
        self.output = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            x = layer(x)
        return self.output(self.norm(x))


@dataclass(frozen=True)
class Flip:
    """Flip bit ``bit`` of element ``index`` (flat) of ``entry`` in what step ``step`` saves."""

    step: int
    entry: str
    index: int
    bit: int = 22  # float32's top mantissa bit: the element changes by a third to a half


def _flip(t: torch.Tensor, index: int, bit: int) -> torch.Tensor:
    out = t.detach().clone()
    bits = out.view(-1).view(torch.int32)
    bits[index] ^= 1 << bit
    return out


def train(
    steps: int = 12,
    *,
    freeze: tuple[str, int] | None = None,
    resume: tuple[int, int] | None = None,
    seed: int = 0,
    log: list[dict[str, Any]] | None = None,
) -> list[tuple[int, Tiny, torch.optim.Optimizer]]:
    """Train and return, after each step, (step, a copy of the model, a copy of the optimizer).
    ``freeze=(prefix, k)``: parameters under ``prefix`` stop learning at step k (checkpoint k equals
    k-1 for them); ``resume=(k, j)``: step k starts from the state saved after step j; ``log`` gets
    each step's ``{"step", "loss", "learning_rate", "grad_norm"}`` (what a Trainer logs)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a model this small: threads only wait for each other on a shared machine
    try:
        return _train(steps, freeze, resume, seed, log)
    finally:
        torch.set_num_threads(threads)


def _train(
    steps: int,
    freeze: tuple[str, int] | None,
    resume: tuple[int, int] | None,
    seed: int,
    log: list[dict[str, Any]] | None,
) -> list[tuple[int, Tiny, torch.optim.Optimizer]]:
    torch.manual_seed(seed)
    model = Tiny()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    g = torch.Generator().manual_seed(seed + 1)
    out: list[tuple[int, Tiny, torch.optim.Optimizer]] = []
    for step in range(1, steps + 1):
        if resume is not None and step == resume[0]:
            _, m, o = out[resume[1] - 1]
            m, o = copy.deepcopy((m, o))  # load_state_dict keeps the tensors it is given: not the saved ones
            model.load_state_dict(m.state_dict())
            opt.load_state_dict(o.state_dict())
        if freeze is not None and step == freeze[1]:
            for name, p in model.named_parameters():
                if name.startswith(freeze[0]):
                    p.requires_grad_(False)
                    p.grad = None
        tokens = torch.randint(0, VOCAB, (8, 17), generator=g)
        logits = model(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if log is not None:
            grads = [p.grad.reshape(-1) for p in model.parameters() if p.grad is not None]
            norm = float(torch.cat(grads).norm())
            log.append(
                {"step": step, "loss": loss.item(), "learning_rate": opt.param_groups[0]["lr"], "grad_norm": norm}
            )
        opt.step()
        m, o = copy.deepcopy((model, opt))  # together: the copy of the optimizer holds the copied parameters
        out.append((step, m, o))
    return out


def titan_state(model: Tiny, opt: torch.optim.Optimizer, step: int) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optimizer": osd, "train_state": {"step": step}}


def save_titan_run(
    root: Path,
    trained: list[tuple[int, Tiny, torch.optim.Optimizer]],
    flip: Flip | None = None,
    poison: tuple[int, str, int] | None = None,
    extra: tuple[int, str] | None = None,
) -> Path:
    """``root/step-N`` DCP folders, one per step, each model weight of two or more dimensions saved
    as four row chunks (what four FSDP ranks write). ``poison=(k, entry, index)``: that element is
    saved as NaN from step k on; ``extra=(k, entry)``: a new tensor saved from step k on."""
    import torch.distributed.checkpoint as dcp

    from tests._chunked import split

    root.mkdir(parents=True, exist_ok=True)
    for step, model, opt in trained:
        state = titan_state(model, opt, step)
        if flip is not None and flip.step == step:
            head, _, rest = flip.entry.partition(".")
            state[head][rest] = _flip(state[head][rest], flip.index, flip.bit)
        if poison is not None and step >= poison[0]:
            head, _, rest = poison[1].partition(".")
            state[head][rest] = state[head][rest].detach().clone()
            state[head][rest].view(-1)[poison[2]] = float("nan")
        if extra is not None and step >= extra[0]:
            head, _, rest = extra[1].partition(".")
            state[head][rest] = torch.full((4, 4), float(step))
        boxes = {f"model.{n}": split(tuple(t.shape), {0: _quarters(t.shape[0])}) for n, t in state["model"].items()
                 if t.dim() >= 2 and t.shape[0] >= 4}  # fmt: skip
        with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
            warnings.filterwarnings("ignore", "torch.distributed is disabled")
            dcp.save(state, checkpoint_id=str(root / f"step-{step}"), planner=_planner(boxes))
    return root


def _planner(boxes: dict[str, Any]) -> Any:
    """:class:`tests._chunked.ChunkedPlanner` for the boxed tensors, the default plan for the rest
    (other tensors whole, plain values as byte items)."""
    from torch.distributed.checkpoint.planner import SavePlan

    from tests._chunked import ChunkedPlanner

    class Planner(ChunkedPlanner):
        def create_local_plan(self) -> SavePlan:
            whole = [i for i in super(ChunkedPlanner, self).create_local_plan().items if i.index.fqn not in self.boxes]
            everything = self.state_dict
            self.state_dict = {k: v for k, v in everything.items() if k in self.boxes}
            try:
                chunked = ChunkedPlanner.create_local_plan(self).items
            finally:
                self.state_dict = everything
            self.plan = SavePlan([*whole, *chunked], planner_data=self.mappings)
            return self.plan

        def resolve_data(self, write_item: Any) -> Any:
            if write_item.index.fqn in self.boxes:
                return ChunkedPlanner.resolve_data(self, write_item)
            return super(ChunkedPlanner, self).resolve_data(write_item)

    return Planner(boxes)


def _quarters(n: int) -> list[int]:
    return [n * k // 4 for k in (1, 2, 3)]


def load_titan_step(folder: Path, model: Tiny, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """A saved step read back by torch's own ``dcp.load``, flattened to ``model.…``/``optimizer.…``."""
    import torch.distributed.checkpoint as dcp

    state = titan_state(*copy.deepcopy((model, opt)), 0)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        dcp.load(state, checkpoint_id=str(folder))
    return _flatten(state)


def _flatten(tree: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    if isinstance(tree, dict):
        for k, v in tree.items():
            out.update(_flatten(v, f"{prefix}{k}."))
    elif isinstance(tree, (list, tuple)):
        for k, v in enumerate(tree):
            out.update(_flatten(v, f"{prefix}{k}."))
    elif isinstance(tree, torch.Tensor):
        out[prefix[:-1]] = tree
    return out


STEPS_PER_EPOCH = 4


def trainer_state(step: int, log: list[dict[str, Any]], logging_steps: int = 2, eval_steps: int = 6) -> dict[str, Any]:
    """``trainer_state.json`` as transformers' Trainer writes it at step ``step``: what was logged so far
    (every ``logging_steps``: loss, learning rate, gradient norm; every ``eval_steps`` an evaluation
    of its own, ``eval_loss``), with the epoch."""
    history: list[dict[str, Any]] = []
    for entry in log:
        at = entry["step"]
        if at > step:
            break
        epoch = at / STEPS_PER_EPOCH
        if at % logging_steps == 0:
            history.append({"epoch": epoch, **entry})
        if at % eval_steps == 0:
            history.append({"epoch": epoch, "eval_loss": entry["loss"] + 0.25, "eval_runtime": 0.1, "step": at})
    return {
        "best_metric": None,
        "epoch": step / STEPS_PER_EPOCH,
        "eval_steps": eval_steps,
        "global_step": step,
        "is_world_process_zero": True,
        "log_history": history,
        "logging_steps": logging_steps,
        "max_steps": len(log),
        "train_batch_size": 8,
    }


def save_hf_run(
    root: Path, trained: list[tuple[int, Tiny, torch.optim.Optimizer]], log: list[dict[str, Any]] | None = None
) -> Path:
    """``root/checkpoint-N`` folders as transformers' Trainer writes them; ``log``: what :func:`train`
    logged, for their ``trainer_state.json`` (:func:`trainer_state`)."""
    from safetensors.torch import save_file

    root.mkdir(parents=True, exist_ok=True)
    for step, model, opt in trained:
        folder = root / f"checkpoint-{step}"
        folder.mkdir()
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(folder / "model.safetensors"))
        torch.save(opt.state_dict(), folder / "optimizer.pt")
        (folder / "trainer_state.json").write_text(json.dumps(trainer_state(step, log or []), indent=2))
    return root


def load_hf_step(folder: Path) -> dict[str, torch.Tensor]:
    """A saved step read back by safetensors and ``torch.load(weights_only=True)``."""
    from safetensors.torch import load_file

    out = dict(load_file(str(folder / "model.safetensors")))
    out.update(_flatten(torch.load(folder / "optimizer.pt", weights_only=True), "optimizer."))
    return out


def reference(states: list[dict[str, torch.Tensor]]) -> dict[str, dict[str, list[Any]]]:
    """The series computed in float64 by torch over whole tensors: what drift must match."""
    out: dict[str, dict[str, list[Any]]] = {}
    for name in states[0]:
        if states[0][name].numel() < 2:
            continue
        raw = [s[name].detach().to(torch.float64).reshape(-1) for s in states]
        ok = [torch.isfinite(t) for t in raw]  # drift's sums take the finite values (of both, in a product)
        ts = [torch.where(f, t, 0.0) for t, f in zip(raw, ok, strict=True)]
        first = ts[0]
        series: dict[str, list[Any]] = {
            "norm": [],
            "rel_change": [],
            "cos_prev": [],
            "cos_first": [],
            "max_abs_change": [],
        }
        for i, t in enumerate(ts):
            series["norm"].append(float(t.norm()))
            series["cos_first"].append(float((t * ok[0]) @ (first * ok[i]) / (t.norm() * first.norm())))
            if i == 0:
                for m in ("rel_change", "cos_prev", "max_abs_change"):
                    series[m].append(None)
                continue
            p, both = ts[i - 1], ok[i] & ok[i - 1]
            d = torch.where(both, t - p, 0.0)
            series["rel_change"].append(float(d.norm() / p.norm()))
            series["cos_prev"].append(float((t * both) @ (p * both) / (t.norm() * p.norm())))
            series["max_abs_change"].append(float(d.abs().max()))
        out[name] = series
    return out
