"""Offline check of vector codes for keys (the two-and-a-half-bits issue), on the shared capture.

For layers 0, 9 and 29 of kv-smollm2-135m-sample.safetensors (keys after RoPE, head_dim 64),
each KV head's keys are quantized and the attention output of query positions 1984..2047
(every 8th), values exact, is compared with the exact one: printed, the median and mean
relative L2 error of the output over query heads and positions. Two protocols:
  all:      the queries attend to every key 0..pos;
  held-out: codebooks are fitted on keys 0..1023 only, and the queries attend to keys
            1024..pos only (none of them seen by the fit).
Formats (bits per key value, parameters counted as the cache stores them):
  int2-channel-p8:  2-bit codes per channel over blocks of 32 tokens, min/max with 8-bit
                    parameters (2.5 bits), as the cache's `int2-channel-p8`;
  int3-channel-p8:  the same in 3 bits (3.5 bits);
  vq{G}x{B}:        channels in groups of G (consecutive, or `pair`: the RoPE pairs c and
                    c + 32), each group's G values one code of B bits into a codebook fitted
                    by k-means per layer and KV head on the keys divided by a static
                    per-channel scale (the calibration's std); B / G bits, no per-block
                    parameters; with `-blk`, min/max per channel and block first (8-bit
                    parameters, +0.5 bits) and the codebook fitted on the normalized keys;
  `-pre`:           the keys turned back to before RoPE (the capture's `rope.inv_freq`,
                    channels c and c + 32 paired), quantized there, and rotated again.
Usage: python3 vector_codes.py PATH/kv-smollm2-135m-sample.safetensors   (needs numpy)
"""
import json
import struct
import sys

import numpy as np

raw = open(sys.argv[1], "rb").read()
n = struct.unpack("<Q", raw[:8])[0]
header = json.loads(raw[8 : 8 + n])
base = 8 + n
FIT = 1024


def tensor(name):
    m = header[name]
    a, b = m["data_offsets"]
    dt = {"F16": np.float16, "F32": np.float32, "I32": np.int32}[m["dtype"]]
    return np.frombuffer(raw[base + a : base + b], dtype=dt).reshape(m["shape"]).astype(np.float64)


def p8(x):
    """Rounds parameters to 8 bits over their block's range, as `-p8` does (approximately)."""
    lo, hi = x.min(), x.max()
    s = (hi - lo) / 255 if hi > lo else 1.0
    return np.round((x - lo) / s) * s + lo


def int_channel(k, bits):
    out = np.empty_like(k)
    levels = 2**bits - 1
    for b in range(0, k.shape[0], 32):
        x = k[b : b + 32]
        lo, hi = p8(x.min(0)), p8(x.max(0))
        s = np.where(hi > lo, (hi - lo) / levels, 1.0)
        out[b : b + 32] = np.clip(np.round((x - lo) / s), 0, levels) * s + lo
    return out


def kmeans(x, n, iters=25, seed=0):
    rng = np.random.default_rng(seed)
    c = x[rng.choice(len(x), n, replace=len(x) < n)].copy()
    for _ in range(iters):
        d = (x * x).sum(1)[:, None] - 2 * x @ c.T + (c * c).sum(1)[None]
        idx = d.argmin(1)
        for j in range(n):
            sel = idx == j
            if sel.any():
                c[j] = x[sel].mean(0)
            else:
                c[j] = x[rng.integers(len(x))]
    return c


def groups(g, pair):
    if pair:
        return [np.array([c, c + 32]) for c in range(32)]
    return [np.arange(c, c + g) for c in range(0, 64, g)]


def encode(x, cb):
    d = (x * x).sum(1)[:, None] - 2 * x @ cb.T + (cb * cb).sum(1)[None]
    return cb[d.argmin(1)]


def vq(k, g, bits, pair=False, blk=False):
    gs = groups(g, pair)
    if blk:
        u = np.empty_like(k)
        lo_all, r_all = np.empty_like(k), np.empty_like(k)
        for b in range(0, k.shape[0], 32):
            x = k[b : b + 32]
            lo, hi = p8(x.min(0)), p8(x.max(0))
            r = np.where(hi > lo, hi - lo, 1.0)
            u[b : b + 32] = (x - lo) / r
            lo_all[b : b + 32], r_all[b : b + 32] = lo, r
    else:
        scale = k[:FIT].std(0) + 1e-6
        u = k / scale
    train = np.concatenate([u[:FIT][:, gi] for gi in gs])
    cb = kmeans(train, 2**bits)
    uq = np.empty_like(u)
    for gi in gs:
        uq[:, gi] = encode(u[:, gi], cb)
    return uq * r_all + lo_all if blk else uq * scale


INV_FREQ = tensor("rope.inv_freq")


def rope(k, sign):
    """Rotates each position's pairs (c, c + 32) by sign · pos · inv_freq[c]."""
    ang = np.arange(k.shape[0])[:, None] * INV_FREQ[None] * sign
    c, s = np.cos(ang), np.sin(ang)
    a, b = k[:, :32], k[:, 32:]
    return np.concatenate([a * c - b * s, b * c + a * s], 1)


def pre(f):
    return lambda k: rope(f(rope(k, -1.0)), 1.0)


def attend(q, k, v, lo, pos):
    s = q @ k[lo : pos + 1].T * 0.125
    p = np.exp(s - s.max())
    return (p / p.sum()) @ v[lo : pos + 1]


def errors(Q, K, V, quantize, lo):
    e = []
    for hk in range(K.shape[0]):
        kq = quantize(K[hk])
        for hq in range(hk * 3, hk * 3 + 3):
            for pos in range(1984, 2048, 8):
                o = attend(Q[hq, pos], K[hk], V[hk], lo, pos)
                e.append(np.linalg.norm(o - attend(Q[hq, pos], kq, V[hk], lo, pos)) / np.linalg.norm(o))
    return np.median(e), np.mean(e)


formats = [
    ("int2-channel-p8", 2.5, lambda k: int_channel(k, 2)),
    ("int3-channel-p8", 3.5, lambda k: int_channel(k, 3)),
    ("vq2x4 pair", 2.0, lambda k: vq(k, 2, 4, pair=True)),
    ("vq4x8", 2.0, lambda k: vq(k, 4, 8)),
    ("vq4x10", 2.5, lambda k: vq(k, 4, 10)),
    ("vq2x5 pair", 2.5, lambda k: vq(k, 2, 5, pair=True)),
    ("vq4x8-blk", 2.5, lambda k: vq(k, 4, 8, blk=True)),
    ("vq4x12", 3.0, lambda k: vq(k, 4, 12)),
    ("int2-channel-p8-pre", 2.5, pre(lambda k: int_channel(k, 2))),
    ("vq4x8-pre", 2.0, pre(lambda k: vq(k, 4, 8))),
    ("vq4x10-pre", 2.5, pre(lambda k: vq(k, 4, 10))),
    ("vq2x5 pair-pre", 2.5, pre(lambda k: vq(k, 2, 5, pair=True))),
    ("vq4x8-blk-pre", 2.5, pre(lambda k: vq(k, 4, 8, blk=True))),
    ("vq4x12-pre", 3.0, pre(lambda k: vq(k, 4, 12))),
]
only = sys.argv[2].split(",") if len(sys.argv) > 2 else None
for layer in [0, 9, 29]:
    Q, K, V = (tensor(f"layer{layer}.{x}") for x in "qkv")
    for name, bits, f in formats:
        if only and name not in only:
            continue
        a = errors(Q, K, V, f, 0)
        h = errors(Q, K, V, f, FIT)
        print(f"layer {layer:2d} {name:16s} {bits:.2f} bits: all median {a[0]:.4f} mean {a[1]:.4f}; held-out median {h[0]:.4f} mean {h[1]:.4f}", flush=True)
