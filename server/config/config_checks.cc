#include "server/config/config_checks.h"

#include <algorithm>
#include <map>
#include <set>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace twinkle::config_internal {

bool IsDevice(const std::string& d) {
  int index;
  return d == "cpu" || (absl::StartsWith(d, "cuda:") && absl::SimpleAtoi(d.substr(5), &index) && index >= 0);
}

namespace {

// sampler.devices: empty (colocated) or the devices of dedicated sampler workers. A GPU is
// either the trainer's or the sampler's: two processes each holding a copy of the base model
// and a KV cache on one GPU would fight over its memory. CPU workers share the host, as
// engine.devices: [cpu, cpu] does. `key` / `training_key` name the lists (engine.devices and
// sampler.devices, or models[i].devices and models[i].sampler_devices).
void CheckSamplerDevices(const std::vector<std::string>& devices, const std::vector<std::string>& training,
                         const std::string& key, const std::string& training_key, KeyErrors& r) {
  std::set<std::string> seen;
  for (const std::string& d : devices) {
    if (!IsDevice(d)) {
      r.ErrorAtKey(key, absl::StrCat("'", d, "' is not a device (cpu or cuda:N)"));
      continue;
    }
    if (!seen.insert(d).second && d != "cpu") {
      r.ErrorAtKey(key, absl::StrCat("'", d, "' is listed twice"));
    }
    if (d != "cpu" && std::find(training.begin(), training.end(), d) != training.end()) {
      r.ErrorAtKey(key, absl::StrCat("'", d, "' is also in ", training_key,
                                     "; a dedicated sampler worker needs a GPU of its own (only cpu may be "
                                     "shared; leave ", key, " empty to sample on the training workers)"));
    }
  }
}

// One model's training devices: cpu, cuda:N, or DEVICE@NODE on a node agent. True when any
// is on another node.
bool CheckTrainingDevices(const Config& c, const std::vector<std::string>& devices, const std::string& key,
                          KeyErrors& r) {
  if (devices.empty()) r.ErrorAtKey(key, "needs at least one device");
  bool remote = false;
  for (const std::string& d : devices) {
    const size_t at = d.find('@');
    if (at != std::string::npos) {
      remote = true;
      const std::string node = d.substr(at + 1);
      const bool named = !node.empty() && node.size() <= 64 && node[0] != '_' && node[0] != '.' && node[0] != '-' &&
                         std::all_of(node.begin(), node.end(), [](char ch) {
                           return (ch >= 'a' && ch <= 'z') || (ch >= '0' && ch <= '9') || ch == '_' || ch == '.' ||
                                  ch == '-';
                         });
      if (!named) {
        r.ErrorAtKey(key, absl::StrCat("'", d, "': a node name is [a-z0-9][a-z0-9_.-]{0,63}"));
      }
    }
    if (!IsDevice(d.substr(0, at))) {
      r.ErrorAtKey(key, absl::StrCat("'", d, "' is not a device (cpu or cuda:N, or DEVICE@NODE on a node agent)"));
    }
  }
  if (remote) {
    if (devices.size() > 1 && devices[0].find('@') != std::string::npos) {
      r.ErrorAtKey(key, absl::StrCat("rank 0 ('", devices[0], "') serves the ranks' rendezvous and must be on this node"));
    }
    if (c.nodes.listen.empty() || c.nodes.secret_file.empty()) {
      r.ErrorAtKey("nodes", absl::StrCat("devices on other nodes (DEVICE@NODE in ", key,
                                         ") need nodes.listen and nodes.secret_file"));
    }
  }
  return remote;
}

// The `models:` list: not together with `model:`, not empty, names unique, and no device
// (other than cpu) serving two models: a GPU holds one base model's workers. In the list form
// every model names its own devices, so the top-level engine.devices and sampler.devices
// would be ambiguous and are refused. Engines on other nodes: each model has its own node
// socket (ForModel: models[i] listens on nodes.listen's port + i), so those ports must exist.
void CheckModels(const Config& c, KeyErrors& r) {
  if (!c.models_listed) return;
  if (r.Has("model")) {
    r.ErrorAtKey("models", "give either model: (one base model) or models: (several), not both");
  }
  if (c.models.empty()) {
    r.ErrorAtKey("models", "needs at least one model (or use model: for a single one)");
    return;
  }
  for (const char* key : {"engine.devices", "sampler.devices"}) {
    if (r.Has(key)) {
      r.ErrorAtKey(key, absl::StrCat("with models:, each model lists its own devices (models[i].",
                                     std::string(key) == "engine.devices" ? "devices" : "sampler_devices",
                                     "); remove ", key));
    }
  }
  std::map<std::string, size_t> names;
  std::map<std::string, size_t> device_owner;  // non-cpu device -> model index
  for (size_t i = 0; i < c.models.size(); ++i) {
    const ModelEntry& m = c.models[i];
    const std::string at = absl::StrCat("models[", i, "]");
    if (auto [it, inserted] = names.emplace(m.name, i); !inserted) {
      r.ErrorAtKey(at + ".name", absl::StrCat("'", m.name, "' is already the name of models[", it->second,
                                              "]; every model needs its own name (name:, default: the directory's name)"));
    }
    const bool remote = CheckTrainingDevices(c, m.devices, at + ".devices", r);
    if (remote && !c.nodes.listen.empty()) {
      int port = 0;
      const size_t colon = c.nodes.listen.rfind(':');
      if (colon != std::string::npos && absl::SimpleAtoi(c.nodes.listen.substr(colon + 1), &port) &&
          port + static_cast<int>(i) > 65535) {
        r.ErrorAtKey(at + ".devices", absl::StrCat("models[", i, "]'s node agents join nodes.listen's port + ", i,
                                                   ", past 65535: lower nodes.listen's port"));
      }
      if (c.nodes.rendezvous_port > 0 && c.nodes.rendezvous_port + static_cast<int>(i) > 65535) {
        r.ErrorAtKey("nodes.rendezvous_port", absl::StrCat("models[", i, "] rendezvouses at its port + ", i,
                                                           ", past 65535"));
      }
    }
    CheckSamplerDevices(m.sampler_devices, m.devices, at + ".sampler_devices", at + ".devices", r);
    for (const auto& [list, key] : {std::pair{&m.devices, at + ".devices"},
                                    std::pair{&m.sampler_devices, at + ".sampler_devices"}}) {
      for (const std::string& d : *list) {
        if (d == "cpu" || !IsDevice(d.substr(0, d.find('@')))) continue;
        auto [it, inserted] = device_owner.emplace(d, i);
        if (!inserted && it->second != i) {
          r.ErrorAtKey(key, absl::StrCat("'", d, "' is already used by models[", it->second, "] ('",
                                         c.models[it->second].name,
                                         "'); a device serves one model (only cpu may be shared)"));
        }
      }
    }
  }
}

}  // namespace

void CheckSemantics(const Config& c, KeyErrors& r) {
  const bool loopback = IsLoopbackHost(c.server.host);
  if (!loopback && !c.auth.enabled) {
    r.ErrorAtKey("server.host", absl::StrCat("refusing to bind non-loopback address '", c.server.host,
                                             "' without authentication; bind 127.0.0.1 or ::1, "
                                             "or set auth.enabled with tenants"));
  }
  if (c.auth.enabled && c.auth.tenants.empty()) {
    r.ErrorAtKey("auth.enabled",
                 "authentication is enabled but no tenant is configured (auth.tenants or "
                 "auth.tenants_file)");
  }
  if (c.auth.jwt_ttl_s != 0 && c.auth.jwt_ttl_s < kMinJwtTtlSeconds) {
    // The SDK renews a token with a minute or less left before every call.
    r.ErrorAtKey("auth.jwt_ttl_s", absl::StrCat("must be 0 (no token exchange) or at least ", kMinJwtTtlSeconds,
                                                " seconds"));
  }
  if (c.testing.hooks && c.auth.enabled && !loopback) {
    r.ErrorAtKey("testing.hooks",
                 absl::StrCat("refusing test hooks (they let a client pause the scheduler) on "
                              "non-loopback address '", c.server.host, "'; tests bind 127.0.0.1"));
  }
  if (!c.server.tls.client_ca_file.empty() && c.server.tls.cert_file.empty()) {
    r.ErrorAtKey("server.tls.client_ca_file", "needs server.tls.cert_file and key_file (mTLS is TLS)");
  }
  if (c.server.tls.cert_file.empty() != c.server.tls.key_file.empty()) {
    r.ErrorAtKey("server.tls", "set both cert_file and key_file, or neither");
  }
  // One model: engine.devices and sampler.devices (models[0] mirrors them); several: each
  // model's lists (CheckModels).
  bool remote = false;
  if (c.models_listed) {
    for (const ModelEntry& m : c.models) {
      remote |= std::any_of(m.devices.begin(), m.devices.end(),
                            [](const std::string& d) { return d.find('@') != std::string::npos; });
    }
    CheckModels(c, r);
  } else {
    remote = CheckTrainingDevices(c, c.engine.devices, "engine.devices", r);
    CheckSamplerDevices(c.sampler.devices, c.engine.devices, "sampler.devices", "engine.devices", r);
  }
  if (!c.nodes.listen.empty()) {
    const size_t colon = c.nodes.listen.rfind(':');
    int port = 0;
    if (colon == std::string::npos || colon == 0 || !absl::SimpleAtoi(c.nodes.listen.substr(colon + 1), &port) ||
        port < 1 || port > 65535) {
      r.ErrorAtKey("nodes.listen", absl::StrCat("'", c.nodes.listen, "' is not host:port"));
    }
    if (c.nodes.secret_file.empty()) r.ErrorAtKey("nodes.secret_file", "nodes.listen needs the node secret");
    const std::string host = RendezvousHost(c);
    const bool remote_group = std::any_of(c.models.begin(), c.models.end(), [](const ModelEntry& m) {
      return m.devices.size() > 1 && std::any_of(m.devices.begin(), m.devices.end(), [](const std::string& d) {
               return d.find('@') != std::string::npos;
             });
    });
    if (remote_group && (host == "0.0.0.0" || host == "::" || host == "*" || host.empty())) {
      r.ErrorAtKey("nodes.rendezvous_host", absl::StrCat("nodes.listen binds '", host,
                                                         "': set the address other nodes reach this node at"));
    }
  }
  if (c.engine.heartbeat_timeout_ms <= 2 * c.engine.heartbeat_interval_ms) {
    r.ErrorAtKey("engine.heartbeat_timeout_ms",
                 absl::StrCat("must exceed twice heartbeat_interval_ms (",
                              c.engine.heartbeat_interval_ms, ")"));
  }
  if (c.engine.restart_backoff_initial_ms > c.engine.restart_backoff_max_ms) {
    r.ErrorAtKey("engine.restart_backoff_initial_ms", "must not exceed restart_backoff_max_ms");
  }
  if (c.server.grpc_port != 0 && c.server.grpc_port == c.server.http_port) {
    r.ErrorAtKey("server.http_port", "must differ from grpc_port");
  }
}

}  // namespace twinkle::config_internal
