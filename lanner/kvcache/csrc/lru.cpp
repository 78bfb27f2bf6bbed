// The hot loops of lanner/kvcache/lru.py on CPU tensors, one pass each where the PyTorch version needs several
// tensor ops (each a pass over the step's entries plus an allocation). Same tables, same decisions: the Python
// classes own the state and call these; tests replay traces through both and compare every step.
//
//  * lookup: a step's sorted unique addresses -> their slot + 1 (0: not resident) and the misses;
//  * pb_move: PB-LRU's recency update: per slot, one count moves from its bucket's row to the target bucket's
//    row of the level-1 bitmap (per bucket, slots per 64-slot word) and in level 0 (slots per bucket), and the
//    slot's epoch is set;
//  * pb_victims: the free bucket, then the coldest non-empty bucket onward: per bucket the words whose count is
//    non-zero, then their slots still in that bucket, until n are found (never a slot of the current step).
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

constexpr int64_t kWord = 64;

int64_t* data(const at::Tensor& t, const char* what) {
  if (t.scalar_type() != at::kLong || !t.is_contiguous() || !t.device().is_cpu())
    throw std::invalid_argument(std::string(what) + ": expected a contiguous int64 CPU tensor");
  return t.data_ptr<int64_t>();
}

// (slot + 1 for every address, the addresses that are not resident)
std::pair<at::Tensor, at::Tensor> lookup(const at::Tensor& addr_slot, const at::Tensor& addrs) {
  const int64_t n = addrs.numel(), na = addr_slot.numel();
  const int64_t* table = data(addr_slot, "addr_slot");
  const int64_t* a = data(addrs, "addrs");
  at::Tensor slot1 = at::empty({n}, addrs.options());
  std::vector<int64_t> miss;
  int64_t* s = slot1.data_ptr<int64_t>();
  pybind11::gil_scoped_release nogil;
  for (int64_t i = 0; i < n; i++) {
    if (a[i] < 0 || a[i] >= na) throw std::out_of_range("lookup: address outside the address space");
    s[i] = table[a[i]] + 1;
    if (s[i] == 0) miss.push_back(a[i]);
  }
  at::Tensor out = at::empty({(int64_t)miss.size()}, addrs.options());
  std::copy(miss.begin(), miss.end(), out.data_ptr<int64_t>());
  return {slot1, out};
}

// bucket of an epoch e (as PBLRU._bucket): free (-1) -> B, older than the B-1 most recent -> the coldest
inline int64_t bucket(int64_t e, int64_t epoch, int64_t B) {
  return e < 0 ? B : std::max(e, epoch - B + 1) & (B - 1);
}

// slot1: slot + 1 (0: the sentinel row, whose count column 0 is never read); to_bucket B frees the slots
// sizes: slots per bucket (level 0), kept for the real slots only
void pb_move(at::Tensor& slot_epoch, at::Tensor& count, at::Tensor& sizes, const at::Tensor& slot1, int64_t epoch,
             int64_t B, int64_t row, int64_t to_bucket, int64_t new_epoch) {
  int64_t* ep = data(slot_epoch, "slot_epoch");
  int64_t* cnt = data(count, "count");
  int64_t* size = data(sizes, "sizes");
  const int64_t* s = data(slot1, "slot1");
  const int64_t n = slot1.numel();
  pybind11::gil_scoped_release nogil;
  int64_t* to = cnt + to_bucket * row;
  int64_t moved = 0;
  for (int64_t i = 0; i < n; i++) {
    const int64_t s1 = s[i];
    if (s1 == 0) continue;  // the sentinel (a miss): nothing to move
    const int64_t col = (s1 + kWord - 1) >> 6, old = bucket(ep[s1], epoch, B);
    cnt[old * row + col]--;
    size[old]--;
    to[col]++;
    ep[s1] = new_epoch;
    moved++;
  }
  size[to_bucket] += moved;
}

at::Tensor pb_victims(const at::Tensor& slot_epoch, const at::Tensor& count, const at::Tensor& sizes, int64_t n,
                      int64_t epoch, int64_t B, int64_t row, int64_t num_slots, const at::Tensor& step_slot1) {
  const int64_t* ep = data(slot_epoch, "slot_epoch");
  const int64_t* cnt = data(count, "count");
  const int64_t* size = data(sizes, "sizes");
  const int64_t cur = epoch & (B - 1), words = row - 1;
  at::Tensor out = at::empty({n}, slot_epoch.options());
  int64_t* v = out.data_ptr<int64_t>();
  int64_t found = 0;
  std::vector<uint64_t> mine;  // the step's slots, built only if the current bucket is reached
  {
    pybind11::gil_scoped_release nogil;
    for (int64_t i = 0; i <= B && found < n; i++) {
      const int64_t b = i == 0 ? B : (cur + i) & (B - 1);  // free, coldest ... current
      if (size[b] == 0) continue;  // level 0: an empty bucket costs nothing
      if (b == cur && mine.empty()) {
        mine.assign((num_slots + 63) / 64, 0);
        const int64_t* s = data(step_slot1, "step_slot1");
        for (int64_t j = 0; j < step_slot1.numel(); j++)
          if (s[j] > 0) mine[(s[j] - 1) >> 6] |= 1ull << ((s[j] - 1) & 63);
      }
      const int64_t* c = cnt + b * row + 1;
      for (int64_t w = 0; w < words && found < n; w++) {
        int64_t left = c[w];  // the word's slots in bucket b: stop scanning it once they are all seen
        const int64_t end = std::min(num_slots, (w + 1) * kWord);
        for (int64_t slot = w * kWord; slot < end && left > 0 && found < n; slot++) {
          if (bucket(ep[slot + 1], epoch, B) != b) continue;
          left--;
          if (b == cur && (mine[slot >> 6] >> (slot & 63) & 1)) continue;
          v[found++] = slot;
        }
      }
    }
  }
  if (found < n)
    throw std::runtime_error("PB-LRU: " + std::to_string(n - found) + " slots short (all remaining are protected)");
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("lookup", &lookup, "sorted unique addresses -> (slot + 1 each, the misses)");
  m.def("pb_move", &pb_move, "PB-LRU recency update of slots (slot + 1) into a bucket, with their new epoch");
  m.def("pb_victims", &pb_victims, "PB-LRU: n victim slots, free bucket first, then coldest to current");
}
