// The schema of every cockpit_fast op, declared once. Backend files register kernels with
// TORCH_LIBRARY_IMPL; the dispatcher picks CPU or CUDA. Importing cockpit_fast._C runs this.
#include <Python.h>
#include <torch/library.h>

extern "C" PyObject* PyInit__C(void) {
  static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module);
}

namespace {

constexpr const char* kOps[] = {"batch_l2",  "sum_grad_squared",  "batch_l2_and_sum_grad_squared",
                                "hist1d",    "hist2d",            "batch_dot",
                                "per_sample_stats", "outer_hist1d", "outer_hist2d",
                                "hist1d_batch_l2_batch_dots", "factored_hist1d_batch_l2_batch_dots"};

// The ops are statistics with no gradient: below autograd, so that their results never require
// grad, as the Python twins' (torch.no_grad) do not, and nothing records a backward that does
// nothing.
void without_gradient(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack) {
  op.redispatchBoxed(keys & c10::after_autograd_keyset, stack);
}

}  // namespace

TORCH_LIBRARY(cockpit_fast, m) {
  m.def("batch_l2(Tensor g, float scale) -> Tensor");
  m.def("sum_grad_squared(Tensor g, float scale) -> Tensor");
  m.def("batch_l2_and_sum_grad_squared(Tensor g, float scale) -> (Tensor, Tensor)");
  m.def("hist1d(Tensor g, int bins, float lo, float hi, float scale) -> Tensor");
  m.def(
      "hist2d(Tensor g, Tensor param, int xbins, int ybins, float xlo, float xhi, float ylo, "
      "float yhi, float scale) -> Tensor");
  m.def("batch_dot(Tensor g, Tensor direction, float scale) -> Tensor");
  m.def(
      "hist1d_batch_l2_batch_dots(Tensor g, Tensor directions, int bins, float lo, float hi, "
      "float hist_scale, float scale) -> (Tensor, Tensor, Tensor)");
  m.def(
      "factored_hist1d_batch_l2_batch_dots(Tensor left, Tensor right, Tensor directions, int bins, "
      "float lo, float hi, float hist_scale, float scale) -> (Tensor, Tensor, Tensor)");
  m.def("per_sample_stats(Tensor g, float scale, float[] p_values) -> Tensor");
  m.def("outer_hist1d(Tensor left, Tensor right, int bins, float lo, float hi, float scale) -> Tensor");
  m.def(
      "outer_hist2d(Tensor left, Tensor right, Tensor param, int xbins, int ybins, float xlo, "
      "float xhi, float ylo, float yhi, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(cockpit_fast, Autograd, m) {
  for (const char* name : kOps) {
    m.impl(name, torch::CppFunction::makeFromBoxedFunction<&without_gradient>());
  }
}
