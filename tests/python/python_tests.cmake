# The Python tests run on two stacks (docs/design.md §16), each a ctest entry of its own:
#   NAME        Debian 12's: build/venv, packd's wheel installed into a venv that sees Debian's
#               python3-torch, -grpcio, -protobuf and -numpy (torch 1.13, protobuf 4.21)
#   NAME_pypi   PyPI's: build/venv-pypi, the wheel installed into a venv over deploy/pypi-venv.sh's
#               pinned stack (torch 2, grpcio 1.8x, protobuf 7, numpy 2, transformers, verl)
# Both label `python` and their stack's name (ctest -L pypi). Each test prints its stack's
# versions in its header (tests/support/packd_stack.py). Without the PyPI venv (deploy/pypi-venv.sh
# not run, or PACKD_PYPI=0 given to deploy/install-deps.sh) the PyPI entries are one skipped test
# that says so.
find_program(PACKD_SYSTEM_PYTHON python3 PATHS /usr/bin NO_DEFAULT_PATH)
set(PACKD_VENV_PYTHON ${CMAKE_BINARY_DIR}/venv/bin/python)
set(PACKD_PYPI_PYTHON ${CMAKE_BINARY_DIR}/venv-pypi/bin/python)

# Where deploy/pypi-venv.sh keeps the venv of the constraints file (-DPACKD_PYPI_VENV= another).
set_property(DIRECTORY ${PROJECT_SOURCE_DIR} APPEND PROPERTY CMAKE_CONFIGURE_DEPENDS
             ${PROJECT_SOURCE_DIR}/deploy/pypi-constraints.txt)
if(NOT PACKD_PYPI_VENV)
  execute_process(COMMAND ${PROJECT_SOURCE_DIR}/deploy/pypi-venv.sh --path
                  OUTPUT_VARIABLE _pypi_venv OUTPUT_STRIP_TRAILING_WHITESPACE
                  RESULT_VARIABLE _pypi_rc ERROR_QUIET)
else()
  set(_pypi_venv ${PACKD_PYPI_VENV})
  set(_pypi_rc 0)
endif()
set(PACKD_PYPI_STACK OFF)
if(_pypi_rc EQUAL 0 AND EXISTS ${_pypi_venv}/.packd-complete)
  file(STRINGS ${_pypi_venv}/.packd-complete _pypi_versions LIMIT_COUNT 1)
  set(PACKD_PYPI_STACK ON)
  set(PACKD_PYPI_BASE ${_pypi_venv})
  message(STATUS "packd: the Python tests run on PyPI's stack too (${_pypi_venv}): "
                 "${_pypi_versions}")
else()
  set(PACKD_PYPI_SKIP_REASON "the PyPI stack's venv (${_pypi_venv}) is not made: run "
                             "deploy/pypi-venv.sh (deploy/install-deps.sh does, unless PACKD_PYPI=0)")
  message(STATUS "packd: ${PACKD_PYPI_SKIP_REASON}; the Python tests run on Debian's stack only")
endif()

# packd_python_test(NAME COMMAND PYTHON args... [ENVIRONMENT var=value...] [TIMEOUT seconds]):
# NAME and NAME_pypi, PYTHON replaced by each stack's interpreter, run in the build folder with
# tests/support on PYTHONPATH, after the fixture that installs the wheel there.
function(packd_python_test name)
  cmake_parse_arguments(PARSE_ARGV 1 arg "" "TIMEOUT" "COMMAND;ENVIRONMENT")
  set(stacks debian)
  if(PACKD_PYPI_STACK)
    list(APPEND stacks pypi)
  endif()
  foreach(stack IN LISTS stacks)
    if(stack STREQUAL "debian")
      set(test ${name})
      set(python ${PACKD_VENV_PYTHON})
      set(fixture packd_python_package)
      set(peers "")
    else()
      set(test ${name}_pypi)
      set(python ${PACKD_PYPI_PYTHON})
      set(fixture packd_python_package_pypi)
      # Peers' files that are not installed packages (flash-attn's bert_padding.py).
      set(peers "PACKD_PEERS_DIR=${PACKD_PYPI_BASE}/peers")
    endif()
    list(TRANSFORM arg_COMMAND REPLACE "^PYTHON$" ${python} OUTPUT_VARIABLE command)
    add_test(NAME ${test} COMMAND ${command} WORKING_DIRECTORY ${CMAKE_BINARY_DIR})
    set_tests_properties(${test} PROPERTIES
      FIXTURES_REQUIRED ${fixture} LABELS "python;${stack}"
      ENVIRONMENT "${arg_ENVIRONMENT};${peers};PYTHONPATH=${PROJECT_SOURCE_DIR}/tests/support")
    if(arg_TIMEOUT)
      set_tests_properties(${test} PROPERTIES TIMEOUT ${arg_TIMEOUT})
    endif()
  endforeach()
endfunction()

# packd_pytest(NAME PATH... [ENVIRONMENT ...] [TIMEOUT s]): pytest over PATH on both stacks, every
# warning an error: a deprecation on the newest torch, numpy or protobuf fails the test that meets
# it, not a user's job a release later.
function(packd_pytest name)
  cmake_parse_arguments(PARSE_ARGV 1 arg "" "TIMEOUT" "ENVIRONMENT")
  set(extra)
  if(arg_TIMEOUT)
    set(extra TIMEOUT ${arg_TIMEOUT})
  endif()
  packd_python_test(${name}
    COMMAND PYTHON -m pytest -q -rs -W error -p no:cacheprovider -p packd_stack ${arg_UNPARSED_ARGUMENTS}
    ENVIRONMENT ${arg_ENVIRONMENT} ${extra})
endfunction()
