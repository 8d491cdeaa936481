/* Activation quantization: float rows to the int8 blocks (el_block_q8a) every quantized GEMV reads. */
#include <math.h>

#include "edgellm_kernels.h"

void el_quantize_act(const float *x, int k, el_block_q8a *out) {
    for (int b = 0; b < k / EL_QK; b++, x += EL_QK) {
        float amax = 0.0f;
        for (int j = 0; j < EL_QK; j++) {
            const float a = x[j] < 0.0f ? -x[j] : x[j];
            amax = a > amax ? a : amax;
        }
        const float d = amax / 127.0f, id = amax > 0.0f ? 127.0f / amax : 0.0f;
        int sum = 0;
        for (int j = 0; j < EL_QK; j++) {
            /* |x * id| <= 127: round half to even as lrintf does in the default rounding mode */
            const int q = (int)nearbyintf(x[j] * id);
            out[b].qs[j] = (int8_t)q;
            sum += q;
        }
        out[b].d = d;
        out[b].s = d * (float)sum;
    }
}
