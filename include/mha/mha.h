/* mha: SIMD-optimized CPU runtime for multi-head attention. The stable C ABI.
 *
 * All tensors are float32, contiguous, row-major. Every function returns mha_status; on failure
 * mha_last_error() gives a message for the calling thread, and no output buffer is written.
 * No C++ exception ever crosses this boundary. */
#ifndef MHA_MHA_H
#define MHA_MHA_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum mha_status {
    MHA_OK = 0,
    MHA_INVALID_ARGUMENT = 1,
    MHA_OUT_OF_MEMORY = 2,
    MHA_UNSUPPORTED = 3,
    MHA_INTERNAL = 4
} mha_status;

/* The message of the last failed call made by this thread ("" if none). Valid until the next call
 * into mha from the same thread. */
const char *mha_last_error(void);

/* A runtime owns a thread arena of num_threads (0 = all hardware threads; the runtimes of one size
 * share one arena), the tile config, and per-thread scratch. Many host threads may call one
 * runtime at the same time. The tile config is read from the file named by MHA_TILE_CONFIG if
 * that is set (a broken one fails the call).
 * The ISA is picked from the CPU; the environment variable MHA_ISA=avx2|avx512 overrides it
 * (MHA_UNSUPPORTED if the CPU lacks it). */
typedef struct mha_runtime mha_runtime;
mha_status mha_runtime_create(int num_threads, mha_runtime **out);
void mha_runtime_destroy(mha_runtime *rt); /* NULL is fine */

/* mha_runtime_create with the tile config file at tile_config_path (JSON, as mha-tune --out writes
 * it; see the README). NULL or "" means the environment variable MHA_TILE_CONFIG, else the defaults,
 * which is also what mha_runtime_create does. A missing, unreadable or broken config (bad JSON,
 * unknown keys, values that break a kernel constraint, a config for another ISA) fails with
 * MHA_INVALID_ARGUMENT and a message naming the file and the problem. */
mha_status mha_runtime_create_with_config(int num_threads, const char *tile_config_path, mha_runtime **out);

/* *bytes = the scratch the runtime holds between calls. Each call borrows what it needs from the
 * runtime's buffers, which grow to the largest call so far and are kept for the next; the
 * attention's scratch grows with the tiles and threads, not with Lq x Lk. The count includes the
 * buffers other threads' calls have on loan at the time, so it never drops. */
mha_status mha_runtime_scratch_bytes(const mha_runtime *rt, uint64_t *bytes);

/* C = alpha * op(A) * op(B) + beta * C, row-major; trans is 'N' or 'T'.
 * op(A) is m x k, op(B) is k x n. beta == 0 means C is not read (NaN in C is overwritten).
 * Leading dimensions count floats between rows of the stored matrix: lda >= k for 'N' A (m x k),
 * lda >= m for 'T' A (stored k x m); likewise ldb, and ldc >= n. Elements of C outside the m x n
 * window are never written. The result is bitwise identical for any thread count. */
mha_status mha_sgemm(mha_runtime *rt, char transa, char transb, int64_t m, int64_t n, int64_t k,
                     float alpha, const float *a, int64_t lda, const float *b, int64_t ldb,
                     float beta, float *c, int64_t ldc);

/* op(B) packed once for many products against it (a weight): k x n, transb and ldb as for
 * mha_sgemm ('N': B stored k x n, ldb >= n; 'T': stored n x k, ldb >= k). B is copied into the
 * panels the runtime's GEMM microkernel reads, so each mha_sgemm_packed_b call packs nothing of B;
 * no pointer to b is kept. The packed B is tied to the microkernel and depth blocking of the
 * runtime that packed it: a runtime with another ISA or tile config refuses it (MHA_INVALID_ARGUMENT,
 * with a message). It is never changed after mha_sgemm_pack_b returns, so many host threads may
 * use one at the same time. Bad input (transb not 'N' or 'T', k or n negative, ldb too small, b
 * NULL with k, n > 0, sizes that overflow) gets MHA_INVALID_ARGUMENT and *out = NULL. */
typedef struct mha_packed_b mha_packed_b;
mha_status mha_sgemm_pack_b(mha_runtime *rt, char transb, int64_t k, int64_t n, const float *b, int64_t ldb,
                            mha_packed_b **out);
void mha_packed_b_destroy(mha_packed_b *b); /* NULL is fine */
/* *bytes = the size of the packed copy. */
mha_status mha_packed_b_bytes(const mha_packed_b *b, uint64_t *bytes);

/* C = alpha * op(A) * B + beta * C with B packed by mha_sgemm_pack_b: op(A) is m x k (transa and
 * lda as for mha_sgemm) and C m x n, k and n those B was packed with. The same bits as mha_sgemm
 * with the same arguments and B as it was stored, for any thread count, and a row of C the same
 * bits whatever m is. beta == 0 means C is not read. Bad input as for mha_sgemm, and a B packed by
 * a runtime of another ISA or tile config, gets MHA_INVALID_ARGUMENT and writes nothing. */
mha_status mha_sgemm_packed_b(mha_runtime *rt, char transa, int64_t m, float alpha, const float *a, int64_t lda,
                              const mha_packed_b *b, float beta, float *c, int64_t ldc);

/* y[r, :] = softmax(x[r, :]) for each of rows rows of cols values; x == y (same ld) is allowed.
 * -INFINITY entries get probability 0; a row of only -INFINITY gets all zeros; a NaN makes its row
 * NaN (and +INFINITY too, as +inf - +inf is NaN). Rows are max-subtracted, so logits up to +-3e38
 * never overflow. Elements past cols in each row are never read or written. rows == 0 or
 * cols == 0 is a valid empty call. */
mha_status mha_softmax(mha_runtime *rt, int64_t rows, int64_t cols,
                       const float *x, int64_t ldx, float *y, int64_t ldy);

/* Score modifiers of today's decoders (all zero = plain attention). Positions are absolute and
 * bottom-right aligned like causal: key j is at position j and query i at i + kv_len - q_len (per
 * sequence in the varlen and cached forms; in the cache a token's position is its index in its
 * sequence). For query position p and key position j:
 *   s = scale * q.k;  if softcap: s = softcap * tanh(s / softcap);  if alibi: s += slope[h] * (j - p);
 *   window: the key is visible only if j > p - window (with or without causal; combined with every mask);
 *   sinks: one more logit sink[h] per row in the softmax's denominator, with no value row.
 * A window costs time in proportion to the keys inside it: whole key tiles and chunks outside every
 * row's window are skipped, and the results keep every bitwise guarantee of the call.
 * Bad input (window < 0; softcap negative, NaN or infinite; a NaN or infinite ALiBi slope; a NaN or
 * +inf sink) gets MHA_INVALID_ARGUMENT with a message naming the field. */
typedef struct mha_attention_variant {
    int64_t window;             /* 0 = none; else a query at position i sees only keys at positions j > i - window */
    float softcap;              /* 0 = none; else s = softcap * tanh(s / softcap), applied to the scaled score */
    const float *alibi_slopes;  /* NULL or [num_heads]: s += slope[h] * (j - i), after the cap */
    const float *sink_logits;   /* NULL or [num_heads]: one extra logit per head in every row's softmax,
                                   with no value row: it only adds exp(sink - max) to the denominator */
} mha_attention_variant;

typedef struct mha_attention_params {
    int64_t batch, q_len, kv_len;
    int64_t num_heads, num_kv_heads;      /* num_heads % num_kv_heads == 0 (MHA, GQA, MQA) */
    int64_t head_dim, value_dim;          /* Dqk and Dv, which may differ */
    float scale;                          /* 0 means 1/sqrt(head_dim) */
    int causal;                           /* query i sees key j iff j <= i + kv_len - q_len */
    const int32_t *kv_valid_lens;         /* NULL or [batch]: keys j >= valid_len are masked */
    const uint8_t *mask;                  /* NULL or mask[b*mask_batch_stride + i*mask_row_stride + j];
                                             nonzero = may attend, 0 = masked; same for all heads */
    int64_t mask_batch_stride, mask_row_stride;   /* 0 broadcasts */
    float *weights;                       /* NULL, or out: probabilities [batch, num_heads, q_len, kv_len]
                                             (with sinks, the keys' share: a row sums to less than 1) */
    mha_attention_variant variant;        /* window, softcap, ALiBi, sinks; all zero = none */
} mha_attention_params;

/* q [batch, q_len, num_heads, head_dim], k [batch, kv_len, num_kv_heads, head_dim],
   v [batch, kv_len, num_kv_heads, value_dim], out [batch, q_len, num_heads, value_dim].
   All masks combine (a key must pass every one). A query row with no visible key gets zeros.
   Subnormal floats count as zero inside the call (flush-to-zero and denormals-are-zero on the
   threads that compute it, the caller's floating-point mode restored before it returns): an input
   or result below FLT_MIN in magnitude is 0.
   Fused: the q_len x kv_len score matrix is never stored. The result is bitwise identical for
   any thread count and for a sequence alone or inside a batch. out may be q itself (in place)
   when value_dim == head_dim, the row strides are equal and weights is NULL: each query row's
   output is written after the last read of that row, with the same bits as into a buffer of its
   own; out == q otherwise gets MHA_INVALID_ARGUMENT. No other overlap of out with the inputs or
   weights is allowed. Bad input (sizes <= 0 where they
   must be positive, num_heads not a multiple of num_kv_heads, a valid length outside [0, kv_len],
   a mask row stride below kv_len, NULL pointers, overflowing sizes) gets MHA_INVALID_ARGUMENT. */
mha_status mha_attention(mha_runtime *rt, const mha_attention_params *p,
                         const float *q, const float *k, const float *v, float *out);

/* Storage types: of the KV cache (mha_kv_cache_config) and of a layer's weights (mha_layer_config).
 * Arithmetic stays fp32. MHA_BF16 answers MHA_UNSUPPORTED until bf16 storage is built.
 * MHA_I8 (the KV cache only): each appended token's K and V rows are stored per KV head as int8
 * with one fp32 scale, symmetric: scale = max |x| / 127 (nudged by at most a few ulp so that
 * 127 * scale == max |x| where a float allows it: a row of equal values round-trips exactly),
 * q = round-to-nearest(x / scale); a zero row gets scale 0 and zeros. Attention widens them to fp32
 * as it reads (value times scale) and computes exactly as over an fp32 cache holding those values,
 * with the same bitwise guarantees. K and V must be finite (else MHA_INVALID_ARGUMENT, nothing
 * appended). mha_kv_cache_read returns the widened values. */
typedef enum mha_dtype { MHA_F32 = 0, MHA_BF16 = 1, MHA_I8 = 2 } mha_dtype;

/* Add & Norm around a sub-block f (attention, or the encoder's feed-forward network), with
 * LayerNorm(x) = (x - mean) / sqrt(var + eps) * norm_weight + norm_bias over each row's E values:
 *   MHA_NORM_POST: out = LayerNorm(x + f(x))   (seed 002, PyTorch's default, norm_first=False)
 *   MHA_NORM_PRE:  out = x + f(LayerNorm(x))   (norm_first=True)
 * For the attention layer x is the query; with MHA_NORM_PRE key and value are normalized too only
 * for self-attention (they are the query). A row of equal values gives norm_bias; a NaN stays in
 * its row. */
typedef enum mha_norm { MHA_NORM_NONE = 0, MHA_NORM_POST = 1, MHA_NORM_PRE = 2 } mha_norm;

/* Rotary position embeddings (Su et al., RoFormer) on the first dims of every q and k head, right
 * after their projection: the pair (a, b) of frequency index d < dims/2 at position p turns by the
 * angle p * position_scale * theta^(-2d/dims). Positions as in mha_attention_variant (query i at
 * i + kv_len - q_len, key j at j; in the cached layer a token's index in its sequence). In fp32. */
typedef struct mha_rope {
    int64_t dims;         /* 0 = none; else the first dims (even, <= head_dim) of every q and k head rotate */
    float theta;          /* base, 0 = 10000; negative, NaN or infinite: MHA_INVALID_ARGUMENT */
    int interleaved;      /* 0: pairs (x[d], x[d + dims/2]) as Hugging Face's rotate_half (GPT-NeoX, Llama, Qwen);
                             1: adjacent pairs (x[2d], x[2d+1]) as GPT-J and Meta's reference Llama;
                             any other value: MHA_INVALID_ARGUMENT */
    float position_scale; /* positions are multiplied by this before the angles (linear scaling), 0 = 1;
                             negative, NaN or infinite: MHA_INVALID_ARGUMENT */
} mha_rope;

/* ---- The multi-head attention layer ----------------------------------------------------------
 * Built once from a checkpoint's weights, then called for every request:
 *   Q = query Wq^T + bq, K = key Wk^T + bk, V = value Wv^T + bv  (PyTorch's nn.Linear layout)
 *   O = mha_attention(Q, K, V), out = O Wo^T + bo.
 * The weights are copied and packed for the runtime's GEMM microkernel when the layer is built; the
 * caller's buffers may be freed afterwards. A layer may be used from many threads at once. */
typedef struct mha_layer mha_layer;

typedef struct mha_layer_config {
    int64_t embed_dim;                /* E: the width of query and out */
    int64_t num_heads;                /* H */
    int64_t num_kv_heads;             /* 0 = num_heads; num_heads must be a multiple of it */
    int64_t head_dim, value_dim;      /* per head; 0 = embed_dim / num_heads */
    int64_t kdim, vdim;               /* widths of key and value; 0 = embed_dim */
    mha_dtype weight_dtype;           /* MHA_F32 (0); MHA_BF16 answers MHA_UNSUPPORTED for now */
    int norm;                         /* an mha_norm: MHA_NORM_NONE (0), MHA_NORM_POST or MHA_NORM_PRE */
    float norm_eps;                   /* LayerNorm's eps; 0 = 1e-5 (seed 002 uses 1e-6); negative or NaN: MHA_INVALID_ARGUMENT */
    mha_attention_variant variant;    /* the attention's score modifiers; its arrays are copied when the layer is built */
    mha_rope rope;                    /* rotary embeddings on q and k; all zero = none */
} mha_layer_config;

typedef struct mha_layer_weights {
    const float *q_weight;            /* [num_heads * head_dim, embed_dim] */
    const float *k_weight;            /* [num_kv_heads * head_dim, kdim] */
    const float *v_weight;            /* [num_kv_heads * value_dim, vdim] */
    const float *out_weight;          /* [embed_dim, num_heads * value_dim] */
    const float *q_bias, *k_bias, *v_bias, *out_bias;   /* NULL = no bias */
    const float *norm_weight, *norm_bias;               /* [embed_dim] each, for norm; NULL = 1 and 0 */
} mha_layer_weights;

/* Fills *out with pointers into PyTorch's packed in_proj_weight [3E, E] and in_proj_bias [3E]
 * (NULL = no bias), plus the out_proj weight [E, E] and bias [E] (NULL = no bias). Valid only for
 * kdim = vdim = E, num_kv_heads = num_heads, head_dim = value_dim = E / num_heads. */
mha_status mha_layer_weights_from_in_proj(const mha_layer_config *config, const float *in_proj_weight,
                                          const float *in_proj_bias, const float *out_proj_weight,
                                          const float *out_proj_bias, mha_layer_weights *out);

/* Packs the weights for rt's ISA and tile config. Bad input (a dimension <= 0 that must be
 * positive, num_heads not a multiple of num_kv_heads, NULL weights, overflowing sizes) gets
 * MHA_INVALID_ARGUMENT with a message naming the field. */
mha_status mha_layer_create(mha_runtime *rt, const mha_layer_config *config, const mha_layer_weights *weights,
                            mha_layer **out);
void mha_layer_destroy(mha_layer *layer); /* NULL is fine */

typedef struct mha_layer_forward_params {
    int64_t batch, q_len, kv_len;     /* kv_len: 0 or q_len for self-attention */
    int causal;                       /* as in mha_attention_params */
    const int32_t *kv_valid_lens;     /* NULL or [batch], each in [0, kv_len] */
    const uint8_t *mask;              /* NULL or mask[b*mask_batch_stride + i*mask_row_stride + j];
                                         nonzero = may attend, 0 = masked */
    int64_t mask_batch_stride, mask_row_stride;   /* 0 broadcasts */
    float *weights;                   /* NULL, or out: per-head probabilities [batch, num_heads, q_len, kv_len] */
} mha_layer_forward_params;

/* query [batch, q_len, E], key [batch, kv_len, kdim], value [batch, kv_len, vdim] ->
 * out [batch, q_len, E]. key = value = NULL (or both == query) is self-attention. rt must have the
 * ISA and tile config the layer was built with (any thread count). The result is bitwise identical
 * for any thread count and for a sequence alone or inside a batch. A query row with no visible key
 * gets zeros from the attention (so out = bo there), where PyTorch gives NaN. */
mha_status mha_layer_forward(mha_runtime *rt, const mha_layer *layer, const mha_layer_forward_params *p,
                             const float *query, const float *key, const float *value, float *out);

/* ---- Serving: ragged batches, a paged KV cache, incremental decode ----------------------------
 * Every path below (mha_attention, mha_attention_varlen, mha_attention_cached, the layer's forward
 * and forward_cached) computes a query row the same way: each score is one ordered sum over the
 * head dimension, and keys are folded into the online softmax in fixed tiles and chunks aligned to
 * absolute key positions (the runtime's attn_block_k and attn_kv_chunk). So a token's output has
 * the same bits alone or in a batch of any composition, in a full prefill, a chunked prefill or a
 * decode step, on any number of threads (for one runtime ISA and tile config). Values of V must be
 * finite for this to hold (a masked key's V is multiplied by 0). */

typedef struct mha_varlen_params {
    int64_t num_seqs;
    const int64_t *q_offsets;    /* [num_seqs + 1], non-decreasing, q_offsets[0] = 0: sequence s owns query rows q_offsets[s] .. q_offsets[s+1]-1 */
    const int64_t *kv_offsets;   /* [num_seqs + 1], the same for key/value rows */
    int64_t num_heads, num_kv_heads, head_dim, value_dim;
    float scale;                 /* 0 = 1/sqrt(head_dim) */
    int causal;                  /* bottom-right, per sequence, as in mha_attention_params */
    mha_attention_variant variant; /* window, softcap, ALiBi, sinks (positions per sequence); all zero = none */
} mha_varlen_params;

/* q [total_q, num_heads, head_dim], k [total_kv, num_kv_heads, head_dim], v [total_kv, num_kv_heads, value_dim],
   out [total_q, num_heads, value_dim]; total_q = q_offsets[num_seqs]. A sequence with no queries is skipped;
   one with queries and no keys gets zeros. No padding is computed: work items are (sequence, KV head,
   query block), costliest first. Subnormals count as zero inside the attention, as in mha_attention
   (so too in mha_attention_cached and in the layers' attention). out may be q itself (in place) on
   mha_attention's terms (value_dim == head_dim, equal row strides); so too in mha_attention_cached. */
mha_status mha_attention_varlen(mha_runtime *rt, const mha_varlen_params *p,
                                const float *q, const float *k, const float *v, float *out);

/* A paged KV cache: fixed-size blocks of block_tokens tokens, all allocated (and zeroed) when the
 * cache is created, handed to sequences through per-sequence block tables and reference-counted, so
 * a fork shares its source's blocks and copies one only when a write would change a shared block.
 * A block holds, per KV head, its tokens' K already in the GEMM microkernel's packed-panel layout
 * (keys across the vector lanes) and their V rows, so attention reads each cached byte once and
 * packs no K. The cache is tied to the runtime's ISA and tile config it was created with: attention
 * through a runtime with another microkernel or attention tiles is refused.
 *
 * Threads: any number of host threads may call these functions on one cache at once, as long as a
 * sequence is not written (append, release, or the layer's forward_cached) while another call
 * reads or writes that same sequence (attention over it, fork from it, seq_len, read). Calls on
 * different sequences never conflict; forking from a sequence while it is attended is fine. */
typedef struct mha_kv_cache mha_kv_cache;
typedef struct mha_kv_cache_config {
    int64_t num_kv_heads, head_dim, value_dim;
    int64_t block_tokens;        /* tokens per block; 0 = the runtime's choice (the smallest multiple of NR of at
                                    least 64 that divides attn_block_k). It must either divide the runtime's
                                    attn_block_k and be a multiple of the microkernel's NR (or equal attn_block_k),
                                    or be a multiple of attn_block_k when attn_block_k is a multiple of NR */
    int64_t max_tokens;          /* capacity over all sequences, rounded up to whole blocks; every block is allocated at creation */
    mha_dtype dtype;
    int64_t window;              /* 0 = keep every token; W > 0: when n tokens are appended to a sequence of len
                                    tokens, its blocks that hold only positions <= len - W (outside the window of
                                    every query at a position >= len, the appended tokens' and later ones) go
                                    back to the free blocks (shared blocks when their last owner lets go), and
                                    their positions read as zeros. Attention over the cache must then use a
                                    window of at most W, on queries whose windows keep clear of the released
                                    positions (else MHA_INVALID_ARGUMENT); mha_kv_cache_read of a released
                                    position too. Bitwise, nothing changes: those keys were outside every window */
} mha_kv_cache_config;
mha_status mha_kv_cache_create(mha_runtime *rt, const mha_kv_cache_config *config, mha_kv_cache **out);
void       mha_kv_cache_destroy(mha_kv_cache *cache);                                   /* NULL is fine */
/* Appends n_tokens rows of k [n_tokens, num_kv_heads, head_dim] and v [n_tokens, num_kv_heads, value_dim]
   to sequence seq_id (any int64 >= 0; a new id starts an empty sequence, also with n_tokens = 0). Not
   enough free blocks: MHA_OUT_OF_MEMORY, and nothing is appended. */
mha_status mha_kv_cache_append(mha_runtime *rt, mha_kv_cache *cache, int64_t seq_id, int64_t n_tokens,
                               const float *k, const float *v);
mha_status mha_kv_cache_fork(mha_kv_cache *cache, int64_t src_seq, int64_t dst_seq);  /* shares src's blocks, copy-on-write; dst must be new */
mha_status mha_kv_cache_release(mha_kv_cache *cache, int64_t seq_id);                 /* frees its blocks (shared ones when the last owner goes) */
mha_status mha_kv_cache_seq_len(const mha_kv_cache *cache, int64_t seq_id, int64_t *len); /* unknown id: MHA_INVALID_ARGUMENT */
/* Tokens that can still be appended: free blocks times block_tokens (the unused tail of a sequence's
   last block belongs to that sequence and is not counted). */
mha_status mha_kv_cache_free_tokens(const mha_kv_cache *cache, int64_t *tokens);
/* Bytes of K/V storage the cache holds: whole blocks for max_tokens tokens. */
mha_status mha_kv_cache_bytes(const mha_kv_cache *cache, uint64_t *bytes);
/* The resolved configuration (block_tokens filled in). */
mha_status mha_kv_cache_get_config(const mha_kv_cache *cache, mha_kv_cache_config *config);
/* Copies cached positions [start, start + n_tokens) of seq_id back out as k [n_tokens, num_kv_heads, head_dim]
   and v [n_tokens, num_kv_heads, value_dim] (either may be NULL to skip it). */
mha_status mha_kv_cache_read(const mha_kv_cache *cache, int64_t seq_id, int64_t start, int64_t n_tokens,
                             float *k, float *v);

typedef struct mha_cached_params {
    int64_t num_seqs;
    const int64_t *seq_ids;      /* [num_seqs], distinct */
    const int64_t *q_offsets;    /* [num_seqs + 1]: sequence s's n_s = q_offsets[s+1] - q_offsets[s] query rows are its last n_s cached tokens */
    int64_t num_heads;           /* a multiple of the cache's num_kv_heads */
    float scale;                 /* 0 = 1/sqrt(head_dim) */
    int causal;                  /* query i of n_s sees cached positions <= len_s - n_s + i; 0: every cached position */
    mha_attention_variant variant; /* window, softcap, ALiBi, sinks (a token's position: its index in its sequence) */
} mha_cached_params;
/* q [total_q, num_heads, head_dim] -> out [total_q, num_heads, value_dim]. One call serves a whole
   continuous batch: some sequences prefilling a chunk, others decoding one token. */
mha_status mha_attention_cached(mha_runtime *rt, const mha_kv_cache *cache, const mha_cached_params *p,
                                const float *q, float *out);

typedef struct mha_layer_cached_params {
    int64_t num_seqs;
    const int64_t *seq_ids;      /* [num_seqs], distinct; an id the cache does not hold starts a new sequence */
    const int64_t *q_offsets;    /* [num_seqs + 1] rows of x and out per sequence: its new tokens */
    int causal;
} mha_layer_cached_params;
/* x [total_q, E] -> out [total_q, E]: projects the new tokens, appends their K and V to each sequence,
   attends over the cache, projects out. The cache's heads and dims must match the layer's, and the layer
   must be a self-attention layer (kdim = vdim = E). Not enough free blocks for every sequence's new
   tokens: MHA_OUT_OF_MEMORY, and nothing is appended or written. */
mha_status mha_layer_forward_cached(mha_runtime *rt, const mha_layer *layer, mha_kv_cache *cache,
                                    const mha_layer_cached_params *p, const float *x, float *out);

/* ---- The encoder layer --------------------------------------------------------------------------
 * nn.TransformerEncoderLayer(d_model = E, nhead, dim_feedforward = ffn_dim, activation,
 * layer_norm_eps, batch_first=True, norm_first) in eval mode:
 *   MHA_NORM_POST: y = LayerNorm1(x + SelfAttention(x));   out = LayerNorm2(y + FFN(y))
 *   MHA_NORM_PRE:  y = x + SelfAttention(LayerNorm1(x));   out = y + FFN(LayerNorm2(y))
 *   FFN(y) = linear2(activation(linear1(y))).
 * The weights are PyTorch's state_dict tensors: self_attn.in_proj_weight/bias (through
 * mha_layer_weights_from_in_proj), self_attn.out_proj.*, linear1.*, linear2.*, norm1.*, norm2.*. */
typedef enum mha_activation { MHA_ACT_RELU = 0, MHA_ACT_GELU = 1 } mha_activation;  /* GELU: the erf form */

typedef struct mha_encoder_layer mha_encoder_layer;
typedef struct mha_encoder_config {
    mha_layer_config attention;      /* self-attention (kdim = vdim = E); its norm field picks post (norm_first=False)
                                        or pre (True) for both sub-blocks and must not be MHA_NORM_NONE */
    int64_t ffn_dim;
    int activation;                  /* MHA_ACT_RELU = 0, MHA_ACT_GELU = 1 (erf form, as PyTorch's "gelu") */
} mha_encoder_config;
typedef struct mha_encoder_weights {
    mha_layer_weights attention;     /* norm_weight/norm_bias = PyTorch's norm1 */
    const float *linear1_weight, *linear1_bias;   /* [ffn_dim, E], [ffn_dim]; a NULL bias = none */
    const float *linear2_weight, *linear2_bias;   /* [E, ffn_dim], [E] */
    const float *norm2_weight, *norm2_bias;       /* [E]; NULL = 1 and 0 */
} mha_encoder_weights;
mha_status mha_encoder_layer_create(mha_runtime *rt, const mha_encoder_config *config,
                                    const mha_encoder_weights *weights, mha_encoder_layer **out);
void       mha_encoder_layer_destroy(mha_encoder_layer *layer);  /* NULL is fine */
/* x [batch, len, E] -> out [batch, len, E]; p carries batch, q_len (= kv_len, or 0), causal, kv_valid_lens,
   mask as for the layer (p->weights must be NULL). x == out is allowed. The same bitwise guarantees as
   the layer: any thread count, a sequence alone or inside a batch. */
mha_status mha_encoder_layer_forward(mha_runtime *rt, const mha_encoder_layer *layer,
                                     const mha_layer_forward_params *p, const float *x, float *out);

/* Ragged batches, no padding: sequence s owns rows offsets[s] .. offsets[s+1]-1 (offsets [num_seqs + 1],
   non-decreasing, offsets[0] = 0) of x [total, E] and out [total, E] (x == out is allowed). Self-attention
   layers only; a row gets the bits the dense forward gives it in its sequence alone. A failed create leaves
   *out NULL, here as everywhere. */
mha_status mha_layer_forward_varlen(mha_runtime *rt, const mha_layer *layer, int64_t num_seqs, const int64_t *offsets,
                                    int causal, const float *x, float *out);
mha_status mha_encoder_layer_forward_varlen(mha_runtime *rt, const mha_encoder_layer *layer, int64_t num_seqs,
                                            const int64_t *offsets, int causal, const float *x, float *out);

#ifdef __cplusplus
}
#endif

#endif /* MHA_MHA_H */
