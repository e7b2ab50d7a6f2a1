// GPUDirect Storage through cuFile, loaded with dlopen so that neither the build nor the import needs libcufile.
//
// Device buffers go to cuFileRead/cuFileWrite on worker threads (cuFile calls are synchronous); host buffers use
// pread/pwrite. Where the nvidia-fs kernel module is absent (VMs, most clouds) cuFile runs in its compatibility
// mode (POSIX I/O through its own bounce buffers): detail() says which.
#include <dlfcn.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <mutex>

#include "shared_cuda/device.hpp"
#include "shared_cuda/error.hpp"
#include "ssdtrain/detail/threads_backend.hpp"

#if SHARED_CUDA_HAS_CUDA
#include <cuda_runtime_api.h>
#endif

namespace ssdtrain::detail {
namespace {

// The few cuFile types we use, laid out as in cufile.h (stable C ABI since GDS 1.0).
struct cufile_error {
  int err;     // CUfileOpError, 0 = success
  int cu_err;  // CUresult
};
struct cufile_descr {
  int type;  // CU_FILE_HANDLE_TYPE_OPAQUE_FD = 1
  union {
    int fd;
    void* handle;
  } handle;
  const void* fs_ops;
};
using cufile_handle = void*;

struct cufile_api {
  void* library = nullptr;
  std::string path;
  std::string error;  // why it is not usable
  cufile_error (*driver_open)() = nullptr;
  cufile_error (*handle_register)(cufile_handle*, cufile_descr*) = nullptr;
  void (*handle_deregister)(cufile_handle) = nullptr;
  ssize_t (*read)(cufile_handle, void*, std::size_t, off_t, off_t) = nullptr;
  ssize_t (*write)(cufile_handle, const void*, std::size_t, off_t, off_t) = nullptr;
};

// Loaded and the driver opened once per process; the driver stays open until exit (closing it while another
// engine still uses it would break that engine).
const cufile_api& cufile(const std::string& requested) {
  static std::once_flag once;
  static cufile_api api;
  std::call_once(once, [&] {
    std::vector<std::string> names;
    if (!requested.empty()) names.push_back(requested);
    for (const char* n : {"libcufile.so.0", "libcufile.so", "/usr/local/cuda/lib64/libcufile.so.0"}) names.push_back(n);
    for (const auto& n : names) {
      api.library = dlopen(n.c_str(), RTLD_NOW | RTLD_LOCAL);
      if (api.library != nullptr) {
        api.path = n;
        break;
      }
    }
    if (api.library == nullptr) {
      api.error = "libcufile not found (tried " + names.front() + ", ...)";
      return;
    }
    auto sym = [&](const char* name) { return dlsym(api.library, name); };
    api.driver_open = reinterpret_cast<decltype(api.driver_open)>(sym("cuFileDriverOpen"));
    api.handle_register = reinterpret_cast<decltype(api.handle_register)>(sym("cuFileHandleRegister"));
    api.handle_deregister = reinterpret_cast<decltype(api.handle_deregister)>(sym("cuFileHandleDeregister"));
    api.read = reinterpret_cast<decltype(api.read)>(sym("cuFileRead"));
    api.write = reinterpret_cast<decltype(api.write)>(sym("cuFileWrite"));
    if (!api.driver_open || !api.handle_register || !api.handle_deregister || !api.read || !api.write) {
      api.error = api.path + " lacks cuFile symbols";
      return;
    }
    const cufile_error e = api.driver_open();
    if (e.err != 0) api.error = "cuFileDriverOpen failed (cuFile error " + std::to_string(e.err) + ")";
  });
  return api;
}

bool nvidia_fs_loaded() { return ::access("/proc/driver/nvidia-fs/stats", F_OK) == 0; }

// cuFileHandleRegister refuses descriptors opened with O_TMPFILE (CU_FILE_INVALID_FILE_OPEN_FLAG, 5019: O_TMPFILE
// carries the O_DIRECTORY bit). A second descriptor for the same inode, opened with the original's O_DIRECT, is
// not refused for its flags, but opened through /proc/self/fd it still has no name: its path reads
// "/dir/#inode (deleted)", and cuFile then failed with CU_FILE_HANDLE_NOT_REGISTERED (5027), most likely
// because cuFile resolves the descriptor's path to find its file system. So the nameless inode first gets a
// name (linkat through /proc/self/fd), is opened by that name and registered, and the name is removed right
// after registration (`linked` says which name; the caller unlinks it). Where linking fails (a file that was
// created and unlinked, not O_TMPFILE) the /proc reopen is used. Returns -1 (and the reason) where both fail.
int reopen_for_cufile(int fd, std::string& why, std::string& linked) {
  const int flags = ::fcntl(fd, F_GETFL);
  const int open_flags = O_RDWR | O_CLOEXEC | (flags >= 0 ? (flags & O_DIRECT) : 0);
  const std::string proc = "/proc/self/fd/" + std::to_string(fd);
  std::string path = proc;
  char target[4096];
  const ssize_t n = ::readlink(proc.c_str(), target, sizeof(target) - 1);
  if (n > 0) {
    const std::string where(target, static_cast<std::size_t>(n));
    const auto slash = where.rfind('/');
    if (slash != std::string::npos && slash > 0) {
      const std::string name =
          where.substr(0, slash) + "/.ssdtrain-gds-" + std::to_string(::getpid()) + "-" + std::to_string(fd);
      ::unlink(name.c_str());  // a leftover of an earlier process with the same pid
      if (::linkat(AT_FDCWD, proc.c_str(), AT_FDCWD, name.c_str(), AT_SYMLINK_FOLLOW) == 0) {
        path = name;
        linked = name;
      } else {
        why =
            "naming the file for cuFile failed (" + std::string(std::strerror(errno)) + "), registered through " + proc;
      }
    }
  }
  const int copy = ::open(path.c_str(), open_flags);
  if (copy < 0) {
    why = "reopening " + path + " failed: " + std::strerror(errno);
    if (!linked.empty()) ::unlink(linked.c_str());
    linked.clear();
    return -1;
  }
  struct stat a{}, b{};
  if (::fstat(fd, &a) != 0 || ::fstat(copy, &b) != 0 || a.st_dev != b.st_dev || a.st_ino != b.st_ino) {
    ::close(copy);
    why = "reopening " + path + " gave another file";
    if (!linked.empty()) ::unlink(linked.c_str());
    linked.clear();
    return -1;
  }
  return copy;
}

std::string cufile_error_name(int err) {
  switch (err) {
    case 5008:
      return "CU_FILE_IO_NOT_SUPPORTED";
    case 5010:
      return "CU_FILE_NVFS_DRIVER_ERROR";
    case 5018:
      return "CU_FILE_INVALID_FILE_TYPE";
    case 5019:
      return "CU_FILE_INVALID_FILE_OPEN_FLAG";
    case 5020:
      return "CU_FILE_DIO_NOT_SET";
    case 5026:
      return "CU_FILE_DRIVER_ALREADY_OPEN";
    case 5027:
      return "CU_FILE_HANDLE_NOT_REGISTERED";
    case 5028:
      return "CU_FILE_HANDLE_ALREADY_REGISTERED";
    case 5030:
      return "CU_FILE_INTERNAL_ERROR";
    case 5034:
      return "CU_FILE_IO_DISABLED";
    default:
      return "cuFile error";
  }
}

class gds_backend final : public worker_backend {
 public:
  gds_backend(const std::vector<int>& fds, unsigned threads, const std::string& library)
      : worker_backend(threads), api_(cufile(library)) {
    if (!api_.error.empty()) {
      detail_ = "cuFile unusable (" + api_.error + "): GPU data is staged through pinned buffers";
      return;
    }
    std::string reopen_note;
    for (int fd : fds) {
      std::string why, linked;
      const int copy = reopen_for_cufile(fd, why, linked);
      if (copy >= 0) reopened_.push_back(copy);
      if (!why.empty() && reopen_note.empty()) reopen_note = "; " + why;
      cufile_descr d{};
      d.type = 1;
      d.handle.fd = copy >= 0 ? copy : fd;
      cufile_handle h = nullptr;
      const cufile_error e = api_.handle_register(&h, &d);
      if (!linked.empty()) ::unlink(linked.c_str());  // registered (or refused): the file is nameless again
      if (e.err != 0) {
        for (auto* r : handles_) api_.handle_deregister(r);
        handles_.clear();
        detail_ = "cuFileHandleRegister failed (" + cufile_error_name(e.err) + " " + std::to_string(e.err) +
                  reopen_note +
                  "; cuFile's log in the logging dir of its config file names the cause): GPU data is staged "
                  "through pinned buffers (own staging)";
        return;
      }
      handles_.push_back(h);
    }
    detail_ = api_.path + (nvidia_fs_loaded() ? ": GPUDirect Storage (nvidia-fs loaded)"
                                              : ": cuFile compatibility mode (no nvidia-fs: POSIX I/O inside cuFile)");
  }

  ~gds_backend() override {
    stop();
    for (auto* h : handles_) api_.handle_deregister(h);
    for (int fd : reopened_) ::close(fd);
  }

  std::string name() const override { return "gds"; }
  std::string detail() const override { return detail_; }
  bool handles_device_memory() const override { return !handles_.empty(); }

 protected:
  long transfer(const io_request& r) override {
    if (r.device < 0) return blocking_transfer(r);
#if SHARED_CUDA_HAS_CUDA
    cudaSetDevice(r.device);  // cuFile resolves the buffer in the calling thread's current context
#endif
    std::size_t done = 0;
    while (done < r.bytes) {
      const ssize_t n = r.write ? api_.write(handles_[r.file], r.buffer, r.bytes - done,
                                             static_cast<off_t>(r.offset + done), static_cast<off_t>(done))
                                : api_.read(handles_[r.file], r.buffer, r.bytes - done,
                                            static_cast<off_t>(r.offset + done), static_cast<off_t>(done));
      // cuFile returns -1 with errno for POSIX errors and -(cuFile error) otherwise.
      if (n == -1) return -(errno ? errno : EIO);
      if (n < 0) return -EIO;
      if (n == 0) return -EIO;
      done += static_cast<std::size_t>(n);
    }
    return static_cast<long>(done);
  }

 private:
  const cufile_api& api_;
  std::vector<cufile_handle> handles_;
  std::vector<int> reopened_;  // descriptors cuFile accepts (see reopen_for_cufile)
  std::string detail_;
};

}  // namespace

std::unique_ptr<io_backend> make_gds_backend(const std::vector<int>& fds, unsigned threads,
                                             const std::string& library) {
  shared_cuda::require_cuda("ssdtrain's gds backend (use backend='io_uring' or 'threads' without a GPU)");
  return std::make_unique<gds_backend>(fds, threads, library);
}

std::string cufile_probe(const std::string& library) {
  const auto& api = cufile(library);
  if (!api.error.empty()) return "unusable: " + api.error;
  return api.path +
         (nvidia_fs_loaded() ? " (GPUDirect Storage: nvidia-fs loaded)" : " (compatibility mode: no nvidia-fs)");
}

}  // namespace ssdtrain::detail
