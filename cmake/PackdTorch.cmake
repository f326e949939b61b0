# libtorch for the torch backend, the C++ client, the tests and the benchmarks, chosen by
# PACKD_TORCH (docs/design.md §16):
#   debian   Debian 12's libtorch-dev: torch 1.13, CPU only, C++14 headers
#   wheel    a PyPI torch's own (torch.utils.cmake_prefix_path) from PACKD_TORCH_PYTHON, by
#            default the PyPI stack's venv (deploy/pypi-venv.sh): torch 2.x with CUDA, so c10_cuda
#            is found and the client's stream-ordered path (client/stream_order.h) is built;
#            its headers need C++20, which its target asks of whatever links it
#   (empty)  Debian's where it is installed, else the wheel's
# Either way the C++ ABI of libtorch must be gRPC's (Debian's, built with GCC's C++11 ABI): a
# program calling both is compiled and linked here, and a mismatch stops configuring with both
# sides named.
set(PACKD_TORCH "" CACHE STRING
    "libtorch to build against: debian (libtorch-dev) or wheel (a PyPI torch, PACKD_TORCH_PYTHON)")
set(PACKD_TORCH_PYTHON "" CACHE FILEPATH
    "For PACKD_TORCH=wheel: the Python whose torch to use (default: deploy/pypi-venv.sh's venv)")

set(_debian_torch /usr/lib/x86_64-linux-gnu/cmake/Torch)
set(_torch_link_options)
if(PACKD_TORCH STREQUAL "")
  if(EXISTS ${_debian_torch}/TorchConfig.cmake)
    set(PACKD_TORCH debian)
  else()
    set(PACKD_TORCH wheel)
  endif()
endif()

if(PACKD_TORCH STREQUAL "debian")
  find_package(Torch REQUIRED CONFIG PATHS ${_debian_torch} NO_DEFAULT_PATH)
  set(PACKD_TORCH_DESCRIPTION "Debian's libtorch ${Torch_VERSION}")
  set(_torch_abi 1)
  string(REGEX MATCH "_GLIBCXX_USE_CXX11_ABI=([01])" _flag "${TORCH_CXX_FLAGS}")
  if(_flag)
    set(_torch_abi ${CMAKE_MATCH_1})
  endif()
elseif(PACKD_TORCH STREQUAL "wheel")
  set(_python ${PACKD_TORCH_PYTHON})
  if(NOT _python)
    execute_process(COMMAND ${PROJECT_SOURCE_DIR}/deploy/pypi-venv.sh --path
                    OUTPUT_VARIABLE _venv OUTPUT_STRIP_TRAILING_WHITESPACE)
    set(_python ${_venv}/bin/python)
  endif()
  execute_process(
    COMMAND ${_python} -c "import os, torch; print(os.path.dirname(torch.__file__)); print(torch.__version__); print(int(torch._C._GLIBCXX_USE_CXX11_ABI)); print(torch.version.cuda or '')"
    OUTPUT_VARIABLE _info OUTPUT_STRIP_TRAILING_WHITESPACE RESULT_VARIABLE _rc ERROR_VARIABLE _err)
  if(NOT _rc EQUAL 0)
    message(FATAL_ERROR "PACKD_TORCH=wheel: ${_python} cannot import torch (${_err}). Make the "
                        "PyPI stack (deploy/pypi-venv.sh) or set PACKD_TORCH_PYTHON")
  endif()
  string(REPLACE "\n" ";" _info "${_info}")
  list(GET _info 0 _torch_dir)
  list(GET _info 1 _torch_version)
  list(GET _info 2 _torch_abi)
  list(GET _info 3 _torch_cuda)
  # Its CUDA flags for packd's own architectures only: torch's CMake adds -gencode flags for
  # every architecture it was built for, some of which (compute_50) this nvcc no longer has.
  if(NOT TORCH_CUDA_ARCH_LIST AND CMAKE_CUDA_ARCHITECTURES)
    set(TORCH_CUDA_ARCH_LIST)
    foreach(_arch IN LISTS CMAKE_CUDA_ARCHITECTURES)
      string(REGEX REPLACE "([0-9]+)([0-9])$" "\\1.\\2" _arch ${_arch})
      list(APPEND TORCH_CUDA_ARCH_LIST ${_arch})
    endforeach()
  endif()
  # Its own lib/ ahead of the system's (Debian's libtorch is libtorch.so too).
  list(PREPEND CMAKE_PREFIX_PATH ${_torch_dir} ${_torch_dir}/share/cmake)
  find_package(Torch REQUIRED CONFIG PATHS ${_torch_dir}/share/cmake/Torch NO_DEFAULT_PATH)
  # libtorch_cuda's libraries (NCCL, cuDNN, cuBLAS, ...) come from the nvidia-* wheels beside it,
  # which its RPATH names; the linker must find those, not older copies on the system (CUDA's
  # toolkit has an NCCL that lacks symbols torch uses).
  get_filename_component(_site ${_torch_dir} DIRECTORY)
  file(GLOB _nvidia_libs LIST_DIRECTORIES true ${_site}/nvidia/*/lib)
  foreach(_dir IN LISTS _nvidia_libs)
    list(APPEND _torch_link_options "LINKER:-rpath-link,${_dir}")
  endforeach()
  add_link_options(${_torch_link_options})
  set(PACKD_TORCH_DESCRIPTION "torch ${_torch_version}'s libtorch (${_torch_dir}")
  if(_torch_cuda)
    string(APPEND PACKD_TORCH_DESCRIPTION ", CUDA ${_torch_cuda})")
  else()
    string(APPEND PACKD_TORCH_DESCRIPTION ", CPU)")
  endif()
else()
  message(FATAL_ERROR "PACKD_TORCH is ${PACKD_TORCH}: debian or wheel")
endif()
message(STATUS "packd: libtorch: ${PACKD_TORCH_DESCRIPTION}, _GLIBCXX_USE_CXX11_ABI=${_torch_abi}")

# The ABI: one program calling a function of each that returns std::string, compiled with
# libtorch's flags and linked against both; with another ABI one of the two symbols is missing.
set(_abi_source ${CMAKE_BINARY_DIR}/CMakeFiles/packd_torch_abi.cc)
file(WRITE ${_abi_source} "
#include <string>
#include <c10/core/DeviceType.h>
#include <grpcpp/grpcpp.h>
int main() {
  std::string torch = c10::DeviceTypeName(c10::DeviceType::CPU);
  std::string grpc = grpc::Version();
  return static_cast<int>(torch.size() + grpc.size() == 0);
}
")
if(NOT DEFINED PACKD_TORCH_ABI_OK_${PACKD_TORCH})
  try_compile(_abi_ok ${CMAKE_BINARY_DIR}/CMakeFiles/packd_torch_abi
    SOURCES ${_abi_source}
    LINK_LIBRARIES ${TORCH_LIBRARIES} gRPC::grpc++
    LINK_OPTIONS ${_torch_link_options}
    CXX_STANDARD 20
    OUTPUT_VARIABLE _abi_output)
  set(PACKD_TORCH_ABI_OK_${PACKD_TORCH} ${_abi_ok} CACHE INTERNAL "")
endif()
if(NOT PACKD_TORCH_ABI_OK_${PACKD_TORCH})
  unset(PACKD_TORCH_ABI_OK_${PACKD_TORCH} CACHE)
  message(FATAL_ERROR
    "packd: ${PACKD_TORCH_DESCRIPTION} (_GLIBCXX_USE_CXX11_ABI=${_torch_abi}) cannot be linked "
    "with Debian's gRPC ${gRPC_VERSION} (built by GCC with the C++11 ABI, "
    "_GLIBCXX_USE_CXX11_ABI=1): a program calling both does not link. Use a torch built with "
    "the C++11 ABI (PyPI's torch 2.7 and later are) or PACKD_TORCH=debian. The linker said:\n"
    "${_abi_output}")
endif()
