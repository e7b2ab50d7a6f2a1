#include "shared_cuda_bindings.hpp"

#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include "shared_cuda/device.hpp"
#include "shared_cuda/error.hpp"
#include "shared_cuda/jit.hpp"

namespace nb = nanobind;

namespace shared_cuda::bindings {
namespace {

PyObject* cuda_error_type = nullptr;
PyObject* compile_error_type = nullptr;
PyObject* unavailable_error_type = nullptr;

// C++ exception -> Python exception. nanobind already maps std::invalid_argument -> ValueError,
// std::out_of_range -> IndexError, std::bad_alloc -> MemoryError and other std::exception -> RuntimeError.
void translate(const std::exception_ptr& thrown, void*) {
  try {
    std::rethrow_exception(thrown);
  } catch (const io_error& e) {
    // OSError(errno, message) becomes the matching subclass (FileNotFoundError, PermissionError, ...).
    PyObject* args = Py_BuildValue("(is)", e.err(), e.what());
    PyErr_SetObject(PyExc_OSError, args);
    Py_XDECREF(args);
  } catch (const std::system_error& e) {
    PyObject* args = Py_BuildValue("(is)", e.code().value(), e.what());
    PyErr_SetObject(PyExc_OSError, args);
    Py_XDECREF(args);
  } catch (const compile_error& e) {
    PyObject* instance = PyObject_CallFunction(compile_error_type, "s", e.what());
    if (instance != nullptr) {
      PyObject* log = PyUnicode_FromString(e.log().c_str());
      PyObject_SetAttrString(instance, "log", log);
      Py_XDECREF(log);
      PyErr_SetObject(compile_error_type, instance);
      Py_DECREF(instance);
    }
  } catch (const cuda_error& e) {
    PyObject* instance = PyObject_CallFunction(cuda_error_type, "s", e.what());
    if (instance != nullptr) {
      PyObject* code = PyLong_FromLong(e.code());
      PyObject_SetAttrString(instance, "code", code);
      Py_XDECREF(code);
      PyErr_SetObject(cuda_error_type, instance);
      Py_DECREF(instance);
    }
  } catch (const unavailable_error& e) {
    PyErr_SetString(unavailable_error_type, e.what());
  }
}

nb::dict properties_dict(const device_properties& p) {
  nb::dict d;
  d["index"] = p.index;
  d["name"] = p.name;
  d["compute_capability"] = nb::make_tuple(p.major, p.minor);
  d["multiprocessors"] = p.multiprocessors;
  d["total_memory"] = p.total_memory;
  d["l2_cache_bytes"] = p.l2_cache_bytes;
  d["max_shared_memory_per_block_optin"] = p.max_shared_memory_per_block_optin;
  d["can_map_host_memory"] = p.can_map_host_memory;
  d["host_pointer_is_device_pointer"] = p.host_pointer_is_device_pointer;
  d["pci_bus_id"] = p.pci_bus_id;
  return d;
}

// Raises the C++ exception named by `kind`, so tests can check each translation (no other way to make a CUDA
// error on a machine without a GPU).
void raise_for_test(const std::string& kind, const std::string& message, int code) {
  if (kind == "cuda") throw cuda_error(message, code);
  if (kind == "compile") throw compile_error(message, "log: " + message);
  if (kind == "io") throw io_error(code, message);
  if (kind == "invalid_argument") throw invalid_argument(message);
  if (kind == "out_of_range") throw out_of_range(message);
  if (kind == "unavailable") throw unavailable_error(message);
  if (kind == "bad_alloc") throw std::bad_alloc();
  throw invalid_argument("unknown error kind '" + kind + "'");
}

}  // namespace

void bind_shared(nb::module_& m) {
  cuda_error_type = PyErr_NewExceptionWithDoc(
      (std::string(nb::cast<std::string>(m.attr("__name__"))) + ".CudaError").c_str(),
      "A CUDA runtime or driver call failed; `code` is the CUDA error code.", PyExc_RuntimeError, nullptr);
  compile_error_type = PyErr_NewExceptionWithDoc(
      (std::string(nb::cast<std::string>(m.attr("__name__"))) + ".CompileError").c_str(),
      "NVRTC could not compile generated CUDA code; `log` holds NVRTC's log.", PyExc_RuntimeError, nullptr);
  unavailable_error_type =
      PyErr_NewExceptionWithDoc((std::string(nb::cast<std::string>(m.attr("__name__"))) + ".UnavailableError").c_str(),
                                "An optional piece (a GPU, NVRTC, liburing, cuFile) that this call needs is missing.",
                                PyExc_RuntimeError, nullptr);
  m.attr("CudaError") = nb::handle(cuda_error_type);
  m.attr("CompileError") = nb::handle(compile_error_type);
  m.attr("UnavailableError") = nb::handle(unavailable_error_type);
  nb::register_exception_translator(translate);
  // Objects (tensors' owners) may legitimately be alive at interpreter exit; nanobind would report them as leaks.
  nb::set_leak_warnings(false);
  m.def("_raise_for_test", &raise_for_test);

  // Device query: never raises, works with no driver.
  m.def("compiled_with_cuda", &compiled_with_cuda);
  m.def("compiled_architectures", &compiled_architectures);
  m.def("compiled_runtime_version", &compiled_runtime_version);
  m.def("driver_version", &driver_version);
  m.def("device_count", &device_count);
  m.def("cuda_available", &cuda_available);
  m.def("current_device", &current_device);
  m.def("device_properties", [](int device) -> std::optional<nb::dict> {
    auto p = get_device_properties(device);
    if (!p) return std::nullopt;
    return properties_dict(*p);
  });

  // JIT.
  m.def("load_nvrtc", &jit::load_nvrtc);
  m.def("default_nvrtc_candidates", &jit::default_nvrtc_candidates);
  m.def("nvrtc_available", &jit::nvrtc_available);
  m.def("nvrtc_path", &jit::nvrtc_path);
  m.def("nvrtc_version", &jit::nvrtc_version);
  m.def("nvrtc_supported_architectures", &jit::nvrtc_supported_architectures);
  m.def("current_architecture", &jit::current_architecture);
  m.def("jit_compile",
        [](const std::string& source, const std::string& name, int arch, const std::vector<std::string>& flags) {
          auto program = jit::compile(source, name, {arch, flags});
          return std::make_pair(nb::bytes(program.cubin.data(), program.cubin.size()), program.log);
        });
  m.def("jit_cache_key", [](const std::string& source, int arch, const std::vector<std::string>& flags) {
    return jit::cache_key(source, {arch, flags});
  });

  nb::class_<jit::kernel>(m, "JitKernel")
      .def_prop_ro("name", &jit::kernel::name)
      .def("launch",
           [](const jit::kernel& k, std::vector<unsigned> grid, std::vector<unsigned> block, unsigned shared_memory,
              std::uintptr_t stream, const std::vector<nb::bytes>& args) {
             SHARED_CUDA_EXPECT(grid.size() == 3 && block.size() == 3, "grid and block must have 3 entries");
             std::vector<std::string> raw;
             raw.reserve(args.size());
             for (const auto& a : args) raw.emplace_back(a.c_str(), a.size());
             // The interpreter lock stays held: a launch takes microseconds, and releasing the lock around it
             // lets another Python thread (a loader making batches) take it, so the launching thread then waits
             // for that thread's Python to give it back, once per kernel of a training step. (A launch that
             // blocks on a full launch queue now blocks the other Python threads too: the GPU is then the
             // bottleneck, and they are ahead of it.)
             k.launch({grid[0], grid[1], grid[2]}, {block[0], block[1], block[2]}, shared_memory,
                      stream_view::from_address(stream), raw);
           })
      .def("set_max_dynamic_shared_memory", &jit::kernel::set_max_dynamic_shared_memory)
      .def_prop_ro("max_threads_per_block", &jit::kernel::max_threads_per_block)
      .def_prop_ro("registers_per_thread", &jit::kernel::registers_per_thread);

  nb::class_<jit::launch_list>(m, "LaunchList")
      .def(nb::init<>())
      .def(
          "add",
          // patches: (parameter, base, offset) of this launch, as patch() takes them; values: (target, parameter,
          // value index), as bind_value() takes them (target 0: the parameter, 1: its patch's offset, 2: grid x)
          [](jit::launch_list& l, const jit::kernel& k, std::vector<unsigned> grid, std::vector<unsigned> block,
             unsigned shared_memory, const std::vector<nb::bytes>& args,
             const std::vector<std::tuple<std::size_t, std::size_t, std::uint64_t>>& patches,
             const std::vector<std::tuple<int, std::size_t, std::size_t>>& values) {
            SHARED_CUDA_EXPECT(grid.size() == 3 && block.size() == 3, "grid and block must have 3 entries");
            std::vector<std::string> raw;
            raw.reserve(args.size());
            for (const auto& a : args) raw.emplace_back(a.c_str(), a.size());
            const std::size_t index =
                l.add(k, {grid[0], grid[1], grid[2]}, {block[0], block[1], block[2]}, shared_memory, raw);
            for (const auto& [parameter, base, offset] : patches) l.patch(index, parameter, base, offset);
            for (const auto& [target, parameter, value] : values)
              l.bind_value(index, static_cast<jit::launch_list::value_target>(target), parameter, value);
            return index;
          },
          nb::arg("kernel"), nb::arg("grid"), nb::arg("block"), nb::arg("shared_memory"), nb::arg("args"),
          nb::arg("patches") = std::vector<std::tuple<std::size_t, std::size_t, std::uint64_t>>{},
          nb::arg("values") = std::vector<std::tuple<int, std::size_t, std::size_t>>{})
      .def("patch", &jit::launch_list::patch)
      // A copy with the bound numbers written from `values` (one per graph a template serves).
      .def("instantiate", &jit::launch_list::instantiate)
      // The interpreter lock stays held, as for JitKernel.launch.
      .def("launch",
           [](jit::launch_list& l, std::uintptr_t stream, const std::vector<std::uint64_t>& bases, std::size_t first,
              std::size_t last) { l.launch(stream_view::from_address(stream), bases, first, last); })
      .def("__len__", &jit::launch_list::size);

  nb::class_<jit::module>(m, "JitModule").def("get_kernel", &jit::module::get_kernel);

  nb::class_<jit::loader>(m, "JitLoader")
      .def(nb::init<std::string>())
      .def_prop_ro("cache_directory", &jit::loader::cache_directory)
      .def("get",
           [](jit::loader& l, const std::string& source, const std::string& name, int arch,
              const std::vector<std::string>& flags) {
             nb::gil_scoped_release release;  // compiling can take seconds
             return l.get(source, name, {arch, flags});
           })
      .def("get_cubin",
           [](jit::loader& l, const std::string& source, const std::string& name, int arch,
              const std::vector<std::string>& flags) {
             std::vector<char> cubin;
             {
               nb::gil_scoped_release release;
               cubin = l.get_cubin(source, name, {arch, flags});
             }
             return nb::bytes(cubin.data(), cubin.size());
           })
      .def("stats", [](const jit::loader& l) {
        const auto s = l.stats();
        nb::dict d;
        d["memory_hits"] = s.memory_hits;
        d["disk_hits"] = s.disk_hits;
        d["compilations"] = s.compilations;
        d["disk_errors"] = s.disk_errors;
        d["corrupt_entries"] = s.corrupt_entries;
        return d;
      });
}

}  // namespace shared_cuda::bindings
