# TorchConfig.cmake looks for libtorch.so and libc10.so on the system's paths before its own: given a wheel's
# share/cmake as prefix on a machine that also has Debian's libtorch-dev, it takes Debian's libtorch.so next to the
# wheel's libtorch_cpu.so, two libtorches in one program. The libraries of the package that was found are the ones.
foreach(_gradsync_lib TORCH c10)
  string(TOLOWER ${_gradsync_lib} _gradsync_name)
  set(_gradsync_own ${TORCH_INSTALL_PREFIX}/lib/lib${_gradsync_name}.so)
  if(EXISTS ${_gradsync_own} AND DEFINED ${_gradsync_lib}_LIBRARY AND NOT ${_gradsync_lib}_LIBRARY STREQUAL _gradsync_own)
    message(STATUS "gradsync: lib${_gradsync_name}.so from ${_gradsync_own}, not ${${_gradsync_lib}_LIBRARY}")
    list(TRANSFORM TORCH_LIBRARIES REPLACE "^${${_gradsync_lib}_LIBRARY}$" "${_gradsync_own}")
    set(${_gradsync_lib}_LIBRARY ${_gradsync_own} CACHE FILEPATH "lib${_gradsync_name}.so of the libtorch found" FORCE)
  endif()
endforeach()
if(TARGET torch AND EXISTS ${TORCH_INSTALL_PREFIX}/lib/libtorch.so)
  set_property(TARGET torch PROPERTY IMPORTED_LOCATION ${TORCH_INSTALL_PREFIX}/lib/libtorch.so)
endif()
