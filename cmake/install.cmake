# `cmake --install` puts the libraries and headers under the prefix and exports
# ptllm::gate / ptllm::engine for find_package(posttrainllm).
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)
set(ptllm_install_targets ptllm_core ptllm_kernels_ref ptllm_kernels ptllm_kernels_cuda ptllm_gate
    ptllm_model ptllm_engine)
install(TARGETS ${ptllm_install_targets} ptllm EXPORT posttrainllmTargets
        ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR} LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
        RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
install(DIRECTORY src/ DESTINATION include/ptllm FILES_MATCHING PATTERN "*.h")
install(EXPORT posttrainllmTargets NAMESPACE ptllm:: DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/posttrainllm)
configure_package_config_file(cmake/posttrainllmConfig.cmake.in
  ${CMAKE_CURRENT_BINARY_DIR}/posttrainllmConfig.cmake
  INSTALL_DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/posttrainllm)
write_basic_package_version_file(${CMAKE_CURRENT_BINARY_DIR}/posttrainllmConfigVersion.cmake
  COMPATIBILITY SameMinorVersion)
install(FILES ${CMAKE_CURRENT_BINARY_DIR}/posttrainllmConfig.cmake
              ${CMAKE_CURRENT_BINARY_DIR}/posttrainllmConfigVersion.cmake
        DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/posttrainllm)
