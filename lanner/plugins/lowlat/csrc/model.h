// lowlat's Model: one model's geometry, weights (the model's own tensors, named by plugin.py) and activation
// buffers, with what every kernel family shares (the norm, the gated activations, the matmul dispatch). Its
// kernels are defined by family in the headers that include this one: gemma.h, tp.h, attention.h, moe.h,
// forward.h (the step), linear.h (matmuls outside the step); head.h runs the draft head on a Model.
#pragma once
#include <initializer_list>
#include <memory>
#include <set>

#include "comm.h"
#include "common.h"
#include "gemv.h"
#include "quant.h"

namespace lowlat {

// plugin.py's keyword options or name -> tensor dict, read by name. Every name given must be read, else build()
// refuses the kernel (a misspelt optional name would drop a weight without a word).
struct Args {
  pybind11::dict d;
  mutable std::set<std::string> read;

  pybind11::object at(const char* name) const {
    TORCH_CHECK(d.contains(name), "lowlat: '", name, "' not given");
    read.insert(name);
    return d[name];
  }
  template <typename V>
  V value(const char* name) const {
    pybind11::detail::make_caster<V> conv;
    TORCH_CHECK(conv.load(at(name), true), "lowlat: '", name, "' has the wrong type");
    return pybind11::detail::cast_op<V>(std::move(conv));
  }
  template <typename V>
  V value(const char* name, V absent) const {
    return d.contains(name) ? value<V>(name) : absent;
  }
  torch::Tensor tensor(const char* name) const { return value<torch::Tensor>(name); }
  // one tensor per layer; absent: none (the model has no such weight)
  std::vector<torch::Tensor> tensors(const char* name) const {
    if (!d.contains(name)) return {};
    // a tensor is a sequence too: it would cast to its rows
    TORCH_CHECK(pybind11::isinstance<pybind11::list>(d[name]), "lowlat: '", name, "' must be a list of tensors");
    return value<std::vector<torch::Tensor>>(name);
  }
  // the named entries (those given) as their own Args, read here
  Args subset(std::initializer_list<const char*> names) const {
    Args s{pybind11::dict()};
    for (const char* name : names)
      if (d.contains(name)) s.d[name] = at(name);
    return s;
  }
  void check_all_read(const char* what) const {
    for (const auto& item : d) {
      const auto name = item.first.cast<std::string>();
      TORCH_CHECK(read.count(name), "lowlat: ", what, " takes no '", name, "'");
    }
  }
};

// ------------------------------------------------------------------------------------------------ model
template <typename T>
static const T* ptr(const torch::Tensor& t) {
  return t.defined() && t.numel() ? reinterpret_cast<const T*>(t.data_ptr()) : nullptr;
}

struct Model {
  // geometry
  int64_t hidden, inter, L, H, Hkv, D, vocab, max_pos, max_rows;
  double eps, scale;
  bool bf16, dot, has_bias, qk_norm;
  int nthreads;
  // MoE feed-forward (layers with is_moe[l]): E experts of intermediate size minter, top_k per row, the top-k
  // weights renormalized when renorm (Mixtral, Qwen3-MoE with norm_topk_prob)
  int64_t minter = 0, E = 0, top_k = 0;
  bool renorm = false;
  std::vector<char> is_moe;
  // test hook: with record_moe, each forward logs one (layer, expert, rows) entry per expert GEMV pass
  bool record_moe = false;
  std::vector<std::vector<int64_t>> moe_log;
  // weights: the model's own tensors (no copies)
  torch::Tensor embed, final_norm, cos, sin;
  std::vector<torch::Tensor> in_norm, qkv_w, qkv_b, q_norm, k_norm, o_w, post_norm, gu_w, down_w;
  // MoE layers (an empty tensor on dense ones): [E, hidden], [E, 2 * minter, hidden] (gate rows, then up rows),
  // [E, hidden, minter]
  std::vector<torch::Tensor> router_w, w13, w2;
  torch::Tensor scratch;  // activations for max_rows rows, exposed so the plugin can account for it
  // GGUF weights in their stored type (set_quant, quant.h): per layer qkv / o / gate_up / down, and the embedding
  // (also the LM head); a kDense entry means the dense tensor above. act: QAct, the activation mode; the
  // quantized-row buffers: per thread max_rows rows of q8_stride bytes
  std::vector<QMat> q_qkv, q_o, q_gu, q_down;
  QW q_embed;
  std::vector<torch::Tensor> q_keep;
  int act = kActQ8;
  int64_t off_q8 = 0, q8_stride = 0;
  // batch invariance: a row's attention arithmetic depends only on its own context length (PyTorch's flash
  // attention, which the default path mirrors, switches exp variants at the padded batch's length)
  bool invariant = false;
  bool kv_q8 = false;  // forward()'s caches hold Q8_0 rows (uint8 [slots, Hkv, D / 32 * 34]), not the model dtype
  // bf16 models: attention's products through vdpbf16ps (see attend_nv; the same bits as the FMA path)
  bool attn_dot = false;
  // bf16 models with a bf16 cache: attention on AMX tiles (attention_amx.h; other bits than the FMA path's)
  bool attn_amx = false;
  // decode attention split over the context where a sequence spans several key parts (attention_split.h; same bits)
  bool attn_split = true;
  std::vector<float> part_buf;  // the part states of a split step
  std::vector<std::vector<int64_t>> tree_;  // forward()'s draft-tree rows per sequence (see attend)
  // Gemma 3 (set_gemma): every norm is x / rms(x) * (1 + w) with the float32 (1 + w) passed in (one rounding, as
  // transformers' Gemma3RMSNorm); post-norms on the attention and feed-forward outputs before their residual
  // adds; GeGLU (tanh GELU); the embedding times sqrt(hidden) (the factor rounded to the model dtype); local
  // layers read the last `window` positions and take their own RoPE tables (set_rope)
  bool gemma = false;
  float embed_scale = 1.f;
  int64_t window = 0;
  std::vector<char> is_local;
  std::vector<torch::Tensor> g_in, g_pa, g_pf, g_po, g_qn, g_kn;
  torch::Tensor g_final, cos_local, sin_local;
  // per-phase seconds seen by thread 0 (profile = true): GEMV, attention, barrier waits, the rest (norms, RoPE,
  // KV writes, residuals, embedding), the stored-type LM head (qlinear); prof_calls: forwards + LM-head calls
  bool profile = false;
  std::vector<double> prof = std::vector<double>(5, 0.0);
  int64_t prof_calls = 0;
  // tensor parallelism (set_tp): this rank's heads / intermediate / vocab rows are its shards of the weights;
  // the embedding holds vocab rows [vocab0, vocab0 + vocab) of vocab_total
  Comm comm;
  int64_t vocab0 = 0, vocab_total = 0;
  std::vector<int64_t> vocab_sizes;  // every rank's vocab rows (the logits gather)
  // scratch carve-up (bytes)
  int64_t off_x, off_xin, xin_stride, off_qkv, off_q, off_ain, off_tmp, off_gu, off_act;
  int64_t off_logit = 0, off_macc = 0, off_mact = 0, off_xg = 0, xg_stride = 0;  // MoE

  // w: the tensors by name (plugin.py's pack.model_weights): embed_tokens, norm, rope_cos, rope_sin and, one per
  // layer, input_layernorm, qkv_proj, o_proj, post_attention_layernorm (the MLP's input norm), gate_up_proj,
  // down_proj; where the model has them qkv_proj.bias, q_norm, k_norm and for MoE layers router, experts.w13,
  // experts.w2 (the other kind's weights on a layer: empty tensors). A Model without layers (the draft head's)
  // takes the first four only. opt: hidden, inter, heads, kv_heads, head_dim, eps, scale, bf16, dot, threads,
  // max_rows and with MoE layers moe_inter, top_k, renorm, moe_layers (1 for an MoE layer).
  Model(const Args& w, const Args& opt)
      : hidden(opt.value<int64_t>("hidden")), inter(opt.value<int64_t>("inter")), H(opt.value<int64_t>("heads")),
        Hkv(opt.value<int64_t>("kv_heads")), D(opt.value<int64_t>("head_dim")),
        max_rows(opt.value<int64_t>("max_rows")), eps(opt.value<double>("eps")), scale(opt.value<double>("scale")),
        bf16(opt.value<bool>("bf16")), dot(opt.value<bool>("dot") && bf16 && kHaveDot),
        nthreads(int(opt.value<int64_t>("threads"))), minter(opt.value<int64_t>("moe_inter", 0)),
        top_k(opt.value<int64_t>("top_k", 0)), renorm(opt.value<bool>("renorm", false)),
        embed(w.tensor("embed_tokens")), final_norm(w.tensor("norm")), cos(w.tensor("rope_cos")),
        sin(w.tensor("rope_sin")), in_norm(w.tensors("input_layernorm")), qkv_w(w.tensors("qkv_proj")),
        qkv_b(w.tensors("qkv_proj.bias")), q_norm(w.tensors("q_norm")), k_norm(w.tensors("k_norm")),
        o_w(w.tensors("o_proj")), post_norm(w.tensors("post_attention_layernorm")),
        gu_w(w.tensors("gate_up_proj")), down_w(w.tensors("down_proj")), router_w(w.tensors("router")),
        w13(w.tensors("experts.w13")), w2(w.tensors("experts.w2")) {
    L = (int64_t)in_norm.size();
    const auto moe_layers = opt.value<std::vector<int64_t>>("moe_layers", {});
    const auto wdt = bf16 ? torch::kBFloat16 : torch::kFloat32;
    TORCH_CHECK(D % 16 == 0 && D % 2 == 0, "lowlat: head_dim must be a multiple of 16, got ", D);
    TORCH_CHECK(H % Hkv == 0, "lowlat: num_heads must be a multiple of num_kv_heads");
    TORCH_CHECK(nthreads >= 1 && max_rows >= 1 && max_rows <= kMaxRows,
                "lowlat: threads must be >= 1 and max_rows in 1..", kMaxRows);
    TORCH_CHECK(D <= 512, "lowlat: head_dim must be <= 512, got ", D);
    vocab = vocab_total = embed.size(0);
    max_pos = cos.size(0);
    TORCH_CHECK(cos.scalar_type() == torch::kFloat32 && sin.scalar_type() == torch::kFloat32 && cos.is_contiguous() &&
                    sin.is_contiguous() && cos.size(1) == D && sin.sizes() == cos.sizes(),
                "lowlat: rotary tables must be contiguous float32 [max_pos, head_dim]");
    auto chk = [&](const torch::Tensor& t, std::vector<int64_t> shape, const char* what) {
      if (shape.size() == 2 && t.dim() == 2 && t.size(0) == shape[0] && t.size(1) == 0) return;  // set_quant's
      TORCH_CHECK(t.scalar_type() == wdt && t.is_contiguous() && t.device().is_cpu() && t.sizes() == shape,
                  "lowlat: ", what, " must be a contiguous CPU ", (bf16 ? "bfloat16" : "float32"), " tensor of shape ",
                  c10::IntArrayRef(shape), ", got ", t.scalar_type(), " ", t.sizes());
    };
    chk(embed, {vocab, hidden}, "embed_tokens.weight");
    chk(final_norm, {hidden}, "norm.weight");
    has_bias = !qkv_b.empty();
    qk_norm = !q_norm.empty();
    const int64_t nqkv = (H + 2 * Hkv) * D;
    is_moe.assign(L, 0);
    TORCH_CHECK(moe_layers.empty() || (int64_t)moe_layers.size() == L,
                "lowlat: the MoE layer flags must be empty or one per layer");
    for (int64_t l = 0; l < (int64_t)moe_layers.size(); l++) is_moe[l] = moe_layers[l] != 0;
    const bool any_moe = std::find(is_moe.begin(), is_moe.end(), 1) != is_moe.end();
    TORCH_CHECK((int64_t)qkv_w.size() == L && (int64_t)o_w.size() == L &&
                    (int64_t)post_norm.size() == L && (int64_t)gu_w.size() == L && (int64_t)down_w.size() == L &&
                    (!has_bias || (int64_t)qkv_b.size() == L) &&
                    (!qk_norm || ((int64_t)q_norm.size() == L && (int64_t)k_norm.size() == L)) &&
                    (!any_moe || ((int64_t)router_w.size() == L && (int64_t)w13.size() == L &&
                                  (int64_t)w2.size() == L)),
                "lowlat: one weight of each kind per layer expected (MoE weights: an empty tensor on dense layers)");
    if (any_moe) {
      for (int64_t l = 0; l < L; l++)
        if (is_moe[l]) { E = router_w[l].size(0); break; }
      TORCH_CHECK(E >= 1 && minter >= 1 && top_k >= 1 && top_k <= E,
                  "lowlat: MoE needs experts >= 1, intermediate size >= 1 and 1 <= top_k <= experts; got ", E, ", ",
                  minter, ", ", top_k);
    }
    for (int64_t l = 0; l < L; l++) {
      chk(in_norm[l], {hidden}, "input_layernorm.weight");
      chk(qkv_w[l], {nqkv, hidden}, "qkv_proj.weight");
      if (has_bias) chk(qkv_b[l], {nqkv}, "qkv_proj.bias");
      if (qk_norm) { chk(q_norm[l], {D}, "q_norm.weight"); chk(k_norm[l], {D}, "k_norm.weight"); }
      chk(o_w[l], {hidden, H * D}, "o_proj.weight");
      chk(post_norm[l], {hidden}, "post_attention_layernorm.weight");
      if (is_moe[l]) {
        chk(router_w[l], {E, hidden}, "mlp.gate.weight (MoE router)");
        chk(w13[l], {E, 2 * minter, hidden}, "mlp.experts.w13");
        chk(w2[l], {E, hidden, minter}, "mlp.experts.w2");
      } else {
        chk(gu_w[l], {2 * inter, hidden}, "gate_up_proj.weight");
        chk(down_w[l], {hidden, inter}, "down_proj.weight");
      }
    }
    // scratch: x [T, hidden] f32 | xin[nthreads] [T, hidden] X | qkv [T, nqkv] f32 | q [T, H*D] f32 |
    //          ain [T, H*D] X | tmp [T, hidden] f32 | gu [T, 2*max(inter, minter)] f32 | act [T, inter] X
    // MoE:     logit [T, E] f32 | macc [T, hidden] f32 | mact [T*top_k, minter] X | xg[nthreads] [T, hidden] X
    const int64_t T = max_rows, xs = dot ? 2 : 4;
    auto al = [](int64_t b) { return (b + 63) / 64 * 64; };
    int64_t o = 0;
    off_x = o; o += al(T * hidden * 4);
    off_xin = o; xin_stride = al(T * hidden * xs); o += nthreads * xin_stride;
    off_qkv = o; o += al(T * nqkv * 4);
    off_q = o; o += al(T * H * D * 4);
    off_ain = o; o += al(T * H * D * xs);
    off_tmp = o; o += al(T * hidden * 4);
    off_gu = o; o += al(T * 2 * std::max(inter, any_moe ? minter : 0) * 4);
    off_act = o; o += al(T * inter * xs);
    if (any_moe) {
      off_logit = o; o += al(T * E * 4);
      off_macc = o; o += al(T * hidden * 4);
      off_mact = o; o += al(T * top_k * minter * xs);
      off_xg = o; xg_stride = al(T * hidden * xs); o += nthreads * xg_stride;
    }
    scratch = torch::zeros({o + 64}, torch::kUInt8);
    q_qkv.assign(L, QMat());
    q_o.assign(L, QMat());
    q_gu.assign(L, QMat());
    q_down.assign(L, QMat());
  }

  template <typename X> X* buf(int64_t off) const {
    auto base = reinterpret_cast<uintptr_t>(scratch.data_ptr());
    return reinterpret_cast<X*>((base + 63) / 64 * 64 + off);
  }

  // a repacked weight from its buffers in lanner/models/quant.py's PARTS order, rows interleaved in groups of 16:
  // qs uint8 [groups, blocks / 2, 8, 16, 4] (u4) or int8 [groups, blocks, 8, 16, 4] (s8), then [d(, m)] int16
  // (float16 bits) [groups, blocks, 16], or a K-quant's [sc(, mn), sd(, sm)]: byte sub-block scales [groups, units,
  // 16] and int16 super-block scales [groups, blocks / 8, 16]
  QW make_qw(const std::vector<torch::Tensor>& t, int64_t N, int64_t K, const std::string& what) {
    QW w;
    if (t.empty()) return w;
    for (const auto& x : t) TORCH_CHECK(x.is_contiguous() && x.device().is_cpu(), "lowlat: ", what, ": CPU contiguous");
    const auto& qs = t[0];
    // u6 codes: 6 vectors of 64 bytes per block and group (quant.h's u6_codes), u4 and s8: 8
    const bool six = qs.dim() == 5 && qs.size(2) == 6;  // u6 / u5: Q6_K's [sc, sd], Q5_K's [sc, mn, sd, sm]
    w.fmt = qs.scalar_type() != torch::kUInt8 ? kS8 : !six ? kU4 : t.size() == 5 ? kU5 : kU6;
    w.N = N;
    w.K = K;
    w.nbp = ((K + 31) / 32 + 1) / 2 * 2;
    const int64_t G = w.groups();
    const bool u4 = w.fmt == kU4, mins = w.mins(), kq = t.size() >= 2 && t[1].scalar_type() != at::kShort;
    const size_t want = kq ? (mins ? 5 : 3) : (u4 ? 3 : 2);
    const int64_t nvec = six ? 6 : 8, nchunk = u4 ? w.nbp / 2 : w.nbp;
    TORCH_CHECK((w.fmt == kS8) != kq || u4, "lowlat: ", what, ": s8 codes take float16 scales [d], u6 / u5 codes "
                "K-quant ones");
    TORCH_CHECK(t.size() == want, "lowlat: ", what, ": expected ", want, " tensors ([qs, d, m], [qs, d], [qs, sc, mn, "
                "sd, sm] or [qs, sc, sd]), got ", t.size());
    TORCH_CHECK(qs.scalar_type() == (w.fmt == kS8 ? at::kChar : at::kByte) &&
                    qs.sizes() == c10::IntArrayRef({G, nchunk, nvec, kGroup, 4}),
                "lowlat: ", what, ": codes must be ", w.fmt == kS8 ? "int8 [" : "uint8 [", G, ", ", nchunk, ", ",
                nvec, ", 16, 4]");
    auto check = [&](const torch::Tensor& x, at::ScalarType dt, int64_t units, const char* name) {
      TORCH_CHECK(x.scalar_type() == dt && x.sizes() == c10::IntArrayRef({G, units, kGroup}), "lowlat: ", what,
                  ": ", name, " must be ", c10::toString(dt), " [", G, ", ", units, ", 16]");
    };
    auto u16 = [](const torch::Tensor& x) { return reinterpret_cast<const uint16_t*>(x.data_ptr()); };
    w.qs = reinterpret_cast<const uint8_t*>(qs.data_ptr());
    if (kq) {
      TORCH_CHECK(w.nbp * 32 == K && w.nbp % 8 == 0, "lowlat: ", what, ": K-quant rows must be whole super-blocks, "
                  "got K = ", K);
      check(t[1], mins ? at::kByte : at::kChar, mins ? w.nbp : 2 * w.nbp, "sc");
      check(t[mins ? 3 : 2], at::kShort, w.nbp / 8, "sd");
      w.sc = reinterpret_cast<const uint8_t*>(t[1].data_ptr());
      w.sd = u16(t[mins ? 3 : 2]);
      if (mins) {
        check(t[2], at::kByte, w.nbp, "mn");
        check(t[4], at::kShort, w.nbp / 8, "sm");
        w.mn = reinterpret_cast<const uint8_t*>(t[2].data_ptr());
        w.sm = u16(t[4]);
      }
    } else {
      for (size_t i = 1; i < t.size(); i++) check(t[i], at::kShort, w.nbp, i == 1 ? "d" : "m");
      w.d = u16(t[1]);
      if (u4) w.m = u16(t[2]);
    }
    for (const auto& x : t) q_keep.push_back(x);
    return w;
  }

  // a weight of N rows as row segments: t holds each segment's tensors (make_qw's) one after another; a segment
  // spans its codes' groups of 16 rows (the last one: the rows left)
  QMat make_qmat(const std::vector<torch::Tensor>& t, int64_t N, int64_t K, const std::string& what) {
    QMat w;
    for (size_t i = 0; i < t.size();) {
      // a segment's tensor count from its dtypes: [qs, d(, m)] float16 scales; K-quants [qs, sc, mn, sd, sm] with
      // uint8 sc (u4k, u5k), [qs, sc, sd] with int8 sc (u6k)
      const bool u8 = t[i].scalar_type() == torch::kUInt8;
      const bool kq = i + 1 < t.size() && t[i + 1].scalar_type() != at::kShort;
      const size_t n = std::min(t.size() - i, kq ? (t[i + 1].scalar_type() == at::kByte ? size_t(5) : size_t(3))
                                                 : (u8 ? size_t(3) : size_t(2)));
      const int64_t r0 = w.row0.empty() ? 0 : w.row0.back() + w.seg.back().N;
      TORCH_CHECK(r0 < N && t[i].dim() >= 1, "lowlat: ", what, ": its segments hold more than ", N, " rows");
      const int64_t rows = std::min(N - r0, t[i].size(0) * kGroup);
      w.seg.push_back(make_qw(std::vector<torch::Tensor>(t.begin() + i, t.begin() + i + n), rows, K, what));
      w.row0.push_back(r0);
      i += n;
    }
    TORCH_CHECK(w.seg.empty() || w.row0.back() + w.seg.back().N == N, "lowlat: ", what, ": its segments hold ",
                w.row0.back() + w.seg.back().N, " rows, expected ", N);
    return w;
  }

  // GGUF weights in their stored type: ws = per layer [qkv, o, gate_up, down] (4 L entries, an empty list for a
  // dense one), then the embedding; act_mode: QAct (float, q8 or q16 activations). Sizes the quantized-row buffers.
  void set_quant(std::vector<std::vector<torch::Tensor>> ws, int64_t act_mode) {
    TORCH_CHECK(act_mode >= kActFloat && act_mode <= kActQ16, "lowlat.set_quant: act must be 0, 1 or 2");
    TORCH_CHECK((int64_t)ws.size() == 4 * L + 1, "lowlat.set_quant: expected ", 4 * L + 1, " weights");
    TORCH_CHECK(!dot, "lowlat: stored-type weights take float activations (no bf16 dot products)");
    const int64_t nqkv = (H + 2 * Hkv) * D;
    int64_t nbp_max = 0;
    for (int64_t l = 0; l < L; l++) {
      TORCH_CHECK(!is_moe[l] || (ws[4 * l + 2].empty() && ws[4 * l + 3].empty()), "lowlat: MoE layers stay dense");
      q_qkv[l] = make_qmat(ws[4 * l], nqkv, hidden, "qkv_proj");
      q_o[l] = make_qmat(ws[4 * l + 1], hidden, H * D, "o_proj");
      q_gu[l] = make_qmat(ws[4 * l + 2], 2 * inter, hidden, "gate_up_proj");
      q_down[l] = make_qmat(ws[4 * l + 3], hidden, inter, "down_proj");
      for (const QMat* w : {&q_qkv[l], &q_o[l], &q_gu[l], &q_down[l]})
        if (w->quant()) nbp_max = std::max(nbp_max, w->nbp());
    }
    q_embed = make_qw(ws[4 * L], vocab, hidden, "embed_tokens");
    nbp_max = std::max(nbp_max, q_embed.nbp);
    for (int64_t l = 0; l < L; l++) {  // every placeholder must have been supplied
      TORCH_CHECK((q_qkv[l].quant() || qkv_w[l].numel()) && (q_o[l].quant() || o_w[l].numel()) &&
                      (is_moe[l] || ((q_gu[l].quant() || gu_w[l].numel()) && (q_down[l].quant() || down_w[l].numel()))),
                  "lowlat: layer ", l, " lacks a weight (neither dense nor stored)");
    }
    TORCH_CHECK(q_embed.quant() || embed.numel(), "lowlat: the embedding is neither dense nor stored");
    act = int(act_mode);
    reserve_q8(nbp_max);
  }
  // per thread, max_rows quantized activation rows of up to nbp_max blocks in the scratch buffer
  void reserve_q8(int64_t nbp_max) {
    q8_stride = (act_row_bytes(nbp_max) + 63) / 64 * 64;
    off_q8 = scratch.numel();
    auto grown = torch::zeros({off_q8 + nthreads * max_rows * q8_stride + 64}, torch::kUInt8);
    grown.narrow(0, 0, off_q8).copy_(scratch);
    scratch = grown;
    off_q8 -= 64;  // buf() offsets start at the aligned base, at most 63 bytes in
    off_q8 = (off_q8 + 63) / 64 * 64;
  }
  char* q8buf(int tid) const { return buf<char>(off_q8 + tid * max_rows * q8_stride); }

  // rms-normalize `rows` rows of x (float) with weight w into dst (packed GEMV input or model-dtype output):
  // the module computes weight * rms_norm(x.float()).to(dtype) with the product in the model dtype
  template <typename WT, typename DT>
  void rmsnorm(const float* x, const WT* w, DT* dst, int64_t t0, int64_t t1) const {
    for (int64_t t = t0; t < t1; t++) {
      const float* xr = x + t * hidden;
      const float ss = sumsq(xr, hidden);
      const float r = 1.0f / std::sqrt(ss / float(hidden) + float(eps));
      for (int64_t i = 0; i < hidden; i++) stf<DT>(dst, t * hidden + i, rnd<WT>(ldf(w, i) * rnd<WT>(xr[i] * r)));
    }
  }

  // out = act(gate) * up over n elements: gate and up are raw GEMV outputs (float); like the module, bf16 models
  // round them, the activation and the product to bf16. Both activations are g * sigmoid(z): SiLU with z = g;
  // Gemma's GeGLU gelu_tanh(g) = 0.5 g (1 + tanh(v)), v = sqrt(2 / pi) (g + 0.044715 g^3) (ATen's inner term),
  // with z = 2 v: the same function without tanh's cancellation near 0
  template <typename WT, typename XT, bool kGelu>
  static void gated_mul(const float* g, const float* u, XT* out, int64_t n) {
    constexpr bool kBf = std::is_same<WT, bf16_t>::value;
    const float beta = float(M_SQRT2 * M_2_SQRTPI * 0.5), kappa = 0.044715f;
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
      __m512 gv = _mm512_loadu_ps(g + i), uv = _mm512_loadu_ps(u + i);
      if (kBf) { gv = rbf16(gv); uv = rbf16(uv); }
      __m512 negz;
      if constexpr (kGelu) {
        const __m512 cube = _mm512_mul_ps(_mm512_mul_ps(gv, gv), gv);
        const __m512 inner = _mm512_mul_ps(_mm512_set1_ps(beta), _mm512_fmadd_ps(_mm512_set1_ps(kappa), cube, gv));
        negz = _mm512_mul_ps(_mm512_set1_ps(-2.f), inner);
      } else {
        negz = _mm512_sub_ps(_mm512_setzero_ps(), gv);
      }
      __m512 act = _mm512_div_ps(gv, _mm512_add_ps(_mm512_set1_ps(1.f), exp512(negz)));
      act = kBf ? rbf16(_mm512_mul_ps(rbf16(act), uv)) : _mm512_mul_ps(act, uv);
      float r16[16];
      _mm512_storeu_ps(r16, act);
      for (int e = 0; e < 16; e++) stf<XT>(out, i + e, r16[e]);
    }
    for (; i < n; i++) {
      const float gv = rnd<WT>(g[i]);
      const float negz = kGelu ? -2.f * (beta * (gv + kappa * gv * gv * gv)) : -gv;
      stf<XT>(out, i, rnd<WT>(rnd<WT>(gv / (1.f + std::exp(negz))) * rnd<WT>(u[i])));
    }
  }
  template <typename WT, typename XT>
  static void silu_mul(const float* g, const float* u, XT* out, int64_t n) { gated_mul<WT, XT, false>(g, u, out, n); }
  template <typename WT, typename XT>
  static void gelu_mul(const float* g, const float* u, XT* out, int64_t n) { gated_mul<WT, XT, true>(g, u, out, n); }

  // one of the forward's matmuls: the stored-type kernel when the weight is quantized, else the dense GEMV.
  // quantize=false reuses the quantized rows the previous call left in this thread's buffer (same X)
  template <typename WT, typename XT>
  void mm(const QMat& q, const torch::Tensor& dense, int64_t K, int64_t n0, int64_t n1, const XT* X, int64_t ldx, int M,
          float* out, int64_t ldo, int tid, bool quantize = true) const {
    if (!q.quant()) return gemv<WT, XT>(ptr<WT>(dense), K, n0, n1, X, ldx, M, out, ldo);
    if constexpr (std::is_same<XT, float>::value) {
      char* xq = q8buf(tid);
      if (quantize) prepare_rows(X, ldx, M, K, q.nbp(), xq, q8_stride, act);
      qgemv(q, n0, n1, xq, q8_stride, act, M, out, ldo);
    }
  }

  // ---- defined by kernel family in the headers that include this one
  // gemma.h
  void set_gemma(std::vector<torch::Tensor> in, std::vector<torch::Tensor> pa, std::vector<torch::Tensor> pf,
                 std::vector<torch::Tensor> po, std::vector<torch::Tensor> qn, std::vector<torch::Tensor> kn,
                 torch::Tensor fin, std::vector<int64_t> local, int64_t window_, double embed_scale_);
  void set_rope(torch::Tensor c, torch::Tensor s, torch::Tensor cl, torch::Tensor sl);
  template <typename WT, typename DT>
  void norm1p(const float* x, const float* w1, DT* dst, int64_t t0, int64_t t1) const;
  template <typename WT>
  void round_cols(float* y, int64_t T, int64_t a, int64_t b) const;
  template <typename WT>
  void post_norm_add(const float* y, const float* w1, int64_t T, int64_t a, int64_t b) const;
  template <typename WT>
  void add_residual(float* y, const float* post_w, int64_t T, int64_t a, int64_t b) const;
  // tp.h
  void set_tp(int64_t P, int64_t rank, std::vector<int64_t> vocab_sizes_, double timeout_s,
              c10::optional<torch::Tensor> segment, pybind11::object py_reduce);
  static constexpr int64_t kGatherRows = 16;  // logits rows per gather exchange (bounds the segment's size)
  int64_t tp_segment_bytes(int64_t P, int64_t local_vocab_max) const;
  bool tp_aborted() const { return comm.aborted; }
  std::tuple<int64_t, double> tp_wait_stats();
  void tp_reduce(float* p, int64_t T, int64_t a, int64_t b, int tid, int64_t s, std::string& err);
  template <typename WT>
  void tp_partial(float* p, int64_t T, int64_t a, int64_t b, int tid, int64_t s, std::string& err);
  torch::Tensor linear_gather(torch::Tensor x, torch::Tensor W);
  // attention.h
  template <typename WT, typename XT>
  void attend(const float* q, const int64_t* pos, int64_t t0, int64_t nq, int64_t ctx, int64_t kv_len,
              const std::vector<int64_t>& bt, int64_t bs, const WT* kc, const WT* vc, int64_t h0, int64_t nh,
              XT* ain, std::vector<float>& S, std::vector<float>& O, const int64_t* anc, int64_t win, bool q8,
              const KeyPart& part) const;
  template <typename WT, typename XT>
  void attend_parts(const float* q, const int64_t* pos, int64_t t0, int64_t nq, int64_t ctx, int64_t kv_len,
                    const std::vector<int64_t>& bt, int64_t bs, const WT* kc, const WT* vc, int64_t h0, int64_t nh,
                    XT* ain, std::vector<float>& S, std::vector<float>& O, const int64_t* anc = nullptr,
                    int64_t win = 0, bool q8 = false) const;
  template <typename XT>
  void attend_amx(const float* q, const int64_t* pos, int64_t t0, int64_t nq, int64_t ctx,
                  const std::vector<int64_t>& bt, int64_t bs, const bf16_t* kc, const bf16_t* vc, int64_t h0,
                  int64_t nh, XT* ain, std::vector<float>& S, std::vector<float>& O, const int64_t* anc,
                  int64_t win, const KeyPart& part) const;
  template <typename WT, typename XT, int NV, bool Q8>
  void attend_nv(const float* q, const int64_t* pos, int64_t t0, int64_t nq, int64_t ctx, int64_t kv_len,
                 const std::vector<int64_t>& bt, int64_t bs, const WT* kc, const WT* vc, int64_t h0, int64_t nh,
                 XT* ain, std::vector<float>& S, std::vector<float>& O, const int64_t* anc, int64_t win,
                 const KeyPart& part) const;
  // the attention items of a step with B sequences: (sequence, run of its q heads), numbered sequence-major. One
  // item per sequence reads each cache row (all kv groups, adjacent) in one pass; a single sequence splits its
  // heads into one run per thread.
  int64_t items_per_sequence(int64_t B, int nt) const { return std::min<int64_t>(H, (nt + B - 1) / B); }
  int64_t item_head(int64_t k, int64_t n) const { return k * H / n; }  // item k of n: heads item_head(k) ..
  int64_t item_heads(int64_t k, int64_t n) const { return (k + 1) * H / n - k * H / n; }
  torch::Tensor attention(torch::Tensor qt, torch::Tensor kc, torch::Tensor vc, torch::Tensor positions,
                          std::vector<int64_t> q_lens, std::vector<int64_t> ctx_lens,
                          std::vector<std::vector<int64_t>> bts, int64_t bs) const;
  // moe.h
  struct Route;
  struct TopKCmp;
  template <typename WT>
  void topk_row(const float* lr, Route& rt, int64_t* ids, float* w) const;
  template <typename WT>
  void route(const float* logit, int64_t T, Route& rt) const;
  template <typename WT, typename XT>
  void moe_ffn(int64_t l, int tid, int nt, const XT* xin, int64_t T, Route& rt, int64_t& s, std::string& err);
  std::tuple<torch::Tensor, torch::Tensor> test_route(torch::Tensor logits) const;
  // forward.h
  template <typename WT, typename XT>
  void run(const int64_t* ids, const int64_t* pos, int64_t T, const std::vector<int64_t>& q_lens,
           const std::vector<int64_t>& ctx_lens, const Tables& gbts, int64_t bs,
           const std::vector<WT*>& kcs, const std::vector<WT*>& vcs, const std::vector<std::vector<int64_t>>& gslots,
           const std::vector<int64_t>& lgroup, const std::vector<int64_t>& row0, const std::vector<WT*>& cap_at,
           WT* out);
  std::tuple<torch::Tensor, std::vector<torch::Tensor>> forward(
      torch::Tensor ids, torch::Tensor positions, std::vector<std::vector<torch::Tensor>> kv,
      std::vector<int64_t> q_lens, std::vector<int64_t> ctx_lens, std::vector<std::vector<int64_t>> bts,
      int64_t bs, std::vector<int64_t> capture, std::vector<std::vector<int64_t>> tree, Tables group_tables,
      std::vector<int64_t> layer_group);
  // linear.h
  torch::Tensor linear(torch::Tensor x, torch::Tensor W, c10::optional<torch::Tensor> bias, bool out_float,
                       bool argmax) const;
  torch::Tensor qlinear(torch::Tensor x, std::vector<torch::Tensor> w, int64_t N, bool out_float, bool argmax);
  torch::Tensor dequant_t(std::vector<torch::Tensor> w, int64_t N, int64_t K, int64_t a, int64_t b, bool to_bf16);
  torch::Tensor argmax_rows(const torch::Tensor& y) const;
};

// a kernel (Model, Head) from plugin.py's tensors and keyword options; every name must be one it reads
template <typename K>
std::unique_ptr<K> build(const pybind11::dict& tensors, const pybind11::dict& options, const char* what) {
  const Args w{tensors}, opt{options};
  auto kernel = std::make_unique<K>(w, opt);
  w.check_all_read(what);
  opt.check_all_read(what);
  return kernel;
}

}  // namespace lowlat
