# Install rules and the CMake package: find_package(frugal CONFIG) gives frugal::frugal,
# with Torch, fmt and nlohmann_json found again for the consumer.
include(CMakePackageConfigHelpers)

install(TARGETS frugal EXPORT frugalTargets
        ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
        LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR})
install(DIRECTORY ${PROJECT_SOURCE_DIR}/include/frugal DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})

set(FRUGAL_CMAKE_DIR ${CMAKE_INSTALL_LIBDIR}/cmake/frugal)
install(EXPORT frugalTargets NAMESPACE frugal:: DESTINATION ${FRUGAL_CMAKE_DIR})

# The consumer must find the same LibTorch frugal was built with.
set(FRUGAL_TORCH_DIR "${Torch_DIR}")
configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/frugalConfig.cmake.in
  ${PROJECT_BINARY_DIR}/frugalConfig.cmake INSTALL_DESTINATION ${FRUGAL_CMAKE_DIR})
write_basic_package_version_file(${PROJECT_BINARY_DIR}/frugalConfigVersion.cmake
  VERSION ${PROJECT_VERSION} COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/frugalConfig.cmake
              ${PROJECT_BINARY_DIR}/frugalConfigVersion.cmake
        DESTINATION ${FRUGAL_CMAKE_DIR})
