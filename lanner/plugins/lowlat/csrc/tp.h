// lowlat's tensor parallelism on the Model side: joining a group (set_tp), the all-reduce of a row-parallel
// GEMV's partial inside the step, and the LM head's logits gather (linear_gather); the segment protocol is
// Comm (comm.h).
#pragma once
#include "model.h"

namespace lowlat {

// Joins a tensor-parallel group of P ranks as `rank`: `segment` is the shared segment (one host; every rank maps
// the same file, zero-filled, of at least tp_segment_bytes()), or undefined to reduce with `py_reduce` (a
// callable summing a float tensor in place over the ranks, False when it timed out). vocab_sizes: every rank's
// vocabulary rows, in rank order.
inline void Model::set_tp(int64_t P, int64_t rank, std::vector<int64_t> vocab_sizes_, double timeout_s,
                          c10::optional<torch::Tensor> segment, pybind11::object py_reduce) {
  TORCH_CHECK(P >= 2 && rank >= 0 && rank < P && (int64_t)vocab_sizes_.size() == P &&
                  vocab_sizes_[rank] == vocab && timeout_s > 0,
              "lowlat.set_tp: P >= 2 ranks, rank in 0..P-1, one vocab size per rank (this rank's = ", vocab,
              ") and a timeout > 0");
  TORCH_CHECK(!q_embed.quant() && q8_stride == 0, "lowlat: stored-type (GGUF) weights run on one rank only");
  comm = Comm();
  comm.P = P;
  comm.rank = rank;
  comm.nt = nthreads;
  comm.hidden = hidden;
  comm.rows = max_rows;
  comm.timeout_s = timeout_s;
  comm.seq = 1;  // the segment starts zeroed: flag 0 is "nothing published"
  vocab_sizes = vocab_sizes_;
  vocab0 = 0;
  for (int64_t r = 0; r < rank; r++) vocab0 += vocab_sizes[r];
  vocab_total = vocab0;
  for (int64_t r = rank; r < P; r++) vocab_total += vocab_sizes[r];
  comm.gather_cols = *std::max_element(vocab_sizes.begin(), vocab_sizes.end());
  comm.gather_rows = std::min<int64_t>(max_rows, kGatherRows);
  if (segment.has_value()) comm.map(*segment);
  else comm.py_reduce = py_reduce;
  // every rank must split the hidden columns alike: no team smaller than asked (OMP_DYNAMIC, thread limits)
  omp_set_dynamic(0);
  int team = 0;
#pragma omp parallel num_threads(nthreads)
  {
#pragma omp single
    team = omp_get_num_threads();
  }
  TORCH_CHECK(team == nthreads, "lowlat: tensor parallelism needs teams of exactly ", nthreads,
              " OpenMP threads on every rank, this rank gets ", team);
}
inline int64_t Model::tp_segment_bytes(int64_t P, int64_t local_vocab_max) const {
  return Comm::bytes(P, nthreads, max_rows, hidden, std::min<int64_t>(max_rows, kGatherRows), local_vocab_max);
}
// (exchanges, seconds thread 0 waited for the other ranks in them) since the last call
inline std::tuple<int64_t, double> Model::tp_wait_stats() {
  std::tuple<int64_t, double> r{comm.exchanges, comm.wait_s};
  comm.exchanges = 0;
  comm.wait_s = 0;
  return r;
}

// Under TP: sums p (this rank's partial of columns [a, b) = split(hidden, 16) of thread tid, T rows, already in
// the model's rounding) over the ranks, in place, as collective s. Every thread of every rank calls it.
inline void Model::tp_reduce(float* p, int64_t T, int64_t a, int64_t b, int tid, int64_t s, std::string& err) {
  if (comm.shared()) {
    float* mine = comm.red(s, comm.rank);
    for (int64_t t = 0; t < T; t++) std::memcpy(mine + t * hidden + a, p + t * hidden + a, (b - a) * sizeof(float));
    if (!comm.exchange(tid, s)) return;  // aborted: the step's result is dropped
    for (int64_t t = 0; t < T; t++)
      for (int64_t c = a; c < b; c++) {
        float v = 0.f;
        for (int64_t r = 0; r < comm.P; r++) v += comm.red(s, r)[t * hidden + c];
        p[t * hidden + c] = v;
      }
    return;
  }
#pragma omp barrier
  if (tid == 0 && err.empty()) {  // the process group: every collective is still issued after a timeout
    try {
      pybind11::gil_scoped_acquire gil;
      const bool ok = comm.py_reduce(torch::from_blob(p, {T, hidden}, torch::kFloat32)).cast<bool>();
      if (!ok) comm.aborted = true;
    } catch (const std::exception& e) {  // a failed peer: no exception may leave the parallel region
      err = e.what();
      comm.aborted = true;
    }
  }
#pragma omp barrier
}

// a row-parallel GEMV's raw partial (columns [a, b)): rounded as the module's output is, then summed over ranks
template <typename WT>
inline void Model::tp_partial(float* p, int64_t T, int64_t a, int64_t b, int tid, int64_t s, std::string& err) {
  for (int64_t t = 0; t < T; t++)
    for (int64_t c = a; c < b; c++) p[t * hidden + c] = rnd<WT>(p[t * hidden + c]);
  tp_reduce(p, T, a, b, tid, s, err);
}

// The LM head over a vocab-split weight under TP: every rank's x [M, hidden] @ its W shard [vocab, hidden].T,
// gathered through the shared segment into the full [M, vocab_total] logits (in the model dtype) on every rank,
// in chunks of gather_rows rows. Every rank calls it for the same M. Sets `aborted` (and returns garbage) when
// the exchange timed out.
inline torch::Tensor Model::linear_gather(torch::Tensor x, torch::Tensor W) {
  g_invariant = invariant;
  TORCH_CHECK(comm.P > 1 && comm.shared(), "lowlat.linear_gather: needs set_tp with a shared segment");
  TORCH_CHECK(!comm.aborted, "lowlat: an earlier tensor-parallel step was aborted; this kernel is retired");
  TORCH_CHECK(W.dim() == 2 && W.size(0) == vocab_sizes[comm.rank], "lowlat.linear_gather: W must be this rank's ",
              vocab_sizes[comm.rank], " vocabulary rows");
  const auto wdt = bf16 ? torch::kBFloat16 : torch::kFloat32;
  auto y = linear(x, W, c10::nullopt, true, false);  // [M, local vocab] float32
  const int64_t M = y.size(0), n = y.size(1), ld = comm.gather_cols;
  auto out = torch::empty({M, vocab_total}, torch::TensorOptions().dtype(torch::kFloat32));
  float* o = out.data_ptr<float>();
  const float* yp = y.data_ptr<float>();
  for (int64_t m0 = 0; m0 < M; m0 += comm.gather_rows) {
    const int64_t m1 = std::min(M, m0 + comm.gather_rows), s = comm.seq++;
    float* mine = comm.gat(s, comm.rank);
    for (int64_t m = m0; m < m1; m++) std::memcpy(mine + (m - m0) * ld, yp + m * n, n * sizeof(float));
    if (!comm.exchange(0, s)) break;
    for (int64_t r = 0, c0 = 0; r < comm.P; c0 += vocab_sizes[r], r++)
      for (int64_t m = m0; m < m1; m++)
        std::memcpy(o + m * vocab_total + c0, comm.gat(s, r) + (m - m0) * ld, vocab_sizes[r] * sizeof(float));
  }
  return out.to(wdt);
}

}  // namespace lowlat
