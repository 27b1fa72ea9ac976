"""`npufuse trace` on real repositories: nanoGPT and litgpt (tiny configs, random init, synthetic
tokens, a few steps under bf16 autocast), read from git mirrors at recorded commits; nothing of
theirs is copied into this repository. The training scripts are ours (below).

    .venv/bin/python bench/trace_repos.py [--mirrors /work/.mirror]

For each: scan, trace 3 steps, scan --trace. Prints the candidates with reached yes/no, the facts
from the run, the run-time-only candidates, and the traced/plain wall ratio. A repository whose
mirror is absent is skipped with a message (the `fetch` tool of the development sessions brings
``github:karpathy/nanoGPT`` and ``github:Lightning-AI/litgpt`` to ``/work/.mirror/<owner>+<name>/repo``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

NANOGPT_TRAIN = '''
import sys, time, torch
from model import GPT, GPTConfig
torch.manual_seed(0)
m = GPT(GPTConfig(block_size=32, vocab_size=96, n_layer=2, n_head=2, n_embd=32, dropout=0.0, bias=False))
opt = m.configure_optimizers(0.1, 1e-3, (0.9, 0.95), "cpu")
for it in range(int(sys.argv[1])):
    t0 = time.time()
    x = torch.randint(0, 96, (4, 32)); y = torch.roll(x, -1, 1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, loss = m(x, y)
    loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)
    print(f"iter {it}: loss {loss.item():.4f}, time {(time.time() - t0) * 1000:.2f}ms", flush=True)
'''

LITGPT_TRAIN = '''
import sys, torch
from litgpt.config import Config
from litgpt.model import GPT
torch.manual_seed(0)
cfg = Config.from_name("Llama-3.2-1B", n_layer=2, n_embd=32, n_head=4, n_query_groups=2, head_size=8,
                       intermediate_size=64, block_size=64, padded_vocab_size=128, vocab_size=128)
m = GPT(cfg)
opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
for it in range(int(sys.argv[1])):
    x = torch.randint(0, 128, (2, 32)); y = torch.roll(x, -1, 1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = m(x)
    loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, 128), y.reshape(-1))
    loss.backward(); opt.step(); opt.zero_grad()
    print(f"iter {it}: loss {loss.item():.4f}", flush=True)
'''

REPOS = {
    "nanoGPT": {"mirror": "karpathy+nanoGPT", "commit": "3adf61e154c3fe3fca428ad6bc3818b27a3b8291",
                "paths": ["model.py"], "train": NANOGPT_TRAIN},
    "litgpt": {"mirror": "Lightning-AI+litgpt", "commit": "26857050fe3ff627cd714fe92f5838f51a3d5efa",
               "paths": ["litgpt"], "train": LITGPT_TRAIN},
}


def _extract(git_dir: Path, commit: str, paths: list[str], dest: Path) -> None:
    archive = subprocess.run(["git", f"--git-dir={git_dir}", "archive", commit, *paths], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "x", "-C", str(dest)], input=archive, check=True)


def _litgpt_without_lightning(dest: Path) -> None:
    """litgpt's package __init__ and one helper import lightning, which the model does not need
    (and which is not installed here): the temp copy drops those imports."""
    (dest / "litgpt" / "__init__.py").write_text("")
    model = dest / "litgpt" / "model.py"
    model.write_text(model.read_text().replace(
        "from litgpt.scripts.convert_hf_checkpoint import qkv_reassemble",
        "qkv_reassemble = None  # bench copy: lightning is not installed"))


def _npufuse(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    return subprocess.run([sys.executable, "-m", "npufuse", *args], cwd=cwd, env=env, capture_output=True, text=True)


def run_repo(name: str, spec: dict, mirrors: Path) -> None:
    git_dir = mirrors / spec["mirror"] / "repo"
    if not git_dir.exists():
        print(f"{name}: no mirror at {git_dir}: skipped")
        return
    with tempfile.TemporaryDirectory() as tmp:
        repo = Path(tmp) / name
        repo.mkdir()
        _extract(git_dir, spec["commit"], spec["paths"], repo)
        if name == "litgpt":
            _litgpt_without_lightning(repo)
        (repo / "tiny_train.py").write_text(spec["train"])
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "tiny_train.py", "3"], cwd=repo, check=True, capture_output=True)
        plain = time.perf_counter() - t0
        _npufuse(["scan", ".", "--no-progress", "--no-cache"], repo)
        t0 = time.perf_counter()
        tr = _npufuse(["trace", "--cmd", f"{sys.executable} tiny_train.py 50", "--steps", "3"], repo)
        traced = time.perf_counter() - t0
        if tr.returncode != 0:
            print(f"{name}: trace failed ({tr.returncode}): {tr.stderr[-800:]}")
            return
        _npufuse(["scan", ".", "--no-progress", "--no-cache", "--trace", ".npufuse/trace.json"], repo)
        scan = json.loads((repo / ".npufuse" / "scan.json").read_text())
        trace = json.loads((repo / ".npufuse" / "trace.json").read_text())
        print(f"\n{name} @ {spec['commit'][:10]}: {trace['steps']} steps traced, {len(trace['lines'])} lines ran torch ops; "
              f"traced run {traced:.1f} s (incl. scan join and mining) vs plain 3 steps {plain:.1f} s")
        for c in scan["candidates"]:
            rt = c.get("runtime") or {}
            f = rt.get("facts") or {}
            reached = f"yes ({rt.get('calls')} calls)" if rt.get("reached") else "NO (not reached)"
            facts = ", ".join(x for x in (f"autocast {f['autocast']}" if f.get("autocast") else "",
                                          f"mask {f['mask_kind']}" if f.get("mask_kind") else "",
                                          "/".join(f.get("dtypes") or [])) if x)
            print(f"  #{c['id']:<3} {c['pattern']:<16} {c['file']}:{c['line']:<6} reached {reached:<16} {facts}")
        for f in trace["runtime_candidates"]:
            note = f" (static near miss: {f['static_near_miss'][:60]})" if f.get("static_near_miss") else ""
            print(f"  found at run time: {f['file']}:{f['line']} {f['pattern']} -> {f['api']} "
                  f"[{' > '.join(f['ops'][:8])}]{note}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mirrors", default="/work/.mirror", help="folder of <owner>+<name>/repo git mirrors")
    args = ap.parse_args(argv)
    for name, spec in REPOS.items():
        run_repo(name, spec, Path(args.mirrors))
    return 0


if __name__ == "__main__":
    sys.exit(main())
