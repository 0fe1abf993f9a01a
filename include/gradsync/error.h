// defines: gradsync's exception types. Library code throws; only the CLI's main turns errors into exit codes.
#pragma once
#include <stdexcept>
#include <string>

namespace gradsync {

// Base of every error gradsync throws on purpose.
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Bad input from the user or the environment: the message says what, which value, and what is allowed.
class ConfigError : public Error {
 public:
  using Error::Error;
};

// A failure that involves other ranks (rendezvous, a collective, a cross-rank check): the message names ranks.
class DistributedError : public Error {
 public:
  using Error::Error;
};

}  // namespace gradsync
