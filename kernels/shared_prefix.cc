#include "kernels/shared_prefix.h"

#include <algorithm>
#include <cstring>
#include <new>
#include <string>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "kernels/thread_pool.h"

namespace packd {
namespace {

// The groups in the order of their first rows: each one's first row and its
// members (the first included), ascending.
struct Group {
  int64_t id = 0;
  std::vector<int64_t> rows;
};

std::vector<Group> GroupsOf(const SharedPrefix& shared) {
  std::vector<Group> groups;
  absl::flat_hash_map<int64_t, size_t> index;
  for (size_t b = 0; b < shared.groups.size(); ++b) {
    auto [it, added] = index.try_emplace(shared.groups[b], groups.size());
    if (added) groups.push_back(Group{shared.groups[b], {}});
    groups[it->second].rows.push_back(static_cast<int64_t>(b));
  }
  return groups;
}

absl::Status Undefined(absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat(
      "shared_prefix with ", what,
      " is not defined: shared prompts are packed as they are (no padding, "
      "documents, context or sequence parallelism, or fixed shapes)"));
}

}  // namespace

absl::Status ValidateSharedPrefix(const LayoutOptions& options,
                                  int64_t batch_rows, size_t inputs,
                                  bool documents, bool for_pack) {
  if (!options.shared_prefix.has_value()) return absl::OkStatus();
  const SharedPrefix& shared = *options.shared_prefix;
  if (documents) return Undefined("segment_ids");
  if (options.pad_multiple > 1) {
    return Undefined(absl::StrCat("pad_multiple ", options.pad_multiple));
  }
  if (options.cp_size > 1) {
    return Undefined(absl::StrCat("cp_size ", options.cp_size));
  }
  if (options.sp_size > 1) {
    return Undefined(absl::StrCat("sp_size ", options.sp_size));
  }
  if (options.fixed.any()) return Undefined("fixed");
  if (for_pack && shared.targets) {
    return absl::InvalidArgumentError(
        "shared_prefix.targets is Scatter's: a Pack makes the stream, and its "
        "targets come as shifted tensors");
  }
  for (const auto& [field, values] :
       {std::pair<const char*, const std::vector<int64_t>*>{"groups",
                                                            &shared.groups},
        {"prefix_lengths", &shared.prefix_lengths}}) {
    if (static_cast<int64_t>(values->size()) != batch_rows) {
      return absl::InvalidArgumentError(
          absl::StrCat("shared_prefix.", field, " has ", values->size(),
                       " entries but the batch has ", batch_rows,
                       " rows: give one per row"));
    }
  }
  absl::flat_hash_map<int64_t, int64_t> first_of;
  for (int64_t b = 0; b < batch_rows; ++b) {
    const int64_t p = shared.prefix_lengths[b];
    if (p < 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "shared_prefix.prefix_lengths[", b, "] is ", p, ", below 0"));
    }
    auto [it, added] = first_of.try_emplace(shared.groups[b], b);
    const int64_t f = it->second;
    if (!added && shared.prefix_lengths[f] != p) {
      return absl::InvalidArgumentError(absl::StrCat(
          "shared_prefix.prefix_lengths[", b, "] is ", p, " but row ", f,
          " of the same group ", shared.groups[b], " has ",
          shared.prefix_lengths[f], ": a group's rows share one prompt"));
    }
  }
  for (size_t j = 0; j < shared.same_inputs.size(); ++j) {
    const int32_t i = shared.same_inputs[j];
    if (i < 0 || static_cast<size_t>(i) >= inputs) {
      return absl::InvalidArgumentError(
          absl::StrCat("shared_prefix.same_inputs[", j, "] is ", i,
                       ", which names no input (there are ", inputs, ")"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<Layout> MakeSharedLayout(const std::vector<int64_t>& cu,
                                        const LayoutOptions& options,
                                        bool with_position_ids) {
  const SharedPrefix& prefix = *options.shared_prefix;
  const int64_t B = static_cast<int64_t>(cu.size()) - 1;
  auto active = [&](int64_t b) { return cu[b + 1] - cu[b]; };
  const std::vector<Group> groups = GroupsOf(prefix);
  // Sizes first, checked, so that nothing is allocated for a request that
  // does not fit.
  int64_t rows = 0, keys = 0, segments = 0;
  for (const Group& g : groups) {
    const int64_t p = prefix.prefix_lengths[g.rows[0]];
    for (int64_t m : g.rows) {
      if (active(m) < p) {
        return absl::InvalidArgumentError(absl::StrCat(
            "shared_prefix.prefix_lengths[", m, "] is ", p, " but row ", m,
            " has ", active(m), " active tokens: a prompt is a row's first ",
            "active tokens"));
      }
    }
    rows += p;
    keys += p;
    segments += p > 0;
    for (int64_t m : g.rows) {
      const int64_t r = active(m) - p;
      rows += r;
      if (r > 0) {
        keys += p + r;
        ++segments;
      }
    }
  }
  if (options.max_rows > 0 && std::max(rows, keys) > options.max_rows) {
    return absl::ResourceExhaustedError(
        absl::StrCat("the shared stream has ", rows, " rows and ", keys,
                     " keys, more than the ", options.max_rows,
                     " this call may have (what its response can carry)"));
  }
  Layout out;
  SharedLayout& s = out.shared.emplace();
  int64_t targets = 0;
  for (int64_t b = 0; b < B; ++b) {
    targets += std::max<int64_t>(
        active(b) - std::max<int64_t>(prefix.prefix_lengths[b], 1), 0);
  }
  try {
    out.source_runs.reserve(segments);
    out.shifted_runs.reserve(B);
    if (with_position_ids) out.position_ids.resize(rows);
    if (options.with_seq_idx) out.seq_idx.resize(rows);
    s.kv_index.resize(keys);  // not zeroed: every entry is written below
    s.pred_index.resize(targets);
    s.cu_seqlens_q.reserve(segments + 1);
    s.cu_seqlens_k.reserve(segments + 1);
    s.segment_row.reserve(segments);
    s.target_cu_seqlens.reserve(B + 1);
  } catch (const std::bad_alloc&) {
    return absl::ResourceExhaustedError(
        absl::StrCat("the shared stream's ", rows,
                     " rows do not fit in this process's memory"));
  }
  // First the segments, runs and targets, one entry each; then the arrays of
  // one entry per row or key, filled in parallel from them.
  s.cu_seqlens_q.push_back(0);
  s.cu_seqlens_k.push_back(0);
  // Segment n's keys at kv_index[cu_seqlens_k[n]]: `shared` rows from
  // shared_begin (its prompt), then `own` rows from own_begin.
  struct Keys {
    int64_t shared_begin, shared, own_begin, own;
  };
  std::vector<Keys> keys_of;
  keys_of.reserve(segments);
  // Source run r's rows: from stream row run_start[r], positions from
  // run_position[r], all of group run_group[r].
  std::vector<int64_t> run_start, run_position, run_group;
  for (auto* v : {&run_start, &run_position, &run_group}) v->reserve(segments);
  // Where each row's response starts in the stream, and each group's prompt.
  std::vector<int64_t> response_start(B, 0), prompt_start(B, 0);
  auto segment = [&](int64_t row, int64_t q_rows, Keys k) {
    const int64_t n = k.shared + k.own;
    keys_of.push_back(k);
    s.cu_seqlens_q.push_back(s.cu_seqlens_q.back() + q_rows);
    s.cu_seqlens_k.push_back(s.cu_seqlens_k.back() + n);
    s.max_seqlen_q = std::max(s.max_seqlen_q, q_rows);
    s.max_seqlen_k = std::max(s.max_seqlen_k, n);
    s.segment_row.push_back(row);
  };
  int64_t stream_rows = 0;
  auto append = [&](int64_t first_token, int64_t first_position, int64_t n,
                    int64_t group) {
    if (n == 0) return;
    out.source_runs.push_back(TokenRun{first_token, n});
    run_start.push_back(stream_rows);
    run_position.push_back(first_position);
    run_group.push_back(group);
    stream_rows += n;
  };
  for (size_t gi = 0; gi < groups.size(); ++gi) {
    const Group& g = groups[gi];
    const int64_t f = g.rows[0];
    const int64_t p = prefix.prefix_lengths[f];
    const int64_t prompt = stream_rows;
    append(cu[f], 0, p, static_cast<int64_t>(gi));
    // A prompt's queries are its rows, its keys the same rows.
    if (p > 0) segment(f, p, Keys{prompt, p, 0, 0});
    for (int64_t m : g.rows) {
      const int64_t start = stream_rows;
      const int64_t r = active(m) - p;
      prompt_start[m] = prompt;
      response_start[m] = start;
      append(cu[m] + p, p, r, static_cast<int64_t>(gi));
      // A response's keys: its group's prompt, then its own rows.
      if (r > 0) segment(m, r, Keys{prompt, p, start, r});
    }
  }
  out.cu_seqlens = s.cu_seqlens_q;
  out.max_seqlen = s.max_seqlen_q;
  // One target per predicted token, row by row: active index j >= max(P, 1),
  // predicted by the stream row of token j - 1 (for j = P, the prompt's
  // last row, then the response's rows in order).
  s.target_cu_seqlens.push_back(0);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t first = std::max<int64_t>(prefix.prefix_lengths[b], 1);
    const int64_t n = std::max<int64_t>(active(b) - first, 0);
    if (n > 0) out.shifted_runs.push_back(TokenRun{cu[b] + first, n});
    s.target_cu_seqlens.push_back(s.target_cu_seqlens.back() + n);
  }
  auto fill = [](int64_t* out, int64_t first, int64_t n) {
    for (int64_t i = 0; i < n; ++i) out[i] = first + i;
  };
  const int64_t bytes =
      8 * (keys + targets + (with_position_ids + options.with_seq_idx) * rows);
  ThreadPool& pool = ThreadPool::Global();
  const int pieces =
      static_cast<int>(std::clamp<int64_t>(bytes >> 20, 1, pool.num_threads()));
  pool.ParallelFor(pieces, [&](int piece) {
    auto part = [&](size_t n) {
      return std::pair<size_t, size_t>{n * piece / pieces,
                                       n * (piece + 1) / pieces};
    };
    for (auto [n, end] = part(keys_of.size()); n < end; ++n) {
      const Keys& k = keys_of[n];
      int64_t* kv = s.kv_index.data() + s.cu_seqlens_k[n];
      fill(kv, k.shared_begin, k.shared);
      fill(kv + k.shared, k.own_begin, k.own);
    }
    for (auto [b, end] = part(B); b < end; ++b) {
      const int64_t p = prefix.prefix_lengths[b];
      const int64_t n = s.target_cu_seqlens[b + 1] - s.target_cu_seqlens[b];
      int64_t* pred = s.pred_index.data() + s.target_cu_seqlens[b];
      if (n == 0) continue;
      if (p > 0) {  // j = P: the prompt's last row; then the response's
        pred[0] = prompt_start[b] + p - 1;
        fill(pred + 1, response_start[b], n - 1);
      } else {  // j >= 1 of a row without a prompt: its own rows
        fill(pred, response_start[b], n);
      }
    }
    for (auto [r, end] = part(run_start.size()); r < end; ++r) {
      const int64_t n = out.source_runs[r].count;
      if (with_position_ids) {
        fill(out.position_ids.data() + run_start[r], run_position[r], n);
      }
      if (options.with_seq_idx) {
        std::fill_n(out.seq_idx.data() + run_start[r], n, run_group[r]);
      }
    }
  });
  return out;
}

namespace {

// OK, or INVALID_ARGUMENT for the first member of g whose prompt (p rows of
// row_bytes at prompt_of(k) for its k-th row) differs from its first row's.
template <typename PromptOf>
absl::Status CheckGroup(const Group& g, int64_t p, int input, int64_t row_bytes,
                        PromptOf prompt_of) {
  if (p == 0 || row_bytes == 0) return absl::OkStatus();  // nothing to differ
  const unsigned char* first = prompt_of(0);
  for (size_t k = 1; k < g.rows.size(); ++k) {
    const unsigned char* member = prompt_of(k);
    if (std::memcmp(first, member, p * row_bytes) == 0) continue;
    int64_t i = 0;
    while (std::memcmp(first + i * row_bytes, member + i * row_bytes,
                       row_bytes) == 0) {
      ++i;
    }
    return absl::InvalidArgumentError(absl::StrCat(
        "shared_prefix.same_inputs: inputs[", input, "] differs across group ",
        g.id, ": row ", g.rows[k], "'s prompt token ", i, " (of ", p,
        ") is not row ", g.rows[0], "'s, the group's first"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status CheckSamePrompts(const SharedPrefix& shared,
                              const std::vector<int64_t>& starts, int input,
                              const unsigned char* rows, int64_t row_bytes) {
  for (const Group& g : GroupsOf(shared)) {
    PACKD_RETURN_IF_ERROR(CheckGroup(
        g, shared.prefix_lengths[g.rows[0]], input, row_bytes,
        [&](size_t k) { return rows + starts[g.rows[k]] * row_bytes; }));
  }
  return absl::OkStatus();
}

absl::Status CheckSamePromptsBy(const SharedPrefix& shared,
                                const std::vector<int64_t>& cu_seqlens,
                                int input, int64_t row_bytes,
                                GatherPromptsFn gather) {
  std::vector<Group> groups;
  int64_t bytes = 0;
  for (Group& g : GroupsOf(shared)) {
    const int64_t p = shared.prefix_lengths[g.rows[0]];
    if (g.rows.size() < 2 || p == 0 || row_bytes == 0) continue;
    bytes += static_cast<int64_t>(g.rows.size()) * p * row_bytes;
    groups.push_back(std::move(g));
  }
  if (groups.empty()) return absl::OkStatus();
  ThreadPool& pool = ThreadPool::Global();
  const int pieces = static_cast<int>(
      std::min<int64_t>(std::clamp<int64_t>(bytes >> 20, 1, pool.num_threads()),
                        static_cast<int64_t>(groups.size())));
  // Each piece checks a range of groups in order, so the first piece's
  // difference is the first in group order.
  std::vector<absl::Status> found(pieces);
  pool.ParallelFor(pieces, [&](int piece) {
    std::vector<TokenRun> runs;
    std::vector<unsigned char> prompts;
    const size_t end = groups.size() * (piece + 1) / pieces;
    for (size_t gi = groups.size() * piece / pieces; gi < end; ++gi) {
      const Group& g = groups[gi];
      const int64_t p = shared.prefix_lengths[g.rows[0]];
      runs.clear();
      for (int64_t m : g.rows) runs.push_back(TokenRun{cu_seqlens[m], p});
      prompts.resize(g.rows.size() * p * row_bytes);
      found[piece] = gather(runs, prompts.data());
      if (found[piece].ok()) {
        found[piece] = CheckGroup(g, p, input, row_bytes, [&](size_t k) {
          return prompts.data() + k * p * row_bytes;
        });
      }
      if (!found[piece].ok()) return;
    }
  });
  for (absl::Status& status : found) {
    if (!status.ok()) return status;
  }
  return absl::OkStatus();
}

}  // namespace packd
