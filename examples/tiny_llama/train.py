"""Train the tiny demo model on a synthetic next-token task and print one line per step:

    step 1 loss 5.5432 step_time 0.0123

Deterministic for a given --seed. Runs on CPU in seconds."""

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from model import ModelConfig, TinyLlama  # noqa: E402


def make_batch(generator, batch_size, seq_len, vocab_size):
    # A learnable sequence rule: each token is the previous one plus a per-row stride.
    start = torch.randint(0, vocab_size, (batch_size, 1), generator=generator)
    stride = torch.randint(1, 4, (batch_size, 1), generator=generator)
    tokens = (start + stride * torch.arange(seq_len + 1)[None, :]) % vocab_size
    return tokens[:, :-1], tokens[:, 1:]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args(argv)

    torch.manual_seed(args.seed)
    config = ModelConfig.from_json(Path(__file__).parent / "config.json")
    model = TinyLlama(config)
    model.apply(TinyLlama.init_weights)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    data = torch.Generator().manual_seed(args.seed + 1)
    for step in range(1, args.steps + 1):
        start = time.perf_counter()
        inputs, labels = make_batch(data, args.batch_size, args.seq_len, config.vocab_size)
        logits = model(inputs)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, config.vocab_size), labels.reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        elapsed = time.perf_counter() - start
        print(f"step {step} loss {loss.item():.6f} step_time {elapsed:.6f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
