"""The chaos soak's self-check: the comparison with the reference can pass, and it can fail.

* In process (Hugging Face ``transformers`` on the same model files): a prompt's
  KV is computed, then the KV of 1, 4 or 16 of its tokens is replaced by other
  tokens' (or every value moved by 1e-6, relative), and 8 greedy tokens are
  decoded from it: how often the output changes.
* Real servers, the same prompts as the reference pass: (a) stock against stock,
  with another device pool (4x: other hits, other batch shapes) and one request
  at a time: must be 0 wrong; (b) stock with ``--kv-cache-dtype fp8_e4m3`` and
  (c) stock with ``--dtype bfloat16``: the comparison must call them wrong.
"""

from __future__ import annotations

import random
from pathlib import Path

from chaos_run import Tally, replay_pass
from common import table
from sglang_kvbm.ops.demo.server import SglangServer


def kv_probe(model_dir: Path, prompts: int = 30, length: int = 300) -> dict:
    import torch
    from transformers import GPT2LMHeadModel

    model = GPT2LMHeadModel.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    vocab = model.config.vocab_size

    @torch.no_grad()
    def greedy(ids, perturb=None):
        out = model(torch.tensor([ids]), use_cache=True)
        past = out.past_key_values
        if perturb is not None:
            for layer in past.layers:
                perturb(layer.keys, layer.values)  # (batch, heads, tokens, head_dim)
        token, answer = int(out.logits[0, -1].argmax()), []
        for _ in range(8):
            answer.append(token)
            out = model(torch.tensor([[token]]), past_key_values=past, use_cache=True)
            past, token = out.past_key_values, int(out.logits[0, -1].argmax())
        return answer

    def swap(n, p, q):
        def apply(k, v):
            k[:, :, p:p + n] = k[:, :, q:q + n].clone()
            v[:, :, p:p + n] = v[:, :, q:q + n].clone()
        return apply

    def noise(k, v):
        k.mul_(1 + 1e-6 * torch.randn_like(k))
        v.mul_(1 + 1e-6 * torch.randn_like(v))

    rng = random.Random(7)
    changed = {"1 token's KV replaced": 0, "4 tokens' KV replaced": 0, "one 16-token page's KV replaced": 0,
               "every KV value x (1 + 1e-6 noise)": 0}
    for _ in range(prompts):
        ids = [rng.randrange(vocab - 2) for _ in range(length)]
        base = greedy(ids)
        p = rng.randrange(0, length - 32) // 16 * 16
        q = (p + 16 * rng.randrange(1, 8)) % (length - 32) // 16 * 16
        for (name, _), perturb in zip(changed.items(), (swap(1, p, q), swap(4, p, q), swap(16, p, q), noise)):
            changed[name] += greedy(ids, perturb) != base
    return {name: (n, prompts) for name, n in changed.items()}


def run(model_dir: Path, sched, reference: dict, stock: Tally, args, logs: Path) -> int:
    probe = kv_probe(model_dir)
    print("\nin process, 8 greedy tokens after a 300-token prompt, output changed when:")
    for name, (n, total) in probe.items():
        print(f"  {name:36s} {n:3d} / {total}")

    checks = [("(a) stock, pool x4, one at a time", 4 * args.pool, [], 1, False),
              ("(b) stock, --kv-cache-dtype fp8_e4m3", args.pool, ["--kv-cache-dtype", "fp8_e4m3"], args.concurrency, True),
              ("(c) stock, --dtype bfloat16", args.pool, ["--dtype", "bfloat16"], args.concurrency, True)]
    rows, ok = [], True
    for name, pool, extra, concurrency, should_differ in checks:
        tally = Tally(name)
        with SglangServer(model_dir, page_size=16, max_total_tokens=pool, extra_args=extra,
                          log_path=logs / f"selfcheck-{len(rows)}.log") as server:
            replay_pass(sched, server.url, tally, reference, args.hang_seconds, concurrency)
        wrong = len(tally.wrong)
        passed = (wrong > 0) if should_differ else (wrong == 0 and not tally.hangs and not tally.errors)
        ok &= passed and tally.completed > 0
        rows.append([name, tally.completed, wrong, wrong / max(1, tally.completed),
                     "detected (wrong > 0)" if should_differ and passed else
                     "MISSED: compared equal" if should_differ else "equal" if passed else "FAILED: differs",
                     f"{tally.max_logprob_diff:.1e}" if tally.completed > wrong else "-"])
    print()
    print(table(["against the stock reference", "requests", "wrong", "wrong share", "verdict",
                 "max |logprob diff| of equal ones"], rows))
    print(f"the reference against itself (a repeat of a prompt vs its first answer): {len(stock.wrong)} wrong")
    ok &= not stock.wrong
    print(f"self-check: {'PASSED' if ok else 'FAILED'}")
    return 0 if ok else 1
