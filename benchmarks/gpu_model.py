"""A Llama-3.1-8B-shaped decoder in plain PyTorch whose KV lives in SGLang's pool (``gpu_e2e.py``'s model).

Random weights, generated on the device from a seed; no SGLang kernel, no
flashinfer: attention is ``torch.nn.functional.scaled_dot_product_attention``.
One forward takes the new tokens, their positions, the pool slots of the cached
prefix and those of the new tokens, and the pool. Per layer it reads the layer's
K and V buffers through ``kvcache.get_key_buffer(layer)`` /
``get_value_buffer(layer)`` (where a layer-wise load makes it wait for that
layer, as SGLang's attention backends do), writes the new tokens' K and V into
their slots, and attends over prefix + new K/V gathered from the pool: full
over the prefix, causal among the new tokens (a lower-right causal mask). It
returns the last token's logits (float32). Nothing in it syncs the host.

Shapes: ``8b`` is Llama-3.1-8B's (32 layers, hidden 4096, 32 query / 8 KV heads
of 128, SwiGLU 14336, vocab 128256, RoPE theta 500000; Llama 3.1's RoPE scaling
is left out: same cost), ``tiny`` a CPU stand-in.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right


@dataclasses.dataclass(frozen=True)
class Shape:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    mlp: int
    vocab: int
    theta: float = 500_000.0
    eps: float = 1e-5

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """K and V of one token over all layers, in the pool."""
        return self.layers * 2 * self.kv_heads * self.head_dim * dtype.itemsize

    def params(self) -> int:
        per_layer = self.hidden * (self.heads + 2 * self.kv_heads) * self.head_dim + self.heads * self.head_dim * \
            self.hidden + 3 * self.hidden * self.mlp + 2 * self.hidden
        return self.layers * per_layer + 2 * self.vocab * self.hidden + self.hidden

    def flops_per_token(self) -> float:
        """Matmul FLOPs of one token (2 per multiply-add), without attention's."""
        return 2.0 * (self.params() - self.vocab * self.hidden)


SHAPES = {
    "8b": Shape(layers=32, hidden=4096, heads=32, kv_heads=8, head_dim=128, mlp=14336, vocab=128256),
    "tiny": Shape(layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16, mlp=176, vocab=512),
}


@dataclasses.dataclass
class Layer:
    attn_norm: torch.Tensor
    wqkv: torch.Tensor  # (hidden, (heads + 2 kv_heads) * head_dim)
    wo: torch.Tensor
    mlp_norm: torch.Tensor
    w_gate_up: torch.Tensor  # (hidden, 2 mlp)
    w_down: torch.Tensor


class Model:
    def __init__(self, shape: Shape, device: str, dtype: torch.dtype, seed: int = 0) -> None:
        self.shape, self.device, self.dtype = shape, torch.device(device), dtype
        gen = torch.Generator(device=self.device).manual_seed(seed)
        s = shape

        def weight(rows: int, cols: int, std: float) -> torch.Tensor:
            w = torch.randn(rows, cols, generator=gen, device=self.device, dtype=dtype)
            return w.mul_(std)

        ones = torch.ones(s.hidden, device=self.device, dtype=dtype)
        branch = 1.0 / math.sqrt(2 * s.layers)  # residual branches scaled down: the stream stays O(1) over depth
        self.embed = weight(s.vocab, s.hidden, 1.0)
        self.layers = []
        for _ in range(s.layers):
            wqkv = weight(s.hidden, (s.heads + 2 * s.kv_heads) * s.head_dim, s.hidden ** -0.5)
            # Queries 4x: scores of std ~4, so attention picks a few keys instead of averaging many random values
            # to nothing; the prefix then moves the logits (~30% on the tiny shape), as in a trained model.
            wqkv[:, : s.heads * s.head_dim].mul_(4.0)
            self.layers.append(Layer(
                ones, wqkv, weight(s.heads * s.head_dim, s.hidden, (s.heads * s.head_dim) ** -0.5 * branch), ones,
                weight(s.hidden, 2 * s.mlp, s.hidden ** -0.5), weight(s.mlp, s.hidden, s.mlp ** -0.5 * branch)))
        self.final_norm = ones
        self.lm_head = weight(s.hidden, s.vocab, s.hidden ** -0.5)
        self.inv_freq = s.theta ** (-torch.arange(0, s.head_dim, 2, device=self.device, dtype=torch.float32)
                                    / s.head_dim)
        self.gqa = "native"  # or "expand": K/V heads repeated (attention_check picks)
        self.backends = None  # SDPA backends allowed (CUDA: flash and memory-efficient only, never math)

    # -- the forward ---------------------------------------------------------------------------------------------

    @torch.no_grad()
    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, prefix_slots: torch.Tensor,
                new_slots: torch.Tensor, kvcache) -> torch.Tensor:
        """Logits (float32, vocab) of the last of ``tokens``; their K/V written to ``new_slots`` of ``kvcache``."""
        s = self.shape
        n = tokens.numel()
        slots = torch.cat([prefix_slots.to(torch.int64), new_slots.to(torch.int64)])
        mask = causal_lower_right(n, slots.numel()) if n > 1 else None  # one query token sees every key
        cos, sin = self._rope(positions)
        x = self.embed[tokens]
        for index, p in enumerate(self.layers):
            h = rms_norm(x, p.attn_norm, s.eps)
            q, k, v = (h @ p.wqkv).split([s.heads * s.head_dim, s.kv_heads * s.head_dim, s.kv_heads * s.head_dim], -1)
            q = rotate(q.view(n, s.heads, s.head_dim), cos, sin)
            k = rotate(k.view(n, s.kv_heads, s.head_dim), cos, sin)
            keys, values = kvcache.get_key_buffer(index), kvcache.get_value_buffer(index)  # waits for the layer
            keys[new_slots] = k
            values[new_slots] = v.view(n, s.kv_heads, s.head_dim)
            out = self.attend(q, keys[slots], values[slots], mask)
            x = x + out @ p.wo
            h = rms_norm(x, p.mlp_norm, s.eps)
            gate, up = (h @ p.w_gate_up).chunk(2, dim=-1)
            x = x + (F.silu(gate) * up) @ p.w_down
        return (rms_norm(x[-1:], self.final_norm, s.eps) @ self.lm_head).float()[0]

    def attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask) -> torch.Tensor:
        """q (n, heads, d), keys/values (L, kv_heads, d) -> (n, heads * d)."""
        n = q.shape[0]
        q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (q, keys, values))
        if self.gqa == "expand":
            group = self.shape.heads // self.shape.kv_heads
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        kwargs = {"enable_gqa": True} if self.gqa == "native" else {}
        if self.backends is None:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **kwargs)
        else:
            with sdpa_kernel(self.backends):
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **kwargs)
        return out[0].transpose(0, 1).reshape(n, -1)

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        angles = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        angles = torch.cat([angles, angles], -1)[:, None, :]  # (n, 1, head_dim): both halves
        return angles.cos(), angles.sin()

    # -- checks --------------------------------------------------------------------------------------------------

    def attention_check(self) -> str:
        """Pick how attention runs here, checked against a float32 reference with an explicit lower-right mask:
        SDPA's own GQA, else K/V heads repeated; on CUDA flash/efficient kernels only, else any. Returns what."""
        s = self.shape
        gen = torch.Generator(device=self.device).manual_seed(1)
        q = torch.randn(7, s.heads, s.head_dim, generator=gen, device=self.device, dtype=self.dtype)
        k, v = (torch.randn(300, s.kv_heads, s.head_dim, generator=gen, device=self.device, dtype=self.dtype)
                for _ in range(2))
        want, square_want = reference_attention(q, k, v), reference_attention(q, k[:7], v[:7])
        tries = [("native", [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]),
                 ("expand", [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]),
                 ("native", None), ("expand", None)]
        if self.device.type != "cuda":
            tries = [t for t in tries if t[1] is None]
        failures = []
        for gqa, backends in tries:
            self.gqa, self.backends = gqa, backends
            try:
                got = self.attend(q, k, v, causal_lower_right(7, 300)).float()
                one = self.attend(q[-1:], k, v, None).float()  # a single query: no mask
                square = self.attend(q, k[:7], v[:7], causal_lower_right(7, 7)).float()  # a recompute: plain causal
            except Exception as exc:  # no kernel for it here (RuntimeError), or an older torch's signature
                failures.append(f"{gqa}/{'flash+efficient' if backends else 'any'}: {str(exc).splitlines()[0]}")
                continue
            err = max((got - want).abs().max().item(), (one - want[-1:]).abs().max().item(),
                      (square - square_want).abs().max().item())
            if err < (2e-2 if self.dtype != torch.float32 else 1e-4):
                return f"SDPA {gqa} GQA, {'flash/efficient kernels only' if backends else 'any kernel'}, " \
                       f"max error {err:.1e} vs reference" + (f" (refused: {'; '.join(failures)})" if failures else "")
            failures.append(f"{gqa}: max error {err:.1e}")
        raise RuntimeError(f"no attention path matches the reference here: {'; '.join(failures)}")


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Float32 math: q (n, heads, d) over k/v (L, kv_heads, d), query i seeing keys <= L - n + i."""
    n, heads, d = q.shape
    length, group = k.shape[0], heads // k.shape[1]
    kk, vv = (t.float().repeat_interleave(group, dim=1).transpose(0, 1) for t in (k, v))
    scores = q.float().transpose(0, 1) @ kk.transpose(1, 2) / math.sqrt(d)
    allowed = torch.ones(n, length, dtype=torch.bool, device=q.device).tril(length - n)
    scores = scores.masked_fill(~allowed, float("-inf"))
    return (scores.softmax(-1) @ vv).transpose(0, 1).reshape(n, heads * d)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE, rotate-half form (Llama's), in float32."""
    xf = x.float()
    a, b = xf.chunk(2, dim=-1)
    return (xf * cos + torch.cat([-b, a], -1) * sin).to(x.dtype)
