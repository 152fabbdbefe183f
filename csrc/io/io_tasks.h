// What one read call is cut into (io_reader.cpp runs it): every op validated before a byte is
// written, then cut into tasks of about one thread's share, grouped by file.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "metamat/io_file.h"
#include "metamat/io_reader.h"

namespace metamat {
namespace io {

// Rows [row0, row0 + rows) of op `op`, or bytes [byte0, byte0 + bytes) of a one-row op.
struct Task {
  int64_t op;
  int64_t row0, rows;    // row range (strided ops)
  int64_t byte0, bytes;  // byte range within the row (rows == 1 ops split by bytes)
};

// "file <path>, read op <i>: <msg>" (parts known).
std::string op_error(const FileTable& files, const ReadOp* ops, int64_t i,
                     const std::string& msg);

// Everything about op `o` that can be checked without writing: file (opened and validated on
// first use), sizes, dtypes, byte range. "" or the message.
std::string validate_op(FileTable& files, const ReadOp& o);

// Ops cut into tasks of about one thread's share (opt.task_bytes at most), grouped by file (in
// file-offset order within one) so that the descriptor cache opens each file about once
// however many files there are.
std::vector<Task> make_tasks(const ReadOp* ops, int64_t n, const ReadOptions& opt);

}  // namespace io
}  // namespace metamat
