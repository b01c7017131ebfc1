#include "server/config/config.h"

#include <arpa/inet.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <limits>
#include <map>
#include <optional>
#include <set>
#include <sstream>

#include <nlohmann/json.hpp>
#include <yaml-cpp/yaml.h>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include <cstring>

#include "core/tenancy/sha256.h"
#include "core/tenancy/tenant_registry.h"
#include "server/config/config_checks.h"

namespace twinkle {
namespace {

using config_internal::CheckSemantics;

// Constraints a field may carry; the reader enforces them, the renderer masks secrets.
struct Spec {
  double min = -std::numeric_limits<double>::infinity();
  double max = std::numeric_limits<double>::infinity();
  std::vector<std::string> one_of;  // allowed values of a string field
  bool secret = false;              // masked by print-config
  bool path = false;                // resolved against the config file's folder
  bool required = false;
};

Spec Range(double min, double max) { return Spec{.min = min, .max = max}; }
Spec OneOf(std::vector<std::string> values) { return Spec{.one_of = std::move(values)}; }
Spec Path() { return Spec{.path = true}; }
Spec RequiredPath() { return Spec{.path = true, .required = true}; }
Spec SecretPath() { return Spec{.secret = true, .path = true}; }
Spec Secret() { return Spec{.secret = true}; }
Spec Required() { return Spec{.required = true}; }

// ---- The field lists: the one place that names every key. -------------------------------

template <typename V> void VisitFields(V& v, TlsConfig& c) {
  v.Field("cert_file", c.cert_file, Path());
  v.Field("key_file", c.key_file, SecretPath());
  v.Field("client_ca_file", c.client_ca_file, Path());
}
template <typename V> void VisitFields(V& v, ServerSection& c) {
  v.Field("host", c.host, Spec{});
  v.Field("grpc_port", c.grpc_port, Range(0, 65535));
  v.Field("http_port", c.http_port, Range(0, 65535));
  v.Field("drain_timeout_s", c.drain_timeout_s, Range(0, 3600));
  v.Section("tls", c.tls);
  v.Field("max_http_connections", c.max_http_connections, Range(1, 1000000));
  v.Field("idle_timeout_s", c.idle_timeout_s, Range(1, 86400));
  v.Field("max_concurrent_streams", c.max_concurrent_streams, Range(1, 1000000));
  v.Field("allowed_hosts", c.allowed_hosts, Spec{});
  v.Field("allowed_origins", c.allowed_origins, Spec{});
  v.Field("metrics_tenant_labels", c.metrics_tenant_labels, Spec{});
}
template <typename V> void VisitFields(V& v, ModelSection& c) {
  v.Field("path", c.path, RequiredPath());
  v.Field("name", c.name, Spec{});
  v.Field("dtype", c.dtype, OneOf({"float32", "bfloat16", "float16"}));
  v.Field("max_context_tokens", c.max_context_tokens, Range(0, 1e9));
  v.Field("chat_renderer_fallback", c.chat_renderer_fallback, OneOf({"", "qwen3", "qwen3_5", "llama3", "chatml"}));
}
template <typename V> void VisitFields(V& v, ModelEntry& c) {
  VisitFields(v, static_cast<ModelSection&>(c));  // the `model:` keys, under the same names
  v.Field("devices", c.devices, Spec{});
  v.Field("sampler_devices", c.sampler_devices, Spec{});
  v.Field("max_adapters", c.max_adapters, Range(0, 100000));
}
template <typename V> void VisitFields(V& v, EngineSection& c) {
  v.Field("devices", c.devices, Spec{});
  v.Field("binary", c.binary, Path());
  v.Field("heartbeat_interval_ms", c.heartbeat_interval_ms, Range(10, 60000));
  v.Field("heartbeat_timeout_ms", c.heartbeat_timeout_ms, Range(50, 600000));
  v.Field("startup_timeout_s", c.startup_timeout_s, Range(1, 86400));
  v.Field("restart_backoff_initial_ms", c.restart_backoff_initial_ms, Range(1, 3600000));
  v.Field("restart_backoff_max_ms", c.restart_backoff_max_ms, Range(1, 3600000));
  v.Field("call_timeout_s", c.call_timeout_s, Range(0.05, 604800));
  v.Field("call_timeout_per_mib_s", c.call_timeout_per_mib_s, Range(0, 86400));
  v.Field("adapter_restore_points", c.adapter_restore_points, Spec{});
  v.Field("collective_timeout_s", c.collective_timeout_s, Range(1, 86400));
  v.Field("activation_checkpointing", c.activation_checkpointing, Spec{});
  v.Field("logit_chunk_rows", c.logit_chunk_rows, Range(0, 1e7));
  v.Field("activation_memory_mib", c.activation_memory_mib, Range(0, 1e7));
  v.Field("rank_token_budget", c.rank_token_budget, Range(0, 1e9));
  v.Field("rebalance", c.rebalance, Spec{});
}
// Also the shape of a tenant's `quotas` (same keys, same ranges).
template <typename V> void VisitFields(V& v, LimitsSection& c) {
  v.Field("max_adapters", c.max_adapters, Range(1, 100000));
  v.Field("max_lora_rank", c.max_lora_rank, Range(1, 1024));
  v.Field("max_tokens_per_request", c.max_tokens_per_request, Range(1, 1e9));
  v.Field("max_pending_ops", c.max_pending_ops, Range(1, 1e6));
  v.Field("max_sessions", c.max_sessions, Range(1, 1e6));
  v.Field("max_buffered_tokens", c.max_buffered_tokens, Range(1, 1e12));
  v.Field("tokens_per_s", c.tokens_per_s, Range(0, 1e12));
  v.Field("burst_tokens", c.burst_tokens, Range(1, 1e12));
  v.Field("storage_quota_bytes", c.storage_quota_bytes, Range(0, 1e18));
}
template <typename V> void VisitFields(V& v, TenantConfig& c) {
  v.Field("id", c.id, Required());
  v.Field("key_sha256", c.key_sha256, Secret());
  v.Section("quotas", c.quotas);
  v.Field("role", c.role, OneOf({"admin", "member", "read-only"}));
}
template <typename V> void VisitFields(V& v, AuthSection& c) {
  v.Field("enabled", c.enabled, Spec{});
  v.Field("tenants_file", c.tenants_file, Path());
  v.List("tenants", c.tenants);
  v.Field("audit_retention_days", c.audit_retention_days, Range(1, 36500));
  v.Field("usage_flush_interval_s", c.usage_flush_interval_s, Range(0.1, 3600));
  v.Field("max_keys_per_tenant", c.max_keys_per_tenant, Range(1, 100000));
  v.Field("jwt_ttl_s", c.jwt_ttl_s, Range(0, 7 * 86400));
  v.Field("jwt_signing_secret", c.jwt_signing_secret, Secret());
}
template <typename V> void VisitFields(V& v, SchedulerSection& c) {
  v.Field("max_tokens_per_step", c.max_tokens_per_step, Range(1, 1e9));
  v.Field("max_ops_per_step", c.max_ops_per_step, Range(1, 4096));
  v.Field("fuse", c.fuse, Spec{});
  v.Field("queue_cap", c.queue_cap, Range(1, 1e6));
  v.Field("max_loras", c.max_loras, Range(1, 4096));
}
template <typename V> void VisitFields(V& v, SamplerSection& c) {
  v.Field("devices", c.devices, Spec{});
  v.Field("kv_cache_blocks", c.kv_cache_blocks, Range(1, 1e8));
  v.Field("kv_block_size", c.kv_block_size, Range(1, 1024));
  v.Field("state_slots", c.state_slots, Range(1, 65536));
  v.Field("max_decode_steps_per_call", c.max_decode_steps_per_call, Range(1, 4096));
  v.Field("stream_decode_steps_per_call", c.stream_decode_steps_per_call, Range(1, 4096));
  v.Field("max_snapshots", c.max_snapshots, Range(1, 1e5));
  v.Field("max_snapshots_per_tenant", c.max_snapshots_per_tenant, Range(1, 1e5));
  v.Field("max_sessions_per_tenant", c.max_sessions_per_tenant, Range(1, 1e5));
  v.Field("default_max_tokens", c.default_max_tokens, Range(1, 1e7));
  v.Field("max_num_samples", c.max_num_samples, Range(1, 1e5));
}
template <typename V> void VisitFields(V& v, SessionsSection& c) {
  v.Field("adapter_timeout_s", c.adapter_timeout_s, Range(1, 1e8));
  v.Field("adapter_max_lifetime_s", c.adapter_max_lifetime_s, Range(1, 1e8));
  v.Field("future_retention_s", c.future_retention_s, Range(1, 1e8));
  v.Field("max_retained_results", c.max_retained_results, Range(1, 1e9));
  v.Field("max_retained_result_bytes", c.max_retained_result_bytes, Range(1024, 1e13));
}
template <typename V> void VisitFields(V& v, StorageSection& c) {
  v.Field("data_dir", c.data_dir, Path());
  v.Field("url_signing_secret", c.url_signing_secret, Secret());
  v.Field("download_url_ttl_s", c.download_url_ttl_s, Range(1, 7 * 86400));
  v.Field("reap_interval_s", c.reap_interval_s, Range(1, 86400));
  v.Field("max_import_bytes", c.max_import_bytes, Range(1024, 64 << 20));
}
template <typename V> void VisitFields(V& v, NodesSection& c) {
  v.Field("listen", c.listen, Spec{});
  v.Field("secret_file", c.secret_file, SecretPath());
  v.Field("rendezvous_host", c.rendezvous_host, Spec{});
  v.Field("rendezvous_port", c.rendezvous_port, Range(0, 65535));
}
template <typename V> void VisitFields(V& v, TestingSection& c) {
  v.Field("hooks", c.hooks, Spec{});
}
template <typename V> void VisitFields(V& v, LoggingSection& c) {
  v.Field("level", c.level, OneOf({"debug", "info", "warning", "error"}));
  v.Field("format", c.format, OneOf({"text", "json"}));
}
// `limits` comes before `auth`: a tenant's quotas start from the limits already read.
template <typename V> void VisitFields(V& v, Config& c) {
  v.Section("server", c.server);
  // `model:` (one base model) or `models:` (several); which one a file used is checked after
  // reading (CheckModels), and print-config writes back the form the file had.
  if (v.Wants("model", c.models_listed)) v.Section("model", c.model);
  if (v.Wants("models", c.models_listed)) v.List("models", c.models);
  v.Section("engine", c.engine);
  v.Section("limits", c.limits);
  v.Section("auth", c.auth);
  v.Section("scheduler", c.scheduler);
  v.Section("sampler", c.sampler);
  v.Section("sessions", c.sessions);
  v.Section("storage", c.storage);
  v.Section("nodes", c.nodes);
  v.Section("testing", c.testing);
  v.Section("logging", c.logging);
}

// The top level of auth.tenants_file.
struct TenantsFile {
  std::vector<TenantConfig> tenants;
};
template <typename V> void VisitFields(V& v, TenantsFile& c) { v.List("tenants", c.tenants); }

// ---- Reading YAML. -----------------------------------------------------------------------

class YamlReader : public config_internal::KeyErrors {
 public:
  YamlReader(std::string file, std::filesystem::path base_dir)
      : file_(std::move(file)), base_dir_(std::move(base_dir)) {}

  // Reads a mapping node into `target`, then reports keys nobody asked for.
  // yaml-cpp nodes are handles whose operator= writes into the tree, so the reader keeps
  // pointers to nodes that live on the caller's stack instead of reassigning Node members.
  template <typename T> void ReadMap(const YAML::Node& node, const std::string& path, T& target) {
    if (node.IsDefined() && !node.IsNull() && !node.IsMap()) {
      Error(node, path, "expected a mapping of keys to values");
      return;
    }
    const YAML::Node* saved_node = node_;
    const std::string saved_path = path_;
    std::set<std::string> saved_known = std::move(known_);
    node_ = &node;
    path_ = path;
    known_.clear();
    VisitFields(*this, target);
    if (node.IsDefined() && node.IsMap()) {
      for (const auto& kv : node) {
        const std::string key = kv.first.Scalar();
        if (!known_.count(key)) {
          Error(kv.first, Join(key), absl::StrCat("unknown key (known: ",
                                                  absl::StrJoin(known_, ", "), ")"));
        }
      }
    }
    node_ = saved_node;
    path_ = saved_path;
    known_ = std::move(saved_known);
  }

  template <typename T> void Section(const char* name, T& target) {
    known_.insert(name);
    const YAML::Node child = Child(name);
    ReadMap(child, Join(name), target);
  }

  // `model` is read when the file has it or has no `models` (then its missing path is the
  // error a file without any model gets); `models` whenever present.
  bool Wants(const char* name, bool /*listed*/) {
    known_.insert(name);
    if (std::string(name) == "model") return Child("model").IsDefined() || !Child("models").IsDefined();
    return true;
  }

  void Field(const char* name, std::string& value, const Spec& spec) {
    known_.insert(name);
    const YAML::Node n = Child(name);
    if (!n || n.IsNull()) {
      if (spec.required) Error(*node_, Join(name), "required key is missing");
      return;
    }
    if (!n.IsScalar()) return Error(n, Join(name), "expected a string");
    value = n.Scalar();
    if (!spec.one_of.empty() &&
        std::find(spec.one_of.begin(), spec.one_of.end(), value) == spec.one_of.end()) {
      Error(n, Join(name), absl::StrCat("'", value, "' is not one of: ",
                                        absl::StrJoin(spec.one_of, ", ")));
    }
    if (spec.required && value.empty()) Error(n, Join(name), "must not be empty");
    if (spec.path && !value.empty()) {
      value = (base_dir_ / value).lexically_normal().string();
      if (!value.empty() && value.back() == '/') value.pop_back();
    }
  }

  void Field(const char* name, std::vector<std::string>& value, const Spec&) {
    known_.insert(name);
    const YAML::Node n = Child(name);
    if (!n || n.IsNull()) return;
    if (!n.IsSequence()) return Error(n, Join(name), "expected a list of strings");
    std::vector<std::string> out;
    for (const YAML::Node& item : n) {
      if (!item.IsScalar()) return Error(item, Join(name), "expected a list of strings");
      out.push_back(item.Scalar());
    }
    value = std::move(out);
  }

  template <typename Int>
    requires std::is_integral_v<Int>
  void Field(const char* name, Int& value, const Spec& spec) {
    known_.insert(name);
    const YAML::Node n = Child(name);
    if (!n || n.IsNull()) return;
    int64_t parsed;
    if (!n.IsScalar() || !absl::SimpleAtoi(n.Scalar(), &parsed)) {
      return Error(n, Join(name), absl::StrCat("expected an integer, got '", Describe(n), "'"));
    }
    CheckRange(n, name, static_cast<double>(parsed), spec);
    value = static_cast<Int>(parsed);
  }

  void Field(const char* name, double& value, const Spec& spec) {
    known_.insert(name);
    const YAML::Node n = Child(name);
    if (!n || n.IsNull()) return;
    double parsed;
    if (!n.IsScalar() || !absl::SimpleAtod(n.Scalar(), &parsed) || !std::isfinite(parsed)) {
      return Error(n, Join(name), absl::StrCat("expected a number, got '", Describe(n), "'"));
    }
    CheckRange(n, name, parsed, spec);
    value = parsed;
  }

  void Field(const char* name, bool& value, const Spec&) {
    known_.insert(name);
    const YAML::Node n = Child(name);
    if (!n || n.IsNull()) return;
    bool parsed = false;
    if (!n.IsScalar() || !YAML::convert<bool>::decode(n, parsed)) {
      return Error(n, Join(name), absl::StrCat("expected true or false, got '", Describe(n), "'"));
    }
    value = parsed;
  }

  // A list of mappings, each read like a section into a fresh item (see NewItem).
  template <typename T> void List(const char* name, std::vector<T>& value) {
    known_.insert(name);
    const YAML::Node n = Child(name);
    if (!n || n.IsNull()) return;
    if (!n.IsSequence()) return Error(n, Join(name), "expected a list of mappings");
    const std::string list_path = Join(name);
    std::vector<T> out;
    int index = 0;
    for (const YAML::Node& item : n) {
      const std::string item_path = absl::StrCat(list_path, "[", index++, "]");
      T t = NewItem<T>();
      ReadMap(item, item_path, t);
      AfterItem(item, item_path, t);
      out.push_back(std::move(t));
    }
    value = std::move(out);
  }

  // Where each tenant read by this reader was defined, in reading order.
  struct Location {
    std::string where;  // "FILE:LINE"
    std::string key;    // "auth.tenants[1]"
  };
  const std::vector<Location>& tenant_locations() const { return tenant_locations_; }

  // A tenant's quotas start from these (the `limits` section, read before `auth`).
  void set_tenant_defaults(const LimitsSection* limits) { tenant_defaults_ = limits; }
  void AddErrors(const std::vector<std::string>& errors) {
    errors_.insert(errors_.end(), errors.begin(), errors.end());
  }

  void Error(const YAML::Node& at, const std::string& key, const std::string& message) {
    const int line = at.IsDefined() && at.Mark().line >= 0 ? at.Mark().line + 1 : 1;
    errors_.push_back(absl::StrCat(file_, ":", line, ": ", key, ": ", message));
  }
  void ErrorAtKey(const std::string& dotted_key, const std::string& message) override {
    errors_.push_back(absl::StrCat(file_, ":", LineOf(dotted_key), ": ", dotted_key, ": ", message));
  }
  const std::vector<std::string>& errors() const { return errors_; }
  void set_root(const YAML::Node* root) { root_ = root; }
  // Whether the document has this dotted key ("engine.devices"; no list indices).
  bool Has(const std::string& dotted_key) const override {
    if (root_ == nullptr) return false;
    std::optional<YAML::Node> n(*root_);
    for (absl::string_view part : absl::StrSplit(dotted_key, '.')) {
      if (!n->IsDefined() || !n->IsMap()) return false;
      const YAML::Node& parent = *n;
      YAML::Node child = parent[std::string(part)];
      if (!child.IsDefined()) return false;
      n.emplace(child);
    }
    return true;
  }

 private:
  YAML::Node Child(const char* name) const {
    if (node_ == nullptr || !node_->IsDefined() || !node_->IsMap()) return YAML::Node();
    return (*node_)[name];  // const lookup: never inserts the key
  }
  std::string Join(const std::string& key) const {
    return path_.empty() ? key : absl::StrCat(path_, ".", key);
  }
  static std::string Describe(const YAML::Node& n) {
    if (n.IsScalar()) return n.Scalar();
    return n.IsMap() ? "a mapping" : "a list";
  }
  void CheckRange(const YAML::Node& n, const char* name, double v, const Spec& spec) {
    if (v < spec.min || v > spec.max) {
      Error(n, Join(name), absl::StrCat(n.Scalar(), " is out of range [", spec.min, ", ",
                                        spec.max, "]"));
    }
  }
  // Line of a dotted key in the document, for checks that span several fields.
  int LineOf(const std::string& dotted_key) const {
    if (root_ == nullptr) return 1;
    std::optional<YAML::Node> n(*root_);
    int line = 1;
    for (absl::string_view part : absl::StrSplit(dotted_key, '.')) {
      if (!n->IsDefined() || !n->IsMap()) break;
      // "models[1]": the key, then the list item.
      int index = -1;
      if (const size_t open = part.find('['); open != absl::string_view::npos && part.back() == ']') {
        if (!absl::SimpleAtoi(part.substr(open + 1, part.size() - open - 2), &index)) index = -1;
        part = part.substr(0, open);
      }
      const YAML::Node& parent = *n;
      YAML::Node child = parent[std::string(part)];
      if (!child.IsDefined()) break;
      if (index >= 0) {
        if (!child.IsSequence() || index >= static_cast<int>(child.size())) break;
        const YAML::Node& list = child;
        YAML::Node item = list[static_cast<size_t>(index)];
        if (item.Mark().line >= 0) line = item.Mark().line + 1;
        n.emplace(item);
        continue;
      }
      if (child.Mark().line >= 0) line = child.Mark().line + 1;
      n.emplace(child);  // rebinding, not assignment (see ReadMap)
    }
    return line;
  }

  template <typename T> T NewItem() const {
    T item;
    if constexpr (std::is_same_v<T, TenantConfig>) {
      if (tenant_defaults_ != nullptr) item.quotas = *tenant_defaults_;
    }
    return item;
  }

  void AfterItem(const YAML::Node&, const std::string&, ModelEntry&) {}

  // Checks of one tenant that need its YAML node (for line numbers).
  void AfterItem(const YAML::Node& item, const std::string& path, TenantConfig& t) {
    const int line = item.IsDefined() && item.Mark().line >= 0 ? item.Mark().line + 1 : 1;
    tenant_locations_.push_back({absl::StrCat(file_, ":", line), path});
    if (!item.IsMap()) return;
    if (!t.id.empty() && !tenancy::IsValidTenantId(t.id)) {
      Error(item["id"], absl::StrCat(path, ".id"),
            absl::StrCat("'", t.id.substr(0, 80), "' is not a tenant id (1 to 64 of a-z, 0-9, _ and -)"));
    }
    const YAML::Node keys = item["key_sha256"];
    if (t.key_sha256.empty() &&
        (!keys.IsDefined() || keys.IsNull() || (keys.IsSequence() && keys.size() == 0))) {
      Error(keys.IsDefined() ? keys : item, absl::StrCat(path, ".key_sha256"),
            "needs at least one digest (the SHA-256 of an API key: printf %s \"$KEY\" | sha256sum)");
    }
    int entry = 0;
    for (std::string& digest : t.key_sha256) {
      ++entry;
      // Never echo the value: an operator may have pasted the key itself here.
      if (!tenancy::ParseSha256Hex(digest)) {
        Error(keys, absl::StrCat(path, ".key_sha256"),
              absl::StrCat("entry ", entry, " is not 64 hex digits (the SHA-256 of an API key: ",
                           "printf %s \"$KEY\" | sha256sum)"));
      }
      for (char& c : digest) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    }
    if (tenant_defaults_ == nullptr) return;
    const YAML::Node quotas = item["quotas"];
    if (!quotas.IsDefined() || !quotas.IsMap()) return;
    const LimitsSection& limits = *tenant_defaults_;
    const LimitsSection& q = t.quotas;
    auto check = [&](const char* key, double value, double limit, bool zero_is_unlimited) {
      const YAML::Node n = quotas[key];
      if (!n.IsDefined()) return;
      const bool exceeds = zero_is_unlimited ? limit > 0 && (value == 0 || value > limit)
                                             : value > limit;
      if (!exceeds) return;
      Error(n, absl::StrCat(path, ".quotas.", key),
            absl::StrCat(n.Scalar(), zero_is_unlimited && value == 0 ? " (unlimited)" : "",
                         " exceeds the server limit limits.", key, " (", limit, ")"));
    };
    check("max_adapters", q.max_adapters, limits.max_adapters, false);
    check("max_lora_rank", q.max_lora_rank, limits.max_lora_rank, false);
    check("max_tokens_per_request", static_cast<double>(q.max_tokens_per_request),
          static_cast<double>(limits.max_tokens_per_request), false);
    check("max_pending_ops", q.max_pending_ops, limits.max_pending_ops, false);
    check("max_sessions", q.max_sessions, limits.max_sessions, false);
    check("max_buffered_tokens", static_cast<double>(q.max_buffered_tokens),
          static_cast<double>(limits.max_buffered_tokens), false);
    check("tokens_per_s", q.tokens_per_s, limits.tokens_per_s, true);
    check("burst_tokens", static_cast<double>(q.burst_tokens),
          static_cast<double>(limits.burst_tokens), false);
    check("storage_quota_bytes", static_cast<double>(q.storage_quota_bytes),
          static_cast<double>(limits.storage_quota_bytes), true);
  }

  const std::string file_;
  const std::filesystem::path base_dir_;
  const YAML::Node* root_ = nullptr;
  const YAML::Node* node_ = nullptr;
  std::string path_;
  std::set<std::string> known_;
  std::vector<std::string> errors_;
  const LimitsSection* tenant_defaults_ = nullptr;
  std::vector<Location> tenant_locations_;
};


// Tenant ids and key digests are unique over auth.tenants and auth.tenants_file together.
// Messages name where both definitions are, never a digest.
void CheckTenantsUnique(const std::vector<TenantConfig>& tenants,
                        const std::vector<YamlReader::Location>& where,
                        std::vector<std::string>& errors) {
  if (tenants.size() != where.size()) return;
  std::map<std::string, size_t> ids, digests;
  for (size_t i = 0; i < tenants.size(); ++i) {
    const TenantConfig& t = tenants[i];
    if (!t.id.empty()) {
      auto [it, inserted] = ids.emplace(t.id, i);
      if (!inserted) {
        errors.push_back(absl::StrCat(where[i].where, ": ", where[i].key, ".id: tenant '", t.id,
                                      "' is already defined at ", where[it->second].where));
      }
    }
    for (const std::string& digest : t.key_sha256) {
      auto [it, inserted] = digests.emplace(digest, i);
      if (!inserted) {
        const std::string other = tenants[it->second].id;
        errors.push_back(absl::StrCat(
            where[i].where, ": ", where[i].key, ".key_sha256: a digest is listed twice",
            it->second == i ? "" : absl::StrCat(" (also by tenant '", other, "' at ",
                                                where[it->second].where, ")"),
            "; every API key must belong to one tenant"));
      }
    }
  }
}

// Reads auth.tenants_file (already resolved against the config's folder) and appends its
// tenants to config.auth.tenants.
void ReadTenantsFile(Config& config, YamlReader& main_reader,
                     std::vector<YamlReader::Location>& locations) {
  const std::string file = config.auth.tenants_file;
  std::ifstream in(file);
  if (!in) {
    main_reader.ErrorAtKey("auth.tenants_file",
                           absl::StrCat("cannot read ", file, ": ", std::strerror(errno)));
    return;
  }
  std::stringstream text;
  text << in.rdbuf();
  YAML::Node root;
  try {
    root = YAML::Load(text.str());
  } catch (const YAML::Exception& e) {
    main_reader.AddErrors({absl::StrCat(file, ":", e.mark.line + 1, ": invalid YAML: ", e.msg)});
    return;
  }
  if (root.IsDefined() && !root.IsNull() && !root.IsMap()) {
    const int line = root.Mark().line >= 0 ? root.Mark().line + 1 : 1;
    main_reader.AddErrors({absl::StrCat(file, ":", line,
                                        ": tenants: expected a mapping with a `tenants:` list")});
    return;
  }
  TenantsFile tenants_file;
  YamlReader reader(file, std::filesystem::path(file).parent_path());
  reader.set_root(&root);
  reader.set_tenant_defaults(&config.limits);
  reader.ReadMap(root, "", tenants_file);
  main_reader.AddErrors(reader.errors());
  for (TenantConfig& t : tenants_file.tenants) config.auth.tenants.push_back(std::move(t));
  locations.insert(locations.end(), reader.tenant_locations().begin(),
                   reader.tenant_locations().end());
}

// ---- Rendering. --------------------------------------------------------------------------

class JsonRenderer {
 public:
  // The form the file had: `models:` when it listed models, else `model:`.
  bool Wants(const char* name, bool listed) { return (std::string(name) == "models") == listed; }
  template <typename T> void Section(const char* name, T& target) {
    JsonRenderer child;
    VisitFields(child, target);
    out_[name] = std::move(child.out_);
  }
  template <typename T> void Field(const char* name, T& value, const Spec& spec) {
    if constexpr (std::is_same_v<T, std::string>) {
      out_[name] = spec.secret && !value.empty() ? "***" : value;
    } else if constexpr (std::is_same_v<T, std::vector<std::string>>) {
      out_[name] = spec.secret ? std::vector<std::string>(value.size(), "***") : value;
    } else {
      out_[name] = value;
    }
  }
  template <typename T> void List(const char* name, std::vector<T>& items) {
    nlohmann::ordered_json list = nlohmann::ordered_json::array();
    for (T& item : items) {
      JsonRenderer child;
      VisitFields(child, item);
      list.push_back(std::move(child.out_));
    }
    out_[name] = std::move(list);
  }
  nlohmann::ordered_json out_ = nlohmann::ordered_json::object();
};

void EmitYaml(YAML::Emitter& e, const nlohmann::ordered_json& j) {
  if (j.is_object()) {
    e << YAML::BeginMap;
    for (const auto& [k, v] : j.items()) {
      e << YAML::Key << k << YAML::Value;
      EmitYaml(e, v);
    }
    e << YAML::EndMap;
  } else if (j.is_array()) {
    // Lists of scalars on one line; lists of mappings (tenants) one item per block.
    const bool block = !j.empty() && j.front().is_object();
    e << (block ? YAML::Block : YAML::Flow) << YAML::BeginSeq;
    for (const auto& v : j) EmitYaml(e, v);
    e << YAML::EndSeq;
  } else if (j.is_string()) {
    e << j.get<std::string>();
  } else if (j.is_boolean()) {
    e << j.get<bool>();
  } else if (j.is_number_integer()) {
    e << j.get<int64_t>();
  } else {
    e << j.get<double>();
  }
}

// Both forms become `models` (see Config::models); names default to the directory's name.
void NormalizeModels(Config& c) {
  if (!c.models_listed) {
    ModelEntry m;
    static_cast<ModelSection&>(m) = c.model;
    m.devices = c.engine.devices;
    m.sampler_devices = c.sampler.devices;
    c.models = {std::move(m)};
  }
  for (ModelEntry& m : c.models) {
    if (m.name.empty()) m.name = std::filesystem::path(m.path).filename().string();
    if (m.max_adapters == 0) m.max_adapters = c.limits.max_adapters;
  }
  if (c.models_listed && !c.models.empty()) c.model = c.models[0];
  else if (!c.models.empty()) c.model.name = c.models[0].name;
}

}  // namespace

Config ForModel(const Config& config, size_t index) {
  Config c = config;
  const ModelEntry& m = config.models.at(index);
  c.model = m;
  c.engine.devices = m.devices;
  c.sampler.devices = m.sampler_devices;
  c.limits.max_adapters = m.max_adapters;
  c.models = {m};
  // Each model's supervisor has its own node socket and rendezvous: models[i] on port + i.
  if (index > 0 && !c.nodes.listen.empty()) {
    const size_t colon = c.nodes.listen.rfind(':');
    int port = 0;
    if (colon != std::string::npos && absl::SimpleAtoi(c.nodes.listen.substr(colon + 1), &port)) {
      c.nodes.listen = absl::StrCat(c.nodes.listen.substr(0, colon), ":", port + static_cast<int>(index));
    }
  }
  if (index > 0 && c.nodes.rendezvous_port > 0) c.nodes.rendezvous_port += static_cast<int32_t>(index);
  return c;
}

bool IsLoopbackHost(const std::string& host) {
  if (host == "localhost" || host == "::1" || host == "[::1]") return true;
  in_addr v4;
  if (inet_pton(AF_INET, host.c_str(), &v4) == 1) return (ntohl(v4.s_addr) >> 24) == 127;
  return false;
}

absl::StatusOr<Config> ParseConfig(const std::string& yaml_text,
                                   const std::filesystem::path& file_name) {
  YAML::Node root;
  try {
    root = YAML::Load(yaml_text);
  } catch (const YAML::Exception& e) {
    return absl::InvalidArgumentError(absl::StrCat(file_name.string(), ":", e.mark.line + 1,
                                                   ": invalid YAML: ", e.msg));
  }
  Config config;
  config.source_file = file_name;
  YamlReader reader(file_name.string(), file_name.parent_path());
  reader.set_root(&root);
  reader.set_tenant_defaults(&config.limits);
  config.models_listed = reader.Has("models");
  reader.ReadMap(root, "", config);
  NormalizeModels(config);
  std::vector<YamlReader::Location> tenant_locations = reader.tenant_locations();
  if (!config.auth.tenants_file.empty()) ReadTenantsFile(config, reader, tenant_locations);
  std::vector<std::string> unique_errors;
  CheckTenantsUnique(config.auth.tenants, tenant_locations, unique_errors);
  reader.AddErrors(unique_errors);
  if (reader.errors().empty()) CheckSemantics(config, reader);
  if (!reader.errors().empty()) {
    return absl::InvalidArgumentError(absl::StrJoin(reader.errors(), "\n"));
  }
  // The default data_dir lives beside the config file, like a relative path key would.
  if (config.storage.data_dir.empty()) {
    config.storage.data_dir = (file_name.parent_path() / "twinkle-data").lexically_normal().string();
  }
  return config;
}

absl::StatusOr<Config> LoadConfigFile(const std::filesystem::path& file) {
  std::ifstream in(file);
  if (!in) {
    return absl::NotFoundError(absl::StrCat(file.string(), ": cannot read the config file: ",
                                            std::strerror(errno)));
  }
  std::stringstream text;
  text << in.rdbuf();
  return ParseConfig(text.str(), file);
}

std::string RendezvousHost(const Config& c) {
  if (!c.nodes.rendezvous_host.empty()) return c.nodes.rendezvous_host;
  const size_t colon = c.nodes.listen.rfind(':');
  return colon == std::string::npos ? std::string() : c.nodes.listen.substr(0, colon);
}

absl::Status CheckEnvironment(const Config& config) {
  namespace fs = std::filesystem;
  const std::string where = config.source_file.string();
  std::error_code ec;
  for (size_t i = 0; i < std::max<size_t>(config.models.size(), 1); ++i) {
    const std::string& path = config.models.empty() ? config.model.path : config.models[i].path;
    const std::string key = config.models_listed ? absl::StrCat("models[", i, "].path") : "model.path";
    if (!fs::is_directory(path, ec)) {
      return absl::NotFoundError(absl::StrCat(where, ": ", key, ": model directory ", path, " does not exist"));
    }
    if (!fs::is_regular_file(fs::path(path) / "config.json", ec)) {
      return absl::NotFoundError(
          absl::StrCat(where, ": ", key, ": ", path, " has no config.json (not an HF model directory)"));
    }
  }
  for (const auto& [key, file] :
       {std::pair{"server.tls.cert_file", config.server.tls.cert_file},
        std::pair{"server.tls.key_file", config.server.tls.key_file},
        std::pair{"server.tls.client_ca_file", config.server.tls.client_ca_file}}) {
    if (!file.empty() && !std::ifstream(file)) {
      return absl::NotFoundError(absl::StrCat(where, ": ", key, ": cannot read ", file));
    }
  }
  return absl::OkStatus();
}

std::string RenderConfig(const Config& config, ConfigFormat format) {
  JsonRenderer renderer;
  VisitFields(renderer, const_cast<Config&>(config));  // the renderer only reads
  // The list form names devices per model; the top-level lists would be refused on reading
  // the output back.
  if (config.models_listed) {
    renderer.out_["engine"].erase("devices");
    renderer.out_["sampler"].erase("devices");
  }
  // A path may hold bytes that are not UTF-8 (Linux file names are bytes); JSON output shows
  // them as U+FFFD instead of throwing out of print-config.
  if (format == ConfigFormat::kJson) {
    return renderer.out_.dump(2, ' ', false, nlohmann::ordered_json::error_handler_t::replace) + "\n";
  }
  YAML::Emitter emitter;
  EmitYaml(emitter, renderer.out_);
  return std::string(emitter.c_str()) + "\n";
}

}  // namespace twinkle
