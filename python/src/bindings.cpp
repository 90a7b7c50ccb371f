// megamoe._C: the public C++ API (include/megamoe) as a nanobind module, with no torch dependency.
//
// Conventions (python/megamoe wraps this module; users call that, not _C):
// - A non-ok Status becomes a Python exception of the class registered for its code through
//   _set_error_classes() (megamoe/errors.py), with the C++ message unchanged.
// - Tensors cross as plain tuples (data_ptr, dtype, shape, strides, device_kind, device_index), so
//   numpy arrays, torch tensors and raw device pointers all use one path and nothing here knows a
//   framework; megamoe.torch's forward hands its tensors over as they are (forward_tensors: read
//   through torch.Tensor's methods, with the dtype table it registered), for its host time. The
//   caller keeps the memory alive for the duration of the call (and, on a GPU backend, until the
//   stream has consumed it, as with any stream-ordered library).
// - The GIL is released around every call that launches kernels, blocks on peers or runs the cpu
//   backend's rank threads (create, warmup, forward, check_error, NCCL bootstraps), so ranks driven
//   from Python threads make progress together.
#include <cuda_runtime_api.h>
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "core/device.h"
#include "megamoe/checkpoint.h"
#include "megamoe/comm.h"
#include "megamoe/config.h"
#include "megamoe/knobs.h"
#include "megamoe/layer.h"
#include "megamoe/status.h"
#include "megamoe/tensor.h"
#include "megamoe/types.h"
#include "megamoe/weights.h"
#include "reference/error_model.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace megamoe {
namespace {

// A non-ok Status on its way to Python (translated by the handler registered in the module).
struct StatusError {
  StatusCode code;
  std::string message;
};

void check(const Status& st) {
  if (!st.is_ok()) throw StatusError{st.code(), st.message()};
}

// Python classes per StatusCode, set by megamoe/errors.py at import; RuntimeError until then.
PyObject* g_error_classes[static_cast<int>(StatusCode::kInternal) + 1] = {};

void set_error_classes(nb::dict classes) {
  for (auto [key, value] : classes) {
    const int code = nb::cast<int>(key);
    if (code <= 0 || code > static_cast<int>(StatusCode::kInternal))
      throw nb::value_error(("_set_error_classes: no StatusCode " + std::to_string(code)).c_str());
    Py_XDECREF(g_error_classes[code]);
    g_error_classes[code] = value.ptr();
    Py_INCREF(value.ptr());
  }
}

// ---- tensors ----

// (data_ptr, dtype, shape, strides, device_kind, device_index) -> TensorView; None -> absent view.
TensorView to_view(nb::handle obj, const char* name) {
  TensorView v;
  if (obj.is_none()) return v;
  nb::tuple t = nb::cast<nb::tuple>(obj);
  if (t.size() != 6)
    throw nb::value_error((std::string(name) + ": a tensor crosses as (data_ptr, dtype, shape, strides, "
                                               "device_kind, device_index)").c_str());
  v.data = reinterpret_cast<void*>(nb::cast<uintptr_t>(t[0]));
  v.dtype = static_cast<DType>(nb::cast<int>(t[1]));
  nb::tuple shape = nb::cast<nb::tuple>(t[2]);
  nb::tuple strides = nb::cast<nb::tuple>(t[3]);
  if (shape.size() > static_cast<size_t>(TensorView::kMaxDims))
    throw StatusError{StatusCode::kInvalidArgument,
                      "invalid argument: " + std::string(name) + ".ndim=" + std::to_string(shape.size()) +
                          ", must be at most " + std::to_string(TensorView::kMaxDims)};
  if (strides.size() != shape.size())
    throw nb::value_error((std::string(name) + ": strides and shape differ in length").c_str());
  v.ndim = static_cast<int>(shape.size());
  for (int i = 0; i < v.ndim; ++i) {
    v.shape[i] = nb::cast<int64_t>(shape[i]);
    v.strides[i] = nb::cast<int64_t>(strides[i]);
  }
  v.device.kind = static_cast<DeviceKind>(nb::cast<int>(t[4]));
  v.device.index = nb::cast<int>(t[5]);
  return v;
}

// ---- tensors read in place (megamoe.torch's forward) ----
// The same TensorView from an object with torch.Tensor's methods (dtype, data_ptr(), shape,
// is_contiguous(), stride(), get_device()), read here rather than packed into a tuple in Python: the
// forward's host time. Its dtype objects map to DType codes through the table megamoe.torch sets once
// (_set_tensor_dtypes); nothing here imports torch.
std::vector<std::pair<PyObject*, DType>> g_tensor_dtypes;  // strong references, for the process

void set_tensor_dtypes(nb::list pairs) {
  for (auto& e : g_tensor_dtypes) Py_DECREF(e.first);
  g_tensor_dtypes.clear();
  for (nb::handle item : pairs) {
    nb::tuple t = nb::cast<nb::tuple>(item);
    PyObject* dtype = t[0].ptr();
    Py_INCREF(dtype);
    g_tensor_dtypes.emplace_back(dtype, static_cast<DType>(nb::cast<int>(t[1])));
  }
}

struct TensorNames {  // interned once
  PyObject *dtype, *data_ptr, *shape, *is_contiguous, *stride, *get_device;
};
const TensorNames& tensor_names() {
  static const TensorNames n{PyUnicode_InternFromString("dtype"), PyUnicode_InternFromString("data_ptr"),
                             PyUnicode_InternFromString("shape"), PyUnicode_InternFromString("is_contiguous"),
                             PyUnicode_InternFromString("stride"), PyUnicode_InternFromString("get_device")};
  return n;
}

nb::object py_steal(PyObject* o) {
  if (!o) throw nb::python_error();
  return nb::steal(o);
}

int64_t py_int(PyObject* o) {
  const long long v = PyLong_AsLongLong(o);
  if (v == -1 && PyErr_Occurred()) throw nb::python_error();
  return v;
}

TensorView tensor_view_of(nb::handle obj, const char* name) {
  TensorView v;
  if (obj.is_none()) return v;
  const TensorNames& n = tensor_names();
  PyObject* t = obj.ptr();
  nb::object dtype = py_steal(PyObject_GetAttr(t, n.dtype));
  bool known = false;
  for (const auto& e : g_tensor_dtypes)
    if (e.first == dtype.ptr()) {
      v.dtype = e.second;
      known = true;
      break;
    }
  if (!known)
    throw StatusError{StatusCode::kInvalidArgument, "invalid argument: " + std::string(name) + ".dtype=" +
                                                        nb::cast<std::string>(nb::str(dtype)) +
                                                        ", megamoe takes none of that dtype"};
  v.data = reinterpret_cast<void*>(static_cast<uintptr_t>(py_int(py_steal(PyObject_CallMethodNoArgs(t, n.data_ptr)).ptr())));
  nb::object shape = py_steal(PyObject_GetAttr(t, n.shape));  // torch.Size: a tuple
  if (!PyTuple_Check(shape.ptr())) throw nb::type_error((std::string(name) + ".shape is not a tuple").c_str());
  const Py_ssize_t ndim = PyTuple_GET_SIZE(shape.ptr());
  if (ndim > TensorView::kMaxDims)
    throw StatusError{StatusCode::kInvalidArgument, "invalid argument: " + std::string(name) + ".ndim=" +
                                                        std::to_string(ndim) + ", must be at most " +
                                                        std::to_string(TensorView::kMaxDims)};
  v.ndim = static_cast<int>(ndim);
  for (int i = 0; i < v.ndim; ++i) v.shape[i] = py_int(PyTuple_GET_ITEM(shape.ptr(), i));
  nb::object contiguous = py_steal(PyObject_CallMethodNoArgs(t, n.is_contiguous));
  if (contiguous.ptr() == Py_True) {
    int64_t stride = 1;
    for (int i = v.ndim - 1; i >= 0; --i) {
      v.strides[i] = stride;
      stride *= v.shape[i];
    }
  } else {
    nb::object strides = py_steal(PyObject_CallMethodNoArgs(t, n.stride));
    if (!PyTuple_Check(strides.ptr()) || PyTuple_GET_SIZE(strides.ptr()) != ndim)
      throw nb::value_error((std::string(name) + ": strides and shape differ in length").c_str());
    for (int i = 0; i < v.ndim; ++i) v.strides[i] = py_int(PyTuple_GET_ITEM(strides.ptr(), i));
  }
  const int64_t index = py_int(py_steal(PyObject_CallMethodNoArgs(t, n.get_device)).ptr());
  v.device = index < 0 ? Device::cpu() : Device::cuda(static_cast<int>(index));
  return v;
}

nb::tuple device_tuple(const Device& d) { return nb::make_tuple(static_cast<int>(d.kind), d.index); }

// ---- checkpoints ----

// A numpy array viewing host memory `v` (its bits: bf16 as uint16, e4m3 / e8m0 / packed e2m1 as
// uint8), kept alive by `owner`; None for an absent view.
nb::object host_array(const TensorView& v, nb::handle owner) {
  if (!v.present()) return nb::none();
  size_t shape[TensorView::kMaxDims];
  int64_t strides[TensorView::kMaxDims];
  for (int i = 0; i < v.ndim; ++i) {
    shape[i] = static_cast<size_t>(v.shape[i]);
    strides[i] = v.strides[i];
  }
  nb::dlpack::dtype dt;
  switch (v.dtype) {
    case DType::kFloat32: dt = nb::dtype<float>(); break;
    case DType::kBFloat16: dt = nb::dtype<uint16_t>(); break;
    case DType::kFloat8E4M3:
    case DType::kFloat8E8M0:
    case DType::kFloat4E2M1x2:
    case DType::kUInt8: dt = nb::dtype<uint8_t>(); break;
    default:
      throw StatusError{StatusCode::kInternal, std::string("checkpoint tensor of dtype ") + to_string(v.dtype) +
                                                   " has no numpy view here"};
  }
  return nb::cast(nb::ndarray<nb::numpy>(v.data, static_cast<size_t>(v.ndim), shape, owner, strides, dt));
}

// load_checkpoint_experts() for Python: a dict of the geometry, layer, layout, format, files,
// description and the weight arrays (numpy, viewing the loader's host copy, which they keep alive).
nb::dict load_checkpoint(const std::string& dir, int64_t layer, int64_t ep_size, int64_t ep_rank,
                         int64_t max_tokens_per_rank) {
  auto ck = std::make_shared<CheckpointExperts>();
  Status st;
  {
    nb::gil_scoped_release release;
    st = load_checkpoint_experts(dir, layer, ep_size, ep_rank, max_tokens_per_rank, ck.get());
  }
  check(st);
  nb::capsule owner(new std::shared_ptr<CheckpointExperts>(ck),
                    [](void* p) noexcept { delete static_cast<std::shared_ptr<CheckpointExperts>*>(p); });
  const MoeWeights& w = ck->weights;
  nb::dict d;
  d["geometry"] = ck->geometry;
  d["layer"] = ck->layer;
  d["layout"] = std::string(to_string(ck->layout));
  d["weight_format"] = ck->format;
  d["files"] = ck->files;
  d["description"] = ck->to_string();
  d["has_input_scale"] = ck->has_input_scale;
  const std::pair<const char*, const TensorView*> fields[] = {
      {"w13", &w.w13}, {"w13_scale", &w.w13_scale}, {"w2", &w.w2}, {"w2_scale", &w.w2_scale},
      {"w13_global_scale", &w.w13_global_scale}, {"w2_global_scale", &w.w2_global_scale}};
  for (const auto& [name, view] : fields) {
    d[name] = host_array(*view, owner);
    d[(std::string(name) + "_dtype").c_str()] = static_cast<int>(view->dtype);
  }
  return d;
}

// ---- layers ----

// The Python handle of one MoeLayer. The layer object goes away with the handle (or destroy()).
class PyLayer {
 public:
  explicit PyLayer(std::unique_ptr<MoeLayer> layer) : layer_(std::move(layer)) {}

  MoeLayer& get() const {
    if (!layer_)
      throw StatusError{StatusCode::kFailedPrecondition, "the layer was destroyed (destroy() was called on it)"};
    return *layer_;
  }
  bool alive() const { return layer_ != nullptr; }
  void destroy() {
    std::unique_ptr<MoeLayer> gone = std::move(layer_);
    nb::gil_scoped_release release;
    gone.reset();
  }

 private:
  std::unique_ptr<MoeLayer> layer_;
};

PyLayer* create_layer(const MoeGeometry& g, const MoeConfig& c, nb::handle w13, nb::handle w13_scale, nb::handle w2,
                      nb::handle w2_scale, std::shared_ptr<Communicator> comm, nb::handle w13_global_scale,
                      nb::handle w2_global_scale) {
  MoeWeights w{to_view(w13, "w13"),
               to_view(w13_scale, "w13_scale"),
               to_view(w2, "w2"),
               to_view(w2_scale, "w2_scale"),
               to_view(w13_global_scale, "w13_global_scale"),
               to_view(w2_global_scale, "w2_global_scale")};
  std::unique_ptr<MoeLayer> layer;
  Status st;
  {
    nb::gil_scoped_release release;
    st = MoeLayer::create(g, c, w, std::move(comm), &layer);
  }
  check(st);
  return new PyLayer(std::move(layer));
}

void forward(PyLayer& self, nb::handle x, nb::handle topk_ids, nb::handle topk_weights, nb::handle y, uintptr_t stream,
             nb::handle x_scale) {
  MoeLayer& layer = self.get();
  const TensorView vx = to_view(x, "x"), vids = to_view(topk_ids, "topk_ids"),
                   vw = to_view(topk_weights, "topk_weights"), vy = to_view(y, "y"), vs = to_view(x_scale, "x_scale");
  Status st;
  {
    nb::gil_scoped_release release;
    st = layer.forward(vx, vids, vw, vy, reinterpret_cast<void*>(stream), vs);
  }
  check(st);
}

// forward() on tensors read in place (tensor_view_of): megamoe.torch's forward.
void forward_tensors(PyLayer& self, nb::handle x, nb::handle topk_ids, nb::handle topk_weights, nb::handle y,
                     uintptr_t stream, nb::handle x_scale) {
  MoeLayer& layer = self.get();
  const TensorView vx = tensor_view_of(x, "x"), vids = tensor_view_of(topk_ids, "topk_ids"),
                   vw = tensor_view_of(topk_weights, "topk_weights"), vy = tensor_view_of(y, "y"),
                   vs = tensor_view_of(x_scale, "x_scale");
  Status st;
  {
    nb::gil_scoped_release release;
    st = layer.forward(vx, vids, vw, vy, reinterpret_cast<void*>(stream), vs);
  }
  check(st);
}

// ---- diagnostics (tests and the host-overhead measurement) ----

// Host nanoseconds of each of `iters` forward() calls made from C++ on prebuilt views: the baseline
// the Python forward's overhead is measured against.
std::vector<int64_t> time_forward(PyLayer& self, nb::handle x, nb::handle topk_ids, nb::handle topk_weights,
                                  nb::handle y, uintptr_t stream, nb::handle x_scale, int iters) {
  MoeLayer& layer = self.get();
  const TensorView vx = to_view(x, "x"), vids = to_view(topk_ids, "topk_ids"),
                   vw = to_view(topk_weights, "topk_weights"), vy = to_view(y, "y"), vs = to_view(x_scale, "x_scale");
  std::vector<int64_t> ns;
  ns.reserve(iters);
  Status st;
  {
    nb::gil_scoped_release release;
    for (int i = 0; i < iters && st.is_ok(); ++i) {
      const auto t0 = std::chrono::steady_clock::now();
      st = layer.forward(vx, vids, vw, vy, reinterpret_cast<void*>(stream), vs);
      ns.push_back(std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count());
    }
  }
  check(st);
  return ns;
}

void cuda_check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    cudaGetLastError();
    throw StatusError{StatusCode::kCudaError, std::string(what) + ": " + cudaGetErrorString(err)};
  }
}

// The nodes of a CUDA graph, in the graph's order: the kernel's function name, or "<memcpy>" /
// "<memset>" / "<node type N>".
std::vector<std::string> graph_nodes(uintptr_t graph_ptr) {
  cudaGraph_t graph = reinterpret_cast<cudaGraph_t>(graph_ptr);
  size_t n = 0;
  cuda_check(cudaGraphGetNodes(graph, nullptr, &n), "cudaGraphGetNodes");
  std::vector<cudaGraphNode_t> nodes(n);
  cuda_check(cudaGraphGetNodes(graph, nodes.data(), &n), "cudaGraphGetNodes");
  std::vector<std::string> out;
  for (cudaGraphNode_t node : nodes) {
    cudaGraphNodeType type;
    cuda_check(cudaGraphNodeGetType(node, &type), "cudaGraphNodeGetType");
    if (type == cudaGraphNodeTypeKernel) {
      cudaKernelNodeParams params{};
      cuda_check(cudaGraphKernelNodeGetParams(node, &params), "cudaGraphKernelNodeGetParams");
      const char* name = nullptr;
      if (cudaFuncGetName(&name, params.func) != cudaSuccess || !name) {
        cudaGetLastError();
        name = "<kernel>";
      }
      out.emplace_back(name);
    } else if (type == cudaGraphNodeTypeMemcpy) {
      out.emplace_back("<memcpy>");
    } else if (type == cudaGraphNodeTypeMemset) {
      out.emplace_back("<memset>");
    } else {
      out.emplace_back("<node type " + std::to_string(static_cast<int>(type)) + ">");
    }
  }
  return out;
}

// forward() captured from C++ on `stream` (which must not be capturing): its graph's nodes.
std::vector<std::string> captured_forward_nodes(PyLayer& self, nb::handle x, nb::handle topk_ids,
                                                nb::handle topk_weights, nb::handle y, uintptr_t stream_ptr,
                                                nb::handle x_scale) {
  MoeLayer& layer = self.get();
  const TensorView vx = to_view(x, "x"), vids = to_view(topk_ids, "topk_ids"),
                   vw = to_view(topk_weights, "topk_weights"), vy = to_view(y, "y"), vs = to_view(x_scale, "x_scale");
  cudaStream_t stream = reinterpret_cast<cudaStream_t>(stream_ptr);
  cudaGraph_t graph = nullptr;
  Status st;
  {
    nb::gil_scoped_release release;
    cuda_check(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), "cudaStreamBeginCapture");
    st = layer.forward(vx, vids, vw, vy, stream, vs);
    const cudaError_t end = cudaStreamEndCapture(stream, &graph);
    if (st.is_ok()) cuda_check(end, "cudaStreamEndCapture");
  }
  check(st);
  std::vector<std::string> nodes = graph_nodes(reinterpret_cast<uintptr_t>(graph));
  cudaGraphDestroy(graph);
  return nodes;
}

nb::tuple status_tuple(const Status& s) { return nb::make_tuple(static_cast<int>(s.code()), s.message()); }

Status status_from(nb::handle gate) {
  if (gate.is_none()) return Status::ok();
  nb::tuple t = nb::cast<nb::tuple>(gate);
  return Status(static_cast<StatusCode>(nb::cast<int>(t[0])), nb::cast<std::string>(t[1]));
}

// ---- enums given as enum values or their canonical names ----

template <typename E>
E enum_arg(nb::handle v, Status (*parse)(const std::string&, E*)) {
  if (nb::isinstance<nb::str>(v)) {
    E out{};
    check(parse(nb::cast<std::string>(v), &out));
    return out;
  }
  return nb::cast<E>(v);
}

template <typename E, typename Cls>
void enum_field(Cls& cls, const char* name, E MoeConfig::*field, Status (*parse)(const std::string&, E*)) {
  cls.def_prop_rw(
      name, [field](const MoeConfig& c) { return c.*field; },
      [field, parse](MoeConfig& c, nb::handle v) { c.*field = enum_arg<E>(v, parse); });
}

Status parse_dtype(const std::string& s, DType* out) {
  for (int i = 0; i <= static_cast<int>(DType::kUInt8); ++i) {
    if (s == to_string(static_cast<DType>(i))) {
      *out = static_cast<DType>(i);
      return Status::ok();
    }
  }
  return invalid_argument("value", "dtype", "'" + s + "'", "is not a megamoe dtype name");
}

// Sets attributes from keyword arguments (constructors of the plain structs): `cpp` was just
// constructed in place by the binding's __init__.
template <typename T>
void set_fields(T* cpp, nb::kwargs kwargs) {
  nb::handle self = nb::find(cpp);
  nb::inst_mark_ready(self);
  for (auto [key, value] : kwargs) {
    const std::string name = nb::cast<std::string>(key);
    if (!nb::hasattr(self, name.c_str()))
      throw nb::type_error(("unexpected keyword argument '" + name + "'").c_str());
    nb::setattr(self, key, value);
  }
}

}  // namespace
}  // namespace megamoe

NB_MODULE(_C, m) {
  using namespace megamoe;
  m.doc() = "megamoe C++ API (use the megamoe package; this module is its binding)";
  m.attr("__version__") = MEGAMOE_VERSION;

  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const StatusError& e) {
      PyObject* cls = g_error_classes[static_cast<int>(e.code)];
      PyErr_SetString(cls ? cls : PyExc_RuntimeError, e.message.c_str());
    }
  });
  m.def("_set_error_classes", &set_error_classes);
  m.def("_set_tensor_dtypes", &set_tensor_dtypes, "pairs"_a);
  m.def("load_checkpoint_experts", &load_checkpoint, "dir"_a, "layer"_a, "ep_size"_a, "ep_rank"_a,
        "max_tokens_per_rank"_a);

  nb::enum_<StatusCode>(m, "StatusCode", nb::is_arithmetic())
      .value("ok", StatusCode::kOk)
      .value("invalid_argument", StatusCode::kInvalidArgument)
      .value("unavailable", StatusCode::kUnavailable)
      .value("failed_precondition", StatusCode::kFailedPrecondition)
      .value("timeout", StatusCode::kTimeout)
      .value("io_error", StatusCode::kIoError)
      .value("cuda_error", StatusCode::kCudaError)
      .value("nccl_error", StatusCode::kNcclError)
      .value("internal", StatusCode::kInternal);
  // Raises the exception of `code` with `message` (tests of the mapping; Python-side refusals).
  m.def("_raise_status", [](int code, const std::string& message) { check(Status(static_cast<StatusCode>(code), message)); });

  nb::enum_<DType>(m, "DType", nb::is_arithmetic())
      .value("float32", DType::kFloat32)
      .value("float64", DType::kFloat64)
      .value("bfloat16", DType::kBFloat16)
      .value("float16", DType::kFloat16)
      .value("int32", DType::kInt32)
      .value("int64", DType::kInt64)
      .value("float8_e4m3", DType::kFloat8E4M3)
      .value("float8_e8m0", DType::kFloat8E8M0)
      .value("float4_e2m1x2", DType::kFloat4E2M1x2)
      .value("uint8", DType::kUInt8);
  nb::enum_<Backend>(m, "Backend", nb::is_arithmetic())
      .value("auto", Backend::kAuto)
      .value("mega", Backend::kMega)
      .value("routed", Backend::kRouted)
      .value("cpu", Backend::kCpu);
  nb::enum_<WeightFormat>(m, "WeightFormat", nb::is_arithmetic())
      .value("bf16", WeightFormat::kBf16)
      .value("fp8_block", WeightFormat::kFp8Block)
      .value("mxfp8", WeightFormat::kMxfp8)
      .value("nvfp4", WeightFormat::kNvfp4)
      .value("mxfp4", WeightFormat::kMxfp4);
  nb::enum_<DispatchFormat>(m, "DispatchFormat", nb::is_arithmetic())
      .value("bf16", DispatchFormat::kBf16)
      .value("fp8_block", DispatchFormat::kFp8Block);
  nb::enum_<CombineDtype>(m, "CombineDtype", nb::is_arithmetic())
      .value("bf16", CombineDtype::kBf16)
      .value("mxfp8", CombineDtype::kMxfp8)
      .value("nvfp4", CombineDtype::kNvfp4);
  nb::enum_<OwnerReduce>(m, "OwnerReduce", nb::is_arithmetic())
      .value("auto", OwnerReduce::kAuto)
      .value("off", OwnerReduce::kOff)
      .value("on", OwnerReduce::kOn);
  nb::enum_<DeviceKind>(m, "DeviceKind", nb::is_arithmetic()).value("cpu", DeviceKind::kCpu).value("cuda", DeviceKind::kCuda);
  nb::enum_<CommKind>(m, "CommKind", nb::is_arithmetic()).value("host_threads", CommKind::kHostThreads).value("nccl", CommKind::kNccl);

  // Canonical names (command line, knob cache) of each enum value.
  m.def("name_of", [](Backend v) { return std::string(to_string(v)); });
  m.def("name_of", [](WeightFormat v) { return std::string(to_string(v)); });
  m.def("name_of", [](DispatchFormat v) { return std::string(to_string(v)); });
  m.def("name_of", [](CombineDtype v) { return std::string(to_string(v)); });
  m.def("name_of", [](OwnerReduce v) { return std::string(to_string(v)); });
  m.def("name_of", [](DType v) { return std::string(to_string(v)); });
  m.def("name_of", [](StatusCode v) { return std::string(to_string(v)); });
  m.def("parse_dtype", [](const std::string& s) {
    DType d{};
    check(parse_dtype(s, &d));
    return d;
  });
  m.def("dtype_bytes", [](DType v) { return dtype_bytes(v); });

  nb::class_<MoeGeometry>(m, "MoeGeometry")
      .def(nb::init<>())
      .def("__init__",
           [](MoeGeometry* g, nb::kwargs kw) {
             new (g) MoeGeometry();
             set_fields(g, kw);
           })
      .def_rw("hidden", &MoeGeometry::hidden)
      .def_rw("intermediate", &MoeGeometry::intermediate)
      .def_rw("num_experts", &MoeGeometry::num_experts)
      .def_rw("top_k", &MoeGeometry::top_k)
      .def_rw("ep_size", &MoeGeometry::ep_size)
      .def_rw("ep_rank", &MoeGeometry::ep_rank)
      .def_rw("max_tokens_per_rank", &MoeGeometry::max_tokens_per_rank)
      .def("validate", [](const MoeGeometry& g) { check(g.validate()); })
      .def_prop_ro("experts_per_rank", &MoeGeometry::experts_per_rank)
      .def_prop_ro("first_local_expert", &MoeGeometry::first_local_expert)
      .def("owner_of", &MoeGeometry::owner_of, "expert"_a)
      .def("padded", &MoeGeometry::padded, "multiple"_a = kDimAlignment)
      .def("for_rank", &MoeGeometry::for_rank, "rank"_a)
      .def("same_shape", &MoeGeometry::same_shape)
      .def("__eq__", [](const MoeGeometry& a, const MoeGeometry& b) { return a.same_shape(b) && a.ep_rank == b.ep_rank; })
      .def("__copy__", [](const MoeGeometry& g) { return g; })
      .def("__repr__", &MoeGeometry::to_string);
  m.attr("DIM_ALIGNMENT") = kDimAlignment;

  auto knobs = nb::class_<Knobs>(m, "Knobs")
                   .def(nb::init<>())
                   .def("__init__",
                        [](Knobs* k, nb::kwargs kw) {
                          new (k) Knobs();
                          set_fields(k, kw);
                        })
                   .def("validate", [](const Knobs& k) { check(k.validate()); })
                   .def("__eq__", [](const Knobs& a, const Knobs& b) { return a == b; })
                   .def("__repr__", &Knobs::to_string);
  // Every field from the one table of them (knobs.h), so a new knob reaches Python without an edit here.
  for (const KnobField& f : knob_fields())
    knobs.def_prop_rw(
        f.name, [member = f.member](const Knobs& k) { return k.*member; },
        [member = f.member](Knobs& k, int32_t v) { k.*member = v; });

  auto config = nb::class_<MoeConfig>(m, "MoeConfig");
  config.def(nb::init<>()).def("__init__", [](MoeConfig* c, nb::kwargs kw) {
    new (c) MoeConfig();
    set_fields(c, kw);
  });
  enum_field(config, "backend", &MoeConfig::backend, &parse_backend);
  enum_field(config, "weight_format", &MoeConfig::weight_format, &parse_weight_format);
  enum_field(config, "dispatch_format", &MoeConfig::dispatch_format, &parse_dispatch_format);
  enum_field(config, "combine_dtype", &MoeConfig::combine_dtype, &parse_combine_dtype);
  enum_field(config, "owner_reduce", &MoeConfig::owner_reduce, &parse_owner_reduce);
  config.def_rw("pow2_scales", &MoeConfig::pow2_scales)
      .def_rw("in_kernel_fc2_reduce", &MoeConfig::in_kernel_fc2_reduce)
      .def_rw("output_scale", &MoeConfig::output_scale)
      .def_rw("mega_max_tokens_per_rank", &MoeConfig::mega_max_tokens_per_rank)
      .def_rw("knobs", &MoeConfig::knobs)
      .def(
          "validate",
          [](const MoeConfig& c, const MoeGeometry* g) { check(g ? c.validate(*g) : c.validate()); },
          "geometry"_a = nb::none())
      .def("uses_owner_reduce", &MoeConfig::uses_owner_reduce)
      .def_prop_ro("intermediate_format", &MoeConfig::intermediate_format)
      .def("__copy__", [](const MoeConfig& c) { return c; })
      .def("__repr__", &MoeConfig::to_string);

  // ---- selection ----
  m.def(
      "select_backend",
      [](const MoeGeometry& g, const MoeConfig& c) {
        BackendSelection s = select_backend(g, c);
        return std::make_pair(s.backend, s.reason);
      },
      "geometry"_a, "config"_a);
  // The pure rule with given gates: None = the gate passes, else (code, message).
  m.def(
      "select_backend_with_gates",
      [](const MoeGeometry& g, const MoeConfig& c, nb::handle mega_gate, nb::handle routed_gate) {
        BackendSelection s = select_backend(g, c, status_from(mega_gate), status_from(routed_gate));
        return std::make_pair(s.backend, s.reason);
      },
      "geometry"_a, "config"_a, "mega_gate"_a.none(), "routed_gate"_a.none());
  m.def("capability", [](Backend b, const MoeGeometry& g, const MoeConfig& c) {
    switch (b) {
      case Backend::kMega: return status_tuple(mega_capability(g, c));
      case Backend::kRouted: return status_tuple(routed_capability(g, c));
      case Backend::kCpu: return status_tuple(cpu_capability(g, c));
      default: return status_tuple(invalid_argument("argument", "backend", "auto", "name one backend: mega, routed or cpu"));
    }
  });

  // The rel-L2 bound of a forward against the float64 reference (reference/error_model.h): what
  // the C++ tests hold the cpu backend to, for the Python tests to use the same.
  m.def("_error_bound", [](const MoeConfig& c, int64_t top_k) {
    const reference::ErrorBound b = reference::error_bound(c, top_k);
    return std::make_pair(b.rel_l2, b.derivation);
  });

  m.def("_same_points_bound", [](CombineDtype c) { return reference::same_points_bound(c).rel_l2; });
  m.def("_graph_nodes", &graph_nodes, "graph"_a);

  // ---- devices and versions ----
  m.def("cuda_device_count", [] { return cuda_device_count(); });
  m.def("nccl_version", [] { return nccl_version(); });
  m.def("cuda_runtime_version", [] { return cuda_runtime_version(); });

  // ---- communicators ----
  nb::class_<Communicator>(m, "Communicator")
      .def_prop_ro("rank", &Communicator::rank)
      .def_prop_ro("size", &Communicator::size)
      .def_prop_ro("kind", &Communicator::kind)
      .def_prop_ro("group_id", &Communicator::group_id)
      .def("__repr__", &Communicator::to_string);
  m.def("create_host_group", [](int size) {
    std::vector<std::shared_ptr<Communicator>> ranks;
    check(create_host_group(size, &ranks));
    return ranks;
  });
  m.def("create_nccl_group", [](const std::vector<int>& devices) {
    std::vector<std::shared_ptr<Communicator>> ranks;
    Status st;
    {
      nb::gil_scoped_release release;
      st = create_nccl_group(devices, &ranks);
    }
    check(st);
    return ranks;
  });
  m.def("nccl_unique_id_hex", [] {
    std::string hex;
    check(nccl_unique_id_hex(&hex));
    return hex;
  });
  m.def(
      "create_nccl_rank",
      [](int rank, int world_size, int device, const std::string& id_hex) {
        NcclBootstrap b;
        b.rank = rank;
        b.world_size = world_size;
        b.device = device;
        b.id_hex = id_hex;
        std::shared_ptr<Communicator> comm;
        Status st;
        {
          nb::gil_scoped_release release;
          st = create_nccl_rank(b, &comm);
        }
        check(st);
        return comm;
      },
      "rank"_a, "world_size"_a, "device"_a, "id_hex"_a);
  m.def(
      "adopt_nccl_comm",
      [](uintptr_t nccl_comm, int device) {
        std::shared_ptr<Communicator> comm;
        check(adopt_nccl_comm(reinterpret_cast<void*>(nccl_comm), device, &comm));
        return comm;
      },
      "nccl_comm"_a, "device"_a);
  m.def("nccl_rank_from_env", [] {
    NcclBootstrap b;
    check(NcclBootstrap::from_env(&b));
    std::shared_ptr<Communicator> comm;
    Status st;
    {
      nb::gil_scoped_release release;
      st = create_nccl_rank(b, &comm);
    }
    check(st);
    return comm;
  });

  // ---- the layer ----
  nb::class_<PyLayer>(m, "MoeLayer")
      .def_static("create", &create_layer, "geometry"_a, "config"_a, "w13"_a, "w13_scale"_a.none(), "w2"_a,
                  "w2_scale"_a.none(), "comm"_a.none(), "w13_global_scale"_a.none() = nb::none(),
                  "w2_global_scale"_a.none() = nb::none())
      .def("warmup",
           [](PyLayer& self) {
             MoeLayer& layer = self.get();
             Status st;
             {
               nb::gil_scoped_release release;
               st = layer.warmup();
             }
             check(st);
           })
      .def("forward", &forward, "x"_a, "topk_ids"_a, "topk_weights"_a, "y"_a, "stream"_a = 0,
           "x_scale"_a.none() = nb::none())
      .def("forward_tensors", &forward_tensors, "x"_a, "topk_ids"_a, "topk_weights"_a, "y"_a, "stream"_a,
           "x_scale"_a.none())
      .def(
          "check_error",
          [](PyLayer& self, uintptr_t stream) {
            MoeLayer& layer = self.get();
            Status st;
            {
              nb::gil_scoped_release release;
              st = layer.check_error(reinterpret_cast<void*>(stream));
            }
            check(st);
          },
          "stream"_a = 0)
      .def("error_pending",
           [](PyLayer& self) {
             if (!self.alive())
               throw StatusError{StatusCode::kFailedPrecondition, "error_pending() after release(): build a new layer"};
             MoeLayer& layer = self.get();
             bool pending = false;
             Status st;
             {
               nb::gil_scoped_release release;
               st = layer.error_pending(&pending);
             }
             check(st);
             return pending;
           })
      .def("set_expert_counts",
           [](PyLayer& self, nb::handle counts) { check(self.get().set_expert_counts(to_view(counts, "counts"))); }, "counts"_a.none())
      .def("expert_weight_views",
           [](PyLayer& self) {
             std::vector<ExpertWeightView> views;
             check(self.get().expert_weight_views(&views));
             std::vector<std::map<std::string, std::pair<uintptr_t, int64_t>>> out;
             auto region = [](void* p, int64_t bytes) { return std::make_pair(reinterpret_cast<uintptr_t>(p), bytes); };
             for (const ExpertWeightView& v : views)
               out.push_back({{"w13", region(v.w13, v.w13_bytes)},
                              {"w13_scale", region(v.w13_scale, v.w13_scale_bytes)},
                              {"w2", region(v.w2, v.w2_bytes)},
                              {"w2_scale", region(v.w2_scale, v.w2_scale_bytes)}});
             return out;
           })
      .def("_time_forward", &time_forward, "x"_a, "topk_ids"_a, "topk_weights"_a, "y"_a, "stream"_a,
           "x_scale"_a.none(), "iters"_a)
      .def("_captured_forward_nodes", &captured_forward_nodes, "x"_a, "topk_ids"_a, "topk_weights"_a, "y"_a,
           "stream"_a, "x_scale"_a.none())
      .def("destroy", &PyLayer::destroy)
      .def_prop_ro("alive", &PyLayer::alive)
      .def_prop_ro("backend", [](const PyLayer& self) { return self.get().backend(); })
      .def_prop_ro("device", [](const PyLayer& self) { return device_tuple(self.get().device()); })
      .def_prop_ro("geometry", [](const PyLayer& self) { return self.get().geometry(); })
      .def_prop_ro("config", [](const PyLayer& self) { return self.get().config(); })
      .def_prop_ro("selection_reason", [](const PyLayer& self) { return self.get().selection().reason; })
      .def("set_stage_timing", [](PyLayer& self, bool on) { check(self.get().set_stage_timing(on)); })
      .def("last_stage_times", [](PyLayer& self) {
        std::vector<MoeLayer::StageTime> times;
        check(self.get().last_stage_times(&times));
        std::vector<std::pair<std::string, double>> out;
        for (const auto& t : times) out.emplace_back(t.stage, t.us);
        return out;
      });
}
