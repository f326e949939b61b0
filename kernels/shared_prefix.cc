#include "kernels/shared_prefix.h"

#include <algorithm>
#include <cstring>
#include <new>
#include <string>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "base/status_macros.h"

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
  try {
    out.source.reserve(rows);
    if (with_position_ids) out.position_ids.reserve(rows);
    if (options.with_seq_idx) out.seq_idx.reserve(rows);
    s.kv_index.reserve(keys);
    s.cu_seqlens_q.reserve(segments + 1);
    s.cu_seqlens_k.reserve(segments + 1);
    s.segment_row.reserve(segments);
  } catch (const std::bad_alloc&) {
    return absl::ResourceExhaustedError(
        absl::StrCat("the shared stream's ", rows,
                     " rows do not fit in this process's memory"));
  }
  s.cu_seqlens_q.push_back(0);
  s.cu_seqlens_k.push_back(0);
  // Where each row's response starts in the stream, and each group's prompt.
  std::vector<int64_t> response_start(B, 0), prompt_start(B, 0);
  auto segment = [&](int64_t row, int64_t q_begin, int64_t q_rows,
                     int64_t k_prompt, int64_t k_prompt_rows) {
    for (int64_t i = 0; i < k_prompt_rows; ++i) {
      s.kv_index.push_back(k_prompt + i);
    }
    if (q_begin != k_prompt) {  // a response: then its own rows
      for (int64_t i = 0; i < q_rows; ++i) s.kv_index.push_back(q_begin + i);
    }
    const int64_t k_rows = (q_begin != k_prompt ? q_rows : 0) + k_prompt_rows;
    s.cu_seqlens_q.push_back(s.cu_seqlens_q.back() + q_rows);
    s.cu_seqlens_k.push_back(s.cu_seqlens_k.back() + k_rows);
    s.max_seqlen_q = std::max(s.max_seqlen_q, q_rows);
    s.max_seqlen_k = std::max(s.max_seqlen_k, k_rows);
    s.segment_row.push_back(row);
  };
  auto append = [&](int64_t first_token, int64_t first_position, int64_t n,
                    int64_t group) {
    for (int64_t i = 0; i < n; ++i) {
      out.source.push_back(first_token + i);
      if (with_position_ids) out.position_ids.push_back(first_position + i);
      if (options.with_seq_idx) out.seq_idx.push_back(group);
    }
  };
  for (size_t gi = 0; gi < groups.size(); ++gi) {
    const Group& g = groups[gi];
    const int64_t f = g.rows[0];
    const int64_t p = prefix.prefix_lengths[f];
    const int64_t prompt = static_cast<int64_t>(out.source.size());
    append(cu[f], 0, p, static_cast<int64_t>(gi));
    // A prompt's queries are its rows, its keys the same rows.
    if (p > 0) segment(f, prompt, p, prompt, p);
    for (int64_t m : g.rows) {
      const int64_t start = static_cast<int64_t>(out.source.size());
      const int64_t r = active(m) - p;
      prompt_start[m] = prompt;
      response_start[m] = start;
      append(cu[m] + p, p, r, static_cast<int64_t>(gi));
      if (r > 0) {
        if (p > 0) {
          segment(m, start, r, prompt, p);
        } else {  // no shared keys: its own rows only
          segment(m, start, r, start, r);
        }
      }
    }
  }
  out.cu_seqlens = s.cu_seqlens_q;
  out.max_seqlen = s.max_seqlen_q;
  // One target per predicted token, row by row: active index j >= max(P, 1),
  // predicted by the stream row of token j - 1 (for j = P, the prompt's
  // last row).
  s.target_cu_seqlens.push_back(0);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t p = prefix.prefix_lengths[b];
    for (int64_t j = std::max<int64_t>(p, 1); j < active(b); ++j) {
      out.shifted_source.push_back(cu[b] + j);
      s.pred_index.push_back(j - 1 < p ? prompt_start[b] + j - 1
                                       : response_start[b] + (j - 1 - p));
    }
    s.target_cu_seqlens.push_back(
        static_cast<int64_t>(out.shifted_source.size()));
  }
  return out;
}

absl::Status CheckSamePrompts(const SharedPrefix& shared,
                              const std::vector<int64_t>& cu, int input,
                              const unsigned char* packed, int64_t row_bytes) {
  for (const Group& g : GroupsOf(shared)) {
    const int64_t f = g.rows[0];
    const int64_t p = shared.prefix_lengths[f];
    const unsigned char* first = packed + cu[f] * row_bytes;
    for (size_t k = 1; k < g.rows.size(); ++k) {
      const int64_t m = g.rows[k];
      const unsigned char* member = packed + cu[m] * row_bytes;
      if (std::memcmp(first, member, p * row_bytes) == 0) continue;
      int64_t i = 0;
      while (std::memcmp(first + i * row_bytes, member + i * row_bytes,
                         row_bytes) == 0) {
        ++i;
      }
      return absl::InvalidArgumentError(absl::StrCat(
          "shared_prefix.same_inputs: inputs[", input,
          "] differs across group ", g.id, ": row ", m, "'s prompt token ", i,
          " (of ", p, ") is not row ", f, "'s, the group's first"));
    }
  }
  return absl::OkStatus();
}

}  // namespace packd
