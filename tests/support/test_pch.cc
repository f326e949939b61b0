// The translation unit that builds the tests' precompiled header
// (tests/CMakeLists.txt): <ATen/ATen.h>, <gtest/gtest.h> and <gmock/gmock.h>,
// which CMake includes before this line.
