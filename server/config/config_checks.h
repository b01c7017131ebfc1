#pragma once
// The checks of a read Config that span keys (docs/config.md): binding and auth, TLS, the
// devices of one model or of each in `models:`, engines on other nodes, ports and back-offs.
// ParseConfig runs them after reading the file; they report through KeyErrors, which the
// YAML reader implements (it adds the file and line of the key).

#include <string>

#include "server/config/config.h"

namespace twinkle::config_internal {

class KeyErrors {
 public:
  virtual ~KeyErrors() = default;
  // "FILE:LINE: dotted.key: message".
  virtual void ErrorAtKey(const std::string& dotted_key, const std::string& message) = 0;
  // Whether the document has this dotted key ("engine.devices"; no list indices).
  virtual bool Has(const std::string& dotted_key) const = 0;
};

// cpu or cuda:N.
bool IsDevice(const std::string& d);

// Checks that involve more than one field or more than a range.
void CheckSemantics(const Config& c, KeyErrors& r);

}  // namespace twinkle::config_internal
