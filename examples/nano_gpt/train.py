"""Train the nanoGPT-style example under bf16 autocast on a synthetic next-token task; one line
per iteration in nanoGPT's own format:

    iter 1: loss 4.5678, time 12.34ms

Deterministic for a given --seed; runs on CPU in seconds."""

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from model import GPT, GPTConfig  # noqa: E402


def get_batch(generator, batch_size, block_size, vocab_size):
    start = torch.randint(0, vocab_size, (batch_size, 1), generator=generator)
    stride = torch.randint(1, 4, (batch_size, 1), generator=generator)
    tokens = (start + stride * torch.arange(block_size + 1)[None, :]) % vocab_size
    return tokens[:, :-1], tokens[:, 1:]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--max-iters", type=int, default=60)
    parser.add_argument("--seed", type=int, default=1337)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--learning-rate", type=float, default=0.05)
    args = parser.parse_args(argv)

    torch.manual_seed(args.seed)
    config = GPTConfig(block_size=args.block_size)
    model = GPT(config)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.learning_rate, momentum=0.9)
    ctx = torch.autocast(device_type="cpu", dtype=torch.bfloat16)
    data = torch.Generator().manual_seed(args.seed + 1)
    for it in range(1, args.max_iters + 1):
        t0 = time.perf_counter()
        x, y = get_batch(data, args.batch_size, args.block_size, config.vocab_size)
        with ctx:
            _, loss = model(x, y)
        optimizer.zero_grad(set_to_none=False)  # grads stay allocated: a fused optimizer keeps them flat
        loss.backward()
        optimizer.step()
        dt = time.perf_counter() - t0
        print(f"iter {it}: loss {loss.item():.4f}, time {dt * 1000:.2f}ms", flush=True)


if __name__ == "__main__":
    main()
