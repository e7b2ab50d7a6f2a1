# Included by each package's CMakeLists.txt: adds shared-cuda (as ./shared-cuda/, a link to the monorepo's copy
# or the real folder inside an sdist), finds nanobind, and defines
#
#   shared_cuda_add_python_module(<package> SOURCES <files...> [LIBRARIES <targets...>])
#
# which builds <package>._core: a nanobind extension holding the package's binding sources plus the shared
# bindings (exceptions, device query, JIT), linked statically against shared_cuda, and installs it together with
# the shared Python helper (shared-cuda/python/_shared_cuda.py) into the wheel's <package>/ folder.
set(SHARED_CUDA_SOURCE_DIR "${CMAKE_CURRENT_LIST_DIR}/..")
add_subdirectory(${SHARED_CUDA_SOURCE_DIR} shared-cuda)  # sets SHARED_CUDA_HAS_CUDA and SHARED_CUDA_ARCHITECTURES
if(SHARED_CUDA_HAS_CUDA)
  # Languages are per directory: enable CUDA in the package's scope too, so it can add .cu files (same architectures:
  # CMAKE_CUDA_ARCHITECTURES is a cache entry).
  enable_language(CUDA)
endif()

find_package(Python 3.10 REQUIRED COMPONENTS Interpreter Development.Module)
find_package(nanobind CONFIG REQUIRED)

function(shared_cuda_add_python_module package)
  cmake_parse_arguments(ARG "" "" "SOURCES;LIBRARIES" ${ARGN})
  # NB_STATIC: nanobind's runtime inside the module. NB_DOMAIN: the packages bind the same C++ types (jit::loader,
  # the exception translators); without separate domains they would share nanobind's registry, and one package's
  # translator would raise another package's exception classes.
  nanobind_add_module(_core NB_STATIC NB_DOMAIN ${package}
    ${ARG_SOURCES}
    ${SHARED_CUDA_SOURCE_DIR}/bindings/shared_cuda_bindings.cpp)
  target_include_directories(_core PRIVATE ${SHARED_CUDA_SOURCE_DIR}/bindings)
  target_link_libraries(_core PRIVATE shared_cuda::shared_cuda ${ARG_LIBRARIES})
  # Bind every symbol to this module's own definitions and keep static libraries' symbols private. Without this,
  # C++ template instantiations (std::regex, std::function, ...) can resolve to libtorch's copies, built with
  # another libstdc++, and crash (seen: a segfault in NVRTC error reporting with torch 2.11 loaded).
  target_link_options(_core PRIVATE -Wl,-Bsymbolic -Wl,--exclude-libs,ALL)
  install(TARGETS _core LIBRARY DESTINATION ${package})
  install(FILES ${SHARED_CUDA_SOURCE_DIR}/python/_shared_cuda.py DESTINATION ${package})
endfunction()
