// ggml's CPU flash attention (GGML_OP_FLASH_ATTN_EXT) on one decode step of a layer shaped
// like Llama-3-8B's (32 query heads over 8 KV heads, head_dim 128): the baseline the serving
// issue quotes, measured on this machine. Built and run by `cargo xtask ggml`, against the
// ggml that ships inside the llama-cpp-python sdist, compiled for the native CPU.
//
// usage: flash_attn CONTEXT TYPE THREADS STEPS   (TYPE: f16, q8_0 or q4_0)
// prints one line: the mean and the fastest milliseconds per step.
#include "ggml.h"
#include "ggml-cpu.h"
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static void fill(struct ggml_tensor *t, unsigned *seed) {
    float *p = (float *)t->data;
    for (long i = 0; i < ggml_nelements(t); i++) {
        *seed = *seed * 1664525u + 1013904223u;
        p[i] = (float)(*seed >> 8) / 16777216.0f - 0.5f;
    }
}

int main(int argc, char **argv) {
    if (argc != 5) {
        fprintf(stderr, "usage: %s CONTEXT f16|q8_0|q4_0 THREADS STEPS\n", argv[0]);
        return 2;
    }
    const long n_kv = atol(argv[1]);
    const char *name = argv[2];
    const int threads = atoi(argv[3]), steps = atoi(argv[4]);
    enum ggml_type type;
    if (!strcmp(name, "f16")) type = GGML_TYPE_F16;
    else if (!strcmp(name, "q8_0")) type = GGML_TYPE_Q8_0;
    else if (!strcmp(name, "q4_0")) type = GGML_TYPE_Q4_0;
    else { fprintf(stderr, "unknown type %s\n", name); return 2; }
    if (n_kv < 1 || n_kv > (1L << 22) || threads < 1 || steps < 1) {
        fprintf(stderr, "CONTEXT in 1..=4194304, THREADS and STEPS at least 1\n");
        return 2;
    }
    const long d = 128, hq = 32, hkv = 8;
    ggml_cpu_init();
    // f32 staging copies of K and V, their converted copies, the query, and room for the
    // graphs' work buffers.
    struct ggml_init_params ip = {(size_t)(d * n_kv * hkv * 4 * 4) + (64u << 20), NULL, false};
    struct ggml_context *ctx = ggml_init(ip);
    if (!ctx) { fprintf(stderr, "ggml_init failed\n"); return 1; }
    unsigned seed = 1;
    struct ggml_tensor *kf = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, d, n_kv, hkv);
    struct ggml_tensor *vf = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, d, n_kv, hkv);
    struct ggml_tensor *q = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, d, 1, hq);
    fill(kf, &seed);
    fill(vf, &seed);
    fill(q, &seed);
    struct ggml_tensor *k = ggml_new_tensor_3d(ctx, type, d, n_kv, hkv);
    struct ggml_tensor *v = ggml_new_tensor_3d(ctx, type, d, n_kv, hkv);
    struct ggml_cgraph *convert = ggml_new_graph(ctx);
    ggml_build_forward_expand(convert, ggml_cpy(ctx, kf, k));
    ggml_build_forward_expand(convert, ggml_cpy(ctx, vf, v));
    ggml_graph_compute_with_ctx(ctx, convert, threads);
    // One new token: no mask is needed (it attends to every cached token).
    struct ggml_tensor *out = ggml_flash_attn_ext(ctx, q, k, v, NULL, 1.0f / sqrtf((float)d), 0.0f, 0.0f);
    struct ggml_cgraph *step = ggml_new_graph(ctx);
    ggml_build_forward_expand(step, out);
    for (int i = 0; i < 3; i++) ggml_graph_compute_with_ctx(ctx, step, threads);
    double best = 1e30, sum = 0;
    for (int i = 0; i < steps; i++) {
        double t0 = now();
        ggml_graph_compute_with_ctx(ctx, step, threads);
        double dt = now() - t0;
        sum += dt;
        if (dt < best) best = dt;
    }
    float o = ((float *)out->data)[0];
    printf("ggml %-5s %7ld tokens  %d thread(s)  %8.3f ms/step mean  %8.3f fastest%s\n", name, n_kv, threads,
           1e3 * sum / steps, 1e3 * best, isfinite(o) ? "" : "  (non-finite output!)");
    ggml_free(ctx);
    return isfinite(o) ? 0 : 1;
}
