# Finds the Python interpreter dkfac is built for and, through its torch, LibTorch (pip's torch ships
# LibTorch's headers, libraries and CMake package). Sets DKFAC_PYTHON, DKFAC_PYTHON_VERSION,
# DKFAC_TORCH_VERSION, DKFAC_TORCH_LIB_DIR, DKFAC_TORCH_LIB_FROM_SCRIPTS and runs find_package(Torch).
#
# The interpreter, first found wins: -DDKFAC_PYTHON=...; the one scikit-build-core builds for (pip install .);
# the active virtual environment ($VIRTUAL_ENV); the repository's .venv (scripts/setup.sh makes it); python3.

if(SKBUILD AND DEFINED Python_EXECUTABLE)
  # pip install .: always the interpreter pip runs for, whatever an earlier configure cached.
  set(DKFAC_PYTHON "${Python_EXECUTABLE}" CACHE FILEPATH "Python interpreter whose torch dkfac is built against" FORCE)
endif()
if(NOT DKFAC_PYTHON)
  if(DEFINED ENV{VIRTUAL_ENV} AND EXISTS "$ENV{VIRTUAL_ENV}/bin/python")
    set(_dkfac_python "$ENV{VIRTUAL_ENV}/bin/python")
  elseif(EXISTS "${CMAKE_CURRENT_LIST_DIR}/../.venv/bin/python")
    get_filename_component(_dkfac_python "${CMAKE_CURRENT_LIST_DIR}/../.venv/bin/python" ABSOLUTE)
  else()
    find_program(_dkfac_python python3 REQUIRED)
  endif()
  set(DKFAC_PYTHON "${_dkfac_python}" CACHE FILEPATH "Python interpreter whose torch dkfac is built against")
endif()

# pip's build isolation hides the environment's site-packages from the build's interpreter through
# PYTHONPATH; `-I` (isolated mode) ignores that, so the torch found is the one the package will import,
# never a second one installed for the build.
set(_dkfac_probe [=[
import sys, os, sysconfig
import torch, torch.utils
lib = os.path.join(os.path.dirname(torch.__file__), "lib")
print(torch.__version__)
print(torch.utils.cmake_prefix_path)
print(lib)
print(f"{sys.version_info[0]}.{sys.version_info[1]}")
print(os.path.relpath(lib, sysconfig.get_path("scripts")))
print(torch.version.cuda or "")  # last: an empty line is stripped
]=])
set(_dkfac_probe_rc 1)
foreach(_dkfac_flags "" "-I")
  execute_process(COMMAND ${DKFAC_PYTHON} ${_dkfac_flags} -c "${_dkfac_probe}"
    OUTPUT_VARIABLE _dkfac_probe_out ERROR_VARIABLE _dkfac_probe_err RESULT_VARIABLE _dkfac_probe_rc
    OUTPUT_STRIP_TRAILING_WHITESPACE)
  if(_dkfac_probe_rc EQUAL 0)
    break()
  endif()
endforeach()
if(NOT _dkfac_probe_rc EQUAL 0)
  message(FATAL_ERROR "dkfac: ${DKFAC_PYTHON} cannot import torch:\n${_dkfac_probe_err}\n"
                      "Run ./scripts/setup.sh (a .venv with torch from PyPI), activate an environment that has "
                      "torch 2.x, or name its interpreter with -DDKFAC_PYTHON=/path/to/python.")
endif()
string(REPLACE "\n" ";" _dkfac_probe_out "${_dkfac_probe_out}")
list(GET _dkfac_probe_out 0 DKFAC_TORCH_VERSION)
list(GET _dkfac_probe_out 1 _dkfac_torch_prefix)
list(GET _dkfac_probe_out 2 DKFAC_TORCH_LIB_DIR)
list(GET _dkfac_probe_out 3 DKFAC_PYTHON_VERSION)
# torch's libraries seen from the environment's scripts folder (bin/): ../lib/python3.X/site-packages/torch/lib
# in a venv. The wheel's `dkfac` command finds them there (tools/CMakeLists.txt), wherever the venv is moved.
list(GET _dkfac_probe_out 4 DKFAC_TORCH_LIB_FROM_SCRIPTS)
list(SUBLIST _dkfac_probe_out 5 1 DKFAC_TORCH_CUDA)  # empty for a CPU-only torch

if(DKFAC_TORCH_VERSION VERSION_LESS 2.11)
  message(FATAL_ERROR "dkfac: ${DKFAC_PYTHON} has torch ${DKFAC_TORCH_VERSION}; dkfac supports torch 2.11 and newer "
                      "(README, 'Supported torch').")
endif()

# The real path: a venv whose torch is a link to another environment's (tests/integration/pip_install_test.sh
# links this environment's into its fresh venvs) compiles against the same header paths as that environment's
# build, so that ccache's results of one serve the other (LibTorch's include paths are part of every key).
get_filename_component(_dkfac_torch_prefix "${_dkfac_torch_prefix}" REALPATH)
list(PREPEND CMAKE_PREFIX_PATH "${_dkfac_torch_prefix}")
if(DKFAC_TORCH_CUDA)
  # A CUDA build of torch: its CMake package needs the toolkit of that CUDA major version.
  if(NOT DEFINED CUDAToolkit_ROOT AND NOT DEFINED ENV{CUDAToolkit_ROOT} AND EXISTS /usr/local/cuda/bin/nvcc)
    set(CUDAToolkit_ROOT /usr/local/cuda)
  endif()
  if(NOT CMAKE_CUDA_COMPILER AND CUDAToolkit_ROOT AND EXISTS "${CUDAToolkit_ROOT}/bin/nvcc")
    set(CMAKE_CUDA_COMPILER "${CUDAToolkit_ROOT}/bin/nvcc")
  endif()
endif()
find_package(Torch REQUIRED)
message(STATUS "dkfac: torch ${DKFAC_TORCH_VERSION} (CUDA ${DKFAC_TORCH_CUDA}) of ${DKFAC_PYTHON} "
               "(Python ${DKFAC_PYTHON_VERSION}), LibTorch from ${_dkfac_torch_prefix}")
