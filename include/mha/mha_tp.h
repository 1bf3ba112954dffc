/* mha_tp: the multi-head attention layer with its heads sharded across the ranks of an MPI
 * communicator (tensor parallelism, as in Megatron-LM: each rank projects and attends for its own
 * heads, and the ranks' partial output projections are summed). The C ABI of libmha_tp, built with
 * -Dmpi (OpenMPI); link with -lmha_tp -lmha and MPI (pkg-config mha_tp). mha.h stays free of MPI:
 * programs that do not shard include only that and never link MPI.
 *
 * The split: the KV heads are dealt out in equal contiguous runs, rank r of N holding KV heads
 * [r * Hkv/N, (r+1) * Hkv/N) and the query heads of their groups, so a GQA group is never split.
 * A rank count that does not divide num_kv_heads is refused, on every rank, with a message.
 *
 * The sum: each rank computes its heads' share of the output projection without the bias,
 * P_r = O_r Wo_r^T [tokens, E]. Row block c of the tokens (tokens * c / N .. tokens * (c+1) / N - 1)
 * is summed on rank c as (((P_0 + P_1) + P_2) + ... + P_{N-1}) + bo, in rank order (an MPI_Alltoallv,
 * then a plain loop: never MPI_Allreduce, whose sum order depends on MPI's algorithm), Add & Norm is
 * applied to those rows, and an MPI_Allgatherv gives every rank the whole output. Each element is
 * that one sum whichever rank computes it, and P_r has the same bits on any thread count, so the
 * output is bitwise identical for any threads per rank and equal to what one process gets from the
 * N shard layers (mha_layer with rank r's heads, no output bias, no norm) summed the same way.
 * Against the unsharded mha_layer the output projection's sum is grouped differently; with
 * MHA_NORM_NONE every element is within 2 * gamma(K + 1) * (sum_k |O_k| |Wo_jk| + |bo_j|) of it,
 * gamma(n) = n u / (1 - n u), u = 2^-24, K = num_heads * value_dim (the README states and the tests
 * check this bound; everything before the output projection has the same bits as unsharded).
 *
 * Collective calls: every function taking a communicator or an mha_tp_layer, except the getters,
 * is collective: every rank of the communicator calls it, in the same order, with the same
 * arguments apart from the pointers (the same config, shapes and flags; the same input values,
 * which are not checked: each rank projects its heads from its own copy of the input). One call at
 * a time per layer, from any one thread per rank (MPI_THREAD_SERIALIZED or more if threads take
 * turns; MPI_THREAD_SINGLE/FUNNELED when it is always the main thread): the runtime's worker
 * threads never call MPI.
 *
 * Errors: a rank whose arguments fail its checks (or that runs out of memory computing its part)
 * does not leave the others waiting: the ranks agree on the status before exchanging any data (one
 * MPI_Allreduce), and then every rank returns the failing rank's status, mha_last_error() giving
 * "rank R of N: <its message>" (the lowest failing rank's, or this rank's own if it failed too);
 * nothing is written and no KV cache is changed. Ranks whose calls disagree (shapes, flags,
 * sequences) are refused alike. Only a NULL layer cannot take part (it holds the communicator):
 * that call returns MHA_INVALID_ARGUMENT on its own rank alone, and the other ranks wait. The layer
 * works on its own duplicate of the communicator (MPI_Comm_dup), with MPI_ERRORS_RETURN on it: an
 * MPI failure becomes MHA_INTERNAL naming the MPI call. */
#ifndef MHA_MHA_TP_H
#define MHA_MHA_TP_H

#include <mpi.h>
#include <stdint.h>

#include "mha/mha.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The heads rank `rank` of `size` holds. */
typedef struct mha_tp_shard {
    int rank, size;
    int64_t head_begin, num_heads;        /* query heads [head_begin, head_begin + num_heads) */
    int64_t kv_head_begin, num_kv_heads;  /* KV heads [kv_head_begin, kv_head_begin + num_kv_heads) */
} mha_tp_shard;

/* Not collective, no MPI: where rank's heads lie, for slicing a checkpoint into per-rank shards.
 * size must divide the config's num_kv_heads (MHA_INVALID_ARGUMENT otherwise, naming both). */
mha_status mha_tp_shard_for(const mha_layer_config *config, int rank, int size, mha_tp_shard *out);

typedef struct mha_tp_layer mha_tp_layer;

/* Collective. Every rank passes the full layer's config and weights (as for mha_layer_create) and
 * keeps only its heads: its rows of q/k/v_weight and q/k/v_bias and its columns of out_weight,
 * packed once for rt's ISA and tiles; the out bias and norm weights are kept whole. *out is NULL on
 * every rank unless every rank succeeded. MPI must be initialized (MPI_Init); the layer must be
 * destroyed before MPI_Finalize. */
mha_status mha_tp_layer_create(mha_runtime *rt, MPI_Comm comm, const mha_layer_config *config,
                               const mha_layer_weights *weights, mha_tp_layer **out);

/* Collective. The same layer from per-rank shards: config is the full layer's; shard holds this
 * rank's part only (see mha_tp_shard_for), dense and row-major:
 *   q_weight [num_heads_r * head_dim, embed_dim]    q_bias [num_heads_r * head_dim] or NULL
 *   k_weight [num_kv_heads_r * head_dim, kdim]      k_bias [num_kv_heads_r * head_dim] or NULL
 *   v_weight [num_kv_heads_r * value_dim, vdim]     v_bias [num_kv_heads_r * value_dim] or NULL
 *   out_weight [embed_dim, num_heads_r * value_dim] (the columns of the rank's heads)
 *   out_bias, norm_weight, norm_bias [embed_dim] each, whole (NULL as in mha_layer_weights). */
mha_status mha_tp_layer_create_from_shard(mha_runtime *rt, MPI_Comm comm, const mha_layer_config *config,
                                          const mha_layer_weights *shard, mha_tp_layer **out);

/* Collective (it frees the layer's communicator; skipped after MPI_Finalize). NULL is fine. */
void mha_tp_layer_destroy(mha_tp_layer *layer);

/* Getters, not collective: this rank's heads; the full layer's resolved config. */
mha_status mha_tp_layer_get_shard(const mha_tp_layer *layer, mha_tp_shard *out);
mha_status mha_tp_layer_get_config(const mha_tp_layer *layer, mha_layer_config *out);

/* Collective; the parameters of mha_layer_forward, every rank passing the whole query (and key,
 * value) and receiving the whole out. p->weights (if not NULL) receives every head's probabilities
 * [batch, num_heads, q_len, kv_len] on every rank (an all-gather of B * H * Lq * Lk floats: leave it
 * NULL unless wanted). */
mha_status mha_tp_layer_forward(mha_runtime *rt, const mha_tp_layer *layer, const mha_layer_forward_params *p,
                                const float *query, const float *key, const float *value, float *out);

/* Collective; the parameters of mha_layer_forward_cached. cache is this rank's own KV cache, holding
 * its KV heads only: created with num_kv_heads = the shard's num_kv_heads (and the layer's head_dim,
 * value_dim). Every rank's cache must hold the same sequences at the same lengths (they are checked
 * to agree); if any rank fails (e.g. its cache is full) no rank's cache changes. */
mha_status mha_tp_layer_forward_cached(mha_runtime *rt, const mha_tp_layer *layer, mha_kv_cache *cache,
                                       const mha_layer_cached_params *p, const float *x, float *out);

/* Collective; the parameters of mha_layer_forward_varlen (self-attention, a ragged batch). */
mha_status mha_tp_layer_forward_varlen(mha_runtime *rt, const mha_tp_layer *layer, int64_t num_seqs,
                                       const int64_t *offsets, int causal, const float *x, float *out);

/* Where the time went, summed over this rank's forward calls (of any form) since the layer was
 * built or the last reset: wall time in the calls, and the part of it spent in MPI (the status
 * agreement, the exchange of the partial sums, the all-gather of the output; waiting for a slower
 * rank counts as communication). Not collective. */
typedef struct mha_tp_timing {
    int64_t calls;
    double seconds, comm_seconds;
    double wait_seconds;  /* the part of comm_seconds in the status agreement, the first MPI call after this rank's
                             heads are done: mostly waiting for the slowest rank (imbalance, not the network) */
} mha_tp_timing;
mha_status mha_tp_layer_timing(const mha_tp_layer *layer, mha_tp_timing *out);
mha_status mha_tp_layer_reset_timing(mha_tp_layer *layer);

#ifdef __cplusplus
}
#endif

#endif /* MHA_MHA_TP_H */
