# cmake/install.cmake - what a distribution ships: libstrata.a and libstrata.so.MAJOR (every
# module's objects in one library), the public headers, strata.pc, and the programs; included
# by the top CMakeLists.txt after every module is defined. docs/PACKAGING.md is its manual.
#
# Invariants:
# - The combined libraries are made of the module libraries' own objects (compiled once, with
#   position-independent code: CMAKE_POSITION_INDEPENDENT_CODE in the top CMakeLists.txt), so
#   they hold exactly the code the programs and the tests run.
# - The public headers are the per-module lists below and nothing else: a header a public header
#   includes is itself on a list (test_install compiles a program that includes every one of them
#   from the installed tree, so a missing entry fails there).
# - Installed paths are relative to the install prefix, which `cmake --install --prefix` may
#   change after configuring: strata.pc is written at install time, with that prefix.
# - Components: `runtime` (the programs and libstrata.so.MAJOR), `dev` (headers, libstrata.a,
#   the libstrata.so link, strata.pc). A plain `make install` / `cmake --install` installs both.

# ---- the public headers, one list per module --------------------------------------------------
# A module split into several (one public header each) adds its headers to its folder's list; a
# new module adds a list and its folder to ST_INSTALL_MODULES, in dependency order.
set(ST_INSTALL_MODULES codec statestore migrations engine api)
if(EXISTS ${PROJECT_SOURCE_DIR}/common/CMakeLists.txt)
  list(PREPEND ST_INSTALL_MODULES common)
endif()
set(ST_PUBLIC_HEADERS_common     common/st_common.h)
set(ST_PUBLIC_HEADERS_codec      codec/st_codec.h)
set(ST_PUBLIC_HEADERS_statestore statestore/st_image.h statestore/st_file.h statestore/st_store.h)
set(ST_PUBLIC_HEADERS_migrations migrations/st_migrate.h)
set(ST_PUBLIC_HEADERS_engine     engine/st_engine.h)
set(ST_PUBLIC_HEADERS_api        api/st_api.h)
# Module folder -> its library targets (a folder may hold several)
set(ST_LIBS_common     st_common)
set(ST_LIBS_codec      st_codec)
set(ST_LIBS_statestore st_statestore)
set(ST_LIBS_migrations st_migrations)
set(ST_LIBS_engine     st_engine)
set(ST_LIBS_api        st_api)

set(ST_INSTALL_HEADERS ${PROJECT_BINARY_DIR}/include/st_version.h)
set(ST_INSTALL_LIBS)
foreach(mod ${ST_INSTALL_MODULES})
  foreach(lib ${ST_LIBS_${mod}})
    if(TARGET ${lib})
      list(APPEND ST_INSTALL_LIBS ${lib})
    endif()
  endforeach()
  foreach(h ${ST_PUBLIC_HEADERS_${mod}})
    if(NOT EXISTS ${PROJECT_SOURCE_DIR}/${h})
      message(FATAL_ERROR "cmake/install.cmake: public header ${h} does not exist")
    endif()
    list(APPEND ST_INSTALL_HEADERS ${PROJECT_SOURCE_DIR}/${h})
  endforeach()
endforeach()
# Headers go into include/strata/ (the names are short: st_codec.h, st_store.h ...); strata.pc's
# Cflags point there, so code includes them as the tree's own code does ("st_engine.h").
set(ST_INCLUDE_SUBDIR strata)

# ---- libstrata.a and libstrata.so --------------------------------------------------------------
# The fuzz build's objects carry libFuzzer's instrumentation: no library is made of them.
if(NOT STRATA_FUZZ)
  set(ST_OBJECTS)
  foreach(lib ${ST_INSTALL_LIBS})
    list(APPEND ST_OBJECTS $<TARGET_OBJECTS:${lib}>)
  endforeach()
  # What the module libraries link (PkgConfig::* of the top CMakeLists.txt, CUDA when built).
  set(ST_DEPS PkgConfig::LMDB PkgConfig::ZSTD PkgConfig::CRYPTO PkgConfig::EVENT
      PkgConfig::JANSSON PkgConfig::XXHASH PkgConfig::ICU Threads::Threads m)
  if(STRATA_HAVE_CUDA)
    list(APPEND ST_DEPS CUDA::cudart CUDA::cublas)
  endif()
  if(STRATA_HAVE_TIER)
    list(APPEND ST_DEPS PkgConfig::HIREDIS)
  endif()

  # Linked as the programs are: by nvcc's driver where CUDA objects are in
  if(STRATA_HAVE_CUDA)
    set(ST_LINKER_LANGUAGE CUDA)
  else()
    set(ST_LINKER_LANGUAGE C)
  endif()
  add_library(strata_static STATIC ${ST_OBJECTS})
  set_target_properties(strata_static PROPERTIES OUTPUT_NAME strata LINKER_LANGUAGE ${ST_LINKER_LANGUAGE})
  target_link_libraries(strata_static INTERFACE ${ST_DEPS})
  add_dependencies(strata_static ${ST_INSTALL_LIBS})
  if(STRATA_BUILD_SHARED)
    add_library(strata_shared SHARED ${ST_OBJECTS})
    # libstrata.so.0 -> libstrata.so.0.1.0: the soname changes with the major version (0 while
    # the API is young: a minor version may change it then, and says so in its notes).
    set_target_properties(strata_shared PROPERTIES OUTPUT_NAME strata LINKER_LANGUAGE ${ST_LINKER_LANGUAGE}
                          VERSION ${PROJECT_VERSION} SOVERSION ${PROJECT_VERSION_MAJOR})
    target_link_libraries(strata_shared PRIVATE ${ST_DEPS})
    # No undefined symbols left for the program to supply (but a sanitizer's runtime, which
    # clang links into the program only)
    if(NOT STRATA_SANITIZE AND NOT STRATA_TSAN)
      target_link_options(strata_shared PRIVATE "LINKER:--no-undefined")
    endif()
    add_dependencies(strata_shared ${ST_INSTALL_LIBS})
  endif()
endif()

# ---- strata.pc ---------------------------------------------------------------------------------
# Requires.private: the pkg-config modules of the libraries libstrata's code calls, for a static
# link (`pkg-config --static`); Libs.private: what has no .pc (libm, threads, the CUDA runtime).
set(ST_PC_REQUIRES_PRIVATE "lmdb libzstd libcrypto libevent libevent_pthreads jansson libxxhash icu-uc")
set(ST_PC_LIBS_PRIVATE "-lm -pthread")
if(STRATA_HAVE_TIER)
  string(APPEND ST_PC_REQUIRES_PRIVATE " hiredis")
endif()
if(STRATA_HAVE_CUDA)
  # The CUDA runtime and cuBLAS (the toolkit ships no .pc a distribution can count on), and the
  # C++ runtime that nvcc's host code needs in a static link.
  string(APPEND ST_PC_LIBS_PRIVATE " -L${CUDAToolkit_LIBRARY_DIR} -lcudart -lcublas -lstdc++")
endif()
foreach(v LIBDIR INCLUDEDIR)
  if(IS_ABSOLUTE "${CMAKE_INSTALL_${v}}")
    set(ST_PC_${v} "${CMAKE_INSTALL_${v}}")
  else()
    set(ST_PC_${v} "\${prefix}/${CMAKE_INSTALL_${v}}")
  endif()
endforeach()
# Written at install time, when the prefix is final (`cmake --install --prefix P` overrides the
# configured one); DESTDIR is added by the install(FILES) below, never written into the file.
file(WRITE ${PROJECT_BINARY_DIR}/strata.pc.in
"prefix=@ST_PC_PREFIX@
libdir=${ST_PC_LIBDIR}
includedir=${ST_PC_INCLUDEDIR}

Name: strata
Description: LLM conversation state: session files, an LMDB state store, an inference engine
Version: ${PROJECT_VERSION}
Requires.private: ${ST_PC_REQUIRES_PRIVATE}
Libs: -L\${libdir} -lstrata
Libs.private: ${ST_PC_LIBS_PRIVATE}
Cflags: -I\${includedir}/${ST_INCLUDE_SUBDIR}
")
install(CODE "set(ST_PC_PREFIX \"\${CMAKE_INSTALL_PREFIX}\")
configure_file(\"${PROJECT_BINARY_DIR}/strata.pc.in\" \"${PROJECT_BINARY_DIR}/strata.pc\" @ONLY)"
        COMPONENT dev)
install(FILES ${PROJECT_BINARY_DIR}/strata.pc DESTINATION ${CMAKE_INSTALL_LIBDIR}/pkgconfig
        COMPONENT dev)

# ---- install rules -------------------------------------------------------------------------------
install(FILES ${ST_INSTALL_HEADERS} DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/${ST_INCLUDE_SUBDIR}
        COMPONENT dev)
if(TARGET strata_static)
  install(TARGETS strata_static ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR} COMPONENT dev)
endif()
if(TARGET strata_shared)
  install(TARGETS strata_shared
          LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR} COMPONENT runtime NAMELINK_COMPONENT dev)
endif()
# The programs a user runs (README.md): the server, the file and store tool, the engine's
# command line and the model maker. The tests' and benchmarks' programs are not installed.
set(ST_INSTALL_PROGRAMS)
foreach(p strata-server statectl strata strata-mkmodel)
  if(TARGET ${p})
    list(APPEND ST_INSTALL_PROGRAMS ${p})
  endif()
endforeach()
install(TARGETS ${ST_INSTALL_PROGRAMS} RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR} COMPONENT runtime)
