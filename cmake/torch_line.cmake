# The libtorch line gradsync is built against, found by find_package(Torch) before this file is included:
#   2.x (>= 2.11): a wheel's torch.utils.cmake_prefix_path or an unzipped libtorch archive (`make`'s default);
#   1.13: Debian 12's libtorch-dev (`make TORCH=debian`).
# Everything the two lines need differently at build time is here; in the code it is src/torch_compat.h.

if(Torch_VERSION VERSION_LESS 1.13)
  message(FATAL_ERROR "gradsync needs libtorch 1.13 or >= 2.11; found ${Torch_VERSION} at ${Torch_DIR}")
endif()
if(Torch_VERSION VERSION_GREATER_EQUAL 2 AND Torch_VERSION VERSION_LESS 2.11)
  message(FATAL_ERROR "gradsync supports libtorch 2.x from 2.11 on; found ${Torch_VERSION} at ${Torch_DIR} (point "
                      "CMAKE_PREFIX_PATH or Torch_DIR at a libtorch >= 2.11, or at Debian's 1.13)")
endif()
message(STATUS "gradsync: libtorch ${Torch_VERSION} at ${Torch_DIR}")

# The libraries of the libtorch found, not another one's on the system paths (also run by gradsyncConfig.cmake).
include(${CMAKE_CURRENT_LIST_DIR}/torch_libraries.cmake)

# Gloo. c10d's ProcessGroupGloo.hpp includes gloo's headers. Debian's libtorch 1.13 links Debian's libgloo, whose
# headers and library gradsync uses too. A libtorch 2.x carries gloo inside libtorch_cpu.so and ships no gloo
# headers: gradsync compiles against Debian's gloo headers (libgloo-dev) and must not link Debian's libgloo (two
# gloos in one process). Those headers are older than the gloo inside libtorch 2.x; what gradsync may touch of gloo
# through them, and why that is safe, is Note [Gloo headers] in src/runtime/gloo_group.cpp.
if(Torch_VERSION VERSION_GREATER_EQUAL 2)
  find_path(GRADSYNC_GLOO_INCLUDE_DIR gloo/algorithm.h REQUIRED DOC "gloo's headers (Debian's libgloo-dev)")
  set(GRADSYNC_GLOO_LIBRARY "")
  if(NOT GRADSYNC_GLOO_INCLUDE_DIR IN_LIST CMAKE_CXX_IMPLICIT_INCLUDE_DIRECTORIES)
    include_directories(SYSTEM ${GRADSYNC_GLOO_INCLUDE_DIR})
  endif()
else()
  find_library(GRADSYNC_GLOO_LIBRARY gloo REQUIRED)
endif()

# libstdc++ before libtorch. The 2.x libraries export copies of libstdc++ functions they were built with
# (std::filesystem among them: libtorch.so alone exports 64); a program whose libtorch loads before libstdc++
# binds its own calls to those copies, and std::filesystem::remove_all jumped to address 0 there. Loading
# libstdc++ first binds every such call to the system's libstdc++, as the compiler intended. Link options come
# before the libraries on the link line; gradsync's are PUBLIC, so a consumer's program gets them too.
set(GRADSYNC_TORCH_LINK_OPTIONS "")
set(GRADSYNC_PC_LINK_FIRST "")
if(Torch_VERSION VERSION_GREATER_EQUAL 2)
  set(GRADSYNC_TORCH_LINK_OPTIONS "SHELL:-Wl,--push-state,--no-as-needed -lstdc++ -Wl,--pop-state")
  set(GRADSYNC_PC_LINK_FIRST "-Wl,--push-state,--no-as-needed -lstdc++ -Wl,--pop-state")
endif()

# A wheel's libtorch_cuda.so finds its NCCL (and cuDNN, ...) in the wheel's nvidia/*/lib through its own RPATH, but
# the linker searches the -rpath directories CUDA's CMake adds first, and /usr/local/cuda/lib holds the toolkit's
# NCCL: older than torch 2.15's (undefined ncclCommGrow, ncclCommSuspend, ... at link time). The wheel's directories
# come first for the link as they do at run time.
file(GLOB _gradsync_wheel_libs LIST_DIRECTORIES true ${TORCH_INSTALL_PREFIX}/../nvidia/*/lib)
foreach(dir ${_gradsync_wheel_libs})
  get_filename_component(dir ${dir} ABSOLUTE)
  list(APPEND GRADSYNC_TORCH_LINK_OPTIONS "-Wl,-rpath-link,${dir}")
  string(APPEND GRADSYNC_PC_LINK_FIRST " -Wl,-rpath-link,${dir}")
endforeach()

# One fmt per program: gradsync links Debian's libfmt, and a libtorch 2.x ships fmt headers of another major version
# in its include directory, which the compiler would otherwise find first. Every gradsync target (the directory
# property reaches tests/ and bench/ too) sees the headers of the fmt it links.
get_target_property(GRADSYNC_FMT_INCLUDE_DIR fmt::fmt INTERFACE_INCLUDE_DIRECTORIES)
foreach(dir ${TORCH_INCLUDE_DIRS})
  if(EXISTS ${dir}/fmt/core.h AND NOT dir STREQUAL GRADSYNC_FMT_INCLUDE_DIR)
    set(GRADSYNC_FMT_FIRST ${PROJECT_BINARY_DIR}/fmt-first)
    file(MAKE_DIRECTORY ${GRADSYNC_FMT_FIRST})
    file(CREATE_LINK ${GRADSYNC_FMT_INCLUDE_DIR}/fmt ${GRADSYNC_FMT_FIRST}/fmt SYMBOLIC)
    include_directories(BEFORE SYSTEM ${GRADSYNC_FMT_FIRST})
    break()
  endif()
endforeach()

# The Python that runs the tests' PyTorch references and `gradsync bench --compare-pytorch`: the torch of the same
# line (the wheel's own interpreter for 2.x, Debian's python3-torch for 1.13). Never linked, never imported by
# gradsync itself.
set(GRADSYNC_PYTHON /usr/bin/python3 CACHE FILEPATH "Python with the reference torch (tests, bench)")

# The C++ standard a pkg-config consumer compiles with: the one libtorch asks of its users (2.15's TorchConfig puts
# cxx_std_20 on the torch target and its headers stop without C++20; 2.11 and 1.13 ask C++17).
set(GRADSYNC_PC_CXX_STD c++17)
if(TARGET torch)
  get_target_property(_gradsync_torch_features torch INTERFACE_COMPILE_FEATURES)
  if(_gradsync_torch_features AND "cxx_std_20" IN_LIST _gradsync_torch_features)
    set(GRADSYNC_PC_CXX_STD c++20)
  endif()
endif()
