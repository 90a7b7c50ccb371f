# Every dependency megamoe builds against, found in one place. scripts/setup.sh installs the ones a
# fresh Debian machine lacks; each failure below names that fix.
find_package(Threads REQUIRED)
find_package(CUDAToolkit 12.8 REQUIRED)

# NCCL >= 2.28 (device API: nccl_device.h). Ships with the CUDA toolkit here.
find_path(MEGAMOE_NCCL_INCLUDE_DIR nccl_device.h
  HINTS ${CUDAToolkit_INCLUDE_DIRS} $ENV{NCCL_HOME}/include /usr/local/include /usr/include)
find_library(MEGAMOE_NCCL_LIBRARY nccl
  HINTS ${CUDAToolkit_LIBRARY_DIR} ${CUDAToolkit_LIBRARY_ROOT}/lib $ENV{NCCL_HOME}/lib /usr/local/lib)
if(NOT MEGAMOE_NCCL_INCLUDE_DIR OR NOT MEGAMOE_NCCL_LIBRARY)
  message(FATAL_ERROR "megamoe needs NCCL >= 2.28 with its device API (nccl_device.h, libnccl.so); "
    "found include='${MEGAMOE_NCCL_INCLUDE_DIR}' lib='${MEGAMOE_NCCL_LIBRARY}'. "
    "Install NCCL 2.28+ (it ships with the CUDA 13 toolkit) or set NCCL_HOME.")
endif()
file(STRINGS ${MEGAMOE_NCCL_INCLUDE_DIR}/nccl.h _nccl_major REGEX "^#define NCCL_MAJOR")
file(STRINGS ${MEGAMOE_NCCL_INCLUDE_DIR}/nccl.h _nccl_minor REGEX "^#define NCCL_MINOR")
string(REGEX MATCH "[0-9]+" _nccl_major "${_nccl_major}")
string(REGEX MATCH "[0-9]+" _nccl_minor "${_nccl_minor}")
if(_nccl_major LESS 2 OR (_nccl_major EQUAL 2 AND _nccl_minor LESS 28))
  message(FATAL_ERROR "megamoe needs NCCL >= 2.28 for the device API; ${MEGAMOE_NCCL_INCLUDE_DIR}/nccl.h is ${_nccl_major}.${_nccl_minor}")
endif()
add_library(megamoe::nccl INTERFACE IMPORTED)
target_include_directories(megamoe::nccl INTERFACE ${MEGAMOE_NCCL_INCLUDE_DIR})
target_link_libraries(megamoe::nccl INTERFACE ${MEGAMOE_NCCL_LIBRARY})
message(STATUS "megamoe: NCCL ${_nccl_major}.${_nccl_minor} at ${MEGAMOE_NCCL_LIBRARY}")

find_package(nlohmann_json 3.10 QUIET)
if(NOT nlohmann_json_FOUND)
  message(FATAL_ERROR "megamoe needs nlohmann-json >= 3.10 for the knob cache and JSON output. Fix: "
    "'apt-get install nlohmann-json3-dev' (or run scripts/setup.sh).")
endif()
if(MEGAMOE_BUILD_TOOL)
  find_package(CLI11 QUIET)
  if(NOT CLI11_FOUND)
    message(FATAL_ERROR "megamoe needs CLI11 for the command-line tool. Fix: 'apt-get install libcli11-dev' (or run scripts/setup.sh).")
  endif()
endif()
if(MEGAMOE_BUILD_TESTS)
  find_package(GTest REQUIRED)
endif()
