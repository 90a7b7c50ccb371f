# Grouped GEMM extras (src/kernels/gemm, tools/megamoe/gemm_cmd.cpp): the `bench-gemm` subcommand
# times cuBLASLt's dense fp8 GEMM as its peer, so the tool links cuBLASLt (CUDA toolkit).
# Include after the megamoe_tool_lib target is defined: include(MegamoeGemm).
if(TARGET megamoe_tool_lib)
  target_link_libraries(megamoe_tool_lib PUBLIC CUDA::cublasLt)
endif()
