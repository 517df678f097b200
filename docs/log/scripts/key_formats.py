"""Offline check of two key formats the two-and-a-half-bits issue lists, on the shared capture.

For layers 0, 9 and 29 of kv-smollm2-135m-sample.safetensors, keys after RoPE are quantized
per channel over blocks of 32 tokens (min/max, f32 parameters, as `intN-channel` in the cache),
and the attention output of the last 64 query positions (every 8th) is compared with the
exact one, values exact. Printed: the median and mean relative L2 error of the output.

  dense-and-sparse: per block, the given fraction of entries kept exactly, chosen greedily as
      the channel extreme whose removal shrinks its channel's range the most;
  lloyd: 2^bits levels inside each group's [min, max] fitted (1-D k-means, ends fixed) on
      all of a KV head's normalized keys, instead of the uniform grid.

Usage: python3 key_formats.py PATH/kv-smollm2-135m-sample.safetensors   (needs numpy)
"""
import json
import struct
import sys

import numpy as np

raw = open(sys.argv[1], "rb").read()
n = struct.unpack("<Q", raw[:8])[0]
header = json.loads(raw[8 : 8 + n])
base = 8 + n


def tensor(name):
    m = header[name]
    a, b = m["data_offsets"]
    dt = {"F16": np.float16, "F32": np.float32, "I32": np.int32}[m["dtype"]]
    return np.frombuffer(raw[base + a : base + b], dtype=dt).reshape(m["shape"]).astype(np.float64)


def sparse_block(x, bits, frac):
    t, d = x.shape
    mask = np.zeros_like(x, bool)
    for _ in range(int(round(frac * t * d))):
        best = None
        for c in range(d):
            col = x[~mask[:, c], c]
            if len(col) < 3:
                continue
            s = np.sort(col)
            gain = max(s[-1] - s[-2], s[1] - s[0])
            if best is None or gain > best[0]:
                top = s[-1] - s[-2] >= s[1] - s[0]
                rows = np.where(~mask[:, c])[0]
                r = rows[np.argmax(x[rows, c])] if top else rows[np.argmin(x[rows, c])]
                best = (gain, c, r)
        mask[best[2], best[1]] = True
    q = np.empty_like(x)
    levels = 2**bits - 1
    for c in range(d):
        keep = x[~mask[:, c], c]
        lo, hi = keep.min(), keep.max()
        s = (hi - lo) / levels if hi > lo else 1.0
        q[:, c] = np.clip(np.round((x[:, c] - lo) / s), 0, levels) * s + lo
    q[mask] = x[mask]
    return q


def normalized(k):
    out = []
    for b in range(0, k.shape[0], 32):
        x = k[b : b + 32]
        lo, hi = x.min(0), x.max(0)
        out.append(((x - lo) / np.where(hi > lo, hi - lo, 1)).ravel())
    return np.concatenate(out)


def lloyd(u, n, iters=50):
    lv = np.linspace(0, 1, n)
    for _ in range(iters):
        idx = np.abs(u[:, None] - lv[None]).argmin(1)
        for j in range(1, n - 1):
            if (idx == j).any():
                lv[j] = u[idx == j].mean()
    return lv


def on_levels(k, lv):
    out = np.empty_like(k)
    for b in range(0, k.shape[0], 32):
        x = k[b : b + 32]
        lo, hi = x.min(0), x.max(0)
        r = np.where(hi > lo, hi - lo, 1)
        idx = np.abs(((x - lo) / r)[..., None] - lv).argmin(-1)
        out[b : b + 32] = lv[idx] * r + lo
    return out


def attend(q, k, v, pos):
    s = q @ k[: pos + 1].T * 0.125
    p = np.exp(s - s.max())
    return (p / p.sum()) @ v[: pos + 1]


def errors(Q, K, V, quantize):
    e = []
    for hk in range(K.shape[0]):
        kq = quantize(K[hk])
        for hq in range(hk * 3, hk * 3 + 3):
            for pos in range(1984, 2048, 8):
                o = attend(Q[hq, pos], K[hk], V[hk], pos)
                e.append(np.linalg.norm(o - attend(Q[hq, pos], kq, V[hk], pos)) / np.linalg.norm(o))
    return np.median(e), np.mean(e)


for layer in [0, 9, 29]:
    Q, K, V = (tensor(f"layer{layer}.{x}") for x in "qkv")
    for bits in [2, 3]:
        for frac in [0, 0.005, 0.01, 0.02]:
            f = lambda k: np.concatenate([sparse_block(k[b : b + 32], bits, frac) for b in range(0, 2048, 32)])
            print(f"layer {layer} int{bits} sparse {frac:.3f}: median %.4f mean %.4f" % errors(Q, K, V, f), flush=True)
        f = lambda k: on_levels(k, lloyd(normalized(k), 2**bits))
        print(f"layer {layer} int{bits} lloyd levels: median %.4f mean %.4f" % errors(Q, K, V, f), flush=True)
