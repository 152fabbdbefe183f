// Verified reads (io_reader.h, execute_reads with blocks): checks the blocks against the ops
// before anything is written, then reads and hashes one block per task.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "metamat/io_file.h"
#include "io_piece.h"
#include "metamat/io_reader.h"

namespace metamat {
namespace io {

struct VerifyPlan {
  std::vector<int64_t> order;                // block indices in (file, offset) order: the tasks
  std::vector<std::vector<int64_t>> ops_of;  // per block: the ops whose span overlaps it
};

// Validates the blocks (file, range within the file, no overlap), that they cover every op's
// span and cut no converting op's element, and builds the plan. "" or the error; `*failed_op`
// names the op concerned (-1: a block).
std::string plan_verify(FileTable& files, const ReadOp* ops, int64_t n, const VerifyBlock* blocks,
                        int64_t nblocks, VerifyPlan* plan, int64_t* failed_op);

struct BlockOutcome {
  int64_t hashed = 0;
  int64_t reread = 0;
  bool mismatch = false;
  uint64_t got = 0;
};

// Reads block `b` (every byte, in file order), delivering to the ops of `bops` and hashing as
// it goes. "" (see `out->mismatch`) or an I/O error.
std::string read_verified_block(OpReader& rd, ReadShared& shared, const ReadOp* ops,
                                const VerifyBlock& b, const std::vector<int64_t>& bops,
                                BlockOutcome* out);

// "checksum mismatch: file <path>, block at offset <o> (<n> bytes): expected xxh3_64 0x..., got 0x...".
std::string mismatch_message(const std::string& path, const VerifyBlock& b, uint64_t got);

}  // namespace io
}  // namespace metamat
