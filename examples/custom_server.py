"""A custom server: Hugging Face transformers runs the model, SGLang's KV pool and radix
cache hold its KV, and sglang-kvbm keeps the evicted pages in host memory.

The server prefills a prompt with the model, writes the KV into SGLang's pool,
caches it, lets other prompts push it out of the device pool, then serves the
same prompt again: the prefix comes back from the host tier into the pool, the
model continues from it, and its greedy tokens must equal a cold run's.

    python examples/custom_server.py            # makes a small random GPT-2 in ./custom-server-model
    python examples/custom_server.py --model DIR --tokens 200 --new 8
"""

from __future__ import annotations

import argparse
import sys

import torch
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from transformers import DynamicCache, GPT2LMHeadModel

from sglang_kvbm import KvbmConfig
from sglang_kvbm.integration.sglang import build_cache
from sglang_kvbm.ops.demo.model import TEST, make_model, prompt_ids

PAGE = 4


class TinyServer:
    """Greedy generation with the KV of every prompt kept in SGLang's paged pool."""

    def __init__(self, model_dir: str, pool_tokens: int, host_blocks: int) -> None:
        self.model = GPT2LMHeadModel.from_pretrained(model_dir, dtype=torch.float32).eval()
        cfg = self.model.config
        self.layers, self.heads, self.head_dim = cfg.n_layer, cfg.n_head, cfg.n_embd // cfg.n_head
        self.pool = MHATokenToKVPool(
            pool_tokens, PAGE, torch.float32, self.heads, self.head_dim, self.layers, "cpu", False
        )
        self.allocator = PagedTokenToKVPoolAllocator(pool_tokens, PAGE, torch.float32, "cpu", self.pool, need_sort=False)
        params = CacheInitParams(
            disable=False,
            req_to_token_pool=ReqToTokenPool(size=4, max_context_len=4096, device="cpu", enable_memory_saver=False),
            token_to_kv_pool_allocator=self.allocator,
            page_size=PAGE,
        )
        self.cache = build_cache(params, KvbmConfig(cpu_cache_blocks=host_blocks))

    @torch.no_grad()
    def generate(self, tokens: list[int], new_tokens: int) -> tuple[list[int], dict]:
        """Greedy tokens for ``tokens``, reusing any cached prefix; the prompt's KV is cached after."""
        hit = self.cache.prefix(tokens)  # locked until release(): evictions cannot take it
        past = DynamicCache()
        reused = len(hit.indices)
        if reused:
            for layer in range(self.layers):  # pool rows are (tokens, heads, dim); HF wants (1, heads, tokens, dim)
                k = self.pool.k_buffer[layer][hit.indices].permute(1, 0, 2).unsqueeze(0)
                v = self.pool.v_buffer[layer][hit.indices].permute(1, 0, 2).unsqueeze(0)
                past.update(k.contiguous(), v.contiguous(), layer)
        out = self.model(torch.tensor([tokens[reused:]]), past_key_values=past, use_cache=True)
        self._store(tokens, hit, out.past_key_values)
        self.cache.release(hit)
        generated = [int(out.logits[0, -1].argmax())]
        past = out.past_key_values
        for _ in range(new_tokens - 1):
            out = self.model(torch.tensor([[generated[-1]]]), past_key_values=past, use_cache=True)
            past = out.past_key_values
            generated.append(int(out.logits[0, -1].argmax()))
        return generated, {"reused": reused, "from_device": hit.device_tokens, "from_host": hit.loaded_tokens}

    def _store(self, tokens, hit, past) -> None:
        """Write the prompt's new full pages into the pool and insert them in the radix cache."""
        full = len(tokens) // PAGE * PAGE
        reused = len(hit.indices)
        need = full - reused
        if need <= 0:
            return
        if self.allocator.available_size() < need:
            self.cache.evict(need - self.allocator.available_size())
        slots = self.allocator.alloc(need)
        for layer in range(self.layers):
            keys, values = past.layers[layer].keys, past.layers[layer].values  # (1, heads, tokens, dim)
            self.pool.k_buffer[layer][slots] = keys[0, :, reused:full].permute(1, 0, 2)
            self.pool.v_buffer[layer][slots] = values[0, :, reused:full].permute(1, 0, 2)
        self.cache.insert(tokens[:full], slots, hit)  # the tree's write-through copies the new pages down

    def close(self) -> None:
        self.cache.close()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a GPT-2 checkpoint directory (default: make a small random one)")
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--new", type=int, default=8)
    args = parser.parse_args(argv)
    model_dir = args.model or str(make_model("custom-server-model", TEST))

    pool_tokens = 512
    server = TinyServer(model_dir, pool_tokens=pool_tokens, host_blocks=1024)
    try:
        prompt = prompt_ids(1, args.tokens)
        cold, info = server.generate(prompt, args.new)
        print(f"cold      : {cold} {info}")
        for seed in range(2, 3 + pool_tokens // args.tokens):  # other traffic fills the device pool
            server.generate(prompt_ids(seed, args.tokens), args.new)
        server.cache.flush(timeout=60)
        warm, info = server.generate(prompt, args.new)
        print(f"host hit  : {warm} {info}")
    finally:
        server.close()
    ok = warm == cold and info["from_host"] > 0 and info["from_device"] == 0
    print("OK: the host-tier prefix reproduced the cold run" if ok else "FAILED: outputs differ or no host hit")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
