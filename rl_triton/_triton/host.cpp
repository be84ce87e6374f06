// The per-call host path of a launch plan, in C++ (rl_triton/_triton/host.py builds it).
//
// A plan (`rl_triton._triton.ops.Launch`) fixes everything about a call but its data: the
// compiled kernel, its grid, and each kernel parameter's source. Python hands that over once
// (`make`). A table (`table`, `call`) finds the plan of a later call from its tensors'
// signature, as the Python plan cache does; running it then costs the output allocations, a
// few pointer reads and one cuLaunchKernel, with no Python-level work per argument.
//
// Parameters are described by (kind, value) pairs in the kernel's own order (constexpr
// arguments already dropped, the way Triton's launcher drops them):
//   INPUT  value = index of the tensor in the call's tensor tuple (its data pointer)
//   OUTPUT value = index of the output (its data pointer)
//   STATE  the plan's look-back scratch on the current stream (registered by `add_state`)
//   CONST  value = the integer itself (i32 or i64: the kernel reads its own width of the slot)
//   SCALAR value = index in the call's scalar tuple (a float, passed as float32)
// Every parameter gets its own 8-byte slot; the driver reads as many bytes as the kernel's
// parameter has, from the start of the slot (little-endian).
#include <Python.h>
#include <dlfcn.h>

#include <cstring>
#include <string>
#include <unordered_map>
#include <vector>

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>

namespace {

enum Kind { INPUT = 0, OUTPUT = 1, STATE = 2, CONST = 3, SCALAR = 4 };
constexpr int kMaxParams = 128;
constexpr int kMaxOutputs = 4;

// The two driver entry points used, declared here so that no CUDA header is needed to build.
using CUresult = int;
using LaunchKernel = CUresult (*)(void*, unsigned, unsigned, unsigned, unsigned, unsigned,
                                  unsigned, unsigned, void*, void**, void**);
using GetErrorString = CUresult (*)(CUresult, const char**);
LaunchKernel launch_kernel = nullptr;
GetErrorString get_error_string = nullptr;

struct Plan {
  void* function;
  unsigned grid, block, shared;
  c10::Device device;
  std::vector<int64_t> out_shape;
  at::ScalarType out_dtype;
  int n_out;
  std::vector<int> kinds;
  std::vector<int64_t> values;
  std::vector<std::pair<void*, at::Tensor>> states;  // (stream, look-back scratch), kept alive
};

const char* kCapsule = "rl_triton.host.Plan";

void destroy(PyObject* capsule) {
  delete static_cast<Plan*>(PyCapsule_GetPointer(capsule, kCapsule));
}

bool load_driver() {
  if (launch_kernel != nullptr) return true;
  void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
  if (lib == nullptr) {
    PyErr_SetString(PyExc_RuntimeError, "rl_triton: cannot open libcuda.so.1");
    return false;
  }
  launch_kernel = reinterpret_cast<LaunchKernel>(dlsym(lib, "cuLaunchKernel"));
  get_error_string = reinterpret_cast<GetErrorString>(dlsym(lib, "cuGetErrorString"));
  if (launch_kernel == nullptr) {
    PyErr_SetString(PyExc_RuntimeError, "rl_triton: libcuda.so.1 has no cuLaunchKernel");
    return false;
  }
  return true;
}

// make(function, grid, block, shared, device_index, out_shape, out_dtype, n_out, kinds, values)
PyObject* make(PyObject*, PyObject* args) {
  unsigned long long function;
  unsigned grid, block, shared;
  int device_index, n_out;
  PyObject *shape, *dtype, *kinds, *values;
  if (!PyArg_ParseTuple(args, "KIIIiOOiOO", &function, &grid, &block, &shared, &device_index,
                        &shape, &dtype, &n_out, &kinds, &values)) {
    return nullptr;
  }
  if (!THPDtype_Check(dtype)) {
    PyErr_SetString(PyExc_TypeError, "rl_triton: out_dtype must be a torch.dtype");
    return nullptr;
  }
  if (n_out < 1 || n_out > kMaxOutputs) {
    PyErr_SetString(PyExc_ValueError, "rl_triton: bad output count");
    return nullptr;
  }
  auto plan = new Plan{reinterpret_cast<void*>(function), grid, block, shared,
                       c10::Device(c10::DeviceType::CUDA, device_index), {},
                       reinterpret_cast<THPDtype*>(dtype)->scalar_type, n_out, {}, {}, {}};
  PyObject* capsule = PyCapsule_New(plan, kCapsule, destroy);
  if (capsule == nullptr) {
    delete plan;
    return nullptr;
  }
  Py_ssize_t n = PySequence_Size(kinds);
  bool ok = n >= 0 && n <= kMaxParams && PySequence_Size(values) == n;
  for (Py_ssize_t i = 0; ok && i < n; ++i) {
    PyObject* k = PySequence_GetItem(kinds, i);
    PyObject* v = PySequence_GetItem(values, i);
    ok = k != nullptr && v != nullptr;
    if (ok) {
      plan->kinds.push_back(static_cast<int>(PyLong_AsLong(k)));
      plan->values.push_back(static_cast<int64_t>(PyLong_AsLongLong(v)));
      ok = !PyErr_Occurred();
    }
    Py_XDECREF(k);
    Py_XDECREF(v);
  }
  for (Py_ssize_t i = 0; ok && i < PySequence_Size(shape); ++i) {
    PyObject* s = PySequence_GetItem(shape, i);
    ok = s != nullptr;
    if (ok) plan->out_shape.push_back(PyLong_AsLongLong(s));
    Py_XDECREF(s);
    ok = ok && !PyErr_Occurred();
  }
  if (!ok || PyErr_Occurred()) {
    Py_DECREF(capsule);
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "rl_triton: bad parameter list");
    return nullptr;
  }
  return capsule;
}

// add_state(plan, stream, scratch): the look-back scratch tensor to pass on that stream (the
// plan holds a reference: it stays valid as long as the plan).
PyObject* add_state(PyObject*, PyObject* args) {
  PyObject *capsule, *scratch;
  unsigned long long stream;
  if (!PyArg_ParseTuple(args, "OKO", &capsule, &stream, &scratch)) return nullptr;
  auto plan = static_cast<Plan*>(PyCapsule_GetPointer(capsule, kCapsule));
  if (plan == nullptr) return nullptr;
  if (!THPVariable_Check(scratch)) {
    PyErr_SetString(PyExc_TypeError, "rl_triton: add_state needs a tensor");
    return nullptr;
  }
  plan->states.emplace_back(reinterpret_cast<void*>(stream), THPVariable_Unpack(scratch));
  Py_RETURN_NONE;
}

// The outputs of one call of `plan` (a new list), or None when the current stream has no
// scratch yet (the Python path then runs the call and registers one).
PyObject* run_plan(Plan* plan, PyObject* tensors, PyObject* scalars) {
  HANDLE_TH_ERRORS  // c10 errors (out of memory, ...) become the Python exceptions torch raises
  const auto* impl = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA);
  c10::OptionalDeviceGuard guard;
  if (impl->getDevice() != plan->device) guard.reset_device(plan->device);
  void* stream = impl->getStream(plan->device).native_handle();
  uint64_t state = 0;
  bool found = false;
  for (const auto& s : plan->states) {
    if (s.first == stream) {
      state = reinterpret_cast<uint64_t>(s.second.data_ptr());
      found = true;
      break;
    }
  }
  if (!found) Py_RETURN_NONE;

  at::Tensor outs[kMaxOutputs];
  for (int j = 0; j < plan->n_out; ++j) {
    outs[j] = at::empty(plan->out_shape,
                        at::TensorOptions().dtype(plan->out_dtype).device(plan->device));
  }
  const size_t n = plan->kinds.size();
  uint64_t slots[kMaxParams];
  void* params[kMaxParams];
  for (size_t i = 0; i < n; ++i) {
    const int64_t v = plan->values[i];
    switch (plan->kinds[i]) {
      case INPUT: {
        if (v >= PyTuple_GET_SIZE(tensors) || !THPVariable_Check(PyTuple_GET_ITEM(tensors, v))) {
          PyErr_SetString(PyExc_TypeError, "rl_triton: a plan's input is not a tensor");
          return nullptr;
        }
        slots[i] = reinterpret_cast<uint64_t>(
            THPVariable_Unpack(PyTuple_GET_ITEM(tensors, v)).data_ptr());
        break;
      }
      case OUTPUT:
        slots[i] = reinterpret_cast<uint64_t>(outs[v].data_ptr());
        break;
      case STATE:
        slots[i] = state;
        break;
      case CONST:
        slots[i] = static_cast<uint64_t>(v);
        break;
      case SCALAR: {
        if (v >= PyTuple_GET_SIZE(scalars)) {
          PyErr_SetString(PyExc_TypeError, "rl_triton: missing scalar");
          return nullptr;
        }
        const double d = PyFloat_AsDouble(PyTuple_GET_ITEM(scalars, v));
        if (d == -1.0 && PyErr_Occurred()) return nullptr;
        const float f = static_cast<float>(d);
        slots[i] = 0;
        std::memcpy(&slots[i], &f, sizeof(f));
        break;
      }
      default:
        PyErr_SetString(PyExc_ValueError, "rl_triton: bad parameter kind");
        return nullptr;
    }
    params[i] = &slots[i];
  }
  if (!load_driver()) return nullptr;
  const CUresult err = launch_kernel(plan->function, plan->grid, 1, 1, plan->block, 1, 1,
                                     plan->shared, stream, params, nullptr);
  if (err != 0) {
    const char* what = "unknown error";
    if (get_error_string != nullptr) get_error_string(err, &what);
    PyErr_Format(PyExc_RuntimeError, "rl_triton: kernel launch failed: %s", what);
    return nullptr;
  }
  PyObject* result = PyList_New(plan->n_out);
  if (result == nullptr) return nullptr;
  for (int j = 0; j < plan->n_out; ++j) {
    PyObject* t = THPVariable_Wrap(std::move(outs[j]));
    if (t == nullptr) {
      Py_DECREF(result);
      return nullptr;
    }
    PyList_SET_ITEM(result, j, t);
  }
  return result;
  END_HANDLE_TH_ERRORS
}

// ---- tables: plans by their tensors' signature ------------------------------------------------
// The signature of a call is that of `rl_triton.estimators._signature` without the name and
// options (a table serves one of those): for every tensor its shape, strides, dtype, device and
// whether its data is 16-byte aligned; None where the call passes None.

struct Table {
  std::unordered_map<std::string, PyObject*> plans;  // signature -> plan capsule (owned)
  void clear() {
    for (auto& kv : plans) Py_DECREF(kv.second);
    plans.clear();
  }
  ~Table() { clear(); }
};

const char* kTableCapsule = "rl_triton.host.Table";

void destroy_table(PyObject* capsule) {
  delete static_cast<Table*>(PyCapsule_GetPointer(capsule, kTableCapsule));
}

// false when an item is neither None nor a strided tensor (no plan has such a signature)
bool signature(PyObject* tensors, std::string& key) {
  int64_t buf[512];
  size_t n = 0;
  const Py_ssize_t count = PyTuple_GET_SIZE(tensors);
  for (Py_ssize_t i = 0; i < count; ++i) {
    PyObject* obj = PyTuple_GET_ITEM(tensors, i);
    if (obj == Py_None) {
      if (n + 1 > 512) return false;
      buf[n++] = -1;
      continue;
    }
    if (!THPVariable_Check(obj)) return false;
    const at::Tensor& t = THPVariable_Unpack(obj);
    if (!t.defined() || t.layout() != c10::kStrided) return false;
    const int64_t dim = t.dim();
    if (n + 2 * dim + 5 > 512) return false;
    buf[n++] = dim;
    for (int64_t d = 0; d < dim; ++d) buf[n++] = t.size(d);
    for (int64_t d = 0; d < dim; ++d) buf[n++] = t.stride(d);
    buf[n++] = static_cast<int64_t>(t.scalar_type());
    buf[n++] = static_cast<int64_t>(t.device().type());
    buf[n++] = t.device().index();
    buf[n++] = (reinterpret_cast<uintptr_t>(t.data_ptr()) % 16) == 0;
  }
  key.assign(reinterpret_cast<const char*>(buf), n * sizeof(int64_t));
  return true;
}

PyObject* table_new(PyObject*, PyObject*) {
  auto table = new Table();
  PyObject* capsule = PyCapsule_New(table, kTableCapsule, destroy_table);
  if (capsule == nullptr) delete table;
  return capsule;
}

// table_add(table, tensors, plan): later calls with the signature of `tensors` run `plan`.
PyObject* table_add(PyObject*, PyObject* args) {
  PyObject *capsule, *tensors, *plan;
  if (!PyArg_ParseTuple(args, "OO!O", &capsule, &PyTuple_Type, &tensors, &plan)) return nullptr;
  auto table = static_cast<Table*>(PyCapsule_GetPointer(capsule, kTableCapsule));
  if (table == nullptr || PyCapsule_GetPointer(plan, kCapsule) == nullptr) return nullptr;
  std::string key;
  if (!signature(tensors, key)) {
    PyErr_SetString(PyExc_TypeError, "rl_triton: table_add needs tensors or None");
    return nullptr;
  }
  Py_INCREF(plan);
  auto it = table->plans.find(key);
  if (it != table->plans.end()) {
    Py_DECREF(it->second);
    it->second = plan;
  } else {
    table->plans.emplace(std::move(key), plan);
  }
  Py_RETURN_NONE;
}

PyObject* table_clear(PyObject*, PyObject* capsule) {
  auto table = static_cast<Table*>(PyCapsule_GetPointer(capsule, kTableCapsule));
  if (table == nullptr) return nullptr;
  table->clear();
  Py_RETURN_NONE;
}

// call(table, tensors, scalars) -> [outputs], or None when no plan has this signature or the
// plan has no scratch on the current stream yet (the Python path takes the call).
PyObject* call(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 3 || !PyTuple_Check(args[1]) || !PyTuple_Check(args[2])) {
    PyErr_SetString(PyExc_TypeError, "rl_triton: call(table, tensors: tuple, scalars: tuple)");
    return nullptr;
  }
  auto table = static_cast<Table*>(PyCapsule_GetPointer(args[0], kTableCapsule));
  if (table == nullptr) return nullptr;
  std::string key;
  if (!signature(args[1], key)) Py_RETURN_NONE;
  auto it = table->plans.find(key);
  if (it == table->plans.end()) Py_RETURN_NONE;
  auto plan = static_cast<Plan*>(PyCapsule_GetPointer(it->second, kCapsule));
  if (plan == nullptr) return nullptr;
  return run_plan(plan, args[1], args[2]);
}

PyMethodDef methods[] = {
    {"make", make, METH_VARARGS, "A plan's launch description, as a capsule."},
    {"add_state", add_state, METH_VARARGS, "Register a plan's look-back scratch for a stream."},
    {"table", table_new, METH_NOARGS, "A new, empty table of plans by signature."},
    {"table_add", table_add, METH_VARARGS, "Index a plan under its call's signature."},
    {"table_clear", table_clear, METH_O, "Forget every plan of a table."},
    {"call", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(call)), METH_FASTCALL,
     "Run the plan of a call's signature, if the table has one."},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "rl_triton_host", nullptr, -1, methods};

}  // namespace

PyMODINIT_FUNC PyInit_rl_triton_host() { return PyModule_Create(&module); }
