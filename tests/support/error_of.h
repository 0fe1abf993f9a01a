// defines: error_of<E>(fn), the message of the exception fn throws, which must be of type E (a test failure
// otherwise), for tests that check what an error says.
#pragma once
#include <exception>
#include <functional>
#include <string>

#include <gtest/gtest.h>

namespace gradsync::test {

template <class E>
std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const E& e) {
    return e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "threw the wrong exception type: " << e.what();
    return e.what();
  }
  ADD_FAILURE() << "did not throw";
  return "";
}

}  // namespace gradsync::test
