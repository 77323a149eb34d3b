"""The CPU KV pool is an anonymous memory map: zero-filled, writable, and costing no memory until touched."""
import resource

import torch

from engine.model_runner import zeroed_pool


def _rss_kb() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() // 1024


def test_pool_is_zero_writable_and_lazy():
    before = _rss_kb()
    shape = (4096, 16, 1, 256)                               # 64 MiB of float32 per pool
    pools = [zeroed_pool(shape, torch.float32, torch.device("cpu")) for _ in range(8)]
    assert all(p.shape == shape and p.dtype == torch.float32 for p in pools)
    assert _rss_kb() - before < 16 * 1024                    # 512 MiB mapped, (almost) nothing resident
    p = pools[3]
    assert p[100].abs().sum().item() == 0 and p[-1].abs().sum().item() == 0
    p[7, 3] = 1.5
    p.view(-1)[-1] = 2.0
    assert p[7, 3].eq(1.5).all() and p.view(-1)[-1].item() == 2.0 and p.sum().item() == 1.5 * 256 + 2.0
    del pools
    assert p[7, 3, 0, 0].item() == 1.5                       # the tensor keeps its mapping alive


def test_bf16_pool():
    p = zeroed_pool((3, 16, 2, 64), torch.bfloat16, torch.device("cpu"))
    assert p.dtype == torch.bfloat16 and p.is_contiguous() and p.float().abs().sum().item() == 0
