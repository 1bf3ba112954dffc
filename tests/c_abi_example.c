/* Compiled as C: the public header is valid C, and a plain C program can call the ABI. */
#include <math.h>
#include <stdio.h>

#include "mha/mha.h"

int main(void) {
    mha_runtime *rt = NULL;
    if (mha_runtime_create(0, &rt) != MHA_OK) {
        fprintf(stderr, "create: %s\n", mha_last_error());
        return 1;
    }
    float a[2 * 3] = {1, 2, 3, 4, 5, 6}, b[3 * 2] = {1, 2, 3, 4, 5, 6}, c[2 * 2];
    mha_status st = mha_sgemm(rt, 'N', 'N', 2, 2, 3, 1.0f, a, 3, b, 2, 0.0f, c, 2);
    const float want[4] = {22, 28, 49, 64};
    int bad = st != MHA_OK;
    for (int i = 0; i < 4; ++i) bad |= fabsf(c[i] - want[i]) > 1e-5f;
    if (mha_sgemm(rt, 'Z', 'N', 2, 2, 3, 1.0f, a, 3, b, 2, 0.0f, c, 2) != MHA_INVALID_ARGUMENT) bad = 1;

    /* The same product with B packed once, as a weight is. */
    mha_packed_b *pb = NULL;
    float cp[2 * 2] = {0, 0, 0, 0};
    uint64_t bytes = 0;
    bad |= mha_sgemm_pack_b(rt, 'N', 3, 2, b, 2, &pb) != MHA_OK;
    bad |= mha_sgemm_packed_b(rt, 'N', 2, 1.0f, a, 3, pb, 0.0f, cp, 2) != MHA_OK;
    bad |= mha_packed_b_bytes(pb, &bytes) != MHA_OK || bytes < 3 * 2 * sizeof(float);
    for (int i = 0; i < 4; ++i) bad |= cp[i] != c[i];
    mha_packed_b_destroy(pb);

    /* A one-head layer, E = 2, identity projections and no biases, on one token: the attention
       over a single key returns its value, so out = x. */
    const float eye[4] = {1, 0, 0, 1};
    mha_layer_config cfg = {.embed_dim = 2, .num_heads = 1};  /* every other field 0: its default */
    mha_layer_weights w = {.q_weight = eye, .k_weight = eye, .v_weight = eye, .out_weight = eye};
    mha_layer *layer = NULL;
    if (mha_layer_create(rt, &cfg, &w, &layer) != MHA_OK) {
        fprintf(stderr, "layer: %s\n", mha_last_error());
        bad = 1;
    } else {
        const float x[2] = {0.5f, -2.0f};
        float out[2] = {0, 0};
        mha_layer_forward_params p = {1, 1, 1, 0, NULL, NULL, 0, 0, NULL};
        bad |= mha_layer_forward(rt, layer, &p, x, NULL, NULL, out) != MHA_OK;
        bad |= fabsf(out[0] - 0.5f) > 1e-6f || fabsf(out[1] + 2.0f) > 1e-6f;
        mha_layer_destroy(layer);
    }
    cfg.num_heads = 3; /* 2 is not a multiple of 3 */
    if (mha_layer_create(rt, &cfg, &w, &layer) != MHA_INVALID_ARGUMENT || layer != NULL) bad = 1;
    printf("%s (last error: %s)\n", bad ? "FAIL" : "ok", mha_last_error());
    mha_runtime_destroy(rt);
    return bad;
}
