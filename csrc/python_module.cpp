// The Python extension module fused_ops._C: importing it runs the static
// TORCH_LIBRARY registrations; it defines no Python functions of its own
// (the ops are reached through torch.ops.fused_ops).
#include <Python.h>

extern "C" PyObject* PyInit__C(void) {
  static PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module);
}
