// int4_ops.cpp on its own, as a module for an instruction set other than this CPU's best (engine/kernels/__init__.py
// avx2_int4_ops: the portable loops vectorized for a CPU with AVX2 and no AVX-512), for benchmarks: compiling it
// alone takes a fraction of the whole cpu_ops build.
#include <torch/extension.h>

#include <string>

at::Tensor int4_gemv(const at::Tensor& x, const at::Tensor& packed, int64_t group, const at::Tensor& sz);
std::string int4_gemv_isa();

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using release = py::call_guard<py::gil_scoped_release>;
  m.def("int4_gemv", &int4_gemv, release(), py::arg("x"), py::arg("packed"), py::arg("group"), py::arg("sz"),
        "x @ W.T for 1-4 float32/bfloat16 rows, W 4-bit as _convert_weight_to_int4pack_for_cpu packs it, sz its table");
  m.def("int4_gemv_isa", &int4_gemv_isa, "int4_gemv's loops in this build");
}
