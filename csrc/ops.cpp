// The schema of every cockpit_fast op, declared once. Backend files register kernels with
// TORCH_LIBRARY_IMPL; the dispatcher picks CPU or CUDA. Importing cockpit_fast._C runs this.
#include <Python.h>
#include <torch/library.h>

extern "C" PyObject* PyInit__C(void) {
  static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module);
}

TORCH_LIBRARY(cockpit_fast, m) {
  m.def("batch_l2(Tensor g, float scale) -> Tensor");
  m.def("sum_grad_squared(Tensor g, float scale) -> Tensor");
  m.def("batch_l2_and_sum_grad_squared(Tensor g, float scale) -> (Tensor, Tensor)");
  m.def("hist1d(Tensor g, int bins, float lo, float hi, float scale) -> Tensor");
  m.def(
      "hist2d(Tensor g, Tensor param, int xbins, int ybins, float xlo, float xhi, float ylo, "
      "float yhi, float scale) -> Tensor");
  m.def("batch_dot(Tensor g, Tensor direction, float scale) -> Tensor");
  m.def("per_sample_stats(Tensor g, float scale, float[] p_values) -> Tensor");
  m.def("outer_hist1d(Tensor left, Tensor right, int bins, float lo, float hi, float scale) -> Tensor");
  m.def(
      "outer_hist2d(Tensor left, Tensor right, Tensor param, int xbins, int ybins, float xlo, "
      "float xhi, float ylo, float yhi, float scale) -> Tensor");
}
