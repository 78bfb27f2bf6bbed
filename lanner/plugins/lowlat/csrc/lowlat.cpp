// lowlat: Lanner's reference CPU kernel plugin. One call runs the whole Llama-family forward (embedding, all
// decoder layers over the paged KV cache, dense or MoE feed-forwards, final norm, captured layer outputs) for
// small batches: decode, verify of k drafts, small prefill chunks. At these sizes a step streams every weight
// once and does little arithmetic per byte, so the design goal is to read the weights at memory bandwidth with
// few synchronisations:
//
//  * one OpenMP parallel region for the whole forward; threads split each GEMV over output rows and fuse the
//    epilogue that needs only their rows (bias, q/k norm, RoPE, the KV-cache write, residual adds, SiLU*up),
//    so a layer costs 5 barriers;
//  * GEMV: the weights as the model holds them ([N, K] row-major, no repacked copy), streamed front to back:
//    one row at a time against 1-3 activation rows (memory-bound: one sequential stream per core is what the
//    prefetcher follows best), row pairs with an L2 software prefetch from 4 rows on (the dot products become
//    the bottleneck); float32 accumulation; bf16 weights use `vdpbf16ps` when the CPU has AVX512_BF16
//    (activations packed to bf16 once per GEMV input), else a bf16 -> fp32 shift + FMA; float32 models an FMA
//    GEMV;
//  * MoE feed-forwards (Qwen3-MoE, Mixtral; dense and MoE layers may mix): router GEMV, then per row a float32
//    softmax and top-k that picks the experts torch.topk picks (ties included); the dispatch is a bitmap of the
//    experts hit plus per-expert row counts, each expert's rows placed by the counts (no sort over the tokens),
//    and each hit expert's gate/up and down GEMVs run once over exactly the rows that picked it, so rows that
//    share an expert stream its weights once (a decode step of B rows reads at most B * top_k experts); an MoE
//    layer costs one barrier more than a dense one (the router's), however many experts are hit;
//  * bf16 models round to bf16 exactly where the PyTorch module rounds (GEMV outputs, norms, RoPE terms, SiLU,
//    residual adds; for MoE also the router logits, the routing weight, weight * expert output and each
//    expert's add into the sum, FusedMoE's order) and attention follows PyTorch's CPU flash attention within
//    each 512-key part of a row's keys (attention_split.h folds the parts), so the plugin tracks the engine's own
//    forward bit for bit in nearly all elements up to 512 keys; float32 models are float32 throughout.
//  * Gemma 3 (set_gemma): (1 + w) norms rounded once, post-norms on the attention and feed-forward outputs (whole
//    rows of a row-split GEMV: one barrier more each), GeGLU, the scaled embedding, sliding-window local layers
//    (each row reads the window of its own position) with their own RoPE tables; one rank only.
//  * tensor parallelism: each rank runs its shard (heads, intermediate size, vocabulary rows) and the all-reduces
//    happen inside the call, in the epilogue of the row-parallel GEMVs: each thread publishes its hidden columns
//    to a memory segment the ranks share as soon as they are done and sums the other ranks' copies of them (see
//    Comm), so a reduce costs no barrier beyond the one the layer already has and about 2 us of waiting, against
//    ~1 ms for a gloo all-reduce on the 2-core VM.
//
// The kernels sit by family in this folder's headers, all in this one translation unit (so inlining is as for one
// file): common.h (scalars, vectors, exp, reductions), gemv.h, quant.h (GGUF blocks as stored), comm.h (the TP
// segment), model.h (Model: weights, buffers, norms), gemma.h, tp.h, attention.h, moe.h, forward.h (the step),
// linear.h (matmuls outside the step), head.h (the draft chain); this file holds the Python bindings.
#include "forward.h"
#include "head.h"
#include "linear.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.attr("have_avx512_bf16") = lowlat::kHaveDot;
  m.attr("have_amx_bf16") = lowlat::have_amx();
  m.attr("have_amx_int8") = lowlat::have_amx_int8();
#ifdef __AVX512F__
  m.attr("isa") = "avx512";
#else
  m.attr("isa") = "avx2";
#endif
  m.def("set_amx_gemv_rows", [](int rows) { lowlat::g_amx_gemv_rows = rows; },
        "qgemv: steps of at least this many q8 / q16 rows on AMX-INT8 tiles (0: never)");
  m.def("set_attn_prefetch", [](int64_t tiles) { lowlat::g_attn_prefetch = tiles; },
        "attention: how many 16-key tiles ahead the cache rows are prefetched (0: off)");
  m.def("set_qprefetch", [](int64_t bytes) { lowlat::g_qprefetch = bytes; },
        "stored-type GEMV: how many bytes of codes ahead the weight stream is prefetched into L1 (0: off)");
  m.def("set_block_rows", [](int64_t rows) {
    TORCH_CHECK(rows >= 0 && rows <= 6, "lowlat: block rows must be in 0..6 (0: the mode's own)");
    lowlat::g_block_rows = int(rows);
  }, "stored-type GEMV: activation rows per block (0: the activation mode's own, q16 5, q8 6, float 4)");
  pybind11::class_<lowlat::Model>(m, "Model", pybind11::module_local())  // the AVX2 build loads beside it
      .def(pybind11::init([](const pybind11::dict& tensors, const pybind11::kwargs& options) {
             return lowlat::build<lowlat::Model>(tensors, options, "lowlat.Model");
           }), "Model(tensors, **options): see Model::Model (csrc/model.h)")
      .def("forward", &lowlat::Model::forward, pybind11::call_guard<pybind11::gil_scoped_release>())
      .def("set_quant", &lowlat::Model::set_quant)
      .def("set_gemma", &lowlat::Model::set_gemma)
      .def("set_rope", &lowlat::Model::set_rope)
      .def_readonly("max_pos", &lowlat::Model::max_pos)
      .def("qlinear", &lowlat::Model::qlinear, pybind11::call_guard<pybind11::gil_scoped_release>(),
           pybind11::arg("x"), pybind11::arg("w"), pybind11::arg("n"), pybind11::arg("out_float") = false,
           pybind11::arg("argmax") = false)
      .def_readwrite("invariant", &lowlat::Model::invariant)
      .def_readwrite("attn_dot", &lowlat::Model::attn_dot)
      .def_readwrite("attn_amx", &lowlat::Model::attn_amx)
      .def_readwrite("attn_split", &lowlat::Model::attn_split)
      .def_readwrite("profile", &lowlat::Model::profile)
      .def_readwrite("prof", &lowlat::Model::prof)
      .def_readwrite("prof_calls", &lowlat::Model::prof_calls)
      .def("test_route", &lowlat::Model::test_route)
      .def_readwrite("record_moe", &lowlat::Model::record_moe)
      .def_readonly("moe_log", &lowlat::Model::moe_log)
      .def("attention", &lowlat::Model::attention)
      .def("dequant_t", &lowlat::Model::dequant_t)
      .def("set_tp", &lowlat::Model::set_tp)
      .def("tp_segment_bytes", &lowlat::Model::tp_segment_bytes)
      .def_property_readonly("tp_aborted", &lowlat::Model::tp_aborted)
      .def("tp_wait_stats", &lowlat::Model::tp_wait_stats)
      .def("linear_gather", &lowlat::Model::linear_gather, pybind11::call_guard<pybind11::gil_scoped_release>())
      .def("linear", &lowlat::Model::linear, pybind11::arg("x"), pybind11::arg("weight"),
           pybind11::arg("bias") = pybind11::none(), pybind11::arg("out_float") = false,
           pybind11::arg("argmax") = false)
      .def_readonly("scratch", &lowlat::Model::scratch)
      .def_readonly("dot", &lowlat::Model::dot)
      .def_readonly("nthreads", &lowlat::Model::nthreads)
      .def_readonly("max_rows", &lowlat::Model::max_rows);
  pybind11::class_<lowlat::Head>(m, "Head", pybind11::module_local())
      .def(pybind11::init([](const pybind11::dict& tensors, const pybind11::kwargs& options) {
             return lowlat::build<lowlat::Head>(tensors, options, "lowlat.Head");
           }), "Head(tensors, **options): see Head::Head (csrc/head.h)")
      .def("chain", &lowlat::Head::chain)
      .def("propose", &lowlat::Head::propose)
      .def("set_quant", &lowlat::Head::set_quant);
}
