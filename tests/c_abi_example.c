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
    printf("%s (last error: %s)\n", bad ? "FAIL" : "ok", mha_last_error());
    mha_runtime_destroy(rt);
    return bad;
}
