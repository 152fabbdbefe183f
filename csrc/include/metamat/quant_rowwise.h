// Row-wise quantization of float rows into fbgemm's inference TBE layouts (torch-free).
//
// fbgemm's IntNBitTableBatchedEmbeddingBagsCodegen keeps each table row as
//   INT8/INT4/INT2: [scale fp16][bias fp16][packed data] (reverse_qparam: data first), padded
//                   with zeros to the TBE's row alignment;
//   FP16/FP32:      [data] padded likewise.
// The values are those of fbgemm's FloatOrHalfToFusedNBitRowwiseQuantizedSBHalf (the op
// TorchRec's quantize_embeddings / from_float and its quant sharding call), bit for bit,
// including its AVX2 kernel's order of min/max reduction (which decides the sign of a zero
// minimum):
//   min, max over the whole row; bias = fp16(min); min = float(bias);
//   scale = fp16(range == 0 ? 1 : (max - min) / (2^b - 1)), 1 where it is 0 or its inverse
//   is infinite; q = clamp(round_half_even((x - min) * (1 / scale)), 0, 2^b - 1), packed
//   little end first (element c of a byte at bit (c % (8 / b)) * b).
// The reference implementation is metamat/load/quantize.py (NumPy); tests compare the three.
#pragma once
#include <cstdint>

namespace metamat {
namespace quant {

// Destination kinds; the values are the bit widths (the Python side's codes).
enum class QKind : int64_t { kInt2 = 2, kInt4 = 4, kInt8 = 8, kFp16 = 16, kFp32 = 32 };

// One destination of a batch of rows: columns [col0, col0 + cols) of each source row land in
// row r of the destination at byte `dst + r * dst_stride`. A row's scale and bias always come
// from the whole source row (a column-wise shard of a quantized table shares its row's
// scale/bias, as TorchRec's CW quant sharding does). Six int64 so Python passes an (n, 6)
// int64 array.
struct QuantOut {
  int64_t col0;
  int64_t cols;
  int64_t dst;         // host address of row 0's first byte
  int64_t dst_stride;  // bytes between destination rows
  int64_t kind;        // QKind
  int64_t sb_last;     // 1: scale/bias after the data (fbgemm's reverse_qparam), 0: before
};
static_assert(sizeof(QuantOut) == 6 * sizeof(int64_t), "QuantOut must be 6 packed int64");

// Bytes of one destination row before padding: data plus 4 bytes of scale/bias for INT-N.
int64_t row_bytes(QKind kind, int64_t cols);

// Validates `outs` against the source (columns inside the row, whole bytes for INT4/INT2,
// known kinds, non-null destinations). Returns "" or the message.
const char* check_outputs(const QuantOut* outs, int64_t n, int64_t cols);

// Quantizes `rows` float32 rows of `cols` elements (row r at src + r * src_stride elements)
// into every destination of `outs`, on `threads` threads (rows split among them). `isa`:
// "" (AVX2 where the CPU has it, else scalar), "avx2" or "scalar"; both give the same bytes.
// Throws CoreError for bad arguments (nothing written).
void quantize_rows(const float* src, int64_t rows, int64_t cols, int64_t src_stride,
                   const QuantOut* outs, int64_t nouts, int threads, const char* isa);

// "avx2" or "scalar": what quantize_rows(isa="") runs on this CPU.
const char* default_isa();

}  // namespace quant
}  // namespace metamat
