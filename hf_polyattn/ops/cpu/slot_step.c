/* ops/slot_step.py's ``slot_step`` for float32 on the CPU, one call for the whole batch of a layer.

   The same arithmetic as the PyTorch reference (tests/ops/test_slot_step.py checks the two agree and both agree
   with the whole sequence in one call), written as loops over the batch's sequences and kv heads that read and
   write each slot's buffers in place: the PyTorch step (eager or compiled) spends its 0.5-0.6 ms a call on the
   demo's SmolLM2 layer on dispatch, for about 0.25 M multiply-adds; this file takes 0.08 ms at batch 1
   (recipes/benchmark_slot_step.py, the 2-core CPU).

   Layout (``ops.packed.RingLayout`` stacked over P entries, one page a slot, ``slot_state``): a slot's row starts
   at state + slot * page; buffer i at offsets[i] within it: kv (P, Hmax, F, d + 1), keys (P, Hmax, S + W, d),
   vext (P, Hmax, S + W, d + 1), valid, logg (P, Hmax, W), meta (P, 6). Sums of log-gates in double: they are
   exponentiated. Built by ops/cpu_kernels.py with the system's C compiler; no Python or torch headers. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { FEATURE_ELU = 0, FEATURE_RELU = 1, FEATURE_HEDGEHOG = 2 };

static float dot(const float *a, const float *b, int64_t n) {
    float s = 0.0f;
    for (int64_t i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

/* the features of one row x (n_in) into f: projection, LayerNorm with the row's affine, the map */
static void features(const float *x, int64_t d, const float *proj, int64_t nf, const float *norm_w,
                     const float *norm_b, float eps, int feature, const float *map_w, int64_t nf2, float *tmp,
                     float *f) {
    float *y = tmp; /* nf */
    if (proj) {
        for (int64_t j = 0; j < nf; j++) y[j] = 0.0f;
        for (int64_t i = 0; i < d; i++) {
            const float xi = x[i];
            const float *p = proj + i * nf;
            for (int64_t j = 0; j < nf; j++) y[j] += xi * p[j];
        }
    } else {
        memcpy(y, x, sizeof(float) * d);
    }
    if (norm_w) {
        float mean = 0.0f, var = 0.0f;
        for (int64_t j = 0; j < nf; j++) mean += y[j];
        mean /= (float)nf;
        for (int64_t j = 0; j < nf; j++) var += (y[j] - mean) * (y[j] - mean);
        var /= (float)nf;
        const float r = 1.0f / sqrtf(var + eps);
        for (int64_t j = 0; j < nf; j++) y[j] = (y[j] - mean) * r * norm_w[j] + norm_b[j];
    }
    if (feature == FEATURE_ELU) {
        for (int64_t j = 0; j < nf; j++) f[j] = y[j] > 0.0f ? y[j] + 1.0f : expf(y[j]);
    } else if (feature == FEATURE_RELU) {
        for (int64_t j = 0; j < nf; j++) f[j] = y[j] > 0.0f ? y[j] : 0.0f;
    } else { /* Hedgehog: [softmax(y W), softmax(-y W)] */
        float *z = tmp + nf; /* nf2 */
        for (int64_t k = 0; k < nf2; k++) z[k] = 0.0f;
        for (int64_t j = 0; j < nf; j++) {
            const float yj = y[j];
            const float *w = map_w + j * nf2;
            for (int64_t k = 0; k < nf2; k++) z[k] += yj * w[k];
        }
        float hi = z[0], lo = z[0];
        for (int64_t k = 1; k < nf2; k++) {
            hi = z[k] > hi ? z[k] : hi;
            lo = z[k] < lo ? z[k] : lo;
        }
        float sp = 0.0f, sn = 0.0f;
        for (int64_t k = 0; k < nf2; k++) {
            f[k] = expf(z[k] - hi);
            f[nf2 + k] = expf(lo - z[k]);
            sp += f[k];
            sn += f[nf2 + k];
        }
        for (int64_t k = 0; k < nf2; k++) {
            f[k] /= sp;
            f[nf2 + k] /= sn;
        }
    }
}

/* log sigmoid(z), stable on both sides */
static float log_sigmoid(float z) { return (z < 0.0f ? z : 0.0f) - log1pf(expf(-fabsf(z))); }

int hf_polyattn_slot_step(
    /* B sequences, Hkv kv heads, G queries a head, head dim d */
    int64_t b_count, int64_t hkv, int64_t g, int64_t d, const float *q, const float *k, const float *v,
    const int64_t *slots, int64_t sub, float *state, int64_t page, const int64_t *offsets,
    /* the buffers' kv heads, state features (after the map) */
    int64_t hmax, int64_t nfeat, int64_t sinks, int64_t window, int decay,
    /* the layer (``SlotPlan``; NULL where absent) */
    const float *proj, int64_t nproj, const float *q_norm_w, const float *q_norm_b, const float *k_norm_w,
    const float *k_norm_b, float eps, int feature, const float *map_w, int64_t nmap, const float *gate_w,
    const float *gate_b, const float *scalar_log_gate, int has_cap, float gate_cap, const float *window_mix,
    const double *inv_freq, int64_t rotary_dim, int64_t span, float scale, float offset, float smallest,
    float *out) {
    const int64_t n = sinks + window, e = d + 1;
    const int64_t nf = proj ? nproj : d; /* the kernel inputs' width */
    float *scratch = (float *)malloc(sizeof(float) * (size_t)(2 * (nf + nmap) + (g + 1) * nfeat + g * n + 2 * g * e
                                                               + 2 * d + 2));
    if (!scratch) return 1;
    float *tmp = scratch, *fq = tmp + 2 * (nf + nmap), *fk = fq + g * nfeat, *scores = fk + nfeat;
    float *num = scores + g * n, *far = num + g * e, *sq = far + g * e;
    float *cs = NULL;
    if (inv_freq && sinks) cs = (float *)malloc(sizeof(float) * (size_t)rotary_dim);
    for (int64_t bi = 0; bi < b_count; bi++) {
        float *row = state + slots[bi] * page;
        float *meta = row + offsets[5] + sub * 6;
        const double length = meta[0];
        const int64_t head = (int64_t)meta[1], slot = sinks + head;
        if (cs) { /* the sinks' query rotation by min(0, span - length) */
            double delta = (double)span - length;
            delta = delta < 0.0 ? delta : 0.0;
            for (int64_t i = 0; i < rotary_dim / 2; i++) {
                const double a = delta * inv_freq[i];
                cs[i] = (float)cos(a);
                cs[rotary_dim / 2 + i] = (float)sin(a);
            }
        }
        for (int64_t h = 0; h < hkv; h++) {
            float *kv = row + offsets[0] + ((sub * hmax + h) * nfeat) * e;
            float *keys = row + offsets[1] + ((sub * hmax + h) * n) * d;
            float *vext = row + offsets[2] + ((sub * hmax + h) * n) * e;
            float *logg = decay ? row + offsets[4] + (sub * hmax + h) * window : NULL;
            const float *qh = q + ((bi * hkv + h) * g) * d;
            const float *kh = k + (bi * hkv + h) * d, *vh = v + (bi * hkv + h) * d;
            float *k_old = keys + slot * d, *vx_old = vext + slot * e;
            const float *ph = proj ? proj + h * d * nproj : NULL;
            const float *mw = map_w ? map_w + h * nf * nmap : NULL;
            /* features of the queries and of the key leaving the window */
            for (int64_t gi = 0; gi < g; gi++)
                features(qh + gi * d, d, ph, nf, q_norm_w ? q_norm_w + (h * g + gi) * nf : NULL,
                         q_norm_b ? q_norm_b + (h * g + gi) * nf : NULL, eps, feature, mw, nmap, tmp,
                         fq + gi * nfeat);
            features(k_old, d, ph, nf, k_norm_w ? k_norm_w + h * nf : NULL, k_norm_b ? k_norm_b + h * nf : NULL,
                     eps, feature, mw, nmap, tmp, fk);
            /* the state decays by the leaving key's gate and takes it; the new key's log-gate */
            float lg_new = 0.0f;
            if (decay) {
                const float gate = expf(logg[head]);
                for (int64_t i = 0; i < nfeat * e; i++) kv[i] *= gate;
                if (gate_w) {
                    lg_new = log_sigmoid(dot(vh, gate_w + h * d, d) + gate_b[h]);
                } else {
                    lg_new = scalar_log_gate[h];
                }
                if (has_cap && lg_new > gate_cap) lg_new = gate_cap;
            }
            for (int64_t f = 0; f < nfeat; f++) {
                const float ff = fk[f];
                float *kvf = kv + f * e;
                for (int64_t j = 0; j < e; j++) kvf[j] += ff * vx_old[j];
            }
            /* the new key in the leaving key's slot */
            memcpy(k_old, kh, sizeof(float) * d);
            memcpy(vx_old, vh, sizeof(float) * d);
            vx_old[d] = 1.0f;
            double log_total = 0.0;
            if (decay) {
                logg[head] = lg_new;
                for (int64_t w = 0; w < window; w++) log_total += logg[w];
            }
            /* the read: the sinks and the window exactly, one normaliser, the state through the features */
            for (int64_t gi = 0; gi < g; gi++) {
                const float *qg = qh + gi * d;
                float *sc = scores + gi * n;
                const float *qs = qg;
                if (cs) {
                    const int64_t half = rotary_dim / 2;
                    for (int64_t i = 0; i < half; i++) {
                        const float c = cs[i], s = cs[half + i];
                        sq[i] = qg[i] * c - qg[half + i] * s;
                        sq[half + i] = qg[half + i] * c + qg[i] * s;
                    }
                    for (int64_t i = rotary_dim; i < d; i++) sq[i] = qg[i];
                    qs = sq;
                }
                float m = 0.0f; /* the row max clamped at 0 */
                for (int64_t j = 0; j < n; j++) {
                    sc[j] = dot(j < sinks ? qs : qg, keys + j * d, d) * scale;
                    m = sc[j] > m ? sc[j] : m;
                }
                float *nm = num + gi * e, *fr = far + gi * e;
                for (int64_t i = 0; i < e; i++) nm[i] = fr[i] = 0.0f;
                for (int64_t j = 0; j < n; j++) {
                    const float wj = expf(sc[j] - m);
                    const float *vx = vext + j * e;
                    for (int64_t i = 0; i < e; i++) nm[i] += wj * vx[i];
                }
                const float *fqg = fq + gi * nfeat;
                for (int64_t f = 0; f < nfeat; f++) {
                    const float ff = fqg[f];
                    const float *kvf = kv + f * e;
                    for (int64_t i = 0; i < e; i++) fr[i] += ff * kvf[i];
                }
                float factor = (float)exp(log_total - (double)m);
                if (window_mix) factor *= fabsf(window_mix[h * g + gi]);
                float *o = out + ((bi * hkv + h) * g + gi) * d;
                float den = nm[d] + far[gi * e + d] * factor + offset;
                den = den > smallest ? den : smallest;
                for (int64_t i = 0; i < d; i++) o[i] = (nm[i] + fr[i] * factor) / den;
            }
        }
        meta[0] += 1.0f;
        meta[1] = (float)((head + 1) % window);
        meta[4] += 1.0f;
    }
    free(cs);
    free(scratch);
    return 0;
}
