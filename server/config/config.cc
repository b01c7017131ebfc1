#include "server/config/config.h"

#include <arpa/inet.h>

#include <cmath>
#include <fstream>
#include <limits>
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

namespace twinkle {
namespace {

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

// ---- The field lists: the one place that names every key. -------------------------------

template <typename V> void VisitFields(V& v, TlsConfig& c) {
  v.Field("cert_file", c.cert_file, Path());
  v.Field("key_file", c.key_file, SecretPath());
}
template <typename V> void VisitFields(V& v, ServerSection& c) {
  v.Field("host", c.host, Spec{});
  v.Field("grpc_port", c.grpc_port, Range(0, 65535));
  v.Field("http_port", c.http_port, Range(0, 65535));
  v.Field("drain_timeout_s", c.drain_timeout_s, Range(0, 3600));
  v.Section("tls", c.tls);
}
template <typename V> void VisitFields(V& v, ModelSection& c) {
  v.Field("path", c.path, RequiredPath());
  v.Field("name", c.name, Spec{});
  v.Field("dtype", c.dtype, OneOf({"float32", "bfloat16", "float16"}));
}
template <typename V> void VisitFields(V& v, EngineSection& c) {
  v.Field("devices", c.devices, Spec{});
  v.Field("binary", c.binary, Path());
  v.Field("heartbeat_interval_ms", c.heartbeat_interval_ms, Range(10, 60000));
  v.Field("heartbeat_timeout_ms", c.heartbeat_timeout_ms, Range(50, 600000));
  v.Field("startup_timeout_s", c.startup_timeout_s, Range(1, 86400));
  v.Field("restart_backoff_initial_ms", c.restart_backoff_initial_ms, Range(1, 3600000));
  v.Field("restart_backoff_max_ms", c.restart_backoff_max_ms, Range(1, 3600000));
}
template <typename V> void VisitFields(V& v, LimitsSection& c) {
  v.Field("max_adapters", c.max_adapters, Range(1, 100000));
  v.Field("max_lora_rank", c.max_lora_rank, Range(1, 1024));
  v.Field("max_tokens_per_request", c.max_tokens_per_request, Range(1, 1e9));
}
template <typename V> void VisitFields(V& v, LoggingSection& c) {
  v.Field("level", c.level, OneOf({"debug", "info", "warning", "error"}));
}
template <typename V> void VisitFields(V& v, Config& c) {
  v.Section("server", c.server);
  v.Section("model", c.model);
  v.Section("engine", c.engine);
  v.Section("limits", c.limits);
  v.Section("logging", c.logging);
}

// ---- Reading YAML. -----------------------------------------------------------------------

class YamlReader {
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

  void Error(const YAML::Node& at, const std::string& key, const std::string& message) {
    const int line = at.IsDefined() && at.Mark().line >= 0 ? at.Mark().line + 1 : 1;
    errors_.push_back(absl::StrCat(file_, ":", line, ": ", key, ": ", message));
  }
  void ErrorAtKey(const std::string& dotted_key, const std::string& message) {
    errors_.push_back(absl::StrCat(file_, ":", LineOf(dotted_key), ": ", dotted_key, ": ", message));
  }
  const std::vector<std::string>& errors() const { return errors_; }
  void set_root(const YAML::Node* root) { root_ = root; }

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
      const YAML::Node& parent = *n;
      YAML::Node child = parent[std::string(part)];
      if (!child.IsDefined()) break;
      if (child.Mark().line >= 0) line = child.Mark().line + 1;
      n.emplace(child);  // rebinding, not assignment (see ReadMap)
    }
    return line;
  }

  const std::string file_;
  const std::filesystem::path base_dir_;
  const YAML::Node* root_ = nullptr;
  const YAML::Node* node_ = nullptr;
  std::string path_;
  std::set<std::string> known_;
  std::vector<std::string> errors_;
};

// Checks that involve more than one field or more than a range.
void CheckSemantics(const Config& c, YamlReader& r) {
  if (!IsLoopbackHost(c.server.host)) {
    // Authentication is not configurable yet, so every non-loopback bind is refused.
    r.ErrorAtKey("server.host", absl::StrCat("refusing to bind non-loopback address '", c.server.host,
                                             "' without authentication; bind 127.0.0.1 or ::1"));
  }
  if (c.server.tls.cert_file.empty() != c.server.tls.key_file.empty()) {
    r.ErrorAtKey("server.tls", "set both cert_file and key_file, or neither");
  }
  if (c.engine.devices.empty()) r.ErrorAtKey("engine.devices", "needs at least one device");
  for (const std::string& d : c.engine.devices) {
    int index;
    const bool cuda = absl::StartsWith(d, "cuda:") && absl::SimpleAtoi(d.substr(5), &index) && index >= 0;
    if (d != "cpu" && !cuda) {
      r.ErrorAtKey("engine.devices", absl::StrCat("'", d, "' is not a device (cpu or cuda:N)"));
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

// ---- Rendering. --------------------------------------------------------------------------

class JsonRenderer {
 public:
  template <typename T> void Section(const char* name, T& target) {
    JsonRenderer child;
    VisitFields(child, target);
    out_[name] = std::move(child.out_);
  }
  template <typename T> void Field(const char* name, T& value, const Spec& spec) {
    if constexpr (std::is_same_v<T, std::string>) {
      out_[name] = spec.secret && !value.empty() ? "***" : value;
    } else {
      out_[name] = value;
    }
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
    e << YAML::Flow << YAML::BeginSeq;
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

}  // namespace

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
  reader.ReadMap(root, "", config);
  if (reader.errors().empty()) CheckSemantics(config, reader);
  if (!reader.errors().empty()) {
    return absl::InvalidArgumentError(absl::StrJoin(reader.errors(), "\n"));
  }
  if (config.model.name.empty()) {
    config.model.name = std::filesystem::path(config.model.path).filename().string();
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

absl::Status CheckEnvironment(const Config& config) {
  namespace fs = std::filesystem;
  const std::string where = config.source_file.string();
  std::error_code ec;
  if (!fs::is_directory(config.model.path, ec)) {
    return absl::NotFoundError(absl::StrCat(where, ": model.path: model directory ",
                                            config.model.path, " does not exist"));
  }
  if (!fs::is_regular_file(fs::path(config.model.path) / "config.json", ec)) {
    return absl::NotFoundError(absl::StrCat(where, ": model.path: ", config.model.path,
                                            " has no config.json (not an HF model directory)"));
  }
  for (const auto& [key, file] : {std::pair{"server.tls.cert_file", config.server.tls.cert_file},
                                  std::pair{"server.tls.key_file", config.server.tls.key_file}}) {
    if (!file.empty() && !std::ifstream(file)) {
      return absl::NotFoundError(absl::StrCat(where, ": ", key, ": cannot read ", file));
    }
  }
  return absl::OkStatus();
}

std::string RenderConfig(const Config& config, ConfigFormat format) {
  JsonRenderer renderer;
  VisitFields(renderer, const_cast<Config&>(config));  // the renderer only reads
  if (format == ConfigFormat::kJson) return renderer.out_.dump(2) + "\n";
  YAML::Emitter emitter;
  EmitYaml(emitter, renderer.out_);
  return std::string(emitter.c_str()) + "\n";
}

}  // namespace twinkle
