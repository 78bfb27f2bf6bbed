// Suffix index for speculative drafts (lanner/spec/suffix.py): for every context of 1..depth tokens that occurs
// in the indexed text, how often each next token followed it. This is a suffix trie truncated at `depth`, with
// nodes addressed by a hash of their context instead of pointers: appending a token touches `depth` nodes
// (O(new tokens) per step), a lookup hashes the query's tail backwards. A hash collision can only give a bad
// draft, which verification rejects; it can never change the output.
//
// Documents (a request's prompt + output, or a finished output in the shared index) are added whole or
// token by token; a document can be removed again (the shared index's oldest-first eviction). A `scope`
// (the API's `user`) seeds every hash, so one scope's contexts never match another's.
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <cstdint>
#include <queue>
#include <stdexcept>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

namespace {

inline uint64_t mix(uint64_t h, int64_t token) {
  // splitmix64 finaliser over (h, token): cheap and well spread
  uint64_t x = h ^ (static_cast<uint64_t>(token) + 0x9e3779b97f4a7c15ULL + (h << 6) + (h >> 2));
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ULL;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebULL;
  x ^= x >> 31;
  return x;
}

struct Node {
  int32_t total = 0;
  std::vector<std::pair<int32_t, int32_t>> next;  // (token, count); short lists, scanned linearly
};

class SuffixIndex {
 public:
  explicit SuffixIndex(int64_t depth) : depth_(depth) {
    if (depth < 1) throw std::invalid_argument("depth must be >= 1");
  }

  // A document of the shared index, added (delta +1) or removed again (-1); tokens before `start` are context only.
  void add(const std::vector<int64_t>& ids, int64_t start, uint64_t scope, int32_t delta) {
    update(ids.data(), static_cast<int64_t>(ids.size()), start, scope, delta);
  }

  // A request's own index: appends its new tokens to the kept text and counts them (O(new tokens * depth)).
  void extend(const std::vector<int64_t>& ids) {
    const int64_t start = static_cast<int64_t>(text_.size());
    text_.insert(text_.end(), ids.begin(), ids.end());
    update(text_.data(), static_cast<int64_t>(text_.size()), start, 0, 1);
  }

  int64_t length() const { return static_cast<int64_t>(text_.size()); }

  // draft() for the tail of the kept text (a request's own index)
  std::tuple<std::vector<int64_t>, int64_t, double, std::vector<double>> draft_own(int64_t max_tokens, double factor,
                                                                                    double min_prob) const {
    const int64_t n = static_cast<int64_t>(text_.size());
    const int64_t from = std::max<int64_t>(0, n - depth_);
    return draft(std::vector<int64_t>(text_.begin() + from, text_.end()), 0, max_tokens, factor, min_prob);
  }

  // draft_tree() for the tail of the kept text (a request's own index)
  std::tuple<std::vector<int64_t>, std::vector<int64_t>, int64_t, double> draft_tree_own(
      int64_t max_nodes, int64_t max_depth, double factor, double min_prob) const {
    const int64_t n = static_cast<int64_t>(text_.size());
    const int64_t from = std::max<int64_t>(0, n - depth_);
    return draft_tree(std::vector<int64_t>(text_.begin() + from, text_.end()), 0, max_nodes, max_depth, factor,
                      min_prob);
  }

  // Counts token ids[i] after each of its contexts ids[i-n..i-1], n = 1..depth, for i in [start, n).
  // Contexts reach back before start. delta = +1 adds, -1 removes.
  void update(const int64_t* ids, int64_t n, int64_t start, uint64_t scope, int32_t delta) {
    for (int64_t i = std::max<int64_t>(start, 1); i < n; ++i) {
      uint64_t h = scope;
      const int64_t lo = std::max<int64_t>(0, i - depth_);
      for (int64_t j = i - 1; j >= lo; --j) {
        h = mix(h, ids[j]);
        bump(h, static_cast<int32_t>(ids[i]), delta);
      }
    }
  }

  // Draft for the tail of `ctx`: the longest context (<= depth tokens) of the tail that occurs, then the most
  // frequent continuation, token by token, while the running probability (product of count / total) stays >=
  // min_prob and fewer than min(max_tokens, factor * match length) tokens are drafted. Returns (tokens, match
  // length, score = expected accepted tokens under the frequencies = sum of running probabilities, the running
  // probability of each token).
  std::tuple<std::vector<int64_t>, int64_t, double, std::vector<double>> draft(
      const std::vector<int64_t>& ctx, uint64_t scope, int64_t max_tokens, double factor, double min_prob) const {
    std::vector<int64_t> out;
    std::vector<double> probs;
    auto [node, match] = longest_match(ctx, scope);
    if (node == nullptr) return {out, 0, 0.0, probs};
    const int64_t limit = std::min<int64_t>(max_tokens, static_cast<int64_t>(factor * match + 1e-9));
    std::vector<int64_t> path(ctx.end() - match, ctx.end());
    double prob = 1.0, score = 0.0;
    while (static_cast<int64_t>(out.size()) < limit && node != nullptr) {
      int32_t best = -1, best_count = 0;
      for (const auto& [tok, count] : node->next)
        if (count > best_count) best = tok, best_count = count;
      if (best < 0) break;
      prob *= static_cast<double>(best_count) / node->total;
      if (prob < min_prob) break;
      out.push_back(best);
      probs.push_back(prob);
      score += prob;
      path.push_back(best);
      // the node of the path's last (up to depth) tokens: it exists, the path occurs in the text
      uint64_t g = scope;
      const int64_t m = static_cast<int64_t>(path.size());
      node = nullptr;
      for (int64_t j = m - 1; j >= std::max<int64_t>(0, m - depth_); --j) g = mix(g, path[j]);
      auto it = nodes_.find(g);
      if (it != nodes_.end() && it->second.total > 0) node = &it->second;
    }
    return {out, match, score, probs};
  }

  // A tree of continuations of the tail of `ctx` (SuffixDecoding's best-first expansion): from the longest
  // matching context, repeatedly add the candidate whose running probability (product of count / total along
  // its path) is highest, and offer its continuations as new candidates, until max_nodes nodes are taken or no
  // candidate reaches min_prob. Paths are at most min(max_depth, factor * match length) tokens. Returns (tokens,
  // parents: the index of each node's parent, -1 for a child of the tail; a parent comes before its children,
  // match length, score = expected accepted tokens under the frequencies = sum of the nodes' probabilities).
  std::tuple<std::vector<int64_t>, std::vector<int64_t>, int64_t, double> draft_tree(
      const std::vector<int64_t>& ctx, uint64_t scope, int64_t max_nodes, int64_t max_depth, double factor,
      double min_prob) const {
    std::vector<int64_t> tokens, parents;
    const auto [root, match] = longest_match(ctx, scope);
    if (root == nullptr) return {tokens, parents, 0, 0.0};
    const int64_t limit = std::min<int64_t>(max_depth, static_cast<int64_t>(factor * match + 1e-9));
    // each taken node's context tail (its last <= depth tokens), to find its continuations
    std::vector<std::vector<int64_t>> tails;
    struct Candidate {
      double prob;
      int64_t parent, token, depth;
      bool operator<(const Candidate& o) const { return prob < o.prob; }
    };
    std::priority_queue<Candidate> heap;
    auto offer = [&](const Node* node, double prob, int64_t parent, int64_t depth) {
      if (node == nullptr || depth >= limit) return;
      for (const auto& [tok, count] : node->next) {
        const double p = prob * count / node->total;
        if (count > 0 && p >= min_prob) heap.push({p, parent, tok, depth + 1});
      }
    };
    offer(root, 1.0, -1, 0);
    std::vector<int64_t> start(ctx.end() - match, ctx.end());
    double score = 0.0;
    while (!heap.empty() && static_cast<int64_t>(tokens.size()) < max_nodes) {
      const Candidate c = heap.top();
      heap.pop();
      std::vector<int64_t> tail = c.parent < 0 ? start : tails[c.parent];
      tail.push_back(c.token);
      if (static_cast<int64_t>(tail.size()) > depth_) tail.erase(tail.begin());
      const int64_t index = static_cast<int64_t>(tokens.size());
      tokens.push_back(c.token);
      parents.push_back(c.parent);
      score += c.prob;
      uint64_t g = scope;
      for (auto t = tail.rbegin(); t != tail.rend(); ++t) g = mix(g, *t);
      auto it = nodes_.find(g);
      offer(it != nodes_.end() && it->second.total > 0 ? &it->second : nullptr, c.prob, index, c.depth);
      tails.push_back(std::move(tail));
    }
    return {tokens, parents, match, score};
  }

  int64_t size() const { return static_cast<int64_t>(nodes_.size()); }

 private:
  // The node of the longest context (<= depth tokens) of ctx's tail that occurs, and its length (nullptr, 0: none).
  std::pair<const Node*, int64_t> longest_match(const std::vector<int64_t>& ctx, uint64_t scope) const {
    const int64_t n = static_cast<int64_t>(ctx.size());
    int64_t match = 0;
    const Node* node = nullptr;
    uint64_t h = scope;
    for (int64_t j = n - 1; j >= 0 && n - j <= depth_; --j) {
      h = mix(h, ctx[j]);
      auto it = nodes_.find(h);
      if (it == nodes_.end() || it->second.total <= 0) break;
      node = &it->second;
      match = n - j;
    }
    return {node, match};
  }

  void bump(uint64_t h, int32_t token, int32_t delta) {
    if (delta > 0) {
      Node& node = nodes_[h];
      node.total += delta;
      for (auto& e : node.next)
        if (e.first == token) {
          e.second += delta;
          return;
        }
      node.next.emplace_back(token, delta);
      return;
    }
    auto it = nodes_.find(h);
    if (it == nodes_.end()) return;
    Node& node = it->second;
    for (size_t k = 0; k < node.next.size(); ++k)
      if (node.next[k].first == token) {
        node.next[k].second += delta;
        node.total += delta;
        if (node.next[k].second <= 0) {
          node.next[k] = node.next.back();
          node.next.pop_back();
        }
        break;
      }
    if (node.total <= 0) nodes_.erase(it);
  }

  int64_t depth_;
  std::vector<int64_t> text_;
  std::unordered_map<uint64_t, Node> nodes_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  pybind11::class_<SuffixIndex>(m, "SuffixIndex")
      .def(pybind11::init<int64_t>())
      .def("add", &SuffixIndex::add)
      .def("extend", &SuffixIndex::extend)
      .def("length", &SuffixIndex::length)
      .def("draft", &SuffixIndex::draft)
      .def("draft_own", &SuffixIndex::draft_own)
      .def("draft_tree", &SuffixIndex::draft_tree)
      .def("draft_tree_own", &SuffixIndex::draft_tree_own)
      .def("size", &SuffixIndex::size);
}
