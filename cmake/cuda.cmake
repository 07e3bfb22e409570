# The CUDA backend is built when nvcc is found (and PTLLM_CUDA is not OFF); otherwise a stub
# file declares no CUDA paths, so no call site needs an #ifdef.
option(PTLLM_CUDA "Build the CUDA backend when nvcc is available" ON)
set(PTLLM_HAVE_CUDA OFF)
if(PTLLM_CUDA)
  include(CheckLanguage)
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER AND EXISTS ${CMAKE_CURRENT_SOURCE_DIR}/src/kernels/cuda/cuda_device.cu)
    set(PTLLM_HAVE_CUDA ON)
  endif()
endif()
if(PTLLM_HAVE_CUDA)
  enable_language(CUDA)
  find_package(CUDAToolkit REQUIRED)
  # .cu files are C++17: nvcc's front end rejects fmt's consteval format strings (C++20 mode),
  # and fmt falls back to run-time checked ones in C++17. The headers they include stay
  # C++17-clean (kernels/cuda/*.cuh, core/error.h, core/tensor.h, kernels/ops.h).
  set(CMAKE_CUDA_STANDARD 17)
  # sm_90 SASS plus PTX so other GPUs JIT-compile.
  set(CMAKE_CUDA_ARCHITECTURES 90-real 90-virtual)
  file(GLOB cuda_srcs CONFIGURE_DEPENDS src/kernels/cuda/*.cu src/kernels/cuda/*.cpp)
  list(FILTER cuda_srcs EXCLUDE REGEX "cuda_stub.cpp$|_sm90a.cu$")
  add_library(ptllm_kernels_cuda STATIC ${cuda_srcs})
  # Kernels that use Hopper-only instructions (wgmma, setmaxnreg): sm_90a machine code only, no
  # PTX (it would not JIT anywhere else); the host side asks wgmmaGemmAvailable() before use.
  file(GLOB sm90a_srcs CONFIGURE_DEPENDS src/kernels/cuda/*_sm90a.cu)
  add_library(ptllm_kernels_cuda_sm90a OBJECT ${sm90a_srcs})
  set_target_properties(ptllm_kernels_cuda_sm90a PROPERTIES CUDA_ARCHITECTURES OFF)
  target_compile_options(ptllm_kernels_cuda_sm90a PRIVATE
    $<$<COMPILE_LANGUAGE:CUDA>:-gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr -lineinfo>)
  target_include_directories(ptllm_kernels_cuda_sm90a PRIVATE ${CMAKE_CURRENT_SOURCE_DIR}/src)
  target_link_libraries(ptllm_kernels_cuda_sm90a PRIVATE ptllm_core nlohmann_json::nlohmann_json CUDA::cudart)
  target_sources(ptllm_kernels_cuda PRIVATE $<TARGET_OBJECTS:ptllm_kernels_cuda_sm90a>)
  # Keep host code warning-free too; relaxed constexpr for std:: helpers in device code.
  target_compile_options(ptllm_kernels_cuda PRIVATE
    $<$<COMPILE_LANGUAGE:CUDA>:--expt-relaxed-constexpr -lineinfo>)
  target_include_directories(ptllm_kernels_cuda PUBLIC $<BUILD_INTERFACE:${CMAKE_CURRENT_SOURCE_DIR}/src>)
  target_link_libraries(ptllm_kernels_cuda PUBLIC ptllm_core nlohmann_json::nlohmann_json
                        PRIVATE CUDA::cudart CUDA::cublas CUDA::cublasLt)
else()
  add_library(ptllm_kernels_cuda STATIC src/kernels/cuda/cuda_stub.cpp
                                        src/kernels/cuda/cuda_device_info.cpp)
  target_include_directories(ptllm_kernels_cuda PUBLIC $<BUILD_INTERFACE:${CMAKE_CURRENT_SOURCE_DIR}/src>)
  target_link_libraries(ptllm_kernels_cuda PUBLIC ptllm_core nlohmann_json::nlohmann_json)
endif()
target_link_libraries(ptllm_kernels PUBLIC ptllm_kernels_cuda)
message(STATUS "posttrainllm: CUDA backend ${PTLLM_HAVE_CUDA}")
