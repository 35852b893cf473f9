"""Mapping benchmark (issue 28): a llama-like DCP with torchtitan 0.3.0 names (GQA, bf16) to a
Hugging Face safetensors folder with the rotary q/k permutation, side by side in one run:

* ``cp -r`` + ``sync`` of the same bytes (the yardstick);
* the naive path, what torchtitan's ``convert_to_hf.py`` does: ``dcp.load`` of everything,
  torchtitan's ``Llama3StateDictAdapter.to_hf`` (an equivalent permutation when torchtitan is
  absent), ``safetensors.torch.save_file``, ``sync``;
* ``dcpstudio convert SRC DST --mapping torchtitan-llama3 --config config.json`` (n/a until the
  mapping engine lands).

Each runs in a fresh child process; seconds are the child's whole run (imports excluded for the
Python contenders, sync included), peak RSS its ``VmHWM`` from /proc (``wait4``'s ru_maxrss for
``cp``). Targets: ours <= 1.3x cp+sync, peak RSS <= 4x the largest tensor + 300 MiB.

    python tests/perf/bench_mapping.py --size 2GiB      # by hand, not in CI
    python tests/perf/bench_mapping.py --size 64MiB     # smoke check
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MAKER = r"""
import json, sys, warnings
import torch, torch.distributed.checkpoint as dcp
warnings.simplefilter("ignore")
layers, dim, hidden, vocab, heads, kv, out = int(sys.argv[1]), *map(int, sys.argv[2:7]), sys.argv[7]
g = torch.Generator().manual_seed(0)
mat = lambda r, c: torch.randn(r, c, generator=g).to(torch.bfloat16)
hd = dim // heads
sd = {"tok_embeddings.weight": mat(vocab, dim)}
for i in range(layers):
    p = f"layers.{i}."
    sd[p + "attention.qkv_linear.wq.weight"] = mat(dim, dim)
    sd[p + "attention.qkv_linear.wk.weight"] = mat(kv * hd, dim)
    sd[p + "attention.qkv_linear.wv.weight"] = mat(kv * hd, dim)
    sd[p + "attention.wo.weight"] = mat(dim, dim)
    sd[p + "feed_forward.w1.weight"] = mat(hidden, dim)
    sd[p + "feed_forward.w2.weight"] = mat(dim, hidden)
    sd[p + "feed_forward.w3.weight"] = mat(hidden, dim)
    sd[p + "attention_norm.weight"] = torch.ones(dim)
    sd[p + "ffn_norm.weight"] = torch.ones(dim)
sd["norm.weight"] = torch.ones(dim)
sd["lm_head.weight"] = mat(vocab, dim)
dcp.save(sd, checkpoint_id=out, no_dist=True)
print(json.dumps([len(sd), sum(t.nbytes for t in sd.values()), max(t.nbytes for t in sd.values())]))
"""

HWM = r"""
def _hwm():
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmHWM:")).split()[1]) * 1024
"""

NAIVE = (
    HWM
    + r"""
import json, os, sys, time, warnings
import torch, torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
warnings.simplefilter("ignore")
src, dst, cfg_path = sys.argv[1:4]
cfg = json.load(open(cfg_path))
heads, kv, dim = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["hidden_size"]
try:
    from torchtitan.models import llama3 as L
    from torchtitan.models.common import ComplexRoPE
    from torchtitan.models.common import Embedding, Linear, RMSNorm
    conf = L.Llama3Model.Config(dim=dim, vocab_size=cfg["vocab_size"],
        tok_embeddings=Embedding.Config(num_embeddings=cfg["vocab_size"], embedding_dim=dim),
        norm=RMSNorm.Config(normalized_shape=dim),
        lm_head=Linear.Config(in_features=dim, out_features=cfg["vocab_size"]),
        layers=L._build_llama3_layers(n_layers=cfg["num_hidden_layers"], dim=dim, n_heads=heads, n_kv_heads=kv,
            hidden_dim=cfg["intermediate_size"], rope=ComplexRoPE.Config(dim=dim // heads, max_seq_len=64),
            attn_backend="flex"))
    to_hf, how = L.Llama3StateDictAdapter(conf, None).to_hf, "torchtitan"
except ImportError:
    def permute(w, n):
        return w.view(n, w.shape[0] // n // 2, 2, w.shape[1]).transpose(1, 2).reshape(w.shape).clone()
    def to_hf(sd):
        names = {"attention.qkv_linear.wq": "self_attn.q_proj", "attention.qkv_linear.wk": "self_attn.k_proj",
                 "attention.qkv_linear.wv": "self_attn.v_proj", "attention.wo": "self_attn.o_proj",
                 "feed_forward.w1": "mlp.gate_proj", "feed_forward.w3": "mlp.up_proj",
                 "feed_forward.w2": "mlp.down_proj", "attention_norm": "input_layernorm",
                 "ffn_norm": "post_attention_layernorm"}
        out = {"model.embed_tokens.weight": sd["tok_embeddings.weight"], "model.norm.weight": sd["norm.weight"],
               "lm_head.weight": sd["lm_head.weight"]}
        for k, v in sd.items():
            if k.startswith("layers."):
                _, i, rest = k.split(".", 2)
                mod = rest.removesuffix(".weight")
                v = permute(v, heads) if mod.endswith("wq") else permute(v, kv) if mod.endswith("wk") else v
                out[f"model.layers.{i}.{names[mod]}.weight"] = v
        return out
    how = "equivalent permutation"
t0 = time.perf_counter()
md = dcp.FileSystemReader(src).read_metadata()
sd = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in md.state_dict_metadata.items()}
dcp.load(sd, checkpoint_id=src, no_dist=True)
hf = to_hf(sd)
del sd
os.makedirs(dst)
save_file({k: v.contiguous() for k, v in hf.items()}, os.path.join(dst, "model.safetensors"), {"format": "pt"})
os.sync()
print(json.dumps({"wall": time.perf_counter() - t0, "rss": _hwm(), "how": how}))
"""
)

OURS = (
    HWM
    + r"""
import json, os, sys, time
from dcpstudio.cli.main import main
src, dst, cfg = sys.argv[1:4]
t0 = time.perf_counter()
rc = main(["convert", src, dst, "--mapping", "torchtitan-llama3", "--config", cfg, "-q"])
os.sync()
print(json.dumps({"wall": time.perf_counter() - t0, "rss": _hwm(), "rc": rc}))
"""
)


def parse_size(text: str) -> int:
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    t = text.lower().removesuffix("ib").removesuffix("b")
    return int(float(t[:-1]) * units[t[-1]]) if t and t[-1] in units else int(t)


def shape_for(size: int) -> tuple[int, int, int, int, int, int]:
    """layers, dim, hidden, vocab, heads, kv heads for about ``size`` bytes of bf16 (head_dim 128, GQA 4:1)."""
    dim = 2048 if size >= 1 << 30 else 512
    hidden, vocab, heads = (dim * 8 // 3 + 255) // 256 * 256, 16 * dim, dim // 128
    per_layer = 2 * (2 * dim * dim + 2 * dim * dim // 4 + 3 * hidden * dim)
    layers = max(1, (size - 2 * 2 * vocab * dim) // per_layer)
    return layers, dim, hidden, vocab, heads, max(1, heads // 4)


def has_mapping_engine() -> bool:
    out = subprocess.run([sys.executable, "-m", "dcpstudio", "convert", "--help"], capture_output=True, text=True)
    return "--mapping" in out.stdout


def run(script: str, *args: str) -> dict[str, float]:
    out = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"child failed: {out.stderr.strip().splitlines()[-1:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_cp(src: Path, dst: Path) -> dict[str, float]:
    t0 = time.perf_counter()
    proc = subprocess.Popen(["cp", "-r", str(src), str(dst)])
    _, status, usage = os.wait4(proc.pid, 0)
    subprocess.run(["sync"], check=True)
    assert os.waitstatus_to_exitcode(status) == 0
    return {"wall": time.perf_counter() - t0, "rss": usage.ru_maxrss * 1024}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="2GiB", help="checkpoint size (2GiB; 64MiB for a smoke check)")
    ap.add_argument("--dir", help="where to work (default: a temporary directory)")
    args = ap.parse_args()
    layers, dim, hidden, vocab, heads, kv = shape_for(parse_size(args.size))
    work = Path(tempfile.mkdtemp(prefix="bench_mapping_", dir=args.dir))
    try:
        src = work / "titan_dcp"
        n, total, largest = json.loads(
            subprocess.run(
                [sys.executable, "-c", MAKER, *map(str, (layers, dim, hidden, vocab, heads, kv)), str(src)],
                check=True, capture_output=True, text=True,
            ).stdout.strip().splitlines()[-1]
        )  # fmt: skip
        cfg = work / "config.json"
        cfg.write_text(json.dumps({
            "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": dim,
            "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv,
            "head_dim": dim // heads, "intermediate_size": hidden, "vocab_size": vocab, "tie_word_embeddings": False,
        }))  # fmt: skip
        print(f"source: {n} tensors, {total / 2**20:.0f} MiB, largest {largest / 2**20:.0f} MiB "
              f"({layers} layers, dim {dim}, {heads} heads / {kv} kv heads)")  # fmt: skip
        results: dict[str, dict[str, float] | None] = {"cp + sync": run_cp(src, work / "copy")}
        shutil.rmtree(work / "copy")
        naive = run(NAIVE, str(src), str(work / "naive"), str(cfg))
        results[f"naive ({naive.pop('how')})"] = naive
        shutil.rmtree(work / "naive")
        results["dcpstudio --mapping"] = (
            run(OURS, str(src), str(work / "ours"), str(cfg)) if has_mapping_engine() else None
        )
        base = results["cp + sync"]
        assert base is not None
        print(f"{'contender':34} {'seconds':>8} {'x cp':>6} {'peak RSS MiB':>13}")
        for who, r in results.items():
            if r is None:
                print(f"{who:34} {'n/a: the mapping engine has not landed':>30}")
                continue
            print(f"{who:34} {r['wall']:8.2f} {r['wall'] / base['wall']:6.2f} {r['rss'] / 2**20:13.0f}")
        print(f"targets: <= {1.3 * base['wall']:.2f} s, peak RSS <= {(4 * largest + (300 << 20)) / 2**20:.0f} MiB")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
