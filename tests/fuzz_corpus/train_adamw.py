# Fuzz seed: a plain training script (AdamW, masked label fill, where-blends, a step loop).
import argparse
import os
import time

import torch
from torch import nn


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--weight_decay", type=float, default=0.1)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--use_fused_rmsnorm", action="store_true")
    return parser.parse_args()


def preprocess_labels(labels, pad_token_id):
    labels = labels.clone()
    # padding tokens are ignored by the loss
    labels[labels == pad_token_id] = -100
    return labels


def clip_boxes(bboxes, min_xy, max_xy):
    bboxes = torch.where(bboxes < min_xy, min_xy, bboxes)
    bboxes = torch.where(bboxes > max_xy, max_xy, bboxes)
    return bboxes


def main():
    args = parse_args()
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
    no_decay = ["bias", "norm.weight"]
    groups = [
        {"params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)], "weight_decay": args.weight_decay},
        {"params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.steps)
    for step in range(1, args.steps + 1):
        t0 = time.perf_counter()
        x = torch.randn(8, 64)
        loss = (model(x) - x).pow(2).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        print(f"step={step} loss={loss.item():.4f} step_time={time.perf_counter() - t0:.4f}")
    if os.environ.get("SAVE"):
        torch.save(model.state_dict(), "model.pt")


if __name__ == "__main__":
    main()
