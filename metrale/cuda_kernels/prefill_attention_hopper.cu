// Paged prefill attention on Hopper (sm_90a; other architectures build an empty kernel and launch
// prefill_attention.cu's): flash attention on wgmma. Warpgroup 0 gathers K/V tiles through the block table with
// cp.async into a ring of shared-memory stages; warpgroups 1 and 2 each take 64 query rows, compute S = Q K^T with
// Q and K from shared memory, the online softmax in registers, and O += P V with P from registers; the loading
// warpgroup hands most of its registers to them. Arguments and
// results as paged_prefill_attention (prefill_attention.cu; layouts: attention_tiles.cuh).
#include "attention_tiles.cuh"
#include "warpgroup.cuh"

namespace {

constexpr int HOPPER_THREADS = 384;   // warpgroup 0 loads, 1 and 2 compute
constexpr int HOPPER_ROWS = 128;      // query rows of a CTA, 64 a computing warpgroup
constexpr int HOPPER_KEYS = 128;      // keys of a K/V tile: one a loading thread
constexpr int HOPPER_STAGES = 3;

template <int HEAD_DIM>
struct HopperTiles {
    static constexpr int PARTS = HEAD_DIM / 64;                        // 64-column swizzled tiles of a row
    static constexpr int Q_PART = HOPPER_ROWS * SWIZZLE_ROW_BYTES;
    static constexpr int KV_PART = HOPPER_KEYS * SWIZZLE_ROW_BYTES;
    static constexpr int Q_BYTES = PARTS * Q_PART;
    static constexpr int KV_BYTES = PARTS * KV_PART;                   // one K or V tile
    static constexpr int STAGE_BYTES = 2 * KV_BYTES;                   // K, then V
    // the swizzle's 1024-byte alignment, Q, the stages, a full and an empty barrier a stage, then a gathered
    // tile's key tokens (int32)
    static constexpr int SHARED_BYTES = 1024 + Q_BYTES + HOPPER_STAGES * STAGE_BYTES + 16 * HOPPER_STAGES +
                                        HOPPER_KEYS * 4;
    static_assert(HEAD_DIM % 64 == 0, "head_dim must be a multiple of 64");
    static_assert(SHARED_BYTES <= 227 * 1024, "more shared memory than an SM has");
};

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// acc += P V over a 128-key tile: probs the A fragments of its 16-key steps, V's tile at v_start (MN-major).
// Issued, not waited for; the caller fences first.
template <int HEAD_DIM>
__device__ __forceinline__ void add_values(float (&acc)[HEAD_DIM / 2], const unsigned (&probs)[HOPPER_KEYS / 16][4],
                                           unsigned v_start) {
#pragma unroll
    for (int k = 0; k < HOPPER_KEYS / 16; ++k)
        Wgmma<HEAD_DIM>::registers_a(acc, probs[k], matrix_descriptor(v_start + 16 * k * SWIZZLE_ROW_BYTES,
                                                                      HopperTiles<HEAD_DIM>::KV_PART, 1024));
}
#endif

template <int HEAD_DIM>
__device__ __forceinline__ void paged_prefill_attention_hopper(bf16* out, long long out_stride, const bf16* q,
                                                               long long q_stride, const bf16* kv_cache,
                                                               long long plane_elems, const int* query_starts,
                                                               const int* query_lens, const int* context_lens,
                                                               const int* block_tables, int max_blocks,
                                                               int num_kv_heads, int group_size, int block_shift,
                                                               float scale_log2, int sliding_window, int causal,
                                                               const void* kv_map) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    using T = HopperTiles<HEAD_DIM>;
    extern __shared__ unsigned char dynamic_shared[];
    unsigned char* q_tile = dynamic_shared + ((1024 - (shared_address(dynamic_shared) & 1023)) & 1023);
    unsigned char* stages = q_tile + T::Q_BYTES;   // stage s: K tile at s * STAGE_BYTES, its V tile KV_BYTES on
    const unsigned barriers = shared_address(stages + HOPPER_STAGES * T::STAGE_BYTES);
    auto full = [&](int stage) { return barriers + 8 * stage; };                      // K and V landed
    auto empty = [&](int stage) { return barriers + 8 * (HOPPER_STAGES + stage); };   // both consumers done

    const int query_tile = gridDim.x - 1 - blockIdx.x, head = blockIdx.y, segment = blockIdx.z;
    const int query_len = query_lens[segment];
    const int row0 = query_tile * HOPPER_ROWS;
    if (row0 >= query_len) return;
    const int rows = min(HOPPER_ROWS, query_len - row0);
    const int context = context_lens[segment];
    const int first_position = causal ? context - query_len + row0 : context - 1;
    const int last_position = causal ? first_position + rows - 1 : context - 1;
    const int lo = sliding_window > 0 ? max(0, first_position - sliding_window + 1) : 0;
    const int hi = last_position + 1;
    const int first_tile = lo / HOPPER_KEYS, tiles = (hi + HOPPER_KEYS - 1) / HOPPER_KEYS - first_tile;

    if (threadIdx.x == 0) {
        for (int s = 0; s < HOPPER_STAGES; ++s) {
            barrier_init(full(s), 128);
            barrier_init(empty(s), 256);
        }
    }
    __syncthreads();
    const int warpgroup = threadIdx.x >> 7, thread = threadIdx.x & 127;

    if (warpgroup == 0) {
        registers_decrease<40>();
        // A tile whose keys are all inside lo .. hi - 1 comes through the KV map (kv_map, when given): lane l of warp
        // 0 copies one page's rows of one 64-column part of K or V with the tensor memory accelerator, and lane 0
        // tells the full barrier how many bytes to expect. A tile with keys outside (the last one's past the
        // context, where a page's stale slots could hold NaN, and the first one's below a sliding window) is
        // gathered with cp.async: thread i looks up key i's cache row (-1 outside lo .. hi - 1) into a table, then
        // consecutive threads copy consecutive 16-byte chunks of the rows (zeros for -1), and the copies arrive on
        // the full barrier as they land. Each thread looks up the next tile's page or key while this one's copies
        // are issued and a stage is waited for; stage j is refilled once the consumers are done with tile j - 3.
        constexpr int CHUNKS = HEAD_DIM / 8, ROWS_A_PASS = HOPPER_KEYS / CHUNKS;
        const int kv_head = head / group_size, page = 1 << block_shift, pages = HOPPER_KEYS >> block_shift;
        const bf16* k_plane = kv_cache + (long long)kv_head * HEAD_DIM;
        const int* block_table = block_tables + (long long)segment * max_blocks;
        const long long token_stride = (long long)num_kv_heads * HEAD_DIM;
        int* tokens = reinterpret_cast<int*>(stages + HOPPER_STAGES * T::STAGE_BYTES + 16 * HOPPER_STAGES);
        const int chunk = thread % CHUNKS;
        auto mapped = [&](int i) {
            const int key = (first_tile + i) * HOPPER_KEYS;
            return kv_map != nullptr && key >= lo && key + HOPPER_KEYS <= hi;
        };
        auto lookup = [&](int i) {   // a mapped tile: the first cache row of page (thread % pages); else key thread's
            const int key = (first_tile + i) * HOPPER_KEYS + (mapped(i) ? (thread % pages) * page : thread);
            return key >= lo && key < hi ? (block_table[key >> block_shift] << block_shift) + (key & (page - 1)) : -1;
        };
        int token = lookup(0);
        for (int i = 0; i < tiles; ++i) {
            const int stage = i % HOPPER_STAGES;
            const int next = i + 1 < tiles ? lookup(i + 1) : -1;
            if (i >= HOPPER_STAGES) barrier_wait(empty(stage), (i / HOPPER_STAGES - 1) & 1);
            unsigned char* k_tile = stages + stage * T::STAGE_BYTES;
            if (mapped(i)) {
                if (thread == 0)
                    barrier_arrive_expect(full(stage), T::STAGE_BYTES);
                else
                    barrier_arrive(full(stage));
                __syncwarp();
                if (thread < 2 * T::PARTS * pages) {
                    const int plane = thread / (T::PARTS * pages), part = thread / pages % T::PARTS;
                    tensor_copy_4d(shared_address(k_tile + plane * T::KV_BYTES + part * T::KV_PART) +
                                       (thread % pages) * page * SWIZZLE_ROW_BYTES,
                                   kv_map, 64 * part, kv_head, token, plane, full(stage));
                }
            } else {
                named_barrier(5, 128);   // the table's last readers are done
                tokens[thread] = token;
                named_barrier(5, 128);
#pragma unroll
                for (int pass = 0; pass < CHUNKS; ++pass) {
                    const int row = thread / CHUNKS + ROWS_A_PASS * pass, row_token = tokens[row];
                    const bf16* source = k_plane + (long long)max(row_token, 0) * token_stride + 8 * chunk;
                    const unsigned offset = (chunk >> 3) * T::KV_PART + swizzled_offset(row, chunk & 7);
                    copy_async_16(k_tile + offset, source, row_token >= 0);
                    copy_async_16(k_tile + T::KV_BYTES + offset, source + plane_elems, row_token >= 0);
                }
                barrier_arrive_on_copies(full(stage));
            }
            token = next;
        }
        copy_async_wait<0>();   // the last copies land before the thread exits
        return;
    }

    registers_increase<232>();
    const int group = warpgroup - 1;   // rows 64 * group .. 64 * group + 63 of the CTA
    const int warp = thread >> 5, lane = thread & 31, g = lane >> 2, t = lane & 3;
    const long long first_row = (long long)query_starts[segment] + row0;
    for (int i = thread; i < 64 * (HEAD_DIM / 8); i += 128) {
        const int row = 64 * group + i / (HEAD_DIM / 8), c = i % (HEAD_DIM / 8);
        uint4 value = make_uint4(0, 0, 0, 0);
        if (row < rows)
            value = *reinterpret_cast<const uint4*>(q + (first_row + row) * q_stride + (long long)head * HEAD_DIM +
                                                    8 * c);
        *reinterpret_cast<uint4*>(q_tile + (c >> 3) * T::Q_PART + swizzled_offset(row, c & 7)) = value;
    }
    fence_async_shared();
    named_barrier(1 + group, 128);

    // positions of this thread's two rows (padding rows past the segment take the last row's), and those of the
    // warpgroup's first and last rows
    int position[2];
#pragma unroll
    for (int h = 0; h < 2; ++h)
        position[h] = causal ? min(first_position + 64 * group + 16 * warp + g + 8 * h, last_position) : last_position;
    const int group_first = causal ? min(first_position + 64 * group, last_position) : last_position;
    const int group_last = causal ? min(first_position + 64 * group + 63, last_position) : last_position;
    const unsigned q_start = shared_address(q_tile) + 64 * group * SWIZZLE_ROW_BYTES;
    auto k_start = [&](int stage) { return shared_address(stages + stage * T::STAGE_BYTES); };

    float acc[HEAD_DIM / 2];
#pragma unroll
    for (int i = 0; i < HEAD_DIM / 2; ++i) acc[i] = 0.f;
    float row_max[2] = {negative_infinity(), negative_infinity()}, row_sum[2] = {0.f, 0.f};
    unsigned probs[HOPPER_KEYS / 16][4];   // P of the previous tile, as the A fragments of its 16-key steps

    // S = Q K^T of a stage's tile, issued
    auto add_scores = [&](float (&scores)[HOPPER_KEYS / 2], int stage) {
#pragma unroll
        for (int k = 0; k < HEAD_DIM / 16; ++k) {
            const unsigned column = (k & 3) * 32;   // bytes into the 128-byte rows
            Wgmma<HOPPER_KEYS>::shared_a(scores, matrix_descriptor(q_start + (k >> 2) * T::Q_PART + column, 16, 1024),
                                         matrix_descriptor(k_start(stage) + (k >> 2) * T::KV_PART + column, 16,
                                                           1024), k > 0);
        }
    };
    // The online softmax of the tile from `tile`: scores become probabilities (base 2, scaled) against the rows'
    // new maxima, rescale[h] what the rows' earlier sums and outputs are to be multiplied by.
    auto softmax = [&](float (&scores)[HOPPER_KEYS / 2], int tile, float (&rescale)[2]) {
        // a tile every key of which every row of the warpgroup may see needs no mask
        const bool inside = tile + HOPPER_KEYS - 1 <= group_first &&
                            (sliding_window <= 0 || tile > group_last - sliding_window);
        if (!inside) {
#pragma unroll
            for (int j = 0; j < HOPPER_KEYS / 8; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int key = tile + 8 * j + 2 * t + (e & 1), p = position[e >> 1];
                    if (key > p || (sliding_window > 0 && key <= p - sliding_window))
                        scores[4 * j + e] = negative_infinity();
                }
        }
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            float m = negative_infinity();
#pragma unroll
            for (int j = 0; j < HOPPER_KEYS / 8; ++j)
                m = fmaxf(m, fmaxf(scores[4 * j + 2 * h], scores[4 * j + 2 * h + 1]));
            m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
            m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
            const float new_max = fmaxf(row_max[h], m * scale_log2);
            const float base = new_max == negative_infinity() ? 0.f : new_max;
            rescale[h] = fast_exp2(row_max[h] - base);
            row_max[h] = new_max;
            float sum = 0.f;
#pragma unroll
            for (int j = 0; j < HOPPER_KEYS / 8; ++j)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const float p = fast_exp2(fmaf(scores[4 * j + 2 * h + e], scale_log2, -base));
                    scores[4 * j + 2 * h + e] = p;
                    sum += p;
                }
            row_sum[h] = row_sum[h] * rescale[h] + sum;
        }
    };
    // two 8-key accumulator blocks make a 16-key A fragment (attention_tiles.cuh)
    auto keep_probs = [&](const float (&scores)[HOPPER_KEYS / 2]) {
#pragma unroll
        for (int k = 0; k < HOPPER_KEYS / 16; ++k)
#pragma unroll
            for (int r = 0; r < 4; ++r)
                probs[k][r] = float2_to_bf16x2(scores[8 * k + 2 * r], scores[8 * k + 2 * r + 1]);
    };

    // Each step issues S = Q K^T of tile i and O += P V of tile i - 1 together, then the softmax of tile i runs
    // while the latter is in flight. The warpgroups take turns issuing (named barriers TURN + group), so one's
    // softmax runs beside the other's GEMMs (FlashAttention-3's ping-pong); group 0 starts, and group 1 hands
    // over every turn but its last.
    constexpr int TURN = 3;
    if (group == 1) named_barrier_arrive(TURN, 256);
    {
        barrier_wait(full(0), 0);
        fence_async_shared();   // the loader's copies landed in the generic proxy; wgmma reads in the async one
        named_barrier(TURN + group, 256);
        float scores[HOPPER_KEYS / 2], rescale[2];
        warpgroup_fence();
        add_scores(scores, 0);
        warpgroup_commit();
        if (group == 0 || tiles > 1) named_barrier_arrive(TURN + 1 - group, 256);
        warpgroup_wait<0>();
        pin_registers(scores);
        softmax(scores, first_tile * HOPPER_KEYS, rescale);   // nothing to rescale yet
        keep_probs(scores);
    }
    for (int i = 1; i < tiles; ++i) {
        const int stage = i % HOPPER_STAGES, previous = (i - 1) % HOPPER_STAGES;
        barrier_wait(full(stage), (i / HOPPER_STAGES) & 1);
        fence_async_shared();
        named_barrier(TURN + group, 256);
        float scores[HOPPER_KEYS / 2], rescale[2];
        pin_registers(acc);
        warpgroup_fence();
        add_scores(scores, stage);
        warpgroup_commit();
        add_values<HEAD_DIM>(acc, probs, k_start(previous) + T::KV_BYTES);
        warpgroup_commit();
        if (group == 0 || i < tiles - 1) named_barrier_arrive(TURN + 1 - group, 256);
        warpgroup_wait<1>();
        pin_registers(scores);
        softmax(scores, (first_tile + i) * HOPPER_KEYS, rescale);
        warpgroup_wait<0>();
        pin_registers(acc);
        barrier_arrive(empty(previous));
        // O so far (tiles 0 .. i - 1) to this tile's row maxima
#pragma unroll
        for (int j = 0; j < HEAD_DIM / 8; ++j) {
            acc[4 * j] *= rescale[0];
            acc[4 * j + 1] *= rescale[0];
            acc[4 * j + 2] *= rescale[1];
            acc[4 * j + 3] *= rescale[1];
        }
        keep_probs(scores);
    }
    const int last = (tiles - 1) % HOPPER_STAGES;
    pin_registers(acc);
    warpgroup_fence();
    add_values<HEAD_DIM>(acc, probs, k_start(last) + T::KV_BYTES);
    warpgroup_commit();
    warpgroup_wait<0>();
    pin_registers(acc);
    barrier_arrive(empty(last));

#pragma unroll
    for (int h = 0; h < 2; ++h) {
        float sum = row_sum[h];
        sum += __shfl_xor_sync(0xffffffffu, sum, 1);
        sum += __shfl_xor_sync(0xffffffffu, sum, 2);
        const int row = 64 * group + 16 * warp + g + 8 * h;
        if (row >= rows) continue;
        const float inverse = 1.f / sum;   // >= 1 key: the row's own position
        unsigned* destination = reinterpret_cast<unsigned*>(out + (first_row + row) * out_stride +
                                                            (long long)head * HEAD_DIM + 2 * t);
#pragma unroll
        for (int j = 0; j < HEAD_DIM / 8; ++j)
            destination[4 * j] = float2_to_bf16x2(acc[4 * j + 2 * h] * inverse, acc[4 * j + 2 * h + 1] * inverse);
    }
#endif
}

}  // namespace

#define HOPPER_PREFILL_KERNEL(HEAD_DIM)                                                                             \
    extern "C" __global__ void __launch_bounds__(HOPPER_THREADS, 1) paged_prefill_attention_hopper_hd##HEAD_DIM(      \
        bf16* out, long long out_stride, const bf16* q, long long q_stride, const bf16* kv_cache,                   \
        long long plane_elems, const int* query_starts, const int* query_lens, const int* context_lens,            \
        const int* block_tables, int max_blocks, int num_kv_heads, int group_size, int block_shift,               \
        float scale_log2, int sliding_window, int causal, const void* kv_map) {                                    \
        wait_for_previous_kernel();                                                                                  \
        paged_prefill_attention_hopper<HEAD_DIM>(out, out_stride, q, q_stride, kv_cache, plane_elems, query_starts, \
                                                 query_lens, context_lens, block_tables, max_blocks, num_kv_heads,  \
                                                 group_size, block_shift, scale_log2, sliding_window, causal,       \
                                                 kv_map);                                                           \
    }

HOPPER_PREFILL_KERNEL(64)
HOPPER_PREFILL_KERNEL(128)
