"""The CPU demo: stock SGLang vs SGLang + sglang-kvbm on a multi-turn shared-prefix workload.

Both servers run the same locally generated model on CPU with the same device
KV pool, too small for the workload's working set. Conversations take turns,
so by the time a conversation comes back its prefix has been evicted from the
device pool: stock SGLang recomputes it, the kvbm server loads it from host.
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
import time
from pathlib import Path
from typing import Optional, Sequence

import requests

from sglang_kvbm.ops.demo.model import DEMO, make_model, prompt_ids
from sglang_kvbm.ops.demo.server import SglangServer, stream_chunks

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Workload:
    conversations: int = 4
    turns: int = 4
    context_tokens: int = 1500  # each conversation's own long context (a document, a system prompt)
    question_tokens: int = 40
    answer_tokens: int = 16
    device_pool_tokens: int = 4096  # holds about two conversations of the four

    def requests(self) -> list[tuple[int, list[int]]]:
        """``(conversation, question)`` in arrival order: conversations take turns."""
        order = []
        for turn in range(self.turns):
            for conv in range(self.conversations):
                question = prompt_ids(10_000 + conv * 100 + turn, self.question_tokens, DEMO.vocab_size)
                order.append((conv, question))
        return order


@dataclasses.dataclass
class RunResult:
    name: str
    ttft: list[float] = dataclasses.field(default_factory=list)
    device_hit: int = 0
    host_hit: int = 0
    prompt_tokens: int = 0
    outputs: list[list[int]] = dataclasses.field(default_factory=list)

    @property
    def p50(self) -> float:
        return statistics.median(self.ttft)


def _stream_generate(url: str, input_ids: Sequence[int], max_new_tokens: int) -> tuple[float, dict]:
    """TTFT (time to the first streamed chunk) and the final response."""
    body = {
        "input_ids": list(input_ids),
        "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0, "ignore_eos": True},
        "stream": True,
    }
    start = time.perf_counter()
    ttft: Optional[float] = None
    last: dict = {}
    with requests.post(f"{url}/generate", json=body, stream=True, timeout=600) as response:
        response.raise_for_status()
        for chunk in stream_chunks(response):
            if ttft is None:
                ttft = time.perf_counter() - start
            last = chunk
    return ttft or (time.perf_counter() - start), last


def run_workload(server: SglangServer, workload: Workload, name: str) -> RunResult:
    contexts = [prompt_ids(c, workload.context_tokens, DEMO.vocab_size) for c in range(workload.conversations)]
    history = [list(ctx) for ctx in contexts]
    result = RunResult(name)
    # One throwaway request so the first measured one does not pay start-up costs.
    _stream_generate(server.url, prompt_ids(424242, 64, DEMO.vocab_size), 1)
    for conv, question in workload.requests():
        prompt = history[conv] + question
        ttft, final = _stream_generate(server.url, prompt, workload.answer_tokens)
        meta = final.get("meta_info", {})
        details = meta.get("cached_tokens_details") or {}
        result.ttft.append(ttft)
        result.device_hit += details.get("device", 0)
        result.host_hit += details.get("host", 0)
        result.prompt_tokens += len(prompt)
        answer = final.get("output_ids", [])
        result.outputs.append(answer)
        history[conv] = prompt + answer
    return result


def format_table(stock: RunResult, kvbm: RunResult) -> str:
    rows = [
        ("requests", f"{len(stock.ttft)}", f"{len(kvbm.ttft)}", ""),
        ("prompt tokens", f"{stock.prompt_tokens}", f"{kvbm.prompt_tokens}", ""),
        ("device-hit tokens", f"{stock.device_hit}", f"{kvbm.device_hit}", ""),
        ("host-hit tokens", f"{stock.host_hit}", f"{kvbm.host_hit}", ""),
        ("p50 TTFT (s)", f"{stock.p50:.3f}", f"{kvbm.p50:.3f}", f"{kvbm.p50 / stock.p50:.2f}x"),
        (
            "mean TTFT (s)",
            f"{statistics.fmean(stock.ttft):.3f}",
            f"{statistics.fmean(kvbm.ttft):.3f}",
            f"{statistics.fmean(kvbm.ttft) / statistics.fmean(stock.ttft):.2f}x",
        ),
    ]
    head = ("", "stock SGLang", "SGLang + kvbm", "kvbm / stock")
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(4)]
    line = lambda r: "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
    return "\n".join([line(head), line(tuple("-" * w for w in widths)), *map(line, rows)])


def main(out_dir: str = "demo-out", workload: Workload = Workload()) -> int:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    print(f"[demo] model: random-weight GPT-2 {DEMO} (made locally in {out / 'model'})", flush=True)
    model = make_model(out / "model", DEMO)
    common = dict(page_size=16, max_total_tokens=workload.device_pool_tokens)
    per_conv = workload.context_tokens + workload.turns * (workload.question_tokens + workload.answer_tokens)
    print(
        f"[demo] workload: {workload.conversations} conversations x {workload.turns} turns, ~{per_conv} tokens each; "
        f"device KV pool {workload.device_pool_tokens} tokens",
        flush=True,
    )
    print("[demo] stock SGLang ...", flush=True)
    with SglangServer(model, log_path=out / "stock.log", **common) as server:
        stock = run_workload(server, workload, "stock")
    print("[demo] SGLang --radix-cache-backend kvbm (host tier 1 GiB) ...", flush=True)
    env = {"DYN_KVBM_CPU_CACHE_GB": "1"}
    with SglangServer(
        model, log_path=out / "kvbm.log", extra_args=["--radix-cache-backend", "kvbm"], env=env, **common
    ) as server:
        kvbm = run_workload(server, workload, "kvbm")
    print()
    print(format_table(stock, kvbm))
    same = stock.outputs == kvbm.outputs
    print(f"\ngreedy outputs identical across the two servers: {same}")
    print(f"server logs: {out / 'stock.log'}, {out / 'kvbm.log'}")
    return 0 if same else 1
