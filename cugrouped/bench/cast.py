"""Benchmark of ``multi_pad_cast_transpose`` against torch eager and ``torch.compile`` peers."""

from __future__ import annotations

import dataclasses

import numpy as np

from ..ops import pad_cast_transpose as pct
from .common import copy_bandwidth_gbs, l2_cache_bytes, moe_splits, time_together, with_setting


@dataclasses.dataclass(frozen=True)
class CastConfig:
    """One cast experiment: E experts, hidden size k, total tokens, split pattern."""

    name: str
    experts: int
    k: int
    tokens: int
    jagged: bool

    def m_splits(self) -> list[int]:
        return moe_splits(self.experts, self.tokens, self.jagged, self.experts * 7919 + self.k)


CAST_CONFIGS = (
    CastConfig("dsv3-E8-jagged", 8, 7168, 16384, True),
    CastConfig("dsv3-E8-equal", 8, 7168, 65536, False),
    CastConfig("qwen-E16-equal", 16, 4096, 40960, False),
    CastConfig("fine-E64-jagged", 64, 4096, 8192, True),
    CastConfig("fine-E64-jagged-64k", 64, 7168, 65536, True),
    CastConfig("mixtral-E8-jagged", 8, 4096, 4096, True),
)
QUICK_CAST = CAST_CONFIGS[:1] + CAST_CONFIGS[3:4]


def _torch_peers(cfg: CastConfig, x_torch, m_splits, compile_peer: bool = True):
    """The peers: torch eager cat-pad + scale/clamp/cast + transpose + amax (current scaling, as
    the op does it: the same bits, tested on CPU), and ``torch.compile`` of it."""
    import torch

    m_pad = pct.padded_splits(m_splits, 16)

    def eager(x):
        outs = []
        for xi, mp in zip(torch.split(x, m_splits), m_pad):
            amax = xi.abs().amax() if xi.numel() else torch.zeros((), device=x.device)
            scale = torch.where(amax > 0, 448.0 / amax.float(), torch.ones_like(amax, dtype=torch.float32))
            q = (xi.float() * scale).clamp(-448, 448).to(torch.float8_e4m3fn)
            padded = torch.cat([q.view(torch.uint8), q.new_zeros((mp - q.shape[0], q.shape[1]), dtype=torch.uint8)])
            outs.append((q, padded.t().contiguous(), amax, 1 / scale))
        return outs

    return eager, (torch.compile(eager, dynamic=False) if compile_peer else None)


CAST_IMPLS = ("cugrouped", "torch-eager", "torch-compile")


def cast_bytes(tokens: int, k: int, padded_rows: int, current: bool, l2_bytes: int) -> int:
    """HBM bytes of one cast of a ``(tokens, k)`` 16-bit input: the input read, the FP8 rows
    (``tokens * k``) and the padded transposed copy (``padded_rows * k``) written. Current
    scaling reads the input twice (the amax pass, then the cast); the second read is counted only
    when the input is larger than the L2 cache (``l2_bytes``): an input that fits is read from
    L2 the second time, and counting it would overstate GB/s (past the copy bandwidth)."""
    x = tokens * k * 2
    return x * (2 if current and x > l2_bytes else 1) + tokens * k + padded_rows * k


def permute_cast_bytes(tokens: int, routed_rows: int, k: int, padded_rows: int,
                       l2_bytes: int) -> int:
    """HBM bytes of the fused permute + current-scaling cast: a ``(tokens, k)`` 16-bit token
    matrix gathered into ``routed_rows`` rows (top-k routing: each token in k experts), FP8 rows
    and the padded transposed copy written. Read model: a token matrix that fits in L2 is read
    from HBM once (a token's other routed rows and the cast pass's re-read hit L2); a larger
    one is read once per routed row by each of the two passes (amax, cast), no reuse assumed."""
    reads = tokens * k * 2 if tokens * k * 2 <= l2_bytes else 2 * routed_rows * k * 2
    return reads + routed_rows * k + padded_rows * k


def _cast_inputs(cfg: CastConfig, copies: int, torch):
    """``copies`` inputs on the GPU, their ``dtype=`` tag and delayed scaling's scales (ones):
    bfloat16 torch tensors as MoE activations are (the same ones for the peers), or without
    torch float16 data in CuPy uint16 carriers (CuPy has no bfloat16)."""
    import cupy

    if torch is not None:
        return ([torch.randn((cfg.tokens, cfg.k), device="cuda", dtype=torch.bfloat16)
                 for _ in range(copies)], None,
                torch.ones(cfg.experts, device="cuda", dtype=torch.float32))
    return ([cupy.random.standard_normal((cfg.tokens, cfg.k), dtype=np.float32)
             .astype(cupy.float16).view(cupy.uint16) for _ in range(copies)], "float16",
            cupy.ones(cfg.experts, np.float32))


def tile_fill_pct(m_splits, align: int = 16, half: bool = False) -> float:
    """The share of the cast kernel's tile rows that hold tokens: each expert's rows, padded to
    ``align``, go in whole ``TILE_M``-row tiles, and a tile's empty rows still hold a block's
    threads (jagged counts at E=64: about a fifth of them; a reading of the cast's bandwidth).
    ``half``: with half tiles (``set_half_tiles``), a last tile row of at most 32 rows counts 32
    (exact for an even number of 128-column tiles; with an odd one the row's last half tile is
    half past k). An empty expert's tile row, which only writes its scales, is not counted."""
    def tile_rows(mp):
        full, last = divmod(mp, pct.TILE_M)
        return mp if last == 0 else full * pct.TILE_M + (
            pct.TILE_M // 2 if half and last <= pct.TILE_M // 2 else pct.TILE_M)

    rows = sum(tile_rows(mp) for mp in pct.padded_splits(m_splits, align))
    return 100.0 * sum(m_splits) / rows if rows else 100.0


def bench_cast(quick: bool, rows: list[dict], impls: tuple[str, ...] = CAST_IMPLS) -> None:
    """``impls``: which of :data:`CAST_IMPLS` to time (with ``"cugrouped"``, also its kernel at
    two tiles per block and with half tiles, rows ``cugrouped-tpb2`` and ``cugrouped-half``).
    The GPU check times cugrouped and torch eager first and the ``torch.compile`` peer in a
    later section (its compile takes longest and must not crowd out the other numbers under a
    time limit); its speed-up is over the cugrouped row already measured."""
    configs = QUICK_CAST if quick else CAST_CONFIGS
    try:
        import torch
    except ImportError:
        torch = None
        print("torch not installed: peers skipped")
    if "cugrouped" in impls:
        bw, l2 = copy_bandwidth_gbs(), l2_cache_bytes()
        print(f"device-to-device copy bandwidth: {bw:.0f} GB/s; L2 {l2 / 1e6:.0f} MB (current "
              f"scaling's second read of the input counted only for inputs larger than L2)")
    compile_only = "cugrouped" not in impls and "torch-eager" not in impls
    for cfg in configs:
        # torch.compile of the per-expert loop takes ~1 min to compile at E=64: --quick (the GPU
        # check, under a time limit) compiles it for the small-E configs only
        compile_peer = "torch-compile" in impls and torch is not None and (
            not quick or cfg.experts <= 16)
        if "torch-compile" in impls and torch is not None and not compile_peer:
            print(f"{cfg.name:<22} current  torch-compile  skipped in --quick (compile time at "
                  f"E={cfg.experts}); run without --quick for it")
        if compile_only and not compile_peer:
            continue                 # no data made for a peer that does not run
        m_splits = cfg.m_splits()
        copies = max(2, int(np.ceil(256e6 / (cfg.tokens * cfg.k * 2))))   # > L2 in rotation
        xs, tag, ones = _cast_inputs(cfg, copies, torch)
        xt = xs if torch is not None else None
        fns = {}
        for scaling in ("current", "delayed") if "cugrouped" in impls else ():
            scale = None if scaling == "current" else ones
            fns["cugrouped", scaling] = lambda i, scale=scale: pct.multi_pad_cast_transpose(
                xs[i % copies], m_splits, dtype=tag, scale=scale)
            # the kernel at two tiles per block (set_tiles_per_block(2)) and with half tiles
            # (set_half_tiles(True)), timed beside it
            fns["cugrouped-tpb2", scaling] = with_setting(fns["cugrouped", scaling],
                                                          pct.set_tiles_per_block, 2)
            fns["cugrouped-half", scaling] = with_setting(fns["cugrouped", scaling],
                                                          pct.set_half_tiles, True)
        if torch is not None:
            for impl, fn in zip(("torch-eager", "torch-compile"),
                                _torch_peers(cfg, xt[0], m_splits, compile_peer)):
                if fn is not None and impl in impls:
                    fns[impl, "current"] = lambda i, fn=fn: fn(xt[i % copies])

        def skipped(key, exc, cfg=cfg):   # torch.compile needs Triton and a host C compiler
            if key[0].startswith("cugrouped"):
                raise exc                 # ours failing ends the section, as any error there
            print(f"{cfg.name:<22} current  {key[0]:<14} skipped: {type(exc).__name__}: "
                  f"{str(exc).splitlines()[0][:160] if str(exc) else ''}")

        timed = time_together(fns, 30, skipped=skipped)
        for (impl, scaling), t in timed.items():
            ms, hus = t.ms, t.host_us
            if impl in ("cugrouped", "cugrouped-tpb2", "cugrouped-half"):
                nbytes = cast_bytes(cfg.tokens, cfg.k, sum(pct.padded_splits(m_splits, 16)),
                                    scaling == "current", l2)
                gbs = nbytes / ms / 1e6
                row = dict(op="cast", config=cfg.name, scaling=scaling, impl=impl, ms=ms,
                           gbs=gbs, pct_copy_bw=100 * gbs / bw, host_us=hus,
                           host_us_per_expert=hus / cfg.experts, l2_bytes=l2,
                           tile_fill_pct=tile_fill_pct(m_splits, half=impl == "cugrouped-half"),
                           **t.columns())
                rows.append(row)
                print(f"{cfg.name:<22} {scaling:<8} {impl:<14} {ms:8.3f} ms {gbs:7.0f} GB/s "
                      f"{row['pct_copy_bw']:5.1f}% of copy, host {hus:6.1f} us/call, "
                      f"{row['tile_fill_pct']:.0f}% of tile rows used")
                continue
            # over the cugrouped row timed with it, or (the GPU check's later torch.compile
            # section) the one timed before
            ours = next((r["ms"] for r in reversed(rows) if r.get("op") == "cast"
                         and r["config"] == cfg.name and r["scaling"] == "current"
                         and r["impl"] == "cugrouped"), None)
            row = dict(op="cast", config=cfg.name, scaling="current", impl=impl, ms=ms,
                       host_us=hus, **t.columns())
            if ours is not None:
                row["speedup_of_cugrouped"] = ms / ours
            rows.append(row)
            vs = f"cugrouped is {ms / ours:5.2f}x faster" if ours else "no cugrouped row to compare"
            print(f"{cfg.name:<22} current  {impl:<14} {ms:8.3f} ms   {vs} (host {hus:6.1f} us/call)")


def routing(tokens: int, experts: int, top_k: int, seed: int, device: str = "cuda"):
    """A top-k router's permutation as torch tensors: ``row_index`` (the token of each
    expert-ordered row, int64) and the host counts per expert (one sync, at setup)."""
    import torch

    g = torch.Generator(device=device).manual_seed(seed)
    scores = torch.randn((tokens, experts), device=device, generator=g)
    chosen = scores.topk(top_k, dim=1).indices.reshape(-1)            # (tokens * top_k,)
    order = torch.argsort(chosen, stable=True)
    row_index = (order // top_k).to(torch.int64).contiguous()
    m_splits = torch.bincount(chosen, minlength=experts).tolist()
    return row_index, m_splits


def bench_permute_cast(quick: bool, rows: list[dict]) -> None:
    """The fused MoE permute (``row_index``): cast straight from the token matrix, against the
    permute a framework runs first (``index_select``, the gather copy) followed by our cast or the
    torch eager peer. Current scaling, bfloat16 tokens; a top-k router's indices."""
    try:
        import torch
    except ImportError:
        print("torch not installed: the permute benchmark is skipped")
        return
    configs = QUICK_CAST if quick else CAST_CONFIGS
    bw, l2 = copy_bandwidth_gbs(), l2_cache_bytes()
    for cfg in configs:
        top_k = 2 if cfg.experts <= 16 else 6
        T = max(1, cfg.tokens // top_k)
        copies = max(2, int(np.ceil(256e6 / (T * cfg.k * 2))))          # > L2 in rotation
        xt = [torch.randn((T, cfg.k), device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
        idx, m_splits = routing(T, cfg.experts, top_k, cfg.experts * 31 + cfg.k)
        eager, _ = _torch_peers(cfg, xt[0], m_splits, compile_peer=False)
        impls = {
            "cugrouped-fused": lambda i: pct.multi_pad_cast_transpose(xt[i % copies], m_splits,
                                                                      row_index=idx),
            "index_select+cugrouped": lambda i: pct.multi_pad_cast_transpose(
                xt[i % copies].index_select(0, idx), m_splits),
            "index_select+torch-eager": lambda i: eager(xt[i % copies].index_select(0, idx)),
        }
        # (the read model of permute_cast_bytes)
        nbytes = permute_cast_bytes(T, sum(m_splits), cfg.k, sum(pct.padded_splits(m_splits, 16)), l2)
        record_fused(rows, time_together(impls, 30), "permute-cast", cfg.name, nbytes, bw,
                     f"permute top-{top_k}", top_k=top_k)


def record_fused(rows: list[dict], timed: dict, op: str, config: str, nbytes: int, bw: float,
                 label: str, **extra) -> None:
    """The rows of a fused op timed together with its unfused peers (current scaling): the
    first of ``timed`` is the fused one, its GB/s from ``nbytes`` and the copy bandwidth ``bw``;
    each other one gets its time over the fused one's."""
    fused_ms = None
    for impl, t in timed.items():
        ms, hus = t.ms, t.host_us
        row = dict(op=op, config=config, scaling="current", impl=impl, ms=ms, host_us=hus,
                   **extra, **t.columns())
        if fused_ms is None:
            fused_ms = ms
            gbs = nbytes / ms / 1e6
            row.update(gbs=gbs, pct_copy_bw=100 * gbs / bw)
            note = f"{gbs:7.0f} GB/s {row['pct_copy_bw']:5.1f}% of copy"
        else:
            row.update(speedup_of_cugrouped=ms / fused_ms)
            note = f"fused is {ms / fused_ms:5.2f}x faster"
        rows.append(row)
        print(f"{config:<22} {label} {impl:<25} {ms:8.3f} ms {note} (host {hus:6.1f} us/call)")
